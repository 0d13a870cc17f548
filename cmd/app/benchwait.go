package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/IBM/sarama"

	"github.com/once-dev/once/internal/progress"
	"github.com/once-dev/once/pipeline"
)

// benchWaitSettings are app bench's settings of the handler that waits.
type benchWaitSettings struct {
	HandlerLatency  time.Duration `name:"handler-latency" help:"Measure a handler that waits this long inside the claim's transaction, as a provider's call does (W, WB, WH), beside its ceilings; 0 for none."`
	WaitConcurrency []int         `name:"wait-concurrency" default:"1,4,16,40" sep:"," help:"Concurrency (N) of the key-ordered runs of W and WB."`
	WaitPool        int           `name:"wait-pool" default:"40" help:"The pool's MaxConns in W, WB and WH: key order runs at most min(N, pool) attempts at once."`
	WaitPartitions  []int32       `name:"wait-partitions" default:"6,1" sep:"," help:"Partition counts of W's and WB's topics."`
	WaitSeconds     time.Duration `name:"wait-seconds" default:"5s" help:"Each run of W and WB gets as many events as its ceiling processes in this time (at least 100)."`
	HoldFor         time.Duration `name:"hold-for" default:"1m" help:"WH: how long the held key fails, from its first attempt."`
	HoldWindow      int           `name:"hold-window" default:"2000" help:"WH: the group's Window, the most messages of its partition in flight: how far the other keys run past the held one."`
}

// The variants of the waiting table, and what each is (WH, one key held,
// has its own account below it).
var benchWaitVariants = []struct{ name, what string }{
	{"W", "the handler waits --handler-latency in the claim's transaction, then upserts analytics"},
	{"WB", "billing against the payment simulator (--fault-latency = --handler-latency): charge intent, the provider's call in the claim's transaction, the payment row and its event in the outbox"},
}

func (s benchWaitSettings) validate(only []string) error {
	var errs []error
	if s.HandlerLatency < 0 {
		errs = append(errs, errors.New("--handler-latency must not be negative"))
	}
	if s.HandlerLatency == 0 && slices.ContainsFunc(only, func(v string) bool { return strings.HasPrefix(v, "W") }) {
		errs = append(errs, errors.New("--only W, WB and WH need --handler-latency (how long the handler waits)"))
	}
	if s.HandlerLatency == 0 {
		return errors.Join(errs...)
	}
	if len(only) > 0 && !slices.ContainsFunc(only, func(v string) bool { return strings.HasPrefix(v, "W") }) {
		errs = append(errs, fmt.Errorf("--handler-latency measures W, WB and WH, and --only %s lists none of them", strings.Join(only, ",")))
	}
	if s.WaitPool < 2 {
		errs = append(errs, fmt.Errorf("--wait-pool must be at least 2, got %d", s.WaitPool))
	}
	if len(s.WaitConcurrency) == 0 || slices.ContainsFunc(s.WaitConcurrency, func(n int) bool { return n < 1 || n > s.WaitPool }) {
		errs = append(errs, fmt.Errorf("every --wait-concurrency must be between 1 and --wait-pool %d (the pipeline refuses a pool that cannot serve its Concurrency), got %v", s.WaitPool, s.WaitConcurrency))
	}
	if len(s.WaitPartitions) == 0 || slices.ContainsFunc(s.WaitPartitions, func(p int32) bool { return p < 1 }) {
		errs = append(errs, fmt.Errorf("--wait-partitions: at least one, each at least 1, got %v", s.WaitPartitions))
	}
	if s.WaitSeconds < 100*time.Millisecond {
		errs = append(errs, fmt.Errorf("--wait-seconds must be at least 100ms, got %s", s.WaitSeconds))
	}
	if n := slices.Max(append([]int{1}, s.WaitConcurrency...)); s.HoldWindow < max(20, n) {
		errs = append(errs, fmt.Errorf("--hold-window must be at least 20 and at least the largest --wait-concurrency %d, got %d", n, s.HoldWindow))
	}
	if s.HoldFor <= 0 {
		errs = append(errs, fmt.Errorf("--hold-for must be positive, got %s", s.HoldFor))
	}
	return errors.Join(errs...)
}

// waitRow is one run of W or WB.
type waitRow struct {
	variant    string
	partitions int32
	key        bool // key order; partition order otherwise
	n          int  // Concurrency, in key order
	f          benchFigures
}

