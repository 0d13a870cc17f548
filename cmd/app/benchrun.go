package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/handlers/analytics"
	"github.com/once-dev/once/internal/progress"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/orderevents"
	"github.com/once-dev/once/pipeline"
)

// benchRunCmd is one measurement of app bench, in a process of its own so
// that its peak memory is its own. It prints one JSON line.
type benchRunCmd struct {
	DB           dbSettings `embed:""`
	Brokers      []string   `name:"kafka-brokers" env:"KAFKA_BROKERS" sep:"," help:"Kafka bootstrap addresses."`
	KafkaVersion string     `name:"kafka-version" env:"KAFKA_VERSION" default:"${kafka_version}" help:"The brokers' Kafka version."`
	Variant      string     `name:"variant" required:"" enum:"L1,L2,L2U,L2B,B,P,PB,PBW,W,WB,WH" help:"What to measure (see app bench --help)."`
	Topic        string     `name:"topic" help:"Topic to consume (Kafka variants)."`
	Group        string     `name:"group" required:"" help:"Consumer group, and the claims' group."`
	Events       int        `name:"events" required:"" help:"Events to process before stopping."`
	Concurrency  int        `name:"concurrency" default:"12" help:"L2: goroutines, as many as the partitions a consumer owns; W, WB, WH in key order: the group's Concurrency."`
	BatchSize    int        `name:"batch-size" default:"100" help:"Events per transaction of the batched variants."`
	BatchConc    int        `name:"batch-concurrency" default:"2" help:"Batches at once, in PB and L2B."`
	ClearAfter   bool       `name:"clear-after" help:"Delete the group's claims and the generated events' analytics rows when done (app bench sets it; the group must be one of app bench's own)."`
	ClaimsSince  time.Time  `name:"claims-since" help:"With --clear-after: the claims to delete were made after this time (RFC 3339)."`
	Warmup       int        `name:"warmup-events" help:"Events before the measured ones that warm the run up and are left out of its figures: at an offered load, those the producer marked with its once-bench-warmup header (P, PB), or the first ones handed over (L2, L2B)."`
	Rate         int        `name:"rate" help:"L2, L2B: hand the events to the claim at this rate (events/s) instead of all at once, each latency from the instant it was due: the database's own latency at an offered load. 0: all at once."`
	FromProduce  bool       `name:"from-produce" help:"P, PB, PBW: measure each event's latency from when it was produced (its event id's time, to the millisecond), not from when it entered the group's chain."`
	Split        bool       `name:"split" help:"With --from-produce: split each event's latency into production to the broker's append, the append to delivery to the group, delivery to the claim's commit, and the claim's commit to the offset's commit; latency from the producer's once-bench-produced header (to the ns), not the event id. The topic's message.timestamp.type must be LogAppendTime (app bench's offered-load runs make both)."`
	SplitFile    string     `name:"split-file" type:"path" help:"With --split: write each event's instants and the parts of its latency to this file, a JSON line each."`
	CPUProfile   string     `name:"cpuprofile" help:"Write a CPU profile of the measurement to this file."`
	MemProfile   string     `name:"memprofile" help:"Write an allocation profile of the whole process to this file: every allocation is recorded, so the run is slower and its figures are not comparable."`
	Wait         waitFlags  `embed:""`

	hold *holdFigures // WH's, once measured
	// split: the parts' figures, once measured (--split); splitCPU: the
	// CPU time spent reading them, not the measurement's.
	split    []splitFigure
	splitCPU time.Duration
	// W, WB, WH: the mean time in the handler, and in a provider's call
	// (WB), once measured.
	inHandler, inCall float64
}

// benchFigures is what a measurement reports.
type benchFigures struct {
	Variant string  `json:"variant"`
	Events  int     `json:"events"`
	Seconds float64 `json:"seconds"`
	P50ms   float64 `json:"p50_ms"`
	P99ms   float64 `json:"p99_ms"`
	P999ms  float64 `json:"p999_ms"`
	// CPUus is the measuring process's user + system CPU time per event,
	// in microseconds: a figure this noisy machine's other load hardly
	// moves, unlike a rate.
	CPUus float64 `json:"cpu_us_per_event"`
	// Filled in by app bench.
	PeakRSSKiB int64  `json:"peak_rss_kib,omitempty"`
	Skipped    string `json:"skipped,omitempty"`
	// Split is where the time of an offered-load run's events went
	// (--split): each part's percentiles, in splitParts' order.
	Split []splitFigure `json:"split,omitempty"`
	// Hold is WH's account of the held key and the others.
	Hold *holdFigures `json:"hold,omitempty"`
	// W, WB, WH: the mean time in the handler, and in one call to the
	// payment provider (WB): what of an attempt is the wait itself.
	HandlerMs float64 `json:"handler_ms,omitempty"`
	CallMs    float64 `json:"call_ms,omitempty"`
}

