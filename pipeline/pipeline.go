package pipeline

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace"

	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/outbox"
	"github.com/once-dev/once/schema"
)

// DefaultRevocationGrace is Config.RevocationGrace by default: two of a
// payment client's 5-second requests.
const DefaultRevocationGrace = 10 * time.Second

// validInstanceID: Kafka's rule for a group.instance.id.
func validInstanceID(id string) bool {
	if len(id) == 0 || len(id) > 249 || id == "." || id == ".." {
		return false
	}
	for _, r := range id {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-') {
			return false
		}
	}
	return true
}

// ErrFenced is what Run returns when another process joined a consumer
// group under this one's InstanceID: two instances were given one name.
var ErrFenced = errors.New("pipeline: another process joined the consumer group under this process's InstanceID (group.instance.id), which fenced this one out: give each instance a name of its own")

// saramaSessionTimeout is sarama's session timeout, a group's when
// Config.SessionTimeout is not set.
const saramaSessionTimeout = 10 * time.Second

// maxRevocationGrace is sarama's rebalance timeout, which the grace must
// stay below.
const maxRevocationGrace = 60 * time.Second

// Config configures a [Pipeline]. Optional fields have working zero values;
// each field's documentation ends with its default.
type Config struct {
	// Brokers are the Kafka bootstrap addresses. Required.
	Brokers []string
	// KafkaVersion is the brokers' version, e.g. "4.3.1". Default: [DefaultKafkaVersion].
	KafkaVersion string
	// DB is the database of every group that names none of its own.
	// Required unless every group has a DB.
	DB DB
	// Topics to consume: [Topic] values of any event types. At least one.
	Topics []Binding
	// Outgoing are the topics the handlers publish to with [Publish]:
	// [Outgoing] values of any event types. Default: none.
	Outgoing []OutgoingBinding
	// GroupDBs are the databases of the groups named here (by group name);
	// a Group's own DB wins, and groups named nowhere use DB.
	GroupDBs map[string]DB
	// Router to add the handlers to, keeping its own router-level middleware,
	// which always runs outside the safety chain. Run it with [Pipeline.Run].
	// Default: a router of the pipeline's.
	Router *message.Router

	// Tables names the library's tables in every group's database, as
	// package schema created them (the claim table, the outbox, the parked
	// dead letters). Default: schema's defaults.
	Tables schema.Config

	// CommitMode: [CommitInterval] or [CommitSync]. Default: CommitInterval.
	CommitMode CommitMode
	// CommitInterval of CommitInterval mode. Default: 1s.
	CommitInterval time.Duration

	// HoldBackoff is the first wait before a message whose attempt failed
	// for a reason of the environment (database, network, provider,
	// configuration) is tried again; it doubles up to HoldMaxBackoff. Such a
	// message is never dead-lettered. Defaults: 100ms and 5s.
	HoldBackoff    time.Duration
	HoldMaxBackoff time.Duration

	// AttemptTimeout bounds one attempt of a message, the handler included:
	// an attempt stuck on a database or provider that went silent ends, rolls
	// back, and the message is held and tried again. Keep it above the
	// handler's own longest retries. Default: 2m.
	AttemptTimeout time.Duration
	// StatementTimeout bounds each statement of the claim itself, on the
	// client (see idempotency.Config). Default: 30s.
	StatementTimeout time.Duration
	// TxStatementTimeout is the server's statement_timeout for every
	// statement of a claim's transaction, the handler's included, set for
	// that transaction only. Default: AttemptTimeout.
	TxStatementTimeout time.Duration

	// SessionTimeout of the consumer-group membership: how long the broker
	// waits for a crashed member before giving its partitions to others; the
	// broker allows 6s at least. With an InstanceID, make it cover a
	// restart: a member back within it takes its partitions again without
	// a rebalance. Default: sarama's 10s.
	SessionTimeout time.Duration
	// HeartbeatInterval is how often the member tells the broker it is
	// alive, apart from the session timeout it must stay well under.
	// Default: SessionTimeout / 3 (sarama's 3s for its 10s).
	HeartbeatInterval time.Duration
	// InstanceID makes this process a static member of each of its
	// consumer groups (Kafka's group.instance.id, KIP-345): the same
	// identity after a restart is the same member, and its partitions wait
	// for it for up to SessionTimeout instead of moving to the others and
	// back (two rebalances that stop every member). Give each instance a
	// name of its own that survives its restarts, a StatefulSet pod's name.
	// Two processes with one identity: the newer one fences the older,
	// whose Run then returns [ErrFenced]. A static member sends no
	// LeaveGroup when it stops: scaling in, remove the member
	// (sarama.ClusterAdmin.RemoveMemberFromConsumerGroup, or app group
	// remove-member) or its partitions wait a session timeout. Letters,
	// digits, '.', '_' and '-', at most 249. Default: none (a dynamic
	// member, as before).
	InstanceID string
	// CloseTimeout bounds how long closing waits for in-flight messages.
	// Default: 30s.
	CloseTimeout time.Duration
	// BrokerTimeout is how long Kafka may not answer this process before
	// [Pipeline.Status] reports its groups not joined (a readiness check
	// then fails) and [Pipeline.Lag] returns [ErrKafkaSilent] instead of a
	// lag that stands still: a consumer whose broker hangs keeps its
	// session and sees no error. Every third of it a probe asks a broker
	// for the consumed topics' metadata and each group's coordinator, then
	// asks those coordinators and the leaders of the partitions assigned
	// to this process: a group whose coordinator or leader is cut off is
	// not ready, though another broker answers. Each request waits at most
	// that third, and a hung broker holds up none of the others. At least
	// 1s. Default: [DefaultBrokerTimeout].
	BrokerTimeout time.Duration
	// RevocationGrace is how long the attempts under way of a partition
	// this process gives up (a rebalance, or the stop) may go on to finish
	// and commit before they are cancelled (rolled back, and run again by
	// the partition's next owner, their claims deciding). Nothing new
	// starts meanwhile, and the grace ends as soon as the last of them is
	// done: it delays the group's rebalance by the longest attempt under
	// way, this at most. Cover one call to a provider (its request
	// timeout): a call cut off in the middle leaves the provider holding
	// its Idempotency-Key, and the next owner's call waits on it. Below
	// the group's rebalance timeout (60s), or the member is dropped from
	// the group, and below CloseTimeout, whose drain must cover it.
	// Default: [DefaultRevocationGrace], or half of CloseTimeout when that
	// is shorter. Negative: none.
	RevocationGrace time.Duration

	// MaxEventAge may make the dedup horizon shorter than the claims'
	// recorded retention minus MaxClockSkew, which it follows by default;
	// negative: no horizon. MaxClockSkew bounds ids from the future; default
	// [DefaultMaxClockSkew], negative: no bound. See idempotency.Config.
	MaxEventAge  time.Duration
	MaxClockSkew time.Duration

	// Hooks are told what happens to messages (metrics, logs, traces).
	// Combine several with [ComposeHooks]. Default: none.
	Hooks Hooks

	// SetupRouter, if set, is called once with the router the pipeline
	// runs (its own, or Config.Router), before any handler is added: for a
	// team's router-level plugins and decorators, such as Watermill's
	// metrics. A batched group's messages on the direct path do not pass
	// through the router (see [Batch]; Batch.ThroughRouter keeps them
	// there). Default: none.
	SetupRouter func(*message.Router) error

	// Security of every Kafka connection. Default: plaintext, no SASL.
	Security KafkaSecurity

	// Logger. Default: slog.Default().
	Logger *slog.Logger
}

