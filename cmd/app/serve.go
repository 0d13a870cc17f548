package main

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/once-dev/once"
	"github.com/once-dev/once/internal/reference"
	"github.com/once-dev/once/internal/startup"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/orderevents"
	"github.com/once-dev/once/payment"
	"github.com/once-dev/once/pipeline"
	"github.com/once-dev/once/retention"
)

type serveCmd struct {
	Kafka kafkaSettings `embed:""`
	DB    dbSettings    `embed:""`
	Ops   opsSettings   `embed:""`

	Payment         paymentSettings   `embed:"" prefix:"payment-"`
	BillingCurrency string            `name:"billing-currency" env:"BILLING_CURRENCY" default:"EUR" help:"ISO 4217 currency billing charges in (the guide's events carry none)."`
	GroupDatabases  map[string]string `name:"group-database" env:"ONCE_GROUP_DATABASES" mapsep:";" placeholder:"GROUP=URL;..." help:"A database of its own for a group (its claims and its tables), e.g. billing=postgres://...; groups not listed use --database-url."`

	Concurrency     int           `name:"concurrency" env:"ONCE_CONCURRENCY" default:"6" help:"Key order for billing (confirmations, cancellations) and analytics on payment events: up to this many messages of each group at once, each order's events in their order (pipeline.OrderKey); every such group holds a connection per message, so their sum must fit --db-max-conns. 0: one message of a partition at a time."`
	AnalyticsBatch  int           `name:"analytics-batch" env:"ONCE_ANALYTICS_BATCH" default:"0" help:"Group commit for analytics on order.confirmed: up to this many events per transaction (pipeline.Batch); 0 commits each event on its own."`
	Groups          []string      `name:"groups" env:"ONCE_GROUPS" default:"billing,analytics" sep:"," help:"Consumer groups to run in this process: ${groups}."`
	CommitMode      string        `name:"commit-mode" env:"ONCE_COMMIT_MODE" default:"interval" enum:"interval,sync" help:"interval: sarama commits acknowledged offsets every --commit-interval; sync: commit after every message."`
	CommitInt       time.Duration `name:"commit-interval" env:"ONCE_COMMIT_INTERVAL" default:"1s" help:"Offset commit interval in interval mode."`
	AttemptTimeout  time.Duration `name:"attempt-timeout" env:"ONCE_ATTEMPT_TIMEOUT" default:"2m" help:"Bound on one attempt of a message, its handler included (provider calls and their retries); the message is then held and tried again."`
	KafkaWait       time.Duration `name:"kafka-start-timeout" env:"ONCE_KAFKA_START_TIMEOUT" default:"2m" help:"At start-up, how long to wait for brokers that cannot be reached or are still starting (a restart, offsets loading, a leader election) before giving up; 0 gives up at once. Refused credentials or permissions stop start-up at once."`
	DrainTimeout    time.Duration `name:"drain-timeout" env:"ONCE_DRAIN_TIMEOUT" default:"30s" help:"On SIGTERM, how long messages in flight may take to finish (and their offsets to be committed) before the process leaves anyway; what did not finish is delivered again."`
	RevocationGrace time.Duration `name:"revocation-grace" env:"ONCE_REVOCATION_GRACE" help:"When this instance gives a partition up (a rebalance, a deploy, SIGTERM), how long the attempts under way may take to finish and commit before they are cancelled; cover one provider call. Below --drain-timeout and below 60s (the group's rebalance timeout); negative: none. Default: 10s, or half of --drain-timeout when that is shorter."`
	HoldMax         time.Duration `name:"hold-max-backoff" env:"ONCE_HOLD_MAX_BACKOFF" default:"5s" help:"Longest wait between attempts of a message held because the environment failed (database, network, provider); such a message is never dead-lettered."`
	Migrate         bool          `name:"migrate" env:"ONCE_MIGRATE" default:"true" negatable:"" help:"Apply migrations at start-up."`

	GroupSuffix      string        `name:"group-suffix" env:"ONCE_GROUP_SUFFIX" help:"Appended to every consumer group id and dedup key group (to run isolated copies side by side, as the e2e tests do)."`
	SessionTimeout   time.Duration `name:"session-timeout" env:"ONCE_SESSION_TIMEOUT" default:"10s" help:"Consumer-group session timeout: how long a crashed instance keeps its partitions (6s minimum). With --instance-id, make it cover a restart."`
	HeartbeatInt     time.Duration `name:"heartbeat-interval" env:"ONCE_HEARTBEAT_INTERVAL" help:"How often each group's member tells the broker it is alive (default: a third of --session-timeout)."`
	InstanceID       string        `name:"instance-id" env:"ONCE_INSTANCE_ID" help:"A name of this instance's own that survives its restarts (a StatefulSet pod's name, e.g. ONCE_INSTANCE_ID=$(POD_NAME)): a static member of its consumer groups, which takes its partitions back after a restart within --session-timeout without a rebalance. Remove it with app group remove-member after scaling in."`
	KillAfterCommit  int           `name:"e2e-kill-after-commit" env:"ONCE_E2E_KILL_AFTER_COMMIT" hidden:"" help:"Test hook: SIGKILL this process right after the n-th database commit, before its offset is acknowledged."`
	KillAfterForward int           `name:"e2e-kill-after-forward" env:"ONCE_E2E_KILL_AFTER_FORWARD" hidden:"" help:"Test hook: SIGKILL this process right after the n-th outbox event reached Kafka, before its row is acknowledged."`
	OutboxRetention  time.Duration `name:"outbox-retention" env:"ONCE_OUTBOX_RETENTION" default:"24h" help:"Forwarded rows of the consumer outbox older than this are deleted (every 10 minutes)."`

	Retention           retentionSettings `embed:""`
	MaintenanceInterval time.Duration     `name:"maintenance-interval" env:"ONCE_MAINTENANCE_INTERVAL" default:"10m" help:"How often this process runs a retention pass; 0 leaves them to app maintain as the tables' owner (a cron job): one pass at start-up, so that today's partitions exist, skipped quietly where the role may not run it."`
	MaxClockSkew        time.Duration     `name:"max-clock-skew" env:"ONCE_MAX_CLOCK_SKEW" default:"5m" help:"Events whose id lies further in the future are dead-lettered."`
	TooOld              map[string]string `name:"too-old" env:"ONCE_TOO_OLD" default:"billing=reject;analytics=reject" mapsep:";" help:"Per group, what to do with an event older than the dedup horizon: reject (dead-letter) or process."`
	DLQReplayWindow     time.Duration     `name:"dlq-replay-window" env:"ONCE_DLQ_REPLAY_WINDOW" default:"24h" help:"How old a dead letter may be when it is replayed (operational policy; checked against the provider's key retention)."`
}