func (f benchFigures) rate() float64 {
	if f.Seconds <= 0 {
		return 0
	}
	return float64(f.Events) / f.Seconds
}

// clock measures a run: from the first event started to the last one done,
// and every event's latency.
type clock struct {
	mu        sync.Mutex
	first     time.Time
	last      time.Time
	latencies []time.Duration
	done      atomic.Int64
	want      int64
	all       chan struct{}
}

func newClock(events int) *clock {
	return &clock{latencies: make([]time.Duration, 0, events), want: int64(events), all: make(chan struct{})}
}

func (c *clock) started(at time.Time) {
	c.mu.Lock()
	if c.first.IsZero() || at.Before(c.first) {
		c.first = at
	}
	c.mu.Unlock()
}

func (c *clock) finished(latency time.Duration) {
	c.mu.Lock()
	c.last = time.Now()
	c.latencies = append(c.latencies, latency)
	c.mu.Unlock()
	c.count()
}

// warmedUp counts a warm-up event done: the run waits for it, the figures
// leave it out.
func (c *clock) warmedUp() { c.count() }

func (c *clock) count() {
	if c.done.Add(1) == c.want {
		close(c.all)
	}
}

func (c *clock) figures(variant string) benchFigures {
	c.mu.Lock()
	defer c.mu.Unlock()
	f := benchFigures{Variant: variant, Events: len(c.latencies), Seconds: c.last.Sub(c.first).Seconds()}
	f.P50ms, f.P99ms, f.P999ms = percentiles(c.latencies)
	return f
}

func (b *benchRunCmd) Validate() error {
	if b.Rate < 0 || b.Rate > 0 && b.Variant != "L2" && b.Variant != "L2B" {
		return fmt.Errorf("--rate %d: a rate of at least 1 event/s, for --variant L2 or L2B only", b.Rate)
	}
	if b.Split && (!b.FromProduce || b.Variant[0] != 'P') {
		return fmt.Errorf("--split needs --from-produce and --variant P, PB or PBW")
	}
	if b.Warmup < 0 || b.Warmup > 0 && b.Rate == 0 && !b.Split {
		return fmt.Errorf("--warmup-events %d: at an offered load only (--rate with L2 or L2B, --split with P or PB)", b.Warmup)
	}
	if b.SplitFile != "" && !b.Split {
		return fmt.Errorf("--split-file needs --split")
	}
	return splitFileDir(b.SplitFile)
}