// Hooks are callbacks on what happens to messages, called on the pipeline's
// own goroutines (a message's, a batch's, the forwarder's): keep them short,
// and never block. Every field may be nil. Several are combined with
// [ComposeHooks], as net/http/httptrace's ClientTrace or pgx's tracers are.
//
// A hook reports what already happened (a commit, a parked dead letter, a
// batch), so a panic in one is logged with its stack and the pipeline goes
// on: it would otherwise end the process after that fact, and again at every
// restart. OnDelivered's panic is the exception: it comes before anything
// happened, and holds its message as a handler's panic does.
type Hooks struct {
	// OnResult receives the idempotency outcome of every claim attempt of
	// every group.
	OnResult func(idempotency.Result)
	// OnDelivered is called for every message a group's chain receives.
	OnDelivered func(Delivery)
	// OnHeld is called after each failed attempt of a held message, before
	// the wait.
	OnHeld func(Held)
	// OnDeadLetter is called when a message was dead-lettered: its letter
	// is committed in the group's database, on its way to the topic's
	// dead-letter topic.
	OnDeadLetter func(DeadLetter)
	// OnForwarded is called after an event of a group's outbox reached
	// Kafka, before its row is acknowledged.
	OnForwarded func(Forwarded)
	// OnBatch is called after each batch of a batched group.
	OnBatch func(BatchDone)
}

// ComposeHooks returns hooks that call each of hooks' callbacks in turn, in
// the order given. One that panics does not keep the others from running
// (a team's bug must not silence the metrics beside it); the first panic is
// passed on after them all.
func ComposeHooks(hooks ...Hooks) Hooks {
	return Hooks{
		OnResult:     compose(hooks, func(h Hooks) func(idempotency.Result) { return h.OnResult }),
		OnDelivered:  compose(hooks, func(h Hooks) func(Delivery) { return h.OnDelivered }),
		OnHeld:       compose(hooks, func(h Hooks) func(Held) { return h.OnHeld }),
		OnDeadLetter: compose(hooks, func(h Hooks) func(DeadLetter) { return h.OnDeadLetter }),
		OnForwarded:  compose(hooks, func(h Hooks) func(Forwarded) { return h.OnForwarded }),
		OnBatch:      compose(hooks, func(h Hooks) func(BatchDone) { return h.OnBatch }),
	}
}

