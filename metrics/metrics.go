// Package metrics exports a pipeline's behaviour to Prometheus: every
// message's outcome per topic and consumer group, the claim's phases, batch
// sizes, consumer lag read from Kafka, held messages, the claim table's
// partitions and oldest claim, dead letters waiting for Kafka, and
// retention passes; and Watermill's own router metrics beside them.
//
// Wire it before the pipeline is made, and watch the pipeline once it is:
//
//	m := metrics.New(registry)
//	m.Instrument(&cfg)            // chains cfg's hooks; adds Watermill's router metrics
//	p, err := pipeline.New(cfg)
//	go m.Watch(ctx, p, metrics.Stores{{DB: pool}}, 15*time.Second)
package metrics

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"time"

	wmetrics "github.com/ThreeDotsLabs/watermill/components/metrics"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/pipeline"
	"github.com/once-dev/once/retention"
	"github.com/once-dev/once/schema"
)

// Namespace prefixes every metric of this package.
const Namespace = "once"

// Outcomes of once_messages_total: the idempotency outcomes, and what the
// pipeline did with a failed attempt.
const (
	OutcomeHeld         = "held"          // an attempt failed for the environment; the message is held and retried
	OutcomeDeadLettered = "dead_lettered" // the message's own fault; its letter is committed
)

// Metrics holds the collectors. Make one per process with [New].
type Metrics struct {
	reg prometheus.Registerer

	messages                          *prometheus.CounterVec
	claimSeconds, handlerSeconds      *prometheus.HistogramVec
	commitSeconds                     *prometheus.HistogramVec
	batchSize                         *prometheus.HistogramVec
	batchRunAlone, batchDeadlocks     *prometheus.CounterVec
	afterEffects                      *prometheus.CounterVec
	forwarded                         *prometheus.CounterVec
	lag, lagUnknown, joined, assigned *prometheus.GaugeVec
	held, oldestHeld                  *prometheus.GaugeVec
	heldKeys, pinned, windowFull      *prometheus.GaugeVec
	claimPartitions, oldestClaimAge   *prometheus.GaugeVec
	parkedLetters, oldestParkedLetter *prometheus.GaugeVec
	watchErrors                       *prometheus.CounterVec
	retentionPasses                   *prometheus.CounterVec
	retentionLastSuccess              prometheus.Gauge

	// lagMu guards lagFailed, by the partitions this Metrics has seen
	// (read, or assigned to this process; others may share the
	// collectors) the failed lag reads since the last that read it, and
	// lagBusy, a lag read under way: a read of a broker that does not
	// answer may take sarama's timeouts, and must hold up neither the other
	// gauges nor a second read.
	lagMu     sync.Mutex
	lagFailed map[[3]string]int
	lagBusy   bool
}

// LagUnknownAfter is how many lag reads in a row must fail to read a
// partition before its lag is unknown (its once_consumer_lag series
// removed, once_consumer_lag_unknown 1); until then it keeps its last
// value. One failed read is mostly a leader moving or a request timing
// out, which the next read gets past; a series removed for it would reset
// OnceConsumerLagGrowing's 10 minutes (a failed read every few minutes
// would silence it while the lag grows). Three in a row is 30s at app
// serve's watch interval (10s): a value at most that stale, well inside
// the lag alerts' windows, and a partition that stays unreadable is
// unknown long before OnceConsumerLagUnknown's 2m. While Kafka does not
// answer at all (longer than the broker timeout) the lag is unknown at
// once.
const LagUnknownAfter = 3

// Buckets of the claim's phases: a claim takes about a millisecond on a
// healthy database, a commit with fsync a few.
var phaseBuckets = []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10}