func (b *benchRunCmd) Run(ctx context.Context, d deps) error {
	if b.MemProfile != "" {
		// Every allocation, from the start (the rate must not change once
		// allocations are recorded), so that the profile counts them
		// instead of estimating them.
		runtime.MemProfileRate = 1
		defer func() {
			if err := writeProfile("allocs", b.MemProfile); err != nil {
				fmt.Fprintf(d.stderr, "memprofile: %v\n", err)
			}
		}()
	}
	pool, err := b.DB.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	c := newClock(b.Events + b.Warmup)
	line := progress.New(d.stderr)
	defer line.Done()
	label := b.Variant
	switch {
	case b.Variant[0] == 'W' && b.Wait.Order == "key":
		label = fmt.Sprintf("%s in key order, N %d", b.Variant, b.Concurrency)
	case b.Variant[0] == 'W':
		label = fmt.Sprintf("%s in partition order", b.Variant)
	}
	go func() {
		t := time.NewTicker(500 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-c.all:
				return
			case <-ctx.Done():
				return
			case <-t.C:
				line.Set("%s: %d/%d events", label, c.done.Load(), b.Events)
			}
		}
	}()
	if b.CPUProfile != "" {
		f, err := os.Create(b.CPUProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	// Quiet: a measurement logs only what goes wrong (WH's held key
	// goes wrong on purpose, and is reported).
	level := slog.LevelWarn
	if b.Variant == "WH" {
		level = slog.LevelError
	}
	log := slog.New(slog.NewTextHandler(d.stderr, &slog.HandlerOptions{Level: level}))
	cpuBefore := cpuTime()
	switch b.Variant {
	case "L2", "L2U":
		err = b.direct(ctx, pool, c, log)
	case "L2B":
		err = b.directBatched(ctx, pool, c, log)
	case "L1", "B":
		err = b.bare(ctx, pool, c, log)
	case "P", "PB", "PBW":
		err = b.pipelined(ctx, pool, c, log)
	case "W", "WB", "WH":
		err = b.waiting(ctx, pool, c, log)
	}
	if err != nil {
		return err
	}
	cpu := cpuTime() - cpuBefore - b.splitCPU
	line.Done()
	f := c.figures(b.Variant)
	f.Split = b.split
	// Over every event processed: the warm-up's CPU is in cpu too.
	f.CPUus = float64(cpu.Microseconds()) / float64(max(b.Events+b.Warmup, 1))
	f.PeakRSSKiB = peakRSS(os.Getpid())
	f.Hold = b.hold
	f.HandlerMs, f.CallMs = b.inHandler, b.inCall
	if b.ClearAfter {
		// Every measurement leaves the tables as it found them: the next
		// one then inserts its rows as this one did, instead of updating
		// this one's, and a claim table grown by earlier runs slows none.
		clearBenchRows(ctx, pool, likeEscape(b.Group), b.ClaimsSince, d.stderr)
	}
	return json.NewEncoder(d.stdout).Encode(f)
}

// cpuTime is this process's user + system CPU time so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// peakRSS is a process's VmHWM, its resident set's high-water mark, in KiB:
// of the process since its exec. (getrusage's maxrss would carry over the
// parent's size from the fork.)
func peakRSS(pid int) int64 {
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(status), "\n") {
		if rest, ok := strings.CutPrefix(l, "VmHWM:"); ok {
			kib, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			return kib
		}
	}
	return 0
}

// wait waits for every event, or fails after a generous limit.
func (b *benchRunCmd) wait(ctx context.Context, c *clock) error {
	select {
	case <-c.all:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(time.Duration(b.Events)*5*time.Millisecond + 10*time.Minute):
		return fmt.Errorf("bench %s: %d of %d events after the time limit", b.Variant, c.done.Load(), b.Events)
	}
}

// events makes n events as app bench publishes them.
func benchEvents(n int) [][]byte {
	out := make([][]byte, n)
	for i := range out {
		out[i] = benchEvent(i)
	}
	return out
}

// benchEvent is the i-th generated event, its id made now.
func benchEvent(i int) []byte {
	ev, err := orderevents.NewConfirmed(uuid.Must(uuid.NewV7()), throughputDay, benchCustomers+int64(i), benchCustomers+rand.Int64N(benchCustomerCount),
		decimal.New(100+rand.Int64N(100000), -2))
	if err != nil {
		panic(err) // the values above are always valid
	}
	b, _ := ev.MarshalJSON()
	return b
}

func analyticsUpsert(ctx context.Context, tx pgx.Tx, payload []byte) error {
	ev, err := orderevents.DecodeConfirmed(payload)
	if err != nil {
		return idempotency.Permanent(err)
	}
	return analytics.Handler{}.OnConfirmed(ctx, tx, ev)
}