// recovering is h with every callback but OnDelivered logging its panic
// instead of passing it on (see [Hooks]).
func (h Hooks) recovering(log *slog.Logger) Hooks {
	h.OnResult = recovering(log, "OnResult", h.OnResult)
	h.OnHeld = recovering(log, "OnHeld", h.OnHeld)
	h.OnDeadLetter = recovering(log, "OnDeadLetter", h.OnDeadLetter)
	h.OnForwarded = recovering(log, "OnForwarded", h.OnForwarded)
	h.OnBatch = recovering(log, "OnBatch", h.OnBatch)
	return h
}

func recovering[T any](log *slog.Logger, name string, hook func(T)) func(T) {
	if hook == nil {
		return nil
	}
	return func(v T) {
		defer func() {
			if r := recover(); r != nil {
				stack := debug.Stack()
				if p, ok := r.(*hookPanic); ok { // composed: the hook's own value and stack
					r, stack = p.value, p.stack
				}
				log.Error("pipeline: a hook panicked; what it reports stands and the pipeline goes on", "hook", name, "panic", fmt.Sprint(r), "stack", string(stack))
			}
		}()
		hook(v)
	}
}

// compose chains one callback of every Hooks; nil when none has it.
func compose[T any](hooks []Hooks, field func(Hooks) func(T)) func(T) {
	var fs []func(T)
	for _, h := range hooks {
		if f := field(h); f != nil {
			fs = append(fs, f)
		}
	}
	switch len(fs) {
	case 0:
		return nil
	case 1:
		return fs[0]
	}
	return func(v T) {
		var first *hookPanic
		for _, f := range fs {
			func() {
				defer func() {
					if r := recover(); r != nil && first == nil {
						first = &hookPanic{value: r, stack: debug.Stack()}
					}
				}()
				f(v)
			}()
		}
		if first != nil {
			panic(first)
		}
	}
}

// hookPanic is a composed hook's panic, passed on with the stack it was
// raised on. It is an error so that every recoverer and log handler prints
// it (a JSON log wrote a plain struct as {}).
type hookPanic struct {
	value any
	stack []byte
}

func (p *hookPanic) Error() string { return fmt.Sprintf("%v\n%s", p.value, p.stack) }

// Unwrap is the panic's own error, if it was one.
func (p *hookPanic) Unwrap() error { err, _ := p.value.(error); return err }

// DefaultMaxClockSkew is how far ahead of the database's clock an event's id
// may lie before the event is refused as from the future.
const DefaultMaxClockSkew = idempotency.DefaultMaxClockSkew

// Delivery says where a message came from: the parameters of [Hooks.OnDelivered].
type Delivery struct {
	Topic     string
	Group     string
	Partition int32
	Offset    int64
	// Key is the Kafka message key.
	Key string
	// Headers are the message's Kafka headers, and the pipeline's metadata
	// (MetaKafkaPartition, MetaKafkaOffset, MetaKafkaKey). Read them only.
	Headers map[string]string
	// Attempt counts the attempts of this delivery, from 1, as
	// [DeliveryFrom] sees it inside them (BeforeClaim, InTx, the handler);
	// 0 in Observe, which runs before them, and in hooks.
	Attempt int
}

// Held describes a message held after a failed attempt: the parameters of
// [Hooks.OnHeld].
type Held struct {
	Delivery
	// Attempts so far, and how long the message has been held.
	Attempts int
	Since    time.Duration
	Err      error
}

// Forwarded describes an outbox event that reached Kafka: the parameters of
// [Hooks.OnForwarded].
type Forwarded struct {
	Topic string
	ID    string // the event id the handler gave it
}

// BatchDone describes one batch of a batched group: the parameters of
// [Hooks.OnBatch].
type BatchDone struct {
	Topic, Group string
	// Size: messages in the batch; RunAlone: those it could not decide,
	// now run one by one (all of them when the batch rolled back).
	Size, RunAlone int
	// Deadlock: the batch rolled back because it deadlocked with another
	// transaction (see BatchHandlerFunc on lock order).
	Deadlock bool
	Duration time.Duration
}

// DeadLetter describes a dead-lettered message: the parameters of
// [Hooks.OnDeadLetter].
type DeadLetter struct {
	Delivery
	DLQ    string
	Reason string
	// Err is the permanent error the reason is the text of.
	Err error
}