// New registers the collectors with reg.
func New(reg prometheus.Registerer) (*Metrics, error) {
	tg := []string{"topic", "group"}
	m := &Metrics{
		reg: reg,
		messages: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "messages_total",
			Help: "Messages by outcome: processed, duplicate, payload_mismatch, rejected, outside_horizon, failed (an invalid key), held (an attempt failed for the environment), dead_lettered."}, append(tg, "outcome")),
		claimSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: Namespace, Name: "claim_seconds",
			Help: "Begin and claim of the attempt that decided a message (its batch's, when batched).", Buckets: phaseBuckets}, tg),
		handlerSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: Namespace, Name: "handler_seconds",
			Help: "The handler inside the claim's transaction, for first claims.", Buckets: phaseBuckets}, tg),
		commitSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: Namespace, Name: "commit_seconds",
			Help: "The commit of the claim and the effect.", Buckets: phaseBuckets}, tg),
		batchSize: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: Namespace, Name: "batch_size",
			Help: "Messages per batch of a batched group.", Buckets: []float64{1, 2, 5, 10, 20, 50, 100, 200, 500}}, tg),
		batchRunAlone: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "batch_run_alone_total",
			Help: "Messages a batch could not decide (it rolled back, or a duplicate in it), run one by one."}, tg),
		batchDeadlocks: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "batch_deadlocks_total",
			Help: "Batches rolled back because they deadlocked with another transaction: the batch handler locks rows in no fixed order."}, tg),
		afterEffects: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "attempts_after_effect_total",
			Help: "Attempts that ran the handler again after an earlier attempt of the same delivery had an external effect (a charge, a message sent): each relied on that effect's own idempotency key."}, tg),
		forwarded: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "outbox_forwarded_total",
			Help: "Events of the consumer outbox that reached Kafka."}, []string{"topic"}),
		lag: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: Namespace, Name: "consumer_lag",
			Help: "Messages not yet committed by the group: the partition's high watermark minus the group's committed offset, read from Kafka; no series while it is unknown (once_consumer_lag_unknown)."}, append(tg, "partition")),
		lagUnknown: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: Namespace, Name: "consumer_lag_unknown",
			Help: "1 while the partition's lag is unknown (Kafka silent for longer than the broker timeout, or 3 reads in a row failed to read it; it has no once_consumer_lag series then), 0 while it is read."}, append(tg, "partition")),
		joined: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: Namespace, Name: "group_joined",
			Help: "1 once the group has joined its consumer group in this process, while Kafka answers it (within the broker timeout)."}, tg),
		assigned: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: Namespace, Name: "group_partitions",
			Help: "Partitions assigned to this process in the group's current session."}, tg),
		held: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: Namespace, Name: "held_messages",
			Help: "Messages held now because the environment failed their attempts."}, tg),
		oldestHeld: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: Namespace, Name: "oldest_held_seconds",
			Help: "How long the oldest message held now has been held (0: none)."}, tg),
		heldKeys: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: Namespace, Name: "held_keys",
			Help: "Keys a held message holds now, of a key-ordered group: their later messages wait, the other keys go on."}, tg),
		pinned: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: Namespace, Name: "commit_pinned_seconds",
			Help: "Of a key-ordered group: the longest any partition's committed offset has stood at its first unfinished message (a crash redelivers from there)."}, tg),
		windowFull: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: Namespace, Name: "window_full_partitions",
			Help: "Of a key-ordered group: partitions whose in-flight window is full, where nothing new starts until the first unfinished message is done."}, tg),
		claimPartitions: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: Namespace, Name: "claim_partitions",
			Help: "Partitions of the claim table (daily ones and the default)."}, []string{"store"}),
		oldestClaimAge: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: Namespace, Name: "oldest_claim_age_seconds",
			Help: "Age of the oldest event still claimed, by its UUIDv7 time: retention keeps it near the dedup retention."}, []string{"store"}),
		parkedLetters: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: Namespace, Name: "dead_letters_parked",
			Help: "Dead letters committed in the database and not yet on their dead-letter topic."}, []string{"store"}),
		oldestParkedLetter: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: Namespace, Name: "oldest_parked_dead_letter_seconds",
			Help: "Age of the oldest dead letter not yet on its topic (0: none)."}, []string{"store"}),
		watchErrors: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "watch_errors_total",
			Help: "Failed reads of the watcher (Kafka lag, the claim table)."}, []string{"source"}),
		retentionPasses: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: "retention_passes_total",
			Help: "Retention passes by result: ok or failed."}, []string{"result"}),
		retentionLastSuccess: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: Namespace, Name: "retention_last_success_timestamp_seconds",
			Help: "When a retention pass last succeeded (Unix time)."}),
	}
	// Several services in one process (the demo runs billing and analytics
	// apart) share the registry's collectors: each registers, and the second
	// adopts what the first registered.
	var errs []error
	m.messages = register(reg, m.messages, &errs)
	m.claimSeconds = register(reg, m.claimSeconds, &errs)
	m.handlerSeconds = register(reg, m.handlerSeconds, &errs)
	m.commitSeconds = register(reg, m.commitSeconds, &errs)
	m.batchSize = register(reg, m.batchSize, &errs)
	m.batchRunAlone = register(reg, m.batchRunAlone, &errs)
	m.afterEffects = register(reg, m.afterEffects, &errs)
	m.heldKeys = register(reg, m.heldKeys, &errs)
	m.pinned = register(reg, m.pinned, &errs)
	m.windowFull = register(reg, m.windowFull, &errs)
	m.batchDeadlocks = register(reg, m.batchDeadlocks, &errs)
	m.forwarded = register(reg, m.forwarded, &errs)
	m.lag = register(reg, m.lag, &errs)
	m.lagUnknown = register(reg, m.lagUnknown, &errs)
	m.joined = register(reg, m.joined, &errs)
	m.assigned = register(reg, m.assigned, &errs)
	m.held = register(reg, m.held, &errs)
	m.oldestHeld = register(reg, m.oldestHeld, &errs)
	m.claimPartitions = register(reg, m.claimPartitions, &errs)
	m.oldestClaimAge = register(reg, m.oldestClaimAge, &errs)
	m.parkedLetters = register(reg, m.parkedLetters, &errs)
	m.oldestParkedLetter = register(reg, m.oldestParkedLetter, &errs)
	m.watchErrors = register(reg, m.watchErrors, &errs)
	m.retentionPasses = register(reg, m.retentionPasses, &errs)
	m.retentionLastSuccess = register(reg, m.retentionLastSuccess, &errs)
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return m, nil
}

