package pipeline

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/once-dev/once/middleware/idempotency"
)

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
	// Router to add the handlers to, keeping its own router-level middleware
	// (which runs outside the safety chain). Default: a router of the pipeline's.
	Router *message.Router

	// ClaimSchema and ClaimTable name the claim table in every group's
	// database, as package schema created it. Defaults: "public", "processed_event".
	ClaimSchema string
	ClaimTable  string

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
	// OnHeld is called after each failed attempt of a held message, before
	// the wait. Default: none.
	OnHeld func(Held)

	// SessionTimeout of the consumer-group membership: how long the broker
	// waits for a crashed member before giving its partitions to others; the
	// broker allows 6s at least. Default: sarama's 10s.
	SessionTimeout time.Duration
	// CloseTimeout bounds how long closing waits for in-flight messages.
	// Default: 30s.
	CloseTimeout time.Duration

	// MaxEventAge is the dedup horizon (the claim retention minus
	// MaxClockSkew); MaxClockSkew bounds ids from the future. See
	// idempotency.Config. Default: 0 for both, which disables each check.
	MaxEventAge  time.Duration
	MaxClockSkew time.Duration

	// OnResult receives the idempotency outcome of every claim attempt of
	// every group. Default: none.
	OnResult func(idempotency.Result)
	// OnDelivered is called for every message a group's chain receives.
	// Default: none.
	OnDelivered func(Delivery)
	// OnDeadLetter is called after a message was published to its topic's
	// dead-letter topic. Default: none.
	OnDeadLetter func(DeadLetter)

	// Logger. Default: slog.Default().
	Logger *slog.Logger

	kafkaVersion sarama.KafkaVersion
	topics       []topicBinding
}

// Delivery says where a message came from: the parameters of [Config.OnDelivered].
type Delivery struct {
	Topic     string
	Group     string
	Partition int32
	Offset    int64
}

// DeadLetter describes a message published to a dead-letter topic: the
// parameters of [Config.OnDeadLetter].
type DeadLetter struct {
	Delivery
	DLQ    string
	Reason string
}

// Held describes a message held after a failed attempt: the parameters of
// [Config.OnHeld].
type Held struct {
	Delivery
	// Attempts so far, and how long the message has been held.
	Attempts int
	Since    time.Duration
	Err      error
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
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Validate reports every missing or impossible setting at once. It has no
// side effects.
func (c *Config) Validate() error {
	var errs []error
	var err error
	if c.kafkaVersion, err = ParseKafkaVersion(c.KafkaVersion); err != nil {
		errs = append(errs, fmt.Errorf("pipeline: KafkaVersion: %w", err))
	}
	if len(c.Brokers) == 0 {
		errs = append(errs, errors.New("pipeline: Brokers is empty"))
	}
	if len(c.Topics) == 0 {
		errs = append(errs, errors.New("pipeline: no Topics"))
	}
	if c.CommitMode != CommitInterval && c.CommitMode != CommitSync {
		errs = append(errs, fmt.Errorf("pipeline: CommitMode %q: want %q or %q", c.CommitMode, CommitInterval, CommitSync))
	}
	if c.CommitInterval < 0 || c.HoldBackoff < 0 || c.HoldMaxBackoff < c.HoldBackoff || c.SessionTimeout < 0 || c.CloseTimeout < 0 {
		errs = append(errs, errors.New("pipeline: durations must not be negative, and HoldMaxBackoff must be at least HoldBackoff"))
	}
	c.topics = c.topics[:0]
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
			if g.db == nil {
				b.groups[i].db = c.DB
				if c.DB == nil {
					errs = append(errs, fmt.Errorf("pipeline: topic %s, group %s: no DB, and Config.DB is nil", b.name, g.name))
				}
			}
		}
		c.topics = append(c.topics, b)
	}
	return errors.Join(errs...)
}

// Pipeline runs consumer groups on topics in one Watermill router.
type Pipeline struct {
	cfg      Config
	router   *message.Router
	stopping chan struct{}
	stopOnce sync.Once
	closers  []func() error
}

// New builds the router's handlers. It connects to nothing until [Pipeline.Run].
func New(cfg Config) (*Pipeline, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	wlog := watermill.NewSlogLoggerWithLevelMapping(cfg.Logger, map[slog.Level]slog.Level{
		slog.LevelInfo: slog.LevelDebug, // Watermill's info lines are per subscription detail
	})
	p := &Pipeline{cfg: cfg, router: cfg.Router, stopping: make(chan struct{})}
	if p.router == nil {
		r, err := message.NewRouter(message.RouterConfig{CloseTimeout: cfg.CloseTimeout}, wlog)
		if err != nil {
			return nil, err
		}
		p.router = r
	}

	dlq, err := kafka.NewPublisher(kafka.PublisherConfig{
		Brokers:               cfg.Brokers,
		Marshaler:             kafka.DefaultMarshaler{},
		OverwriteSaramaConfig: PublisherSaramaConfig(cfg.kafkaVersion),
	}, wlog)
	if err != nil {
		return nil, fmt.Errorf("pipeline: dead-letter publisher: %w", err)
	}
	p.closers = append(p.closers, dlq.Close)

	for _, t := range cfg.topics {
		for _, g := range t.groups {
			if err := p.addGroup(t, g, dlq, wlog); err != nil {
				p.Close()
				return nil, err
			}
		}
	}
	return p, nil
}

