package main

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/pipeline"
	"github.com/once-dev/once/retention"
	"github.com/once-dev/once/service/analytics"
	"github.com/once-dev/once/service/billing"
	"github.com/once-dev/once/service/order"
)

type serveCmd struct {
	Kafka kafkaSettings `embed:""`
	DB    dbSettings    `embed:""`

	Payment         paymentSettings   `embed:"" prefix:"payment-"`
	BillingCurrency string            `name:"billing-currency" env:"BILLING_CURRENCY" default:"EUR" help:"ISO 4217 currency billing charges in (the guide's events carry none)."`
	GroupDatabases  map[string]string `name:"group-database" env:"ONCE_GROUP_DATABASES" mapsep:";" placeholder:"GROUP=URL;..." help:"A database of its own for a group (its claims and its tables), e.g. billing=postgres://...; groups not listed use --database-url."`

	Groups     []string      `name:"groups" env:"ONCE_GROUPS" default:"billing,analytics" sep:"," help:"Consumer groups to run in this process: ${groups}."`
	CommitMode string        `name:"commit-mode" env:"ONCE_COMMIT_MODE" default:"interval" enum:"interval,sync" help:"interval: sarama commits acknowledged offsets every --commit-interval; sync: commit after every message."`
	CommitInt  time.Duration `name:"commit-interval" env:"ONCE_COMMIT_INTERVAL" default:"1s" help:"Offset commit interval in interval mode."`
	HoldMax    time.Duration `name:"hold-max-backoff" env:"ONCE_HOLD_MAX_BACKOFF" default:"5s" help:"Longest wait between attempts of a message held because the environment failed (database, network, provider); such a message is never dead-lettered."`
	Migrate    bool          `name:"migrate" env:"ONCE_MIGRATE" default:"true" negatable:"" help:"Apply migrations at start-up."`

	GroupSuffix     string        `name:"group-suffix" env:"ONCE_GROUP_SUFFIX" help:"Appended to every consumer group id and dedup key group (to run isolated copies side by side, as the e2e tests do)."`
	SessionTimeout  time.Duration `name:"session-timeout" env:"ONCE_SESSION_TIMEOUT" default:"10s" help:"Consumer-group session timeout: how long a crashed instance keeps its partitions (6s minimum)."`
	KillAfterCommit int           `name:"e2e-kill-after-commit" env:"ONCE_E2E_KILL_AFTER_COMMIT" hidden:"" help:"Test hook: SIGKILL this process right after the n-th database commit, before its offset is acknowledged."`

	Retention           retentionSettings `embed:""`
	MaintenanceInterval time.Duration     `name:"maintenance-interval" env:"ONCE_MAINTENANCE_INTERVAL" default:"10m" help:"How often this process runs a retention pass (0 to leave it to app maintain)."`
	MaxClockSkew        time.Duration     `name:"max-clock-skew" env:"ONCE_MAX_CLOCK_SKEW" default:"5m" help:"Events whose id lies further in the future are dead-lettered."`
	TooOld              map[string]string `name:"too-old" env:"ONCE_TOO_OLD" default:"billing=reject;analytics=reject" mapsep:";" help:"Per group, what to do with an event older than the dedup horizon: reject (dead-letter) or process."`
	DLQReplayWindow     time.Duration     `name:"dlq-replay-window" env:"ONCE_DLQ_REPLAY_WINDOW" default:"24h" help:"How old a dead letter may be when it is replayed (operational policy; checked against the provider's key retention)."`
}

// handlers lists the consumer groups this binary can run on the
// order-confirmed topic.
var handlers = map[string]func(*serveCmd) (pipeline.HandlerFunc[order.Confirmed], error){
	"analytics": func(*serveCmd) (pipeline.HandlerFunc[order.Confirmed], error) { return analytics.Handler{}.Handle, nil },
	"billing": func(s *serveCmd) (pipeline.HandlerFunc[order.Confirmed], error) {
		client, err := s.Payment.client()
		if err != nil {
			return nil, err
		}
		h := billing.Handler{Payments: client, Currency: s.BillingCurrency}
		if err := h.Validate(); err != nil {
			return nil, fmt.Errorf("--billing-currency (BILLING_CURRENCY): %w", err)
		}
		return h.Handle, nil
	},
}