// register registers c, or returns the collector of the same description
// already registered.
func register[C prometheus.Collector](reg prometheus.Registerer, c C, errs *[]error) C {
	err := reg.Register(c)
	var already prometheus.AlreadyRegisteredError
	if errors.As(err, &already) {
		if existing, ok := already.ExistingCollector.(C); ok {
			return existing
		}
	}
	if err != nil {
		*errs = append(*errs, err)
	}
	return c
}

// Attach makes cfg report to the metrics: their hooks join cfg.Hooks (the
// hooks already there still run first), and Watermill's router metrics
// (namespace once_watermill) are added to whichever router the pipeline
// runs, its own or the team's. It creates no router.
func (m *Metrics) Attach(cfg *pipeline.Config) {
	cfg.Hooks = pipeline.ComposeHooks(cfg.Hooks, m.Hooks())
	setup := cfg.SetupRouter
	cfg.SetupRouter = func(r *message.Router) error {
		if setup != nil {
			if err := setup(r); err != nil {
				return err
			}
		}
		wmetrics.NewPrometheusMetricsBuilder(m.reg, Namespace, "watermill").AddPrometheusRouterMetrics(r)
		return nil
	}
}

// Hooks are the pipeline hooks that count messages, holds, dead letters,
// batches and forwarded events.
func (m *Metrics) Hooks() pipeline.Hooks {
	return pipeline.Hooks{
		OnResult: m.Result,
		OnHeld: func(h pipeline.Held) {
			m.messages.WithLabelValues(h.Topic, h.Group, OutcomeHeld).Inc()
		},
		OnDeadLetter: func(d pipeline.DeadLetter) {
			m.messages.WithLabelValues(d.Topic, d.Group, OutcomeDeadLettered).Inc()
		},
		OnBatch: func(b pipeline.BatchDone) {
			m.batchSize.WithLabelValues(b.Topic, b.Group).Observe(float64(b.Size))
			m.batchRunAlone.WithLabelValues(b.Topic, b.Group).Add(float64(b.RunAlone))
			if b.Deadlock {
				m.batchDeadlocks.WithLabelValues(b.Topic, b.Group).Inc()
			}
		},
		OnForwarded: func(f pipeline.Forwarded) {
			m.forwarded.WithLabelValues(f.Topic).Inc()
		},
	}
}

