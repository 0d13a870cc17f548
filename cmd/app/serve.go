package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/IBM/sarama"
	"github.com/cenkalti/backoff/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/outbox"
	"github.com/once-dev/once/pipeline"
	"github.com/once-dev/once/retention"
	"github.com/once-dev/once/service/analytics"
	"github.com/once-dev/once/service/billing"
	"github.com/once-dev/once/service/order"
)

type serveCmd struct {
	Kafka kafkaSettings `embed:""`
	DB    dbSettings    `embed:""`
	Ops   opsSettings   `embed:""`

	Payment         paymentSettings   `embed:"" prefix:"payment-"`
	BillingCurrency string            `name:"billing-currency" env:"BILLING_CURRENCY" default:"EUR" help:"ISO 4217 currency billing charges in (the guide's events carry none)."`
	GroupDatabases  map[string]string `name:"group-database" env:"ONCE_GROUP_DATABASES" mapsep:";" placeholder:"GROUP=URL;..." help:"A database of its own for a group (its claims and its tables), e.g. billing=postgres://...; groups not listed use --database-url."`

	AnalyticsBatch int           `name:"analytics-batch" env:"ONCE_ANALYTICS_BATCH" default:"0" help:"Group commit for analytics on order.confirmed: up to this many events per transaction (pipeline.Batch); 0 commits each event on its own."`
	Groups         []string      `name:"groups" env:"ONCE_GROUPS" default:"billing,analytics" sep:"," help:"Consumer groups to run in this process: ${groups}."`
	CommitMode     string        `name:"commit-mode" env:"ONCE_COMMIT_MODE" default:"interval" enum:"interval,sync" help:"interval: sarama commits acknowledged offsets every --commit-interval; sync: commit after every message."`
	CommitInt      time.Duration `name:"commit-interval" env:"ONCE_COMMIT_INTERVAL" default:"1s" help:"Offset commit interval in interval mode."`
	AttemptTimeout time.Duration `name:"attempt-timeout" env:"ONCE_ATTEMPT_TIMEOUT" default:"2m" help:"Bound on one attempt of a message, its handler included (provider calls and their retries); the message is then held and tried again."`
	KafkaWait      time.Duration `name:"kafka-start-timeout" env:"ONCE_KAFKA_START_TIMEOUT" default:"2m" help:"At start-up, how long to wait for brokers that cannot be reached or are still starting (a restart, offsets loading, a leader election) before giving up; 0 gives up at once. Refused credentials or permissions stop start-up at once."`
	DrainTimeout   time.Duration `name:"drain-timeout" env:"ONCE_DRAIN_TIMEOUT" default:"30s" help:"On SIGTERM, how long messages in flight may take to finish (and their offsets to be committed) before the process leaves anyway; what did not finish is delivered again."`
	HoldMax        time.Duration `name:"hold-max-backoff" env:"ONCE_HOLD_MAX_BACKOFF" default:"5s" help:"Longest wait between attempts of a message held because the environment failed (database, network, provider); such a message is never dead-lettered."`
	Migrate        bool          `name:"migrate" env:"ONCE_MIGRATE" default:"true" negatable:"" help:"Apply migrations at start-up."`

	GroupSuffix      string        `name:"group-suffix" env:"ONCE_GROUP_SUFFIX" help:"Appended to every consumer group id and dedup key group (to run isolated copies side by side, as the e2e tests do)."`
	SessionTimeout   time.Duration `name:"session-timeout" env:"ONCE_SESSION_TIMEOUT" default:"10s" help:"Consumer-group session timeout: how long a crashed instance keeps its partitions (6s minimum)."`
	KillAfterCommit  int           `name:"e2e-kill-after-commit" env:"ONCE_E2E_KILL_AFTER_COMMIT" hidden:"" help:"Test hook: SIGKILL this process right after the n-th database commit, before its offset is acknowledged."`
	KillAfterForward int           `name:"e2e-kill-after-forward" env:"ONCE_E2E_KILL_AFTER_FORWARD" hidden:"" help:"Test hook: SIGKILL this process right after the n-th outbox event reached Kafka, before its row is acknowledged."`
	OutboxRetention  time.Duration `name:"outbox-retention" env:"ONCE_OUTBOX_RETENTION" default:"24h" help:"Forwarded rows of the consumer outbox older than this are deleted (every 10 minutes)."`

	Retention           retentionSettings `embed:""`
	MaintenanceInterval time.Duration     `name:"maintenance-interval" env:"ONCE_MAINTENANCE_INTERVAL" default:"10m" help:"How often this process runs a retention pass (0 to leave it to app maintain)."`
	MaxClockSkew        time.Duration     `name:"max-clock-skew" env:"ONCE_MAX_CLOCK_SKEW" default:"5m" help:"Events whose id lies further in the future are dead-lettered."`
	TooOld              map[string]string `name:"too-old" env:"ONCE_TOO_OLD" default:"billing=reject;analytics=reject" mapsep:";" help:"Per group, what to do with an event older than the dedup horizon: reject (dead-letter) or process."`
	DLQReplayWindow     time.Duration     `name:"dlq-replay-window" env:"ONCE_DLQ_REPLAY_WINDOW" default:"24h" help:"How old a dead letter may be when it is replayed (operational policy; checked against the provider's key retention)."`
}

