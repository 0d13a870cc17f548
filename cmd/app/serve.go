package main

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/once-dev/once/handlers/analytics"
	"github.com/once-dev/once/handlers/billing"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/pipeline"
)

type serveCmd struct {
	Kafka kafkaSettings `embed:""`
	DB    dbSettings    `embed:""`

	Payment paymentSettings `embed:"" prefix:"payment-"`

	Groups     []string      `name:"groups" env:"ONCE_GROUPS" default:"billing,analytics" sep:"," help:"Consumer groups to run in this process: ${groups}."`
	CommitMode string        `name:"commit-mode" env:"ONCE_COMMIT_MODE" default:"interval" enum:"interval,sync" help:"interval: sarama commits acknowledged offsets every --commit-interval; sync: commit after every message."`
	CommitInt  time.Duration `name:"commit-interval" env:"ONCE_COMMIT_INTERVAL" default:"1s" help:"Offset commit interval in interval mode."`
	MaxRetries int           `name:"max-retries" env:"ONCE_MAX_RETRIES" default:"5" help:"Retries of a failing message before it is dead-lettered."`
	Migrate    bool          `name:"migrate" env:"ONCE_MIGRATE" default:"true" negatable:"" help:"Apply migrations at start-up."`

	DedupRetention  time.Duration `name:"dedup-retention" env:"ONCE_DEDUP_RETENTION" default:"168h" help:"How long processed_event keeps a claim; redeliveries older than this are not recognised."`
	DLQReplayWindow time.Duration `name:"dlq-replay-window" env:"ONCE_DLQ_REPLAY_WINDOW" default:"24h" help:"How old a dead letter may be when it is replayed (operational policy; checked against the provider's key retention)."`
}

// handlers lists the consumer groups this binary can run.
var handlers = map[string]func(*serveCmd) (pipeline.Handler, error){
	"analytics": func(*serveCmd) (pipeline.Handler, error) { return analytics.Handler{}, nil },
	"billing": func(s *serveCmd) (pipeline.Handler, error) {
		client, err := s.Payment.client()
		if err != nil {
			return nil, err
		}
		return billing.Handler{Payments: client}, nil
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
	if s.MaxRetries < 0 {
		return fmt.Errorf("--max-retries (ONCE_MAX_RETRIES) must not be negative")
	}
	if s.DedupRetention <= 0 || s.DLQReplayWindow <= 0 {
		return fmt.Errorf("--dedup-retention (ONCE_DEDUP_RETENTION) and --dlq-replay-window (ONCE_DLQ_REPLAY_WINDOW) must be positive")
	}
	return nil
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
	if s.DedupRetention > keys {
		d.log.Warn("processed_event keeps claims longer than the payment provider keeps keys: a redelivery between the two is stopped only by our claim, never by the provider",
			"dedup_retention", s.DedupRetention, "payment_key_retention", keys)
	}
}

func (s *serveCmd) Run(ctx context.Context, d deps) error {
	pool, err := s.DB.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	if s.Migrate {
		if err := migrate(ctx, pool, d); err != nil {
			return err
		}
	}
	if err := s.Kafka.ensureTopics(ctx); err != nil {
		return fmt.Errorf("KAFKA_BROKERS: %w", err)
	}

	groups := make([]pipeline.Group, 0, len(s.Groups))
	for _, g := range s.Groups {
		h, err := handlers[g](s)
		if err != nil {
			return err
		}
		groups = append(groups, pipeline.Group{Name: g, Handler: h})
		if g == "billing" {
			s.warnAboutKeyRetention(d)
		}
	}
	maxRetries := s.MaxRetries
	if maxRetries == 0 {
		maxRetries = pipeline.NoRetries
	}
	p, err := pipeline.New(pipeline.Config{
		Brokers:        s.Kafka.Brokers,
		KafkaVersion:   s.Kafka.KafkaVersion,
		Topic:          s.Kafka.Topic,
		DLQTopic:       s.Kafka.DLQTopic,
		Groups:         groups,
		DB:             pool,
		CommitMode:     pipeline.CommitMode(s.CommitMode),
		CommitInterval: s.CommitInt,
		MaxRetries:     maxRetries,
		Logger:         d.log,
		OnResult: func(r idempotency.Result) {
			d.log.Debug("message", "outcome", r.Outcome, "event_id", r.EventID, "consumer_group", r.ConsumerGroup, "duration", r.Duration)
		},
		OnDeadLetter: func(group, reason string) {
			d.log.Warn("dead-lettered", "consumer_group", group, "reason", reason)
		},
	})
	if err != nil {
		return err
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