func (c *Config) setDefaults() {
	if c.KafkaVersion == "" {
		c.KafkaVersion = DefaultKafkaVersion
	}
	if c.CommitMode == "" {
		c.CommitMode = CommitInterval
	}
	if c.CommitInterval == 0 {
		c.CommitInterval = time.Second
	}
	if c.HoldBackoff == 0 {
		c.HoldBackoff = 100 * time.Millisecond
	}
	if c.HoldMaxBackoff == 0 {
		c.HoldMaxBackoff = 5 * time.Second
	}
	if c.CloseTimeout == 0 {
		c.CloseTimeout = 30 * time.Second
	}
	if c.BrokerTimeout == 0 {
		c.BrokerTimeout = DefaultBrokerTimeout
	}
	if c.RevocationGrace == 0 {
		// A stop's drain (CloseTimeout) must cover the grace.
		c.RevocationGrace = min(DefaultRevocationGrace, c.CloseTimeout/2)
	}
	if c.AttemptTimeout == 0 {
		c.AttemptTimeout = 2 * time.Minute
	}
	if c.StatementTimeout == 0 {
		c.StatementTimeout = 30 * time.Second
	}
	if c.TxStatementTimeout == 0 {
		c.TxStatementTimeout = c.AttemptTimeout
	}
	if c.MaxClockSkew == 0 {
		c.MaxClockSkew = DefaultMaxClockSkew
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Validate reports every missing or impossible setting at once. It has no
// side effects.
func (c Config) Validate() error {
	c.setDefaults()
	_, _, err := c.resolve()
	return err
}

// resolve checks the configuration and erases the topics' event types.
func (c Config) resolve() (sarama.KafkaVersion, []topicBinding, error) {
	var errs []error
	version, err := ParseKafkaVersion(c.KafkaVersion)
	if err != nil {
		errs = append(errs, fmt.Errorf("pipeline: KafkaVersion: %w", err))
	}
	if len(c.Brokers) == 0 {
		errs = append(errs, errors.New("pipeline: Brokers is empty"))
	} else if slices.Contains(c.Brokers, "") {
		// strings.Split("", ",") of an unset variable.
		errs = append(errs, fmt.Errorf("pipeline: Brokers %q holds an empty address (an unset KAFKA_BROKERS split on commas?)", c.Brokers))
	}
	if err := c.Security.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("pipeline: Security: %w", err))
	}
	if len(c.Topics) == 0 {
		errs = append(errs, errors.New("pipeline: no Topics"))
	}
	if c.CommitMode != CommitInterval && c.CommitMode != CommitSync {
		errs = append(errs, fmt.Errorf("pipeline: CommitMode %q: want %q or %q", c.CommitMode, CommitInterval, CommitSync))
	}
	if c.CommitInterval < 0 || c.HoldBackoff < 0 || c.HoldMaxBackoff < c.HoldBackoff || c.SessionTimeout < 0 || c.CloseTimeout < 0 ||
		c.AttemptTimeout < 0 || c.StatementTimeout < 0 || c.TxStatementTimeout < 0 {
		errs = append(errs, errors.New("pipeline: durations must not be negative, and HoldMaxBackoff must be at least HoldBackoff"))
	}
	if c.BrokerTimeout < time.Second {
		errs = append(errs, fmt.Errorf("pipeline: BrokerTimeout %s: want at least 1s (a probe asks Kafka every third of it)", c.BrokerTimeout))
	}
	if c.InstanceID != "" && !validInstanceID(c.InstanceID) {
		errs = append(errs, fmt.Errorf("pipeline: InstanceID %q: want 1 to 249 letters, digits, '.', '_' or '-' (Kafka's group.instance.id)", c.InstanceID))
	}
	if session := cmp.Or(c.SessionTimeout, saramaSessionTimeout); c.HeartbeatInterval < 0 || c.HeartbeatInterval*3 > session {
		errs = append(errs, fmt.Errorf("pipeline: HeartbeatInterval %s: want at most a third of SessionTimeout %s", c.HeartbeatInterval, session))
	}
	if c.InstanceID != "" && err == nil && !version.IsAtLeast(sarama.V2_3_0_0) {
		errs = append(errs, fmt.Errorf("pipeline: InstanceID needs KafkaVersion 2.3 or later (static membership), not %s", version))
	}
	if c.RevocationGrace > 0 && c.CloseTimeout > 0 && c.RevocationGrace >= c.CloseTimeout {
		errs = append(errs, fmt.Errorf("pipeline: RevocationGrace %s must be shorter than CloseTimeout %s: a stop's drain must cover the attempts it lets finish, or they commit after Run returned",
			c.RevocationGrace, c.CloseTimeout))
	}
	if c.RevocationGrace >= maxRevocationGrace {
		errs = append(errs, fmt.Errorf("pipeline: RevocationGrace %s must stay below the group's rebalance timeout, %s: a member that takes longer to give its partitions up is dropped from the group",
			c.RevocationGrace, maxRevocationGrace))
	}
	errs = append(errs, c.Tables.Validate())
	if _, err := newPublisher(nil, c.Outgoing); err != nil {
		errs = append(errs, err)
	}
	var topics []topicBinding
	names := map[string]bool{}
	for _, t := range c.Topics {
		if t == nil {
			errs = append(errs, errors.New("pipeline: a nil Topics entry"))
			continue
		}
		b, err := t.binding()
		errs = append(errs, err)
		if names[b.name] {
			errs = append(errs, fmt.Errorf("pipeline: topic %s listed twice", b.name))
		}
		names[b.name] = true
		for i, g := range b.groups {
			if g.tooOld != "" && g.tooOld != idempotency.RejectTooOld && g.tooOld != idempotency.ProcessTooOld {
				errs = append(errs, fmt.Errorf("pipeline: topic %s, group %s: TooOld %q: want %q or %q", b.name, g.name, g.tooOld, idempotency.RejectTooOld, idempotency.ProcessTooOld))
			}
			if g.db == nil {
				b.groups[i].db = c.DB
				if db, ok := c.GroupDBs[g.name]; ok && db != nil {
					b.groups[i].db = db
				}
				if b.groups[i].db == nil {
					errs = append(errs, fmt.Errorf("pipeline: topic %s, group %s: no DB, and Config.DB is nil", b.name, g.name))
				}
			}
		}
		topics = append(topics, b)
	}
	errs = append(errs, poolsServe(topics))
	return version, topics, errors.Join(errs...)
}