// direct (L2) runs the claim and the upsert straight from Go, through the
// idempotency middleware, Concurrency at a time: the database's limit for
// one event per transaction.
func (b *benchRunCmd) direct(ctx context.Context, pool *pgxpool.Pool, c *clock, log *slog.Logger) error {
	m, err := idempotency.New(idempotency.Config{DB: pool, ConsumerGroup: b.Group, Logger: log})
	if err != nil {
		return err
	}
	h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, err := idempotency.TxFromContext(msg.Context())
		if err != nil {
			return nil, err
		}
		return nil, analyticsUpsert(msg.Context(), tx, msg.Payload)
	})
	if b.Variant == "L2U" {
		// The upsert alone, in a transaction of its own: what the claim
		// costs the database is L2 against this.
		h = func(msg *message.Message) ([]*message.Message, error) {
			return nil, pgx.BeginFunc(msg.Context(), pool, func(tx pgx.Tx) error { return analyticsUpsert(msg.Context(), tx, msg.Payload) })
		}
	}
	work := make(chan dueEvent)
	var failed atomic.Value
	var wg sync.WaitGroup
	for range b.Concurrency {
		wg.Go(func() {
			for ev := range work {
				start := time.Now()
				if !ev.warmup {
					c.started(start)
				}
				msg := message.NewMessage(watermill.NewUUID(), ev.payload)
				msg.SetContext(ctx)
				if _, err := h(msg); err != nil {
					failed.Store(err)
				}
				if ev.warmup {
					c.warmedUp()
				} else {
					c.finished(time.Since(ev.since(start)))
				}
			}
		})
	}
	b.feed(ctx, benchEvents(b.Events+b.Warmup), work)
	wg.Wait()
	if err, _ := failed.Load().(error); err != nil {
		return fmt.Errorf("bench L2: %w", err)
	}
	return nil
}

// dueEvent is an event handed to L2 or L2B, with the instant it was due
// at an offered load (zero: all at once).
type dueEvent struct {
	payload []byte
	due     time.Time
	warmup  bool // not measured: --warmup-events
}

// since is where the event's latency starts: when it was due, at an
// offered load, else when its processing started.
func (ev dueEvent) since(start time.Time) time.Time {
	if ev.due.IsZero() {
		return start
	}
	return ev.due
}

// feed hands payloads to work, all at once or, with --rate, each at its
// instant, evenly spaced (time.Sleep, not a ticker, so that a late wake-up
// sends what has fallen due at once instead of drifting), and closes it.
// An event's latency starts at its instant: the wait for a free goroutine
// counts, as a delivered message's wait for its turn does.
func (b *benchRunCmd) feed(ctx context.Context, payloads [][]byte, work chan<- dueEvent) {
	defer close(work)
	start := time.Now()
	for i, p := range payloads {
		ev := dueEvent{payload: p, warmup: i < b.Warmup}
		if b.Rate > 0 {
			ev.due = start.Add(time.Duration(float64(i) / float64(b.Rate) * float64(time.Second)))
			if wait := time.Until(ev.due); wait > 0 {
				time.Sleep(wait)
			}
		}
		select {
		case work <- ev:
		case <-ctx.Done():
			return
		}
	}
}

// directBatched (L2B) is L2 with the group commit: BatchSize events per
// transaction, one batch at a time, as a batched group runs them.
func (b *benchRunCmd) directBatched(ctx context.Context, pool *pgxpool.Pool, c *clock, log *slog.Logger) error {
	m, err := idempotency.New(idempotency.Config{DB: pool, ConsumerGroup: b.Group, Logger: log})
	if err != nil {
		return err
	}
	payloads := benchEvents(b.Events + b.Warmup)
	// next forms a batch when a commit slot is free, as a batched group
	// does: what has come, up to BatchSize (the first waited for, the
	// others taken if they are there). All at once, every event has come
	// before the first batch, and each is BatchSize in turn. One slot
	// forms its batch at a time.
	arriving := make(chan dueEvent, len(payloads))
	if b.Rate > 0 {
		go b.feed(ctx, payloads, arriving)
	} else {
		b.feed(ctx, payloads, arriving)
	}
	var mu sync.Mutex
	next := func() []dueEvent {
		mu.Lock()
		defer mu.Unlock()
		first, ok := <-arriving
		if !ok {
			return nil
		}
		chunk := []dueEvent{first}
		for len(chunk) < b.BatchSize {
			select {
			case ev, ok := <-arriving:
				if !ok {
					return chunk
				}
				chunk = append(chunk, ev)
			default:
				return chunk
			}
		}
		return chunk
	}
	var failed atomic.Value
	var wg sync.WaitGroup
	for range b.BatchConc {
		wg.Go(func() {
			for chunk := next(); len(chunk) > 0; chunk = next() {
				if err := b.oneBatch(ctx, m, c, chunk); err != nil {
					failed.Store(err)
				}
			}
		})
	}
	wg.Wait()
	if err, _ := failed.Load().(error); err != nil {
		return err
	}
	return nil
}