func groupNames() []string {
	names := make([]string, 0, len(handlers))
	for n := range handlers {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

func (s *serveCmd) Validate() error {
	if len(s.Groups) == 0 {
		return fmt.Errorf("--groups (ONCE_GROUPS) is empty")
	}
	for _, g := range s.Groups {
		if handlers[g] == nil {
			return fmt.Errorf("--groups (ONCE_GROUPS): unknown group %q", g)
		}
	}
	if s.CommitInt <= 0 {
		return fmt.Errorf("--commit-interval (ONCE_COMMIT_INTERVAL) must be positive")
	}
	if s.HoldMax < 100*time.Millisecond {
		return fmt.Errorf("--hold-max-backoff (ONCE_HOLD_MAX_BACKOFF) must be at least 100ms, got %s", s.HoldMax)
	}
	if s.DLQReplayWindow <= 0 || s.MaintenanceInterval < 0 || s.MaxClockSkew <= 0 {
		return fmt.Errorf("--dlq-replay-window and --max-clock-skew must be positive, --maintenance-interval not negative")
	}
	if s.SessionTimeout < 6*time.Second {
		return fmt.Errorf("--session-timeout (ONCE_SESSION_TIMEOUT) must be at least 6s (the broker's minimum), got %s", s.SessionTimeout)
	}
	if s.MaxClockSkew >= s.Retention.Retention {
		return fmt.Errorf("--max-clock-skew (ONCE_MAX_CLOCK_SKEW) must be well below --dedup-retention")
	}
	if (billing.Handler{Payments: noCharger{}, Currency: s.BillingCurrency}).Validate() != nil {
		return fmt.Errorf("--billing-currency (BILLING_CURRENCY) %q: want an ISO 4217 code such as EUR", s.BillingCurrency)
	}
	for g, url := range s.GroupDatabases {
		if handlers[g] == nil {
			return fmt.Errorf("--group-database (ONCE_GROUP_DATABASES): unknown group %q", g)
		}
		if err := (&dbSettings{DatabaseURL: url, MaxConns: s.DB.MaxConns}).Validate(); err != nil {
			return fmt.Errorf("--group-database (ONCE_GROUP_DATABASES) %s: %w", g, err)
		}
	}
	for g, p := range s.TooOld {
		if handlers[g] == nil {
			return fmt.Errorf("--too-old (ONCE_TOO_OLD): unknown group %q", g)
		}
		if p != string(idempotency.RejectTooOld) && p != string(idempotency.ProcessTooOld) {
			return fmt.Errorf("--too-old (ONCE_TOO_OLD): group %s: policy %q, want reject or process", g, p)
		}
	}
	return nil
}

// killBetweenCommitAndAck is the e2e tests' crash: the transaction has
// committed and the message is not acknowledged yet, so its offset is not
// committed. A real SIGKILL, not an exit: nothing gets to clean up.
func killBetweenCommitAndAck(d deps, r idempotency.Result) {
	d.log.Warn("e2e: killing this process between the database commit and the offset commit",
		"event_id", r.EventID, "consumer_group", r.ConsumerGroup)
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {} // the signal is on its way
}

// warnAboutKeyRetention says where the provider's second lock is gone while
// we may still deliver an event again. The claim protects every committed
// event for --dedup-retention; the provider's key is what protects an event
// whose charge happened but whose transaction rolled back (a reset after the
// charge, then a crash or a dead letter). Replaying such a dead letter after
// the provider forgot the key charges again.
func (s *serveCmd) warnAboutKeyRetention(d deps) {
	keys := s.Payment.KeyRetention
	if s.DLQReplayWindow > keys {
		d.log.Warn("dead letters may be replayed after the payment provider forgot their idempotency key: a charge whose transaction rolled back would be made again",
			"dlq_replay_window", s.DLQReplayWindow, "payment_key_retention", keys)
	}
	if s.Retention.Retention > keys {
		d.log.Warn("processed_event keeps claims longer than the payment provider keeps keys: a redelivery between the two is stopped only by our claim, never by the provider",
			"dedup_retention", s.Retention.Retention, "payment_key_retention", keys)
	}
}

// noCharger lets Validate check the currency without a payment client.
type noCharger struct{ billing.Charger }

func (s *serveCmd) Run(ctx context.Context, d deps) error {
	pool, err := s.DB.open(ctx, d, s.Migrate)
	if err != nil {
		return err
	}
	defer pool.Close()
	// Each group's database holds its claims and its tables: migrated, and
	// kept by retention, one by one.
	pools := map[string]*pgxpool.Pool{s.DB.DatabaseURL: pool}
	groupDB := map[string]*pgxpool.Pool{}
	for _, g := range s.Groups {
		url, ok := s.GroupDatabases[g]
		if !ok {
			groupDB[g] = pool
			continue
		}
		if pools[url] == nil {
			own := dbSettings{DatabaseURL: url, MaxConns: s.DB.MaxConns}
			p, err := own.open(ctx, d, s.Migrate)
			if err != nil {
				return fmt.Errorf("--group-database %s: %w", g, err)
			}
			defer p.Close()
			pools[url] = p
		}
		groupDB[g] = pools[url]
	}
	if err := s.Kafka.ensureTopics(ctx); err != nil {
		return fmt.Errorf("KAFKA_BROKERS: %w", err)
	}

	topic := pipeline.Topic[order.Confirmed]{Name: s.Kafka.Topic, DLQ: s.Kafka.DLQTopic, Decode: order.DecodeConfirmed}
	for _, g := range s.Groups {
		h, err := handlers[g](s)
		if err != nil {
			return err
		}
		policy := idempotency.RejectTooOld
		if p, ok := s.TooOld[g]; ok {
			policy = idempotency.TooOldPolicy(p)
		}
		topic.Groups = append(topic.Groups, pipeline.Group[order.Confirmed]{Name: g + s.GroupSuffix, Handle: h, DB: groupDB[g], TooOld: policy})
		if g == "billing" {
			s.warnAboutKeyRetention(d)
		}
	}
	var commits atomic.Int64
	p, err := pipeline.New(pipeline.Config{
		Brokers:        s.Kafka.Brokers,
		KafkaVersion:   s.Kafka.KafkaVersion,
		DB:             pool,
		Topics:         []pipeline.Binding{topic},
		MaxEventAge:    s.Retention.Retention - s.MaxClockSkew,
		MaxClockSkew:   s.MaxClockSkew,
		CommitMode:     pipeline.CommitMode(s.CommitMode),
		CommitInterval: s.CommitInt,
		HoldMaxBackoff: s.HoldMax,
		Logger:         d.log,
		SessionTimeout: s.SessionTimeout,
		OnResult: func(r idempotency.Result) {
			d.log.Debug("message", "outcome", r.Outcome.String(), "event_id", r.EventID, "consumer_group", r.ConsumerGroup, "duration", r.Duration)
			if r.Outcome == idempotency.Processed && s.KillAfterCommit > 0 && commits.Add(1) == int64(s.KillAfterCommit) {
				killBetweenCommitAndAck(d, r)
			}
		},
		OnDeadLetter: func(dl pipeline.DeadLetter) {
			d.log.Warn("dead-lettered", "topic", dl.Topic, "consumer_group", dl.Group, "partition", dl.Partition, "offset", dl.Offset, "dlq", dl.DLQ, "reason", dl.Reason)
		},
	})
	if err != nil {
		return err
	}
	// One pass per database before consuming, so today's partitions exist;
	// no claim ever waits for one, but claims in the default partition are
	// the slower path.
	for _, db := range pools {
		rcfg := s.Retention.config(d)
		rcfg.DB = db
		if _, err := retention.Run(ctx, rcfg); err != nil {
			return err
		}
		if s.MaintenanceInterval > 0 {
			go retention.Loop(ctx, rcfg, s.MaintenanceInterval)
		}
	}
	go func() {
		<-p.Running()
		d.log.Info("serving", "topic", s.Kafka.Topic, "groups", s.Groups, "commit_mode", s.CommitMode)
	}()
	if err := p.Run(ctx); err != nil {
		return err
	}
	d.log.Info("stopped")
	return nil
}