// poolsServe refuses a pool with fewer connections than the attempts its
// groups run at once, where a key-ordered group runs: each key-ordered
// group's Concurrency and each batched group's Batch.Concurrency, a connection each for the whole
// attempt (a provider's call inside the transaction included). Too few,
// and the attempts wait for a connection inside their attempt's time,
// where the wait counts against them, instead of for a slot. A DB that
// does not say its size (not a *pgxpool.Pool) is not checked.
func poolsServe(topics []topicBinding) error {
	type use struct {
		attempts   int
		who        []string
		keyOrdered bool
	}
	uses := map[DB]*use{}
	var order []DB
	for _, t := range topics {
		for _, g := range t.groups {
			n, what := 0, ""
			switch {
			case g.handleBatch != nil:
				n, what = g.batch.Concurrency, "Batch.Concurrency"
			case g.keyOrdered:
				n, what = g.concurrency, "Concurrency"
			default:
				continue
			}
			u := uses[g.db]
			if u == nil {
				u = &use{}
				uses[g.db] = u
				order = append(order, g.db)
			}
			u.attempts += n
			u.keyOrdered = u.keyOrdered || g.keyOrdered
			u.who = append(u.who, fmt.Sprintf("%s on %s (%s %d)", g.name, t.name, what, n))
		}
	}
	var errs []error
	for _, db := range order {
		sized, ok := db.(interface{ Stat() *pgxpool.Stat })
		if !ok || !uses[db].keyOrdered {
			// Batched groups alone wait for a connection within a batch's
			// time, as they always have: not refused.
			continue
		}
		if most := int(sized.Stat().MaxConns()); uses[db].attempts > most {
			errs = append(errs, fmt.Errorf("pipeline: a pool of MaxConns %d serves groups that run up to %d attempts at once, each on a connection of its own: %s; "+
				"raise the pool's MaxConns (pool_max_conns in its URL, and PgBouncer's default_pool_size behind it) or lower their concurrency",
				most, uses[db].attempts, strings.Join(uses[db].who, ", ")))
		}
	}
	return errors.Join(errs...)
}

// Pipeline runs consumer groups on topics in one Watermill router, and,
// for every database of its groups, moves committed dead letters and outbox
// events to Kafka.
type Pipeline struct {
	cfg       Config
	version   sarama.KafkaVersion
	router    *message.Router
	ownRouter bool
	stopping  chan struct{}
	stopOnce  sync.Once
	// runMu orders Run's start against Close: a router that never ran has
	// no handler to wait for, and Watermill's Close would wait its whole
	// CloseTimeout for them (serve failing its access check at start-up).
	runMu     sync.Mutex
	ran       bool
	closed    bool
	producer  sarama.SyncProducer // dead letters and outbox events
	kafkaPub  outbox.KafkaPublisher
	batchers  []*batcher                // the group commits of batched groups
	local     bool                      // no Kafka: see Local
	rollBack  func(msgUUID string) bool // Local.DeliverRolledBack's messages
	subs      map[string]*subscriber    // by group name
	letters   *dlq.Store
	outbox    *outbox.Outbox
	publisher *publisher // the outbox and Config.Outgoing, for Publish
	dbs       []DB       // distinct databases of the groups, in order of appearance
	dlqTopics []string
	topics    []topicBinding
	groups    []groupRef
	failMu    sync.Mutex
	failed    error // why the pipeline stopped by itself (fail)
	holdsMu   sync.Mutex
	holds     map[*message.Message]holdEntry
	lagState
	probe brokerProbe
	// tracer is the global provider's when the pipeline was made (a no-op
	// until the process installs one).
	tracer  trace.Tracer
	closers []func() error
}