func (b *benchRunCmd) oneBatch(ctx context.Context, m *idempotency.Middleware, c *clock, chunk []dueEvent) error {
	{
		msgs := make([]*message.Message, len(chunk))
		for j, ev := range chunk {
			msgs[j] = message.NewMessage(watermill.NewUUID(), ev.payload)
			msgs[j].SetContext(ctx)
		}
		start := time.Now()
		if !chunk[len(chunk)-1].warmup {
			c.started(start)
		}
		errs := m.ProcessBatch(ctx, msgs, func(ctx context.Context, tx pgx.Tx, claimed []*message.Message) error {
			evs := make([]orderevents.Confirmed, len(claimed))
			for j, msg := range claimed {
				var err error
				if evs[j], err = orderevents.DecodeConfirmed(msg.Payload); err != nil {
					return err
				}
			}
			return analytics.Handler{}.OnConfirmedBatch(ctx, tx, evs)
		})
		for _, err := range errs {
			if err != nil {
				return fmt.Errorf("bench L2B: %w", err)
			}
		}
		for _, ev := range chunk {
			if ev.warmup {
				c.warmedUp()
			} else {
				c.finished(time.Since(ev.since(start)))
			}
		}
	}
	return nil
}

// bare (L1, B) runs the pipeline's subscriber in a plain Watermill router:
// L1 acknowledges every message at once (the broker's and the stack's
// limit), B decodes it and runs the analytics upsert in a transaction of its
// own, without a claim (the unsafe baseline).
func (b *benchRunCmd) bare(ctx context.Context, pool *pgxpool.Pool, c *clock, log *slog.Logger) error {
	sub, err := pipeline.NewSubscriber(b.Brokers, b.Group, b.KafkaVersion, pipeline.KafkaSecurity{}, 1, log)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NewSlogLogger(log))
	if err != nil {
		return err
	}
	router.AddConsumerHandler("bench", b.Topic, sub, func(msg *message.Message) error {
		start := time.Now()
		c.started(start)
		if b.Variant == "B" {
			if err := pgx.BeginFunc(msg.Context(), pool, func(tx pgx.Tx) error { return analyticsUpsert(msg.Context(), tx, msg.Payload) }); err != nil {
				return err
			}
		}
		c.finished(time.Since(start))
		return nil
	})
	return b.runRouter(ctx, c, func(ctx context.Context) error { return router.Run(ctx) }, nil)
}

// runRouter runs run until the clock has every event, then, if every event
// came, whenDone while it still runs, and stops it.
func (b *benchRunCmd) runRouter(ctx context.Context, c *clock, run func(context.Context) error, whenDone func() error) error {
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- run(runCtx) }()
	waitErr := b.wait(ctx, c)
	if waitErr == nil && whenDone != nil {
		waitErr = whenDone()
	}
	cancel()
	if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	return waitErr
}

// pipelined (P, PB, PBW) runs the analytics group through the whole pipeline:
// per event, or batched. The latency is each message's, from its delivery
// to the group (Hooks.OnDelivered) to its commit (a batch's wait included).
func (b *benchRunCmd) pipelined(ctx context.Context, pool *pgxpool.Pool, c *clock, log *slog.Logger) error {
	g := pipeline.Group[orderevents.Confirmed]{Name: b.Group, Handle: analytics.Handler{}.OnConfirmed}
	switch b.Variant {
	case "PB":
		g = pipeline.Group[orderevents.Confirmed]{Name: b.Group, HandleBatch: analytics.Handler{}.OnConfirmedBatch, Batch: pipeline.Batch{Size: b.BatchSize, Concurrency: b.BatchConc}}
	case "PBW":
		g = pipeline.Group[orderevents.Confirmed]{Name: b.Group, HandleBatch: analytics.Handler{}.OnConfirmedBatch,
			Batch: pipeline.Batch{Size: b.BatchSize, Concurrency: b.BatchConc, MaxWait: 5 * time.Millisecond, WaitToFill: true}}
	}
	return b.runPipeline(ctx, pool, c, log, pipeline.Config{
		Topics: []pipeline.Binding{pipeline.Topic[orderevents.Confirmed]{Name: b.Topic, Decode: orderevents.DecodeConfirmed, Groups: []pipeline.Group[orderevents.Confirmed]{g}}},
	})
}