// topics are the reference service's three topics, each with the groups of
// this process that read it.
type topics struct {
	confirmed pipeline.Topic[order.Confirmed]
	cancelled pipeline.Topic[order.Cancelled]
	payments  pipeline.Topic[order.Payment]
}

// groupDeps is what a group's handlers are built from.
type groupDeps struct {
	s       *serveCmd
	name    string // with the suffix
	db      *pgxpool.Pool
	intents *pgxpool.Pool // a small pool of the same database, for work outside the claim's transaction
	ops     *ops
}

// handlers lists the consumer groups this binary can run, and adds each to
// the topics it reads.
var handlers = map[string]func(groupDeps, *topics) error{
	"analytics": func(d groupDeps, t *topics) error {
		h := analytics.Handler{}
		g := pipeline.Group[order.Confirmed]{Name: d.name, Handle: h.OnConfirmed, DB: d.db, TooOld: d.s.tooOld("analytics")}
		if d.s.AnalyticsBatch > 0 {
			g.Handle, g.HandleBatch, g.Batch = nil, h.OnConfirmedBatch, pipeline.Batch{Size: d.s.AnalyticsBatch}
		}
		t.confirmed.Groups = append(t.confirmed.Groups, g)
		t.payments.Groups = append(t.payments.Groups, pipeline.Group[order.Payment]{Name: d.name, Handle: h.OnPayment, DB: d.db, TooOld: d.s.tooOld("analytics")})
		return nil
	},
	"billing": func(d groupDeps, t *topics) error {
		client, err := d.s.Payment.client(d.ops.paymentAttempt)
		if err != nil {
			return err
		}
		box, err := outbox.New(outbox.Config{})
		if err != nil {
			return err
		}
		h := billing.Handler{Payments: client, Currency: d.s.BillingCurrency, DB: d.intents, Outbox: box, Topic: d.s.Kafka.payments(),
			Horizon: d.s.billingHorizon()}
		if err := h.Validate(); err != nil {
			return fmt.Errorf("--billing-currency (BILLING_CURRENCY): %w", err)
		}
		t.confirmed.Groups = append(t.confirmed.Groups, pipeline.Group[order.Confirmed]{Name: d.name, Handle: h.OnConfirmed, DB: d.db, TooOld: d.s.tooOld("billing")})
		t.cancelled.Groups = append(t.cancelled.Groups, pipeline.Group[order.Cancelled]{Name: d.name, Handle: h.OnCancelled, DB: d.db, TooOld: d.s.tooOld("billing")})
		return nil
	},
}

// billingHorizon is the age past which billing's confirmations are never
// processed again, or 0 when they always are (--too-old billing=process):
// then a confirmation past the horizon still settles its charge, and its
// cancellation waits for it instead of being dead-lettered as one whose
// charge will never be recorded.
func (s *serveCmd) billingHorizon() time.Duration {
	if s.tooOld("billing") == idempotency.ProcessTooOld {
		return 0
	}
	return s.Retention.Retention - s.MaxClockSkew
}