// New builds the router's handlers. It connects to Kafka only to make its
// producer; it consumes nothing until [Pipeline.Run].
func New(cfg Config) (*Pipeline, error) {
	p, topics, err := newPipeline(cfg, false)
	if err != nil {
		return nil, err
	}
	cfg = p.cfg
	wlog := newWatermillLogger(cfg.Logger)
	if p.router == nil {
		r, err := message.NewRouter(message.RouterConfig{CloseTimeout: cfg.CloseTimeout}, wlog)
		if err != nil {
			return nil, err
		}
		p.router, p.ownRouter = r, true
	}
	if cfg.SetupRouter != nil {
		if err := cfg.SetupRouter(p.router); err != nil {
			return nil, fmt.Errorf("pipeline: SetupRouter: %w", err)
		}
	}
	pc := PublisherSaramaConfig(p.version)
	cfg.Security.Apply(pc)
	// The producer's client is made here, not by NewSyncProducer, which
	// leaves its client open when the producer fails (a broker still
	// loading refuses the idempotent producer its id): a caller that tries
	// New again would leak one client per try.
	client, err := sarama.NewClient(cfg.Brokers, pc)
	if err == nil {
		if p.producer, err = sarama.NewSyncProducerFromClient(client); err != nil {
			_ = client.Close()
		}
	}
	if errors.Is(err, sarama.ErrClusterAuthorizationFailed) {
		return nil, fmt.Errorf("pipeline: kafka producer on %v: %s may not produce (the idempotent producer of dead letters and outbox events needs WRITE on the dead-letter topics): %w", cfg.Brokers, cfg.Security.principal(), err)
	}
	if err != nil {
		return nil, fmt.Errorf("pipeline: kafka producer on %v: %w", cfg.Brokers, err)
	}
	p.closers = append(p.closers, func() error { return closeProducer(p.producer, client, producerCloseTimeout) })
	p.kafkaPub = outbox.KafkaPublisher{Producer: p.producer}
	if cfg.Hooks.OnForwarded != nil {
		p.kafkaPub.AfterPublish = func(topic string, m *message.Message) { cfg.Hooks.OnForwarded(Forwarded{Topic: topic, ID: m.UUID}) }
	}

	// Every group is built before any handler is registered: a router that
	// holds a handler that never runs could not close.
	all, err := p.buildGroups(topics)
	if err != nil {
		p.Close()
		return nil, err
	}
	for _, b := range all {
		p.router.AddConsumerHandler(b.t.name+"/"+b.g.name, b.t.name, b.sub, b.h)
	}
	return p, nil
}

// newPipeline checks cfg and makes what every pipeline has, local or not:
// the dead-letter store, the outbox and the publisher.
func newPipeline(cfg Config, local bool) (*Pipeline, []topicBinding, error) {
	cfg.setDefaults()
	cfg.Hooks = cfg.Hooks.recovering(cfg.Logger)
	version, topics, err := cfg.resolve()
	if err != nil {
		return nil, nil, err
	}
	p := &Pipeline{cfg: cfg, version: version, router: cfg.Router, stopping: make(chan struct{}), subs: map[string]*subscriber{},
		local: local, tracer: otel.GetTracerProvider().Tracer("github.com/once-dev/once/pipeline")}
	if p.letters, err = dlq.NewStore(cfg.Tables); err != nil {
		return nil, nil, err
	}
	if p.outbox, err = outbox.New(cfg.Tables, cfg.Logger); err != nil {
		return nil, nil, err
	}
	if p.publisher, err = newPublisher(p.outbox, cfg.Outgoing); err != nil {
		return nil, nil, err
	}
	return p, topics, nil
}

// builtGroup is a group's handler chain, and (but for a local pipeline)
// its subscriber.
type builtGroup struct {
	t     topicBinding
	g     groupBinding
	sub   message.Subscriber
	h     message.NoPublishHandlerFunc
	batch *batcher
}

func (p *Pipeline) buildGroups(topics []topicBinding) ([]builtGroup, error) {
	wlog := newWatermillLogger(p.cfg.Logger)
	var all []builtGroup
	seen := map[DB]bool{}
	p.topics = topics
	for _, t := range topics {
		p.dlqTopics = append(p.dlqTopics, t.dlq)
		for _, g := range t.groups {
			b, err := p.buildGroup(t, g, wlog)
			if err != nil {
				return nil, err
			}
			all = append(all, b)
			if !seen[g.db] {
				seen[g.db] = true
				p.dbs = append(p.dbs, g.db)
			}
		}
	}
	return all, nil
}

// Run runs the router (its own, or the team's from [Config.Router]) and the
// dead-letter drainers and outbox forwarders of the groups' databases, until
// ctx is cancelled or every handler stopped. Closing lets in-flight messages
// finish (their commits survive the cancellation; see the idempotency
// package). A team's router that already runs gets the pipeline's handlers
// started, and is left running when ctx ends: stop it yourself.
func (p *Pipeline) Run(ctx context.Context) error {
	p.runMu.Lock()
	if p.closed || p.ran {
		p.runMu.Unlock()
		// A second Run must not reach the deferred Close below: it would
		// stop the first.
		return errors.New("pipeline: Run after Close, or a second Run")
	}
	p.ran = true
	p.runMu.Unlock()
	defer p.Close()
	// stopping is closed before the router's context is cancelled, so that
	// an error caused by the cancellation is always seen as the shutdown's.
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	go func() {
		select {
		case <-ctx.Done():
		case <-p.stopping:
		}
		p.stop()
		cancel()
	}()

	var wg sync.WaitGroup
	// The router may stop by itself (every handler stopped, a subscription
	// failed): the drainers and forwarders stop with it, before Run returns.
	defer func() {
		cancel()
		wg.Wait()
	}()
	for _, db := range p.dbs {
		wg.Go(func() {
			p.letters.Drain(runCtx, dlq.DrainConfig{DB: db, Producer: p.producer, Topics: p.dlqTopics, Logger: p.cfg.Logger})
		})
		wg.Go(func() { p.forward(runCtx, db) })
	}
	for _, b := range p.batchers {
		wg.Go(func() { b.run(runCtx) })
	}
	if !p.local {
		// Not waited for: an ask under way when the pipeline stops ends
		// within a third of BrokerTimeout, and a stop must not wait on a
		// broker that does not answer.
		go p.probeBrokers(runCtx)
	}

	if !p.ownRouter && p.router.IsRunning() {
		if err := p.router.RunHandlers(runCtx); err != nil {
			return err
		}
		<-runCtx.Done()
		return p.failure()
	}
	err := p.router.Run(runCtx)
	if failed := p.failure(); failed != nil {
		return failed
	}
	return err
}