// Run runs the router until ctx is cancelled or every handler stopped, then
// closes it, letting in-flight messages finish (their commits survive the
// cancellation; see the idempotency package), and releases the Kafka clients.
// If you passed your own Router and run it yourself instead, call
// [Pipeline.Close] after it stopped.
func (p *Pipeline) Run(ctx context.Context) error {
	defer p.Close()
	go func() {
		select {
		case <-ctx.Done():
			p.stop()
		case <-p.stopping:
		}
	}()
	return p.router.Run(ctx)
}

// Running is closed once every handler is subscribed.
func (p *Pipeline) Running() chan struct{} { return p.router.Running() }

// Close stops the router and releases the Kafka clients.
func (p *Pipeline) Close() error {
	p.stop()
	errs := []error{p.router.Close()}
	for _, c := range p.closers {
		errs = append(errs, c())
	}
	p.closers = nil
	return errors.Join(errs...)
}

func (p *Pipeline) stop() { p.stopOnce.Do(func() { close(p.stopping) }) }

// stopped reports whether the pipeline or its router is shutting down: an
// error then is the shutdown's, not the message's. The message context is no
// evidence either way: a team's middleware may give it a timeout.
func (p *Pipeline) stopped() bool {
	select {
	case <-p.stopping:
		return true
	default:
		return p.router.IsClosed()
	}
}

func (p *Pipeline) addGroup(t topicBinding, g groupBinding, dlq message.Publisher, wlog watermill.LoggerAdapter) error {
	cfg := p.cfg
	owners := newSessions()
	sub, err := kafka.NewSubscriber(kafka.SubscriberConfig{
		Brokers:               cfg.Brokers,
		Unmarshaler:           unmarshaler{},
		OverwriteSaramaConfig: subscriberSaramaConfig(cfg, g.name),
		ConsumerGroup:         g.name,
		Tracer:                owners,
	}, wlog)
	if err != nil {
		return fmt.Errorf("pipeline: subscriber for topic %s, group %s: %w", t.name, g.name, err)
	}
	p.closers = append(p.closers, sub.Close)

	idem, err := idempotency.New(idempotency.Config{
		DB:            g.db,
		ConsumerGroup: g.name,
		Key:           decodedKey,
		Schema:        cfg.ClaimSchema,
		Table:         cfg.ClaimTable,
		MaxEventAge:   cfg.MaxEventAge,
		MaxClockSkew:  cfg.MaxClockSkew,
		TooOld:        g.tooOld,
		OnResult:      cfg.OnResult,
		Logger:        cfg.Logger,
		LogAttrs:      kafkaLogAttrs,
	})
	if err != nil {
		return fmt.Errorf("pipeline: topic %s, group %s: %w", t.name, g.name, err)
	}

	poison := p.deadLetter(t, g, dlq)

	chain := []message.HandlerMiddleware{
		p.delivered(t.name, g.name),
		releaseRevoked,
	}
	chain = append(chain, g.extra.Observe...)
	chain = append(chain,
		middleware.CorrelationID,
		poison,
		p.hold(t.name, g.name, owners),
		middleware.Recoverer,
		decodeWith(g.decode),
	)
	chain = append(chain, g.extra.BeforeClaim...)
	chain = append(chain, idem.Middleware, refuseReturnedMessages)
	chain = append(chain, g.extra.InTx...)

	h := p.router.AddConsumerHandler(t.name+"/"+g.name, t.name, sub, handleWith(g.handle))
	h.AddMiddleware(chain...)
	return nil
}

func delivery(topic, group string, msg *message.Message) Delivery {
	partition, _ := strconv.ParseInt(msg.Metadata.Get(MetaKafkaPartition), 10, 32)
	offset, _ := strconv.ParseInt(msg.Metadata.Get(MetaKafkaOffset), 10, 64)
	return Delivery{Topic: topic, Group: group, Partition: int32(partition), Offset: offset}
}

func kafkaLogAttrs(msg *message.Message) []any {
	return []any{"partition", msg.Metadata.Get(MetaKafkaPartition), "offset", msg.Metadata.Get(MetaKafkaOffset)}
}