// runPipeline runs cfg's pipeline (its topics and groups, and hooks of its
// own if any) until the clock has every event, timing each from its
// delivery to its group (or its production, --from-produce) to its commit;
// with --split, where each event's time went.
func (b *benchRunCmd) runPipeline(ctx context.Context, pool *pgxpool.Pool, c *clock, log *slog.Logger, cfg pipeline.Config) error {
	// Measured with hooks, not an Observe middleware: one would take a
	// batched group off its direct path (see pipeline.Batch).
	var mu sync.Mutex
	starts := map[partitionOffset]time.Time{}   // delivered, not yet committed
	produced := map[partitionOffset]time.Time{} // --split: the same events' production
	warm := map[partitionOffset]bool{}          // --warmup-events: delivered warm-up events
	var events []*eventTimes                    // --split: the committed ones
	var bad error                               // --split: an event without its production time
	if b.Split {
		events = make([]*eventTimes, 0, b.Events)
		version, err := pipeline.ParseKafkaVersion(b.KafkaVersion)
		if err != nil {
			return fmt.Errorf("--kafka-version: %w", err)
		}
		admin, err := sarama.NewClusterAdmin(b.Brokers, pipeline.PublisherSaramaConfig(version))
		if err != nil {
			return fmt.Errorf("--kafka-brokers: %w", err)
		}
		err = checkLogAppendTime(admin, b.Topic)
		admin.Close()
		if err != nil {
			return err
		}
	}
	keep := !b.FromProduce || b.Split
	// The split's instants are wall-clock times (Round(0) drops the
	// monotonic reading): the producer's and the broker's are, on the same
	// clock, and the parts then add up exactly.
	now := time.Now
	if b.Split {
		now = func() time.Time { return time.Now().Round(0) }
	}
	hooks := pipeline.Hooks{
		OnDelivered: func(d pipeline.Delivery) {
			start := now()
			if !keep {
				c.started(start)
				return
			}
			at := partitionOffset{d.Partition, d.Offset}
			if b.Warmup > 0 && d.Headers[warmupHeader] != "" {
				mu.Lock()
				warm[at] = true
				mu.Unlock()
				return
			}
			c.started(start)
			var from time.Time
			var err error
			if b.Split {
				from, err = producedAt(d.Headers)
			}
			mu.Lock()
			starts[at] = start
			if b.Split {
				produced[at] = from
				bad = cmp.Or(bad, err)
			}
			mu.Unlock()
		},
		OnResult: func(r idempotency.Result) {
			if r.Outcome != idempotency.Processed {
				return
			}
			done := now()
			// Kafka's queueing counts too: what a payments team waits.
			start := idempotency.IDTime(r.EventID)
			if keep {
				// The pipeline's message UUID is topic/partition/offset.
				rest, o, _ := cutLast(r.MessageUUID, "/")
				_, p, _ := cutLast(rest, "/")
				partition, _ := strconv.ParseInt(p, 10, 32)
				offset, _ := strconv.ParseInt(o, 10, 64)
				at := partitionOffset{int32(partition), offset}
				mu.Lock()
				if warm[at] {
					delete(warm, at)
					mu.Unlock()
					c.warmedUp()
					return
				}
				start = starts[at]
				delete(starts, at)
				if b.Split {
					e := &eventTimes{Partition: at.partition, Offset: at.offset, Produced: produced[at], Delivered: start, Committed: done}
					delete(produced, at)
					start = e.Produced
					e.Latency = done.Sub(start)
					events = append(events, e)
				}
				mu.Unlock()
			}
			c.finished(done.Sub(start))
		},
	}
	cfg.Brokers, cfg.KafkaVersion, cfg.DB, cfg.Logger = b.Brokers, b.KafkaVersion, pool, log
	cfg.Hooks = pipeline.ComposeHooks(hooks, cfg.Hooks)
	p, err := pipeline.New(cfg)
	if err != nil {
		return err
	}
	var whenDone func() error
	if b.Split {
		whenDone = func() error {
			mu.Lock()
			done, err := slices.Clone(events), bad
			mu.Unlock()
			if err != nil {
				return fmt.Errorf("--split: %w", err)
			}
			before := cpuTime()
			defer func() { b.splitCPU = cpuTime() - before }()
			if err := b.splitTimes(ctx, done); err != nil {
				return err
			}
			b.split = splitFigures(done)
			if b.SplitFile != "" {
				if err := writeSplitFile(b.SplitFile, done); err != nil {
					return fmt.Errorf("--split-file: %w", err)
				}
			}
			return nil
		}
	}
	return b.runRouter(ctx, c, p.Run, whenDone)
}