// ceiling is the most events/s the run's order allows with a handler that
// waits latency: min(N, pool) attempts at once in key order, one per
// partition in partition order.
func (r waitRow) ceiling(latency time.Duration, pool int) float64 {
	if r.key {
		return float64(min(r.n, pool)) / latency.Seconds()
	}
	return r.partitionCeiling(latency)
}

func (r waitRow) partitionCeiling(latency time.Duration) float64 {
	return float64(r.partitions) / latency.Seconds()
}

// waitReport is what the waiting section measured.
type waitReport struct {
	latency time.Duration
	pool    int
	rows    []waitRow
	hold    *waitHold
}

// waitHold is WH's run.
type waitHold struct {
	n, window, events int
	holdFor           time.Duration
	f                 benchFigures
}

// benchBook is what a run of app bench made, for its cleanup, and how it
// names what it makes next.
type benchBook struct {
	run          string
	started      time.Time
	topics       *[]string
	groups       *[]string
	measurements *int
	line         *progress.Line
}

func (k benchBook) group(what string) string {
	*k.measurements++
	g := fmt.Sprintf("%s.%d.%s", k.run, *k.measurements, what)
	*k.groups = append(*k.groups, g)
	return g
}

// waitOnly: whether the waiting variant v runs.
func (b *benchCmd) waitOnly(v string) bool {
	if b.Wait.HandlerLatency <= 0 {
		return false
	}
	return len(b.Only) == 0 || slices.Contains(b.Only, v)
}

// measureWaiting runs W and WB at each partition count, in partition order
// and in key order at each N, and WH, each in a process of its own, as the
// main table's variants are.
func (b *benchCmd) measureWaiting(ctx context.Context, d deps, version sarama.KafkaVersion, book benchBook) (*waitReport, error) {
	s := b.Wait
	if !b.waitOnly("W") && !b.waitOnly("WB") && !b.waitOnly("WH") {
		return nil, nil
	}
	rep := &waitReport{latency: s.HandlerLatency, pool: s.WaitPool}
	events := func(r waitRow) int {
		return max(100, int(math.Ceil(r.ceiling(s.HandlerLatency, s.WaitPool)*s.WaitSeconds.Seconds())))
	}
	var simulator string
	var paymentTopic string
	if b.waitOnly("WB") {
		paymentTopic = book.run + ".wait.payments"
		if err := pipeline.EnsureTopics(ctx, b.Brokers, version, pipeline.KafkaSecurity{}, 1, 1, paymentTopic); err != nil {
			return nil, err
		}
		*book.topics = append(*book.topics, paymentTopic)
		url, stop, err := b.startSimulator(ctx, d)
		if err != nil {
			return nil, fmt.Errorf("the payment simulator: %w", err)
		}
		defer stop()
		simulator = url
	}
	for _, p := range s.WaitPartitions {
		var runs []waitRow
		for _, v := range []string{"W", "WB"} {
			if !b.waitOnly(v) {
				continue
			}
			runs = append(runs, waitRow{variant: v, partitions: p})
			for _, n := range s.WaitConcurrency {
				runs = append(runs, waitRow{variant: v, partitions: p, key: true, n: n})
			}
		}
		if len(runs) == 0 {
			break
		}
		// One topic per partition count, with as many events as its
		// largest run takes; each run reads it with a group of its own.
		most := 0
		for _, r := range runs {
			most = max(most, events(r))
		}
		topic := fmt.Sprintf("%s.wait.p%d", book.run, p)
		if err := pipeline.EnsureTopics(ctx, b.Brokers, version, pipeline.KafkaSecurity{}, p, 1, topic); err != nil {
			return nil, err
		}
		*book.topics = append(*book.topics, topic)
		if err := publishBench(b.Brokers, version, topic, benchEvents(most), func(n int) { book.line.Set("publishing %s: %d/%d", topic, n, most) }); err != nil {
			return nil, err
		}
		for _, r := range runs {
			order, what, conc := "partition", fmt.Sprintf("%s.p%d.partition", strings.ToLower(r.variant), p), 1
			if r.key {
				order, what, conc = "key", fmt.Sprintf("%s.p%d.key%d", strings.ToLower(r.variant), p, r.n), r.n
			}
			book.line.Set("waiting handler: %s on %d partitions in %s order, N %d", r.variant, p, order, conc)
			args := []string{"--order", order, "--latency", s.HandlerLatency.String()}
			if r.variant == "WB" {
				args = append(args, "--payment-url", simulator, "--payment-topic", paymentTopic)
			}
			group := book.group(what)
			f, err := b.child(ctx, d, r.variant, topic, group, events(r), conc, s.WaitPool, book.started, append(args, b.profileArgs(r.variant, *book.measurements)...)...)
			if err != nil {
				book.line.Done()
				fmt.Fprintf(d.stderr, "bench %s on %d partitions in %s order, N %d: %v\n", r.variant, p, order, conc, err)
				f = benchFigures{Variant: r.variant, Skipped: err.Error()}
			}
			r.f = f
			rep.rows = append(rep.rows, r)
		}
	}
	if b.waitOnly("WH") {
		h, err := b.measureHold(ctx, d, version, book)
		if err != nil {
			return nil, err
		}
		rep.hold = h
	}
	return rep, nil
}