// fail stops the pipeline for a reason that no retry mends (ErrFenced): Run
// returns err.
func (p *Pipeline) fail(err error) {
	p.failMu.Lock()
	if p.failed == nil {
		p.failed = err
	}
	p.failMu.Unlock()
	p.stop()
}

func (p *Pipeline) failure() error {
	p.failMu.Lock()
	defer p.failMu.Unlock()
	return p.failed
}

// forward runs the outbox forwarder of one database until ctx ends,
// restarting it after a failure.
func (p *Pipeline) forward(ctx context.Context, db DB) {
	pub := p.kafkaPub
	pub.Stop = ctx
	for ctx.Err() == nil {
		fw, err := p.outbox.Forwarder(db, pub)
		if err == nil {
			err = fw.Run(ctx)
		}
		if err != nil && ctx.Err() == nil {
			p.cfg.Logger.Warn("outbox forwarder stopped; restarting it", "err", err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

// Running is closed once every handler is subscribed.
func (p *Pipeline) Running() <-chan struct{} { return p.router.Running() }

// Close stops the pipeline: its own router (a team's router is the team's to
// close), and the Kafka clients.
func (p *Pipeline) Close() error {
	p.stop()
	p.runMu.Lock()
	ran := p.ran
	p.closed = true
	p.runMu.Unlock()
	var errs []error
	if p.ownRouter && ran {
		errs = append(errs, p.router.Close())
	}
	for _, c := range p.closers {
		errs = append(errs, c())
	}
	p.closers = nil
	errs = append(errs, p.closeLag())
	return errors.Join(errs...)
}

func (p *Pipeline) stop() { p.stopOnce.Do(func() { close(p.stopping) }) }

// buildGroup makes a group's subscriber and the handler that carries its
// whole safety chain. The chain is composed here rather than added as router
// middleware: a team's router-level middleware, added before or after New,
// then always runs outside it and never inside the claim's transaction.
func (p *Pipeline) buildGroup(t topicBinding, g groupBinding, wlog watermill.LoggerAdapter) (builtGroup, error) {
	cfg := p.cfg
	window := 1 // one message of a partition at a time keeps its events in order
	var gate *keyGate
	var slots chan struct{}
	switch {
	case g.handleBatch != nil:
		window = g.batch.Window
	case g.keyOrdered:
		window = g.window
		gate = newKeyGate(window)
		slots = make(chan struct{}, g.concurrency)
	}
	// One subscriber, and so one member of the Kafka group, per group name,
	// whatever number of topics it reads.
	sub := p.subs[g.name]
	if sub == nil && !p.local {
		sub = newSubscriber(cfg.Brokers, g.name, subscriberSaramaConfig(cfg, p.version, g.name), cfg.Logger)
		sub.closeTimeout = cfg.CloseTimeout
		sub.revocationGrace = max(cfg.RevocationGrace, 0)
		sub.onFatal = p.fail
		sub.pipelined = true
		p.subs[g.name] = sub
		p.closers = append(p.closers, sub.Close)
	}

	idem, err := idempotency.New(idempotency.Config{
		DB:                 g.db,
		ConsumerGroup:      g.name,
		Key:                decodedKey,
		Fingerprint:        decodedFingerprint,
		Schema:             cfg.Tables.WithDefaults().Schema,
		Table:              cfg.Tables.WithDefaults().ClaimTable,
		MaxEventAge:        cfg.MaxEventAge,
		MaxClockSkew:       cfg.MaxClockSkew,
		TooOld:             g.tooOld,
		StatementTimeout:   cfg.StatementTimeout,
		TxStatementTimeout: cfg.TxStatementTimeout,
		// No pause inside an attempt outlasts the attempt itself.
		IdleInTransactionTimeout: cfg.AttemptTimeout + cfg.StatementTimeout,
		OnResult:                 resultsOf(t.name, cfg.Hooks.OnResult),
		Logger:                   cfg.Logger,
		LogAttrs:                 kafkaLogAttrs,
		RecordRejection: func(ctx context.Context, tx pgxTx, msg *message.Message, reason error) error {
			return p.letters.Park(ctx, tx, p.letter(t, g, msg, reason, true))
		},
	})
	if err != nil {
		return builtGroup{}, fmt.Errorf("pipeline: topic %s, group %s: %w", t.name, g.name, err)
	}

	var batch *batcher
	var onSend func(*message.Message) bool
	inTx := g.extra.InTx
	if p.rollBack != nil {
		inTx = append(slices.Clone(inTx), p.rollBackAfterHandler)
	}
	if g.handleBatch != nil {
		batch = newBatcher(p, t.name, g.name, idem, g.handleBatch, inTx, g.batch)
		onSend = func(msg *message.Message) bool { batch.announce(msg); return false }
		// The direct path (see Batch): nothing of the team's has to see
		// each message on its way to the batch.
		if p.ownRouter && !g.batch.ThroughRouter && len(g.extra.Observe) == 0 && len(g.extra.BeforeClaim) == 0 {
			batch.decode = g.decode
			onSend = batch.take
		}
		p.batchers = append(p.batchers, batch)
	}
	if gate != nil {
		onSend = gate.announce
	}
	if sub != nil {
		f := sub.addTopic(t.name, window, onSend)
		if batch != nil {
			batch.toRouter = f.send
		}
		order := OrderPartition
		switch {
		case batch != nil:
			order = ""
		case gate != nil:
			order = OrderKey
		}
		p.groups = append(p.groups, groupRef{topic: t.name, group: g.name, feed: f, gate: gate, order: order})
	}

	var chain []message.HandlerMiddleware
	if batch != nil {
		chain = append(chain, batch.track)
	}
	chain = append(chain, p.delivered(t.name, g.name))
	if !p.local {
		// A local pipeline reports a message it gave up; Kafka would hand
		// it to the partition's next owner.
		chain = append(chain, releaseRevoked)
	}
	if gate != nil {
		// Outside everything that runs the message (a team's Observe
		// included): its turn comes first.
		chain = append(chain, gate.order(p))
	}
	chain = append(chain, refuseReturnedMessages(cfg.Logger, t.name, g.name))
	chain = append(chain, g.extra.Observe...)
	chain = append(chain,
		middleware.CorrelationID,
		p.deadLetter(t, g),
		p.hold(t.name, g.name, slots),
		middleware.Recoverer,
		decodeWith(g.decode),
	)
	chain = append(chain, g.extra.BeforeClaim...)
	if batch != nil {
		chain = append(chain, batch.claim)
	}
	chain = append(chain, idem.Middleware, refuseMessagesInTx)
	chain = append(chain, inTx...)

	h := handleWith(g.handle)
	for i := len(chain) - 1; i >= 0; i-- {
		h = chain[i](h)
	}
	built := builtGroup{t: t, g: g, batch: batch, h: func(msg *message.Message) error {
		_, err := h(msg)
		return err
	}}
	if sub != nil {
		built.sub = sub
	}
	return built, nil
}

func delivery(topic, group string, msg *message.Message) Delivery {
	partition, _ := strconv.ParseInt(msg.Metadata.Get(MetaKafkaPartition), 10, 32)
	offset, _ := strconv.ParseInt(msg.Metadata.Get(MetaKafkaOffset), 10, 64)
	return Delivery{Topic: topic, Group: group, Partition: int32(partition), Offset: offset,
		Key: msg.Metadata.Get(MetaKafkaKey), Headers: msg.Metadata}
}

// resultsOf reports a group's results with their topic: a message of the
// direct path never passed through the router, which names it.
func resultsOf(topic string, hook func(idempotency.Result)) func(idempotency.Result) {
	if hook == nil {
		return nil
	}
	return func(r idempotency.Result) {
		if r.Topic == "" {
			r.Topic = topic
		}
		hook(r)
	}
}

func kafkaLogAttrs(msg *message.Message) []any {
	return []any{"partition", logPartition(msg), "offset", logOffset(msg)}
}

// logPartition and logOffset are where msg was read, as numbers in a log
// line (the metadata keeps them as text: a JSON log had "partition":"0" in
// one line and "partition":0 in another); as the text when it is none.
func logPartition(msg *message.Message) any {
	s := msg.Metadata.Get(MetaKafkaPartition)
	if p, err := strconv.ParseInt(s, 10, 32); err == nil {
		return int32(p)
	}
	return s
}

func logOffset(msg *message.Message) any {
	s := msg.Metadata.Get(MetaKafkaOffset)
	if o, err := strconv.ParseInt(s, 10, 64); err == nil {
		return o
	}
	return s
}

// producerCloseTimeout bounds how long closing waits for the producer's
// messages in flight: a dead letter or outbox send abandoned at shutdown
// (its row stays, and is sent again later) may wait on a broker that
// neither answers nor fails, for every retry of every request.
const producerCloseTimeout = 5 * time.Second

// closeProducer closes producer, and its client after d at the latest,
// which fails what the producer still waits for.
func closeProducer(producer sarama.SyncProducer, client sarama.Client, d time.Duration) error {
	done := make(chan error, 1)
	go func() { done <- producer.Close() }()
	select {
	case err := <-done:
		return errors.Join(err, client.Close())
	case <-time.After(d):
		cerr := client.Close()
		select {
		case err := <-done:
			return errors.Join(err, cerr)
		case <-time.After(d):
			return errors.Join(errors.New("pipeline: the Kafka producer did not close; left behind"), cerr)
		}
	}
}