// Result counts one idempotency outcome; the Failed attempts that the
// pipeline holds or dead-letters are counted by those hooks instead, so
// that every message is counted once per decision.
func (m *Metrics) Result(r idempotency.Result) {
	if len(r.AfterEffects) > 0 {
		m.afterEffects.WithLabelValues(r.Topic, r.ConsumerGroup).Inc()
	}
	if r.Outcome == idempotency.Failed && r.EventID != [16]byte{} {
		return
	}
	m.messages.WithLabelValues(r.Topic, r.ConsumerGroup, r.Outcome.String()).Inc()
	if r.Claim > 0 {
		m.claimSeconds.WithLabelValues(r.Topic, r.ConsumerGroup).Observe(r.Claim.Seconds())
	}
	if r.Handle > 0 {
		m.handlerSeconds.WithLabelValues(r.Topic, r.ConsumerGroup).Observe(r.Handle.Seconds())
	}
	if r.Commit > 0 {
		m.commitSeconds.WithLabelValues(r.Topic, r.ConsumerGroup).Observe(r.Commit.Seconds())
	}
}

// RetentionPass counts a retention pass: give it as retention.Config.OnPass.
func (m *Metrics) RetentionPass(_ retention.Report, err error) {
	if err != nil {
		m.retentionPasses.WithLabelValues("failed").Inc()
		return
	}
	m.retentionPasses.WithLabelValues("ok").Inc()
	m.retentionLastSuccess.SetToCurrentTime()
}

// Store is a database the pipeline's groups keep claims and dead letters
// in, as package schema made it.
type Store struct {
	// Name labels its metrics. Default: "default".
	Name   string
	DB     pipeline.DB
	Tables schema.Config
}

// Stores are the databases [Metrics.Watch] reads.
type Stores []Store