// heldKey is WH's held key; the others are the events' indexes.
const heldKey = "held"

// measureHold runs WH: one partition, key order at the largest N, the
// held key's first event a window's worth of events in (the others' rate
// before the hold is measured on those), four more of its events inside
// the window and one past it, and a window's worth after that.
func (b *benchCmd) measureHold(ctx context.Context, d deps, version sarama.KafkaVersion, book benchBook) (*waitHold, error) {
	s := b.Wait
	w := s.HoldWindow
	h := &waitHold{n: slices.Max(s.WaitConcurrency), window: w, events: 3 * w, holdFor: s.HoldFor}
	first := w
	held := map[int]bool{first: true, first + w/4: true, first + w/2: true, first + 3*w/4: true, first + 3*w/2: true}
	keys := make([]string, h.events)
	for i := range keys {
		keys[i] = strconv.Itoa(i)
		if held[i] {
			keys[i] = heldKey
		}
	}
	topic := book.run + ".wait.hold"
	if err := pipeline.EnsureTopics(ctx, b.Brokers, version, pipeline.KafkaSecurity{}, 1, 1, topic); err != nil {
		return nil, err
	}
	*book.topics = append(*book.topics, topic)
	if err := publishKeyed(b.Brokers, version, topic, benchEvents(h.events), func(i int) string { return keys[i] },
		func(n int) { book.line.Set("publishing %s: %d/%d", topic, n, h.events) }); err != nil {
		return nil, err
	}
	book.line.Set("waiting handler: WH, key %q held for %s", heldKey, s.HoldFor)
	group := book.group(fmt.Sprintf("wh.key%d", h.n))
	args := []string{"--order", "key", "--window", strconv.Itoa(w), "--latency", s.HandlerLatency.String(), "--hold-key", heldKey, "--hold-for", s.HoldFor.String()}
	f, err := b.child(ctx, d, "WH", topic, group, h.events, h.n, s.WaitPool, book.started, append(args, b.profileArgs("WH", *book.measurements)...)...)
	if err != nil {
		book.line.Done()
		fmt.Fprintf(d.stderr, "bench WH: %v\n", err)
		f = benchFigures{Variant: "WH", Skipped: err.Error()}
	}
	h.f = f
	return h, nil
}