func (s *serveCmd) tooOld(group string) idempotency.TooOldPolicy {
	if p, ok := s.TooOld[group]; ok {
		return idempotency.TooOldPolicy(p)
	}
	return idempotency.RejectTooOld
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
	if s.AnalyticsBatch < 0 {
		return fmt.Errorf("--analytics-batch (ONCE_ANALYTICS_BATCH) must not be negative")
	}
	if s.KafkaWait < 0 {
		return fmt.Errorf("--kafka-start-timeout (ONCE_KAFKA_START_TIMEOUT) must not be negative")
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
	if !currencyCode.MatchString(s.BillingCurrency) {
		return fmt.Errorf("--billing-currency (BILLING_CURRENCY) %q: want an ISO 4217 code such as EUR", s.BillingCurrency)
	}
	for g, url := range s.GroupDatabases {
		if handlers[g] == nil {
			return fmt.Errorf("--group-database (ONCE_GROUP_DATABASES): unknown group %q", g)
		}
		if err := (&dbSettings{DatabaseURL: url, MaxConns: s.DB.MaxConns, ConnectTimeout: s.DB.ConnectTimeout, StatementTimeout: s.DB.StatementTimeout}).Validate(); err != nil {
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

var currencyCode = regexp.MustCompile(`^[A-Z]{3}$`)

func (s *serveCmd) Run(ctx context.Context, d deps) (err error) {
	starting := true // until the pipeline runs: its errors are its own
	defer func() {
		if starting && err != nil && ctx.Err() != nil && onlyTheStop(err) {
			// Asked to stop (SIGTERM) while starting: waiting for Kafka or
			// for the database is not a failure to start. Any other error
			// in err still fails the run.
			d.log.Info("stopped during start-up", "while", err)
			err = nil
		}
	}()
	o, err := newOps(s.Ops)
	if err != nil {
		return err
	}
	// Alive from the start; ready once consuming.
	if err := o.serve(ctx, d); err != nil {
		return err
	}
	pool, err := s.DB.open(ctx, d, s.Migrate)
	if err != nil {
		return err
	}
	defer pool.Close()
	// Each group's database holds its claims and its tables: migrated, and
	// kept by retention, one by one.
	pools, err := s.DB.groupPools(ctx, d, pool, s.GroupDatabases, s.Groups, s.Migrate)
	if err != nil {
		return err
	}
	defer pools.close()
	if err := s.waitForKafka(ctx, d, "create the topics", func() error { return s.Kafka.ensureTopics(ctx) }); err != nil {
		return fmt.Errorf("KAFKA_BROKERS: %w", err)
	}

	t := &topics{
		confirmed: pipeline.Topic[order.Confirmed]{Name: s.Kafka.confirmed(), DLQ: dlqOf(s.Kafka.confirmed()), Decode: order.DecodeConfirmed},
		cancelled: pipeline.Topic[order.Cancelled]{Name: s.Kafka.cancelled(), DLQ: dlqOf(s.Kafka.cancelled()), Decode: order.DecodeCancelled},
		payments:  pipeline.Topic[order.Payment]{Name: s.Kafka.payments(), DLQ: dlqOf(s.Kafka.payments()), Decode: order.DecodePayment},
	}
	side := map[*pgxpool.Pool]*pgxpool.Pool{}
	for _, g := range s.Groups {
		db := pools.of[g]
		if side[db] == nil {
			// Billing commits its charge intents outside the claim's
			// transaction: from a pool of their own, so that an attempt that
			// holds a claim's connection never waits for another from the
			// same pool (all of them could be waiting).
			cfg := db.Config().Copy()
			cfg.MaxConns = 4
			p, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				return fmt.Errorf("DATABASE_URL: %w", err)
			}
			defer p.Close()
			side[db] = p
		}
		if err := handlers[g](groupDeps{s: s, name: g + s.GroupSuffix, db: db, intents: side[db], ops: o}, t); err != nil {
			return err
		}
		if g == "billing" {
			s.warnAboutKeyRetention(d)
		}
	}
	var bindings []pipeline.Binding
	if len(t.confirmed.Groups) > 0 {
		bindings = append(bindings, t.confirmed)
	}
	if len(t.cancelled.Groups) > 0 {
		bindings = append(bindings, t.cancelled)
	}
	if len(t.payments.Groups) > 0 {
		bindings = append(bindings, t.payments)
	}

	var commits, forwards atomic.Int64
	cfg := pipeline.Config{
		Brokers:            s.Kafka.Brokers,
		KafkaVersion:       s.Kafka.KafkaVersion,
		Security:           s.Kafka.security,
		DB:                 pool,
		Topics:             bindings,
		MaxEventAge:        s.Retention.Retention - s.MaxClockSkew,
		MaxClockSkew:       s.MaxClockSkew,
		CommitMode:         pipeline.CommitMode(s.CommitMode),
		CommitInterval:     s.CommitInt,
		HoldMaxBackoff:     s.HoldMax,
		StatementTimeout:   s.DB.StatementTimeout,
		TxStatementTimeout: s.DB.StatementTimeout,
		AttemptTimeout:     s.AttemptTimeout,
		Logger:             d.log,
		SessionTimeout:     s.SessionTimeout,
		CloseTimeout:       s.DrainTimeout,
		OnResult: func(r idempotency.Result) {
			d.log.Debug("message", "outcome", r.Outcome.String(), "event_id", r.EventID, "topic", r.Topic, "consumer_group", r.ConsumerGroup, "duration", r.Duration)
			if r.Outcome == idempotency.Processed && s.KillAfterCommit > 0 && commits.Add(1) == int64(s.KillAfterCommit) {
				killHere(d, "e2e: killing this process between the database commit and the offset commit", "event_id", r.EventID, "consumer_group", r.ConsumerGroup)
			}
		},
		OnDeadLetter: func(dl pipeline.DeadLetter) {
			d.log.Warn("dead-lettered", "topic", dl.Topic, "consumer_group", dl.Group, "partition", dl.Partition, "offset", dl.Offset, "dlq", dl.DLQ, "reason", dl.Reason)
		},
		OnForwarded: func(f pipeline.Forwarded) {
			d.log.Debug("forwarded", "topic", f.Topic, "event_id", f.ID)
			if s.KillAfterForward > 0 && forwards.Add(1) == int64(s.KillAfterForward) {
				killHere(d, "e2e: killing this process between the outbox publish and its acknowledgement", "event_id", f.ID, "topic", f.Topic)
			}
		},
	}
	if err := o.metrics.Instrument(&cfg); err != nil {
		return err
	}
	var p *pipeline.Pipeline
	if err := s.waitForKafka(ctx, d, "connect", func() (err error) { p, err = pipeline.New(cfg); return err }); err != nil {
		return err
	}
	for _, db := range pools.all {
		rcfg := s.Retention.config(d)
		rcfg.DB = db
		if err := waitForRetentionPolicy(ctx, d, rcfg); err != nil {
			p.Close()
			if errors.Is(err, retention.ErrRetentionDisagrees) {
				return fmt.Errorf("--dedup-retention (ONCE_DEDUP_RETENTION): %w; start every process with the same, or change it with app maintain --set-retention", err)
			}
			return fmt.Errorf("DATABASE_URL: checking the recorded retention: %w", err)
		}
	}
	// One pass per database before consuming, so today's partitions exist;
	// no claim ever waits for one, but claims in the default partition are
	// the slower path.
	for _, db := range pools.all {
		rcfg := s.Retention.config(d)
		rcfg.DB = db
		// A failed pass (a read-only database during a failover) must not
		// stop a restarted instance from consuming: the next pass catches up.
		rcfg.OnPass = o.metrics.RetentionPass
		rep, err := retention.Run(ctx, rcfg)
		o.metrics.RetentionPass(rep, err)
		if err != nil {
			next := "the next pass retries in " + s.MaintenanceInterval.String()
			if s.MaintenanceInterval == 0 {
				next = "app maintain must run"
			}
			d.log.Error("retention pass failed at start-up; consuming anyway", "next", next, "err", err)
		}
		if s.MaintenanceInterval > 0 {
			go retention.Loop(ctx, rcfg, s.MaintenanceInterval)
		}
		box, err := outbox.New(outbox.Config{})
		if err != nil {
			p.Close()
			return err
		}
		go every(ctx, 10*time.Minute, func() {
			if n, err := box.Prune(ctx, db, s.OutboxRetention, 5000); err != nil {
				d.log.Error("prune outbox", "err", err)
			} else if n > 0 {
				d.log.Info("pruned forwarded outbox rows", "rows", n)
			}
			if slices.Contains(s.Groups, "billing") {
				if n, err := billing.PruneIntents(ctx, db, s.Retention.Retention); err != nil {
					d.log.Error("prune charge intents", "err", err)
				} else if n > 0 {
					d.log.Info("pruned settled charge intents", "rows", n)
				}
			}
		})
	}
	if err := s.waitForKafka(ctx, d, "check access to the topics and groups", func() error { return p.CheckAccess(ctx) }); err != nil {
		p.Close()
		return fmt.Errorf("KAFKA_BROKERS (%s): %w", s.Kafka.security, err)
	}
	o.watch(ctx, p, pools.all...)
	go func() {
		<-p.Running()
		d.log.Info("serving", "topics", []string{s.Kafka.confirmed(), s.Kafka.cancelled(), s.Kafka.payments()}, "groups", s.Groups, "commit_mode", s.CommitMode)
	}()
	starting = false
	if err := p.Run(ctx); err != nil {
		return err
	}
	d.log.Info("stopped")
	return nil
}

// waitForKafka runs step, one of serve's start-up steps that talk to Kafka
// (what names it in the log). A step that fails only because the brokers
// cannot be reached or are still starting is tried again with backoff, a
// line saying so each time, for up to --kafka-start-timeout (each step its
// own: a database wait in between takes nothing from it); any other failure
// (refused credentials, a missing permission, a bad setting) ends start-up
// at once. A consumer restarted beside a restarting broker then waits for
// it instead of exiting.
func (s *serveCmd) waitForKafka(ctx context.Context, d deps, what string, step func() error) error {
	if s.KafkaWait == 0 {
		return step()
	}
	exp := backoff.NewExponentialBackOff()
	exp.MaxInterval = 5 * time.Second
	_, err := backoff.Retry(ctx, func() (struct{}, error) {
		err := step()
		if err != nil && !kafkaUnavailable(err) {
			return struct{}{}, backoff.Permanent(err)
		}
		return struct{}{}, err
	}, backoff.WithBackOff(exp), backoff.WithMaxElapsedTime(s.KafkaWait), backoff.WithNotify(func(err error, next time.Duration) {
		d.log.Warn("waiting for Kafka", "step", what, "retry_in", next.Round(time.Millisecond), "err", err)
	}))
	if err != nil && kafkaUnavailable(err) {
		return fmt.Errorf("%w (waited up to --kafka-start-timeout %s)", err, s.KafkaWait)
	}
	return err
}

// waitForRetentionPolicy checks that the database records the retention
// this process was given. A database that cannot answer yet (read-only
// during a failover, restarting, unreachable, hanging up) is waited for, as
// a claim would be; a refusal no wait clears stops start-up at once with its
// reason: a disagreement, a refused permission (a group role that may not
// record the policy), refused credentials, a database never migrated.
func waitForRetentionPolicy(ctx context.Context, d deps, rcfg retention.Config) error {
	exp := backoff.NewExponentialBackOff()
	exp.MaxInterval = 10 * time.Second
	var last error
	_, err := backoff.Retry(ctx, func() (struct{}, error) {
		err := agreeRetention(ctx, rcfg)
		if err == nil || errors.Is(err, retention.ErrRetentionDisagrees) || databaseRefused(err) {
			return struct{}{}, backoff.Permanent(err)
		}
		if last == nil || ctx.Err() == nil {
			last = err
		}
		if ctx.Err() != nil {
			// Stopped during the attempt (a database shutting down with
			// us answers the same moment): the stop is the error.
			return struct{}{}, backoff.Permanent(context.Cause(ctx))
		}
		d.log.Warn("cannot check the retention policy yet; waiting for the database", "err", err)
		return struct{}{}, err
	}, backoff.WithBackOff(exp), backoff.WithMaxElapsedTime(0))
	if err != nil && ctx.Err() != nil && last != nil && onlyTheStop(err) {
		// What was waited for is said, not wrapped: the stop is clean.
		err = fmt.Errorf("%w (while waiting for the database: %v)", err, last)
	}
	return err
}

// agreeRetention is retention.Agree; a test stages a database that answers
// at the moment of the stop through it.
var agreeRetention = retention.Agree

// databaseRefused reports whether the database refused in a way no wait
// clears: credentials, a permission, a database, schema or table that is not
// there (a setting to fix, or migrations not applied). Every cause must be
// one: with several hosts, one refusing while another is down is a failover
// to wait for. Anything else a database answers at start-up (read-only,
// starting, restarting, hanging up, a pooler that cannot reach it) is
// waited for.
func databaseRefused(err error) bool {
	return everyCause(err, func(cause error) bool {
		var pg *pgconn.PgError
		if !errors.As(cause, &pg) {
			return false
		}
		return strings.HasPrefix(pg.Code, "28") || // invalid authorization: credentials, pg_hba
			strings.HasPrefix(pg.Code, "42") || // access rule violation: a permission, an undefined table
			pg.Code == "3D000" || pg.Code == "3F000" // no such database, no such schema
	})
}

// kafkaUnavailable reports whether err says only that the brokers could not
// be reached or are not ready yet: every error it joins or wraps ends in a
// network failure or in one of the broker states a restart or an election
// passes through. An error that says anything else (authentication,
// authorization, configuration) is not one.
func kafkaUnavailable(err error) bool {
	return everyCause(err, brokerNotThereYet)
}

// onlyTheStop reports whether err says only that start-up was interrupted
// by the stop while it waited: every cause is the cancellation, or a broker
// not there yet (a connection timeout included: what start-up waits
// through). A refused permission found meanwhile is not.
func onlyTheStop(err error) bool {
	return everyCause(err, func(cause error) bool {
		return errors.Is(cause, context.Canceled) || brokerNotThereYet(cause)
	})
}

// everyCause reports whether ok holds for every error at the end of err's
// chains (what it joins or wraps, down to errors that wrap nothing).
func everyCause(err error, ok func(cause error) bool) bool {
	if joined, isJoined := err.(interface{ Unwrap() []error }); isJoined {
		errs := joined.Unwrap()
		for _, e := range errs {
			if !everyCause(e, ok) {
				return false
			}
		}
		return len(errs) > 0
	}
	if inner := errors.Unwrap(err); inner != nil {
		return everyCause(inner, ok)
	}
	return ok(err)
}

// brokerNotThereYet is a cause of kafkaUnavailable: a network failure, or a
// broker state that a restart passes through.
func brokerNotThereYet(err error) bool {
	var kerr sarama.KError
	if errors.As(err, &kerr) {
		return slices.Contains(kafkaStarting, kerr)
	}
	// Not io.EOF, nor an ErrOutOfBrokers without a cause: that is what a TLS
	// client on a plaintext listener sees, and what sarama leaves of a SASL
	// mechanism the broker refuses.
	var netErr net.Error
	return errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) || (errors.As(err, &netErr) && netErr.Timeout())
}

// kafkaStarting are the broker answers of a cluster that is starting,
// restarting or moving leaders: each passes by itself.
var kafkaStarting = []sarama.KError{
	sarama.ErrUnknownTopicOrPartition, sarama.ErrLeaderNotAvailable, sarama.ErrNotLeaderForPartition, sarama.ErrRequestTimedOut,
	sarama.ErrBrokerNotAvailable, sarama.ErrReplicaNotAvailable, sarama.ErrNetworkException, sarama.ErrOffsetsLoadInProgress,
	sarama.ErrConsumerCoordinatorNotAvailable, sarama.ErrNotCoordinatorForConsumer, sarama.ErrNotController,
}