// Watch refreshes the gauges that are read rather than counted (consumer
// lag from Kafka, the pipeline's status, the claim tables and parked dead
// letters) every interval until ctx ends. A failed read counts
// once_watch_errors_total; a failed read of the claim tables keeps their
// last values. A partition's lag keeps its last value through fewer than
// [LagUnknownAfter] failed reads in a row; after that, or while Kafka is
// silent, it has no series and once_consumer_lag_unknown is 1 until it is
// read again (unknown, not the last value: a lag that stood still while
// the broker hung would look like a consumer keeping up).
func (m *Metrics) Watch(ctx context.Context, p *pipeline.Pipeline, stores Stores, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		m.refresh(ctx, p, stores, interval)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// refreshLag reads the lag on its own goroutine, one read at a time: while
// one is under way, the series it would set stay as they are until it
// returns, unless the pipeline reports Kafka silent, which makes the lag
// unknown at once. Watch does not wait for a read under way when it ends
// (a stop must not wait on a broker that does not answer); the read sets
// nothing then.
func (m *Metrics) refreshLag(ctx context.Context, p *pipeline.Pipeline) {
	m.lagMu.Lock()
	defer m.lagMu.Unlock()
	silent := false
	var assigned []pipeline.PartitionLag // partitions that exist, whether read or not
	for _, s := range p.Status() {
		silent = silent || s.KafkaSilent > 0
		for _, part := range s.Partitions {
			assigned = append(assigned, pipeline.PartitionLag{Topic: s.Topic, Group: s.Group, Partition: part})
		}
	}
	if silent {
		m.lagReadLocked(nil, true, assigned)
	}
	if m.lagBusy {
		return
	}
	m.lagBusy = true
	go func() {
		lags, err := p.Lag(ctx)
		if err != nil && ctx.Err() == nil {
			m.watchErrors.WithLabelValues("kafka").Inc()
		}
		m.lagMu.Lock()
		defer m.lagMu.Unlock()
		m.lagBusy = false
		if ctx.Err() == nil {
			m.lagReadLocked(lags, errors.Is(err, pipeline.ErrKafkaSilent), assigned)
		}
	}()
}

// lagReadLocked records a lag read: the partitions of lags were read; every
// other partition seen (in an earlier read, or among assigned) was not,
// and its lag becomes unknown when silent or after LagUnknownAfter such
// reads in a row, else keeps its last value. Caller holds lagMu.
func (m *Metrics) lagReadLocked(lags []pipeline.PartitionLag, silent bool, assigned []pipeline.PartitionLag) {
	if m.lagFailed == nil {
		m.lagFailed = map[[3]string]int{}
	}
	key := func(l pipeline.PartitionLag) [3]string {
		return [3]string{l.Topic, l.Group, strconv.Itoa(int(l.Partition))}
	}
	for _, l := range assigned {
		if _, seen := m.lagFailed[key(l)]; !seen {
			m.lagFailed[key(l)] = 0
		}
	}
	read := make(map[[3]string]bool, len(lags))
	for _, l := range lags {
		k := key(l)
		read[k] = true
		m.lagFailed[k] = 0
		m.lag.WithLabelValues(k[0], k[1], k[2]).Set(float64(l.Lag))
		m.lagUnknown.WithLabelValues(k[0], k[1], k[2]).Set(0)
	}
	for k, failed := range m.lagFailed {
		if read[k] {
			continue
		}
		failed++
		m.lagFailed[k] = failed
		if silent || failed >= LagUnknownAfter {
			m.lag.DeleteLabelValues(k[0], k[1], k[2])
			m.lagUnknown.WithLabelValues(k[0], k[1], k[2]).Set(1)
		}
	}
}

func (m *Metrics) refresh(ctx context.Context, p *pipeline.Pipeline, stores Stores, timeout time.Duration) {
	m.refreshLag(ctx, p)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for _, s := range p.Status() {
		joined := 0.0
		if s.Joined {
			joined = 1
		}
		m.joined.WithLabelValues(s.Topic, s.Group).Set(joined)
		m.assigned.WithLabelValues(s.Topic, s.Group).Set(float64(len(s.Partitions)))
		m.held.WithLabelValues(s.Topic, s.Group).Set(float64(s.Held))
		m.oldestHeld.WithLabelValues(s.Topic, s.Group).Set(s.OldestHeld.Seconds())
		m.heldKeys.WithLabelValues(s.Topic, s.Group).Set(float64(s.HeldKeys))
		m.pinned.WithLabelValues(s.Topic, s.Group).Set(s.Pinned.Seconds())
		m.windowFull.WithLabelValues(s.Topic, s.Group).Set(float64(s.WindowFull))
	}
	for _, s := range stores {
		if err := m.readStore(ctx, s); err != nil {
			m.watchErrors.WithLabelValues("postgres").Inc()
		}
	}
}

func (m *Metrics) readStore(ctx context.Context, s Store) error {
	name := s.Name
	if name == "" {
		name = "default"
	}
	claims := s.Tables.Claims().Qualified
	letters := s.Tables.DeadLettersTable().Qualified
	var partitions int64
	var oldest *[16]byte
	var parked int64
	var parkedAge float64
	// The oldest event id by the primary key's order: an index probe, not
	// a scan (ids are UUIDv7, their order is their time's).
	rows, err := s.DB.Query(ctx, `SELECT
  (SELECT count(*) FROM pg_inherits WHERE inhparent = to_regclass($1)),
  (SELECT event_id FROM `+claims+` ORDER BY event_id LIMIT 1),
  (SELECT count(*) FROM `+letters+`),
  (SELECT coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 FROM `+letters+`)`, claims)
	if err != nil {
		return err
	}
	if _, err := pgx.ForEachRow(rows, []any{&partitions, &oldest, &parked, &parkedAge}, func() error { return nil }); err != nil {
		return err
	}
	m.claimPartitions.WithLabelValues(name).Set(float64(partitions))
	age := 0.0
	if oldest != nil {
		age = time.Since(idempotency.IDTime(*oldest)).Seconds()
	}
	m.oldestClaimAge.WithLabelValues(name).Set(age)
	m.parkedLetters.WithLabelValues(name).Set(float64(parked))
	m.oldestParkedLetter.WithLabelValues(name).Set(parkedAge)
	return nil
}