// startSimulator runs app payment-provider with the handler's latency as
// its --fault-latency, on the bench's database, until stop.
func (b *benchCmd) startSimulator(ctx context.Context, d deps) (url string, stop func(), err error) {
	self, err := os.Executable()
	if err != nil {
		return "", nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	addr := ln.Addr().String()
	ln.Close()
	cmd := exec.CommandContext(ctx, self, "payment-provider", "--no-migrate", "--listen", addr, "--log-level", "warn",
		"--fault-latency", b.Wait.HandlerLatency.String(), "--database-url", b.DB.DatabaseURL)
	cmd.Stdout, cmd.Stderr = io.Discard, d.stderr
	// Stopped as a person would: it finishes its answers.
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 15 * time.Second
	if err := cmd.Start(); err != nil {
		return "", nil, err
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	stop = func() {
		_ = cmd.Process.Signal(os.Interrupt)
		<-exited
	}
	url = "http://" + addr
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); {
		if resp, err := http.Get(url + "/healthz"); err == nil {
			resp.Body.Close()
			return url, stop, nil
		}
		select {
		case err := <-exited:
			return "", nil, fmt.Errorf("it exited: %v", err)
		case <-time.After(50 * time.Millisecond):
		}
	}
	stop()
	return "", nil, errors.New("it did not answer within 30s")
}

// print writes the waiting table and the held key's account.
func (r *waitReport) print(w io.Writer) {
	ms := func(d time.Duration) string {
		return strconv.FormatFloat(float64(d)/float64(time.Millisecond), 'f', -1, 64) + " ms"
	}
	if len(r.rows) > 0 {
		fmt.Fprintf(w, "\nwaiting handler: %s inside the claim's transaction, pool (MaxConns) %d; ceilings: min(N, pool) / latency in key order, partitions / latency in partition order\n", ms(r.latency), r.pool)
		for _, v := range benchWaitVariants {
			if slices.ContainsFunc(r.rows, func(row waitRow) bool { return row.variant == v.name }) {
				fmt.Fprintf(w, "  %-3s %s\n", v.name, v.what)
			}
		}
		t := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(t, "variant\tpartitions\torder\tN\tevents\tevents/s\tceiling\tof ceiling\tx partition ceiling\tp50 ms\tp99 ms\tattempt ms\tin handler ms\tcall ms\tCPU us/event\t")
		for _, row := range r.rows {
			order, n := "partition", "-"
			if row.key {
				order, n = "key", strconv.Itoa(row.n)
			}
			ceiling := row.ceiling(r.latency, r.pool)
			if row.f.Skipped != "" {
				fmt.Fprintf(t, "%s\t%d\t%s\t%s\t-\t-\t%.0f\t-\t-\t-\t-\t-\t-\t-\t-\tskipped (%s)\n", row.variant, row.partitions, order, n, ceiling, row.f.Skipped)
				continue
			}
			call := "-"
			if row.f.CallMs > 0 {
				call = fmt.Sprintf("%.1f", row.f.CallMs)
			}
			// The slots the run's order allows, over events/s: how long
			// each event held one, claim and commit included.
			attempt := ceiling * r.latency.Seconds() / row.f.rate() * 1000
			fmt.Fprintf(t, "%s\t%d\t%s\t%s\t%d\t%.0f\t%.0f\t%.2f\t%.1fx\t%.1f\t%.1f\t%.1f\t%.1f\t%s\t%.0f\t\n", row.variant, row.partitions, order, n, row.f.Events, row.f.rate(),
				ceiling, row.f.rate()/ceiling, row.f.rate()/row.partitionCeiling(r.latency), row.f.P50ms, row.f.P99ms, attempt, row.f.HandlerMs, call, row.f.CPUus)
		}
		t.Flush()
	}
	if h := r.hold; h != nil {
		fmt.Fprintf(w, "\nheld key (WH): 1 partition, key order, N %d, window %d, %d events; key %q fails for %s from its first attempt, as a provider answering 503\n",
			h.n, h.window, h.events, heldKey, h.holdFor)
		if h.f.Skipped != "" || h.f.Hold == nil {
			fmt.Fprintf(w, "  skipped (%s)\n", h.f.Skipped)
			return
		}
		f := *h.f.Hold
		unheld := ""
		for _, row := range r.rows {
			if row.variant == "W" && row.partitions == 1 && row.key && row.n == h.n && row.f.rate() > 0 {
				unheld = fmt.Sprintf("; %.2f of the unheld run (W, 1 partition, N %d: %.0f events/s)", f.DuringRate/row.f.rate(), h.n, row.f.rate())
			}
		}
		ratio := 0.0
		if f.BeforeRate > 0 {
			ratio = f.DuringRate / f.BeforeRate
		}
		t := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintf(t, "  the other keys before the hold\t%.0f events/s\n", f.BeforeRate)
		fmt.Fprintf(t, "  the other keys from the hold until the window filled\t%.0f events/s over %.2f s (%d events): %.2f of before%s\n", f.DuringRate, f.FillSeconds, f.DuringCount, ratio, unheld)
		fmt.Fprintf(t, "  the window full, behind the held key\t%.1f s\n", f.FullSeconds)
		fmt.Fprintf(t, "  the held key\t%d attempts held over %.1f s; its %d events processed after it, in offset order: %s\n", f.HeldAttempts, f.HeldSeconds, f.HeldEvents, yesNo(f.InOrder))
		fmt.Fprintf(t, "  events processed\t%d of %d (lost %d)\n", f.Processed, h.events, h.events-f.Processed)
		t.Flush()
	}
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "NO"
}

// failed is the first run that failed, or nil.
func (r *waitReport) failed() error {
	for _, row := range r.rows {
		if row.f.Skipped != "" {
			return fmt.Errorf("bench: %s on %d partitions failed: %s", row.variant, row.partitions, row.f.Skipped)
		}
	}
	if h := r.hold; h != nil {
		switch {
		case h.f.Skipped != "":
			return fmt.Errorf("bench: WH failed: %s", h.f.Skipped)
		case h.f.Hold == nil || h.f.Hold.Processed != h.events || !h.f.Hold.InOrder:
			return fmt.Errorf("bench: WH lost events or broke the held key's order: %+v", h.f.Hold)
		}
	}
	return nil
}