// cutLast is strings.Cut at the last sep.
func cutLast(s, sep string) (before, after string, found bool) {
	if i := strings.LastIndex(s, sep); i >= 0 {
		return s[:i], s[i+len(sep):], true
	}
	return s, "", false
}

// publishBench writes payloads to topic, each keyed by its index (as its
// order id is), through an idempotent producer; progress reports how far it
// got.
func publishBench(brokers []string, version sarama.KafkaVersion, topic string, payloads [][]byte, progress func(int)) error {
	return publishKeyed(brokers, version, topic, payloads, strconv.Itoa, progress)
}

// publishKeyed is publishBench with the i-th payload keyed key(i).
func publishKeyed(brokers []string, version sarama.KafkaVersion, topic string, payloads [][]byte, key func(int) string, progress func(int)) error {
	cfg := pipeline.PublisherSaramaConfig(version)
	cfg.Producer.Compression = sarama.CompressionNone
	producer, err := sarama.NewSyncProducer(brokers, cfg)
	if err != nil {
		return fmt.Errorf("kafka producer: %w", err)
	}
	defer producer.Close()
	const chunk = 2000
	for i := 0; i < len(payloads); i += chunk {
		var msgs []*sarama.ProducerMessage
		for j, p := range payloads[i:min(i+chunk, len(payloads))] {
			msgs = append(msgs, &sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder(key(i + j)), Value: sarama.ByteEncoder(p)})
		}
		if err := producer.SendMessages(msgs); err != nil {
			return fmt.Errorf("publish to %s: %w", topic, err)
		}
		progress(i + len(msgs))
	}
	return nil
}

// publishAtRate publishes warmup and then events events to topic at rate a
// second, each at its own instant (evenly spaced from the start), through
// an asynchronous producer, so that a slow append holds no event's send
// but the producer's own queue behind it, as a team's producer would. Its
// producedHeader is its instant, to the nanosecond, not when it left: the
// consumer measures its latency from there, and a send that came late
// (the bench's own loop woke late, or the producer queued it) counts, as
// it does for L2 (no coordinated omission). The first warmup carry
// warmupHeader: the consumer leaves them out of its figures.
func publishAtRate(ctx context.Context, brokers []string, version sarama.KafkaVersion, topic string, warmup, events, rate int) error {
	events += warmup
	cfg := pipeline.PublisherSaramaConfig(version)
	cfg.Producer.Compression = sarama.CompressionNone
	producer, err := sarama.NewAsyncProducer(brokers, cfg)
	if err != nil {
		return fmt.Errorf("kafka producer: %w", err)
	}
	var failed error
	var wg sync.WaitGroup
	wg.Go(func() {
		for range producer.Successes() {
		}
	})
	wg.Go(func() {
		for perr := range producer.Errors() {
			failed = cmp.Or(failed, error(perr))
		}
	})
	start := time.Now()
	for i := 0; i < events && ctx.Err() == nil; i++ {
		due := start.Add(time.Duration(float64(i) / float64(rate) * float64(time.Second)))
		if wait := time.Until(due); wait > 0 {
			time.Sleep(wait)
		}
		headers := []sarama.RecordHeader{{Key: []byte(producedHeader), Value: strconv.AppendInt(nil, due.UnixNano(), 10)}}
		if i < warmup {
			headers = append(headers, sarama.RecordHeader{Key: []byte(warmupHeader), Value: []byte("1")})
		}
		producer.Input() <- &sarama.ProducerMessage{Topic: topic, Key: sarama.StringEncoder(strconv.Itoa(i)), Value: sarama.ByteEncoder(benchEvent(i)), Headers: headers}
	}
	producer.AsyncClose()
	wg.Wait()
	if failed != nil {
		return fmt.Errorf("publish to %s: %w", topic, failed)
	}
	return ctx.Err()
}

func writeProfile(name, path string) error {
	// The profile is as of the last collection: one now counts the end of
	// the run too.
	runtime.GC()
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := pprof.Lookup(name).WriteTo(f, 0); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