func (s *serveCmd) Validate() error {
	if len(s.Groups) == 0 {
		return fmt.Errorf("--groups (ONCE_GROUPS) is empty")
	}
	for _, g := range s.Groups {
		if !slices.Contains(reference.Groups, g) {
			return fmt.Errorf("--groups (ONCE_GROUPS): unknown group %q", g)
		}
	}
	if s.CommitInt <= 0 {
		return fmt.Errorf("--commit-interval (ONCE_COMMIT_INTERVAL) must be positive")
	}
	if s.Concurrency < 0 {
		return fmt.Errorf("--concurrency (ONCE_CONCURRENCY) must not be negative")
	}
	if s.AnalyticsBatch < 0 {
		return fmt.Errorf("--analytics-batch (ONCE_ANALYTICS_BATCH) must not be negative")
	}
	if s.KafkaWait < 0 {
		return fmt.Errorf("--kafka-start-timeout (ONCE_KAFKA_START_TIMEOUT) must not be negative")
	}
	if s.RevocationGrace >= time.Minute || (s.RevocationGrace > 0 && s.RevocationGrace >= s.DrainTimeout) {
		return fmt.Errorf("--revocation-grace (ONCE_REVOCATION_GRACE) %s: want it below --drain-timeout (ONCE_DRAIN_TIMEOUT) %s, which must cover it, and below the group's rebalance timeout (60s)",
			s.RevocationGrace, s.DrainTimeout)
	}
	if s.DrainTimeout <= 0 {
		return fmt.Errorf("--drain-timeout (ONCE_DRAIN_TIMEOUT) must be positive")
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
	if !orderevents.IsCurrencyCode(s.BillingCurrency) {
		return fmt.Errorf("--billing-currency (BILLING_CURRENCY) %q: want an ISO 4217 code such as EUR", s.BillingCurrency)
	}
	for g, url := range s.GroupDatabases {
		if !slices.Contains(reference.Groups, g) {
			return fmt.Errorf("--group-database (ONCE_GROUP_DATABASES): unknown group %q", g)
		}
		if err := (&dbSettings{DatabaseURL: url, MaxConns: s.DB.MaxConns, ConnectTimeout: s.DB.ConnectTimeout, StatementTimeout: s.DB.StatementTimeout}).Validate(); err != nil {
			return fmt.Errorf("--group-database (ONCE_GROUP_DATABASES) %s: %w", g, err)
		}
	}
	for g, p := range s.TooOld {
		if !slices.Contains(reference.Groups, g) {
			return fmt.Errorf("--too-old (ONCE_TOO_OLD): unknown group %q", g)
		}
		if p != string(idempotency.RejectTooOld) && p != string(idempotency.ProcessTooOld) {
			return fmt.Errorf("--too-old (ONCE_TOO_OLD): group %s: policy %q, want reject or process", g, p)
		}
	}
	return nil
}

// killHere is the e2e tests' crash, at a moment a hook chose: after a
// database commit whose message is not acknowledged yet, or after an outbox
// publish whose row is not acknowledged yet. A real SIGKILL, not an exit:
// nothing gets to clean up.
func killHere(d deps, why string, attrs ...any) {
	d.log.Warn(why, attrs...)
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

func (s *serveCmd) Run(ctx context.Context, d deps) error {
	o, err := newOps(s.Ops)
	if err != nil {
		return err
	}
	// Alive from the start; ready once consuming.
	if err := o.serve(ctx, d); err != nil {
		return err
	}
	client, err := s.Payment.client(o.paymentAttempt)
	if err != nil {
		return err
	}
	if slices.Contains(s.Groups, reference.Billing) {
		s.warnAboutKeyRetention(d)
	}
	if s.Migrate {
		if err := migrateAll(ctx, d, s.DB, s.GroupDatabases); err != nil {
			return err
		}
	}
	svc, err := reference.New(ctx, s.reference(d, client, o))
	if err == nil {
		defer svc.Close()
		if err = o.attach(svc.Service); err == nil {
			err = svc.Run(ctx)
		}
	}
	if err != nil && ctx.Err() != nil && startup.OnlyTheStop(err) {
		// Asked to stop (SIGTERM) while starting: waiting for Kafka or for
		// the database is not a failure to start.
		d.log.Info("stopped during start-up", "while", err)
		return nil
	}
	if err != nil {
		return err // run names the library's settings as flags
	}
	d.log.Info("stopped")
	return nil
}

// reference is the reference service as the flags say.
func (s *serveCmd) reference(d deps, client *payment.Client, o *ops) reference.Config {
	groupDBs := map[string]string{}
	for g, url := range s.GroupDatabases {
		groupDBs[g+s.GroupSuffix] = url
	}
	tooOld := map[string]once.TooOldPolicy{}
	for g, p := range s.TooOld {
		tooOld[g] = idempotency.TooOldPolicy(p)
	}
	var commits, forwards atomic.Int64
	return reference.Config{
		Service: once.Config{
			Brokers: s.Kafka.Brokers, KafkaVersion: s.Kafka.KafkaVersion, Security: s.Kafka.security, KafkaStartTimeout: orNone(s.KafkaWait),
			TopicPartitions: s.Kafka.Partitions, TopicReplication: s.Kafka.ReplicationFactor,
			DatabaseURL: s.DB.DatabaseURL, GroupDatabases: groupDBs, MaxConns: s.DB.MaxConns, ConnectTimeout: s.DB.ConnectTimeout, CheckOnly: !s.Migrate,
			Retention: s.Retention.Retention, RetentionMode: retention.Mode(s.Retention.Mode), MaintenanceInterval: orNone(s.MaintenanceInterval),
			MaxClockSkew: s.MaxClockSkew, OutboxRetention: s.OutboxRetention,
			CommitMode: pipeline.CommitMode(s.CommitMode), CommitInterval: s.CommitInt, HoldMaxBackoff: s.HoldMax,
			AttemptTimeout: s.AttemptTimeout, StatementTimeout: s.DB.StatementTimeout, TxStatementTimeout: s.DB.StatementTimeout,
			SessionTimeout: s.SessionTimeout, HeartbeatInterval: s.HeartbeatInt, InstanceID: s.InstanceID,
			DrainTimeout: s.DrainTimeout, RevocationGrace: s.RevocationGrace,
			Registry: o.reg, WatchInterval: s.Ops.WatchInterval, BrokerTimeout: s.Ops.BrokerTimeout, Logger: d.log,
			Hooks: once.Hooks{
				OnResult: func(r idempotency.Result) {
					d.log.Debug("message", "outcome", r.Outcome.String(), "event_id", r.EventID, "topic", r.Topic, "consumer_group", r.ConsumerGroup, "duration", r.Duration)
					if r.Outcome == idempotency.Processed && s.KillAfterCommit > 0 && commits.Add(1) == int64(s.KillAfterCommit) {
						killHere(d, "e2e: killing this process between the database commit and the offset commit", "event_id", r.EventID, "consumer_group", r.ConsumerGroup)
					}
				},
				// No OnDeadLetter line: the library logs each dead letter
				// once (a rejection where it is recorded).
				OnForwarded: func(f pipeline.Forwarded) {
					d.log.Debug("forwarded", "topic", f.Topic, "event_id", f.ID)
					if s.KillAfterForward > 0 && forwards.Add(1) == int64(s.KillAfterForward) {
						killHere(d, "e2e: killing this process between the outbox publish and its acknowledgement", "event_id", f.ID, "topic", f.Topic)
					}
				},
			},
		},
		Groups: s.Groups, GroupSuffix: s.GroupSuffix,
		ConfirmedTopic: s.Kafka.confirmed(), CancelledTopic: s.Kafka.cancelled(), PaymentTopic: s.Kafka.payments(),
		Currency: s.BillingCurrency, Payments: client, Concurrency: s.Concurrency, AnalyticsBatch: s.AnalyticsBatch, TooOld: tooOld,
	}
}

// orNone is a flag's duration as once takes it: a flag's 0 is none, which
// once writes negative (its 0 is its default).
func orNone(d time.Duration) time.Duration {
	if d == 0 {
		return -1
	}
	return d
}
