package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/IBM/sarama"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/internal/progress"
	"github.com/once-dev/once/pipeline"
	"github.com/once-dev/once/retention"
	"github.com/once-dev/once/schema"
)

type benchCmd struct {
	DB           dbSettings        `embed:""`
	Brokers      []string          `name:"kafka-brokers" env:"KAFKA_BROKERS" required:"" sep:"," help:"Kafka bootstrap addresses, host:port, comma-separated."`
	KafkaVersion string            `name:"kafka-version" env:"KAFKA_VERSION" default:"${kafka_version}" help:"The brokers' Kafka version."`
	Events       int               `name:"events" default:"200000" help:"Events each variant of the main table processes."`
	Partitions   int32             `name:"partitions" default:"12" help:"Partitions of the main table's topic (and L2's concurrency)."`
	BatchSize    int               `name:"batch-size" default:"100" help:"Events per transaction of PB and L2B."`
	BatchConc    int               `name:"batch-concurrency" default:"2" help:"Batches at once in PB (pipeline.Batch.Concurrency) and L2B."`
	Sweep        []int32           `name:"sweep" default:"1,4,12,24" sep:"," help:"Partition counts of the sweep (P and PB); empty for none."`
	SweepEvents  int               `name:"sweep-events" default:"20000" help:"Events per run of the sweep."`
	PeerEvents   int               `name:"peer-events" default:"10000" help:"Events the Python peer reads (it runs at a few hundred a second)."`
	PeerPython   string            `name:"peer-python" env:"ONCE_SEEDPEER_PYTHON" help:"Python with the peer's packages. Default: the venv that the seedpeer's setup.sh makes (.dev/seedpeer-venv)."`
	PeerDir      string            `name:"peer-dir" env:"ONCE_SEEDPEER_DIR" help:"Folder of the style guide's consume.py. Default: dev/seedpeer (the copy in this repository), unless the style guide's own folder lies beside the checkout."`
	KeepTopics   bool              `name:"keep-topics" help:"Keep the run's topics (to measure again with app bench-run)."`
	Rounds       int               `name:"rounds" default:"1" help:"Times the main table is measured, variants interleaved; each variant's median round is reported."`
	Only         []string          `name:"only" sep:"," enum:"L1,L2,L2U,L2B,B,P,PB,PBW,Peer,W,WB,WH" help:"Run only these variants (default: all; W, WB and WH with --handler-latency)."`
	Rates        []int             `name:"rate" sep:"," help:"Offered loads, events/s, at which P and PB are measured as events are produced (p50/p99/p99.9, and where the time went), and L2 and L2B as events are handed to the claim at the rate (the database's own latency at that load); empty for none."`
	RateEvents   int               `name:"rate-events" default:"10000" help:"Events each offered-load run produces."`
	RateWarmup   time.Duration     `name:"rate-warmup" default:"3s" help:"How long each offered-load run produces events before the measured ones, at the same rate, consumed like them and left out of the figures: a fresh topic's first appends and fetches, and a new process's first connections, are not what a running service waits. 0 for none."`
	SplitFile    string            `name:"split-file" type:"path" help:"Write each offered-load event's instants and the parts of its latency to FILE, a JSON line each, a file per measurement: FILE with the variant and the rate before its extension (split.jsonl: split.P.500.jsonl)."`
	Plot         string            `name:"plot" type:"path" help:"Write a picture of the sweep and the offered loads to this file (.svg or .png), and one of the waiting handler's events/s by N beside it, named with -wait before the extension."`
	CPUProfile   string            `name:"cpuprofile" type:"path" help:"Write a CPU profile of every measuring process: FILE with the measurement's variant and number before its extension (cpu.pprof: cpu.PB.3.pprof)."`
	Wait         benchWaitSettings `embed:""`
}

func (b *benchCmd) Validate() error {
	if b.Events < 1000 || b.SweepEvents < 1000 {
		return fmt.Errorf("--events and --sweep-events must be at least 1000")
	}
	if b.Partitions < 1 || slices.ContainsFunc(b.Sweep, func(p int32) bool { return p < 1 }) {
		return fmt.Errorf("--partitions and every --sweep count must be at least 1")
	}
	if b.Rounds < 1 {
		return fmt.Errorf("--rounds must be at least 1")
	}
	if slices.ContainsFunc(b.Rates, func(r int) bool { return r < 1 }) || b.RateEvents < 100 || b.RateWarmup < 0 {
		return fmt.Errorf("every --rate must be at least 1 event/s, --rate-events at least 100, and --rate-warmup not negative")
	}
	if ext := filepath.Ext(b.Plot); b.Plot != "" && ext != ".svg" && ext != ".png" {
		return fmt.Errorf("--plot %s: want a .svg or .png file", b.Plot)
	}
	if b.BatchSize < 1 {
		return fmt.Errorf("--batch-size must be at least 1")
	}
	if err := splitFileDir(b.SplitFile); err != nil {
		return err
	}
	return b.Wait.validate(b.Only)
}

// benchVariants are the rows of the main table, in order.
var benchVariants = []struct{ name, what string }{
	{"L1", "broker limit: the pipeline's subscriber, a no-op handler"},
	{"L2", "database limit: claim + upsert from Go, no Kafka, per event"},
	{"L2U", "database, no dedup: the upsert alone from Go, per event"},
	{"L2B", "database limit, batched: the same, %d events per transaction, %d at once"},
	{"B", "baseline: subscriber + upsert in a transaction, no dedup (unsafe)"},
	{"P", "the idempotent pipeline, per event"},
	{"PB", "the idempotent pipeline, batched (up to %d per transaction, %d at once; a batch leaves when a slot is free and no more events are on their way)"},
	{"PBW", "the same, each batch waiting up to 5 ms to fill (WaitToFill: the group commit before it was adaptive)"},
	{"Peer", "the style guide's Python consumer (aiokafka + asyncpg)"},
}

// mainVariants: whether any variant of the main table runs.
func (b *benchCmd) mainVariants() bool {
	return slices.ContainsFunc(benchVariants, func(v struct{ name, what string }) bool {
		return len(b.Only) == 0 || slices.Contains(b.Only, v.name)
	})
}

func (b *benchCmd) Run(ctx context.Context, d deps) error {
	version, err := pipeline.ParseKafkaVersion(b.KafkaVersion)
	if err != nil {
		return fmt.Errorf("--kafka-version (KAFKA_VERSION): %w", err)
	}
	pool, err := b.DB.open(ctx, d, true)
	if err != nil {
		return err
	}
	defer pool.Close()
	var server, fsync, syncCommit string
	_ = pool.QueryRow(ctx, `SELECT current_setting('server_version'), current_setting('fsync'), current_setting('synchronous_commit')`).Scan(&server, &fsync, &syncCommit)

	run := "bench-" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	started := time.Now()
	line := progress.New(d.stderr)
	defer line.Done()
	admin, err := sarama.NewClusterAdmin(b.Brokers, pipeline.PublisherSaramaConfig(version))
	if err != nil {
		return fmt.Errorf("--kafka-brokers (KAFKA_BROKERS): %w", err)
	}
	defer admin.Close()
	var topics, groups []string
	defer func() { b.cleanup(context.WithoutCancel(ctx), pool, admin, run, started, topics, groups) }()

	// One topic per partition count, each written once; every variant reads
	// it with a consumer group of its own.
	counts := map[int32]int{}
	if b.mainVariants() {
		counts[b.Partitions] = b.Events
	}
	for _, p := range b.Sweep {
		if _, ok := counts[p]; !ok {
			counts[p] = b.SweepEvents
		}
	}
	topicOf := map[int32]string{}
	for _, p := range slices.Sorted(maps.Keys(counts)) {
		topic := fmt.Sprintf("%s.p%d", run, p)
		if err := pipeline.EnsureTopics(ctx, b.Brokers, version, pipeline.KafkaSecurity{}, p, 1, topic); err != nil {
			return err
		}
		topics, topicOf[p] = append(topics, topic), topic
		payloads := benchEvents(counts[p])
		if err := publishBench(b.Brokers, version, topic, payloads, func(n int) { line.Set("publishing %s: %d/%d", topic, n, len(payloads)) }); err != nil {
			return err
		}
	}

	only := func(v string) bool { return len(b.Only) == 0 || slices.Contains(b.Only, v) }
	measurements := 0
	measure := func(variant string, partitions int32, events int) benchFigures {
		// A group of its own for every measurement: a group that already
		// read the topic would wait for events that never come.
		measurements++
		group := fmt.Sprintf("%s.%d.%s.p%d", run, measurements, strings.ToLower(variant), partitions)
		groups = append(groups, group)
		f, err := b.child(ctx, d, variant, topicOf[partitions], group, events, int(partitions), max(int(partitions)+4, 8), started, b.profileArgs(variant, measurements)...)
		if err != nil {
			line.Done()
			fmt.Fprintf(d.stderr, "bench %s: %v\n", variant, err)
			return benchFigures{Variant: variant, Skipped: err.Error()}
		}
		return f
	}

	// Rounds interleave the variants, so that a slow minute of this noisy
	// machine does not fall on one of them only; each variant's median
	// round is reported.
	rounds := map[string][]benchFigures{}
	for round := 1; round <= b.Rounds; round++ {
		for _, v := range benchVariants {
			if !only(v.name) {
				continue
			}
			line.Set("round %d/%d: measuring %s", round, b.Rounds, v.name)
			if v.name == "Peer" {
				group := fmt.Sprintf("%s.peer%d", run, round)
				groups = append(groups, group)
				rounds[v.name] = append(rounds[v.name], b.peer(ctx, d, topicOf[b.Partitions], group))
				clearBenchRows(ctx, pool, likeEscape(group), started, d.stderr)
				continue
			}
			rounds[v.name] = append(rounds[v.name], measure(v.name, b.Partitions, b.Events))
		}
	}
	main := map[string]benchFigures{}
	spread := map[string]string{}
	for name, fs := range rounds {
		main[name], spread[name] = median(fs)
	}
	type sweepRow struct {
		partitions int32
		p, pb      benchFigures
	}
	var sweep []sweepRow
	for _, p := range b.Sweep {
		line.Set("sweep: %d partitions", p)
		sweep = append(sweep, sweepRow{p, measure("P", p, counts[p]), measure("PB", p, counts[p])})
	}
	var offered []rateRow
	for _, rate := range b.Rates {
		row := rateRow{rate: rate}
		// P and PB read what the bench produces at the rate; beside them
		// the database's own latency at the same load, L2 and L2B: the
		// claim and the upsert handed over at the rate, no Kafka.
		for _, v := range []struct {
			name string
			f    *benchFigures
		}{{"P", &row.p}, {"PB", &row.pb}, {"L2", &row.l2}, {"L2B", &row.l2b}} {
			variant, fromKafka := v.name, v.name[0] == 'P'
			line.Set("offered load: %s at %d events/s", variant, rate)
			measurements++
			group := fmt.Sprintf("%s.%d.%s.rate%d", run, measurements, strings.ToLower(variant), rate)
			groups = append(groups, group)
			var f benchFigures
			var err error
			if fromKafka {
				// A topic per measurement: a group reads from the oldest
				// offset, and must not read the events another one was
				// measured with. Its records carry the broker's append
				// time: the split's.
				topic := fmt.Sprintf("%s.rate%d.%s", run, rate, strings.ToLower(variant))
				if err := logAppendTimeTopic(admin, topic, b.Partitions); err != nil {
					return err
				}
				topics = append(topics, topic)
				f, err = b.atRate(ctx, d, admin, version, variant, topic, group, rate, started, b.profileArgs(variant, measurements)...)
			} else {
				f, err = b.child(ctx, d, variant, "", group, b.RateEvents, int(b.Partitions), max(int(b.Partitions)+4, 8), started,
					append(b.profileArgs(variant, measurements), "--rate", strconv.Itoa(rate), "--warmup-events", strconv.Itoa(b.warmupEvents(rate)))...)
			}
			if err != nil {
				line.Done()
				fmt.Fprintf(d.stderr, "bench %s at %d events/s: %v\n", variant, rate, err)
				f = benchFigures{Variant: variant, Skipped: err.Error()}
			}
			*v.f = f
		}
		offered = append(offered, row)
	}
	waited, err := b.measureWaiting(ctx, d, version, benchBook{run: run, started: started, topics: &topics, groups: &groups, measurements: &measurements, line: line})
	if err != nil {
		return err
	}
	line.Done()

	w := d.stdout
	fast := len(main) > 0 || len(sweep) > 0 || len(offered) > 0
	if fast {
		fmt.Fprintf(w, "once bench: %d events on %d partitions, %d round(s) (sweep: %d events), batch %d; ", b.Events, b.Partitions, b.Rounds, b.SweepEvents, b.BatchSize)
	} else {
		fmt.Fprint(w, "once bench: ")
	}
	fmt.Fprintf(w, "PostgreSQL %s, fsync=%s, synchronous_commit=%s; Kafka %s at %s\n", server, fsync, syncCommit, b.KafkaVersion, strings.Join(b.Brokers, ","))
	if len(main) > 0 {
		b.printMain(w, main, spread)
	}
	if len(sweep) > 0 {
		fmt.Fprintf(w, "\nsweep (%d events each; latencies in ms, from entering the chain to the commit)\n", b.SweepEvents)
		t := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(t, "partitions\tP events/s\tP p99\tPB events/s\tPB p99\tPB/P\t")
		for _, r := range sweep {
			x := "-"
			if r.p.rate() > 0 && r.pb.rate() > 0 {
				x = fmt.Sprintf("%.1fx", r.pb.rate()/r.p.rate())
			}
			fmt.Fprintf(t, "%d\t%.0f\t%.2f\t%.0f\t%.2f\t%s\t\n", r.partitions, r.p.rate(), r.p.P99ms, r.pb.rate(), r.pb.P99ms, x)
		}
		t.Flush()
	}
	if len(offered) > 0 {
		fmt.Fprintf(w, "\noffered load (%d events each, produced at the rate while consumed; %d partitions; latencies in ms, from each event's production to its commit)\n", b.RateEvents, b.Partitions)
		t := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(t, "events/s\tP p50\tP p99\tP p99.9\tPB p50\tPB p99\tPB p99.9\tPB CPU us/event\tL2 p50\tL2 p99\tL2B p50\tL2B p99\t")
		for _, r := range offered {
			fmt.Fprintf(t, "%d\t%.2f\t%.2f\t%.2f\t%.2f\t%.2f\t%.2f\t%.1f\t%.2f\t%.2f\t%.2f\t%.2f\t\n", r.rate, r.p.P50ms, r.p.P99ms, r.p.P999ms, r.pb.P50ms, r.pb.P99ms, r.pb.P999ms, r.pb.CPUus,
				r.l2.P50ms, r.l2.P99ms, r.l2b.P50ms, r.l2b.P99ms)
		}
		t.Flush()
		printSplit(w, offered)
	}
	if waited != nil {
		waited.print(w)
	}
	if b.Plot != "" && (len(sweep) > 0 || len(offered) > 0) {
		pts := benchPlot{}
		for _, r := range sweep {
			pts.sweep = append(pts.sweep, plotSweep{partitions: r.partitions, p: r.p, pb: r.pb})
		}
		for _, r := range offered {
			pts.offered = append(pts.offered, plotRate{rate: r.rate, p: r.p, pb: r.pb, l2: r.l2, l2b: r.l2b})
		}
		if err := pts.save(b.Plot); err != nil {
			return fmt.Errorf("--plot %s: %w", b.Plot, err)
		}
		fmt.Fprintf(w, "\npicture: %s\n", b.Plot)
	}
	if b.Plot != "" && waited != nil && len(waited.rows) > 0 {
		path := waitPlotPath(b.Plot)
		if err := waited.plot().save(path); err != nil {
			return fmt.Errorf("--plot %s: %w", path, err)
		}
		fmt.Fprintf(w, "\npicture of the waiting handler: %s\n", path)
	}
	if fast {
		fmt.Fprintln(w, "\nlatency: from a message's delivery to the group (P, PB: Hooks.OnDelivered), entering the handler (B) or the claim (L2, L2B) to its commit; peak RSS: the measuring process's; CPU: its user + system time over its events.")
	}
	if waited != nil {
		fmt.Fprintln(w, "\nwaiting handler: latency from a message's delivery to its group (Hooks.OnDelivered; a message waiting for its key or a slot included) to its commit; attempt: the slots the order allows (min(N, pool), or the partitions) over events/s, how long each event held one; in handler, call: the mean time inside the handler, and of one call to the payment simulator (WB); CPU: the consumer's user + system time over its events.")
	}
	for _, f := range main {
		if f.Skipped != "" && f.Variant != "Peer" {
			return fmt.Errorf("bench: %s failed: %s", f.Variant, f.Skipped)
		}
	}
	if waited != nil {
		return waited.failed()
	}
	return nil
}

// printMain writes the main table and its ratios.
func (b *benchCmd) printMain(w io.Writer, main map[string]benchFigures, spread map[string]string) {
	fmt.Fprintln(w)
	t := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(t, "variant\t events/s\t rounds\t p50 ms\t p99 ms\t p99.9 ms\t CPU us/event\t peak RSS MiB\twhat")
	for _, v := range benchVariants {
		f, ok := main[v.name]
		if !ok {
			continue
		}
		what := v.what
		if strings.Contains(what, "%d") {
			what = fmt.Sprintf(what, b.BatchSize, b.BatchConc)
		}
		if f.Skipped != "" {
			fmt.Fprintf(t, "%s\t%9s\t%s\t%7s\t%7s\t%8s\t%12s\t%13s\t%s: skipped (%s)\n", v.name, "-", "-", "-", "-", "-", "-", "-", what, f.Skipped)
			continue
		}
		lat50, lat99, lat999, cpu := fmt.Sprintf("%.2f", f.P50ms), fmt.Sprintf("%.2f", f.P99ms), fmt.Sprintf("%.2f", f.P999ms), fmt.Sprintf("%.1f", f.CPUus)
		if v.name == "Peer" || v.name == "L1" {
			lat50, lat99, lat999 = "-", "-", "-"
		}
		if v.name == "Peer" {
			cpu = "-"
		}
		fmt.Fprintf(t, "%s\t%9.0f\t%s\t%7s\t%7s\t%8s\t%12s\t%13.0f\t%s\n", v.name, f.rate(), spread[v.name], lat50, lat99, lat999, cpu, float64(f.PeakRSSKiB)/1024, what)
	}
	t.Flush()

	fmt.Fprintln(w)
	ratio := func(name, a, bb string) {
		fa, oka := main[a]
		fb, okb := main[bb]
		if !oka || !okb || fa.rate() == 0 || fb.rate() == 0 {
			return
		}
		fmt.Fprintf(w, "  %-16s %6.2fx\n", name, fa.rate()/fb.rate())
	}
	ratio("P/B", "P", "B")
	ratio("L2/L2U", "L2", "L2U")
	ratio("P/L2", "P", "L2")
	ratio("PB/P", "PB", "P")
	ratio("PB/L2B", "PB", "L2B")
	ratio("PB/PBW", "PB", "PBW")
	ratio("L2/L2B", "L2", "L2B")
	ratio("P/Peer", "P", "Peer")
	ratio("PB/Peer", "PB", "Peer")
}

// The generated events' customers are the benchCustomerCount ids from
// benchCustomers on, and every event happened on throughputDay: a real
// customer id may well lie in that range (ids drawn at random up to 2^63
// mostly are that large), but hardly with an order dated that day, so
// cleanup finds app bench's rows by both, and only them.
const (
	benchCustomers     = 8_000_000_000_000_000
	benchCustomerCount = 10_000
	// benchOrders bounds the generated orders' ids, from benchCustomers
	// on (the i-th event's order is benchCustomers + i).
	benchOrders = 1 << 40
)

var throughputDay = time.Date(2000, 1, 1, 12, 0, 0, 0, time.UTC)

// printSplit writes where the offered loads' time went, part by part.
func printSplit(w io.Writer, offered []rateRow) {
	fmt.Fprintln(w, "\nwhere the time goes (ms; per event the first three parts add up to its latency above, production to the claim's commit; the offset's commit comes after it)")
	t := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(t, "events/s\tvariant\tpart\tp50\tp99\tp99.9\t")
	for _, r := range offered {
		for _, f := range []benchFigures{r.p, r.pb} {
			if f.Skipped != "" {
				fmt.Fprintf(t, "%d\t%s\tskipped\t-\t-\t-\t\n", r.rate, f.Variant)
				continue
			}
			for _, s := range f.Split {
				fmt.Fprintf(t, "%d\t%s\t%s\t%.2f\t%.2f\t%.2f\t\n", r.rate, f.Variant, s.Part, s.P50ms, s.P99ms, s.P999ms)
			}
			fmt.Fprintf(t, "%d\t%s\t%s\t%.2f\t%.2f\t%.2f\t\n", r.rate, f.Variant, "whole: production -> claim's commit", f.P50ms, f.P99ms, f.P999ms)
		}
	}
	t.Flush()
}

// warmupEvents is how many events --rate-warmup is at rate.
func (b *benchCmd) warmupEvents(rate int) int {
	return int(b.RateWarmup.Seconds() * float64(rate))
}

// rateRow is one offered load's figures.
type rateRow struct {
	rate           int
	p, pb, l2, l2b benchFigures
}

// atRate measures variant while events are produced at rate: the consumer
// joins its group first, so that it reads them as they come, not a
// backlog.
func (b *benchCmd) atRate(ctx context.Context, d deps, admin sarama.ClusterAdmin, version sarama.KafkaVersion, variant, topic, group string, rate int, since time.Time, extra ...string) (benchFigures, error) {
	type result struct {
		f   benchFigures
		err error
	}
	done := make(chan result, 1)
	childCtx, stop := context.WithCancel(ctx)
	defer stop()
	go func() {
		extra = append(extra, "--from-produce", "--split", "--warmup-events", strconv.Itoa(b.warmupEvents(rate)))
		if b.SplitFile != "" {
			ext := filepath.Ext(b.SplitFile)
			extra = append(extra, "--split-file", fmt.Sprintf("%s.%s.%d%s", strings.TrimSuffix(b.SplitFile, ext), variant, rate, ext))
		}
		f, err := b.child(childCtx, d, variant, topic, group, b.RateEvents, int(b.Partitions), max(int(b.Partitions)+4, 8), since, extra...)
		done <- result{f, err}
	}()
	joined := time.Now().Add(time.Minute)
	for {
		groups, err := admin.DescribeConsumerGroups([]string{group})
		if err == nil && len(groups) == 1 && groups[0].State == "Stable" && len(groups[0].Members) > 0 {
			break
		}
		select {
		case r := <-done:
			return r.f, fmt.Errorf("the consumer ended before it joined its group: %v", r.err)
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(joined) {
			return benchFigures{}, fmt.Errorf("the consumer did not join group %s within a minute", group)
		}
	}
	if err := publishAtRate(ctx, b.Brokers, version, topic, b.warmupEvents(rate), b.RateEvents, rate); err != nil {
		return benchFigures{}, err
	}
	r := <-done
	return r.f, r.err
}

// profileArgs asks measurement n's process for its CPU profile, if
// --cpuprofile is set.
func (b *benchCmd) profileArgs(variant string, n int) []string {
	if b.CPUProfile == "" {
		return nil
	}
	ext := filepath.Ext(b.CPUProfile)
	return []string{"--cpuprofile", fmt.Sprintf("%s.%s.%d%s", strings.TrimSuffix(b.CPUProfile, ext), variant, n, ext)}
}

// child runs one measurement in a process of its own and adds its peak RSS:
// concurrency is L2's goroutines (as many as the partitions) or a
// key-ordered group's Concurrency, maxConns the pool's size.
func (b *benchCmd) child(ctx context.Context, d deps, variant, topic, group string, events, concurrency, maxConns int, since time.Time, extra ...string) (benchFigures, error) {
	self, err := os.Executable()
	if err != nil {
		return benchFigures{}, err
	}
	args := []string{"bench-run", "--variant", variant, "--topic", topic, "--group", group,
		"--events", strconv.Itoa(events), "--concurrency", strconv.Itoa(concurrency), "--batch-size", strconv.Itoa(b.BatchSize), "--batch-concurrency", strconv.Itoa(b.BatchConc),
		"--kafka-brokers", strings.Join(b.Brokers, ","), "--kafka-version", b.KafkaVersion,
		"--database-url", b.DB.DatabaseURL, "--db-max-conns", strconv.Itoa(maxConns),
		"--clear-after", "--claims-since", since.Format(time.RFC3339Nano)}
	args = append(args, extra...)
	cmd := exec.CommandContext(ctx, self, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, d.stderr
	if err := cmd.Run(); err != nil {
		return benchFigures{}, fmt.Errorf("%s: %w", variant, err)
	}
	var f benchFigures
	if err := json.Unmarshal(out.Bytes(), &f); err != nil {
		return benchFigures{}, fmt.Errorf("%s printed %q: %w", variant, out.String(), err)
	}
	return f, nil
}

// peer runs the style guide's own consumer on the main topic.
func (b *benchCmd) peer(ctx context.Context, d deps, topic, group string) benchFigures {
	skip := func(why string) benchFigures { return benchFigures{Variant: "Peer", Skipped: why} }
	dir := b.PeerDir
	if dir == "" {
		for _, c := range []string{"../shared/bench/seedpeer", "dev/seedpeer"} {
			if _, err := os.Stat(filepath.Join(c, "consume.py")); err == nil {
				dir = c
				break
			}
		}
	}
	if dir == "" {
		return skip("consume.py not found: set --peer-dir")
	}
	python := b.PeerPython
	if python == "" {
		out, err := exec.CommandContext(ctx, filepath.Join(dir, "setup.sh"), ".dev/seedpeer-venv").Output()
		if err != nil {
			return skip(fmt.Sprintf("python venv: %v", err))
		}
		python = strings.TrimSpace(string(out))
	}
	cmd := exec.CommandContext(ctx, python, filepath.Join(dir, "consume.py"), "--brokers", strings.Join(b.Brokers, ","),
		"--topic", topic, "--dsn", b.DB.DatabaseURL, "--group", group, "--expect", strconv.Itoa(b.PeerEvents))
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, io.Discard
	if err := cmd.Start(); err != nil {
		return skip(fmt.Sprintf("consume.py: %v", err))
	}
	// Its high-water mark, read while it runs (it is gone after).
	var peak atomic.Int64
	watching := make(chan struct{})
	go func() {
		defer close(watching)
		for cmd.ProcessState == nil {
			if kib := peakRSS(cmd.Process.Pid); kib > peak.Load() {
				peak.Store(kib)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}()
	err := cmd.Wait()
	<-watching
	if err != nil {
		return skip(fmt.Sprintf("consume.py: %v", err))
	}
	var r struct {
		Messages int     `json:"messages"`
		Seconds  float64 `json:"seconds"`
	}
	if err := json.Unmarshal(bytes.TrimSpace(out.Bytes()), &r); err != nil {
		return skip(fmt.Sprintf("consume.py printed %q", out.String()))
	}
	return benchFigures{Variant: "Peer", Events: r.Messages, Seconds: r.Seconds, PeakRSSKiB: peak.Load()}
}

// cleanup removes what the run made: its topics, consumer groups, claims
// and analytics rows.
func (b *benchCmd) cleanup(ctx context.Context, pool *pgxpool.Pool, admin sarama.ClusterAdmin, run string, started time.Time, topics, groups []string) {
	for _, t := range topics {
		if b.KeepTopics {
			fmt.Fprintf(os.Stderr, "kept topic %s\n", t)
			continue
		}
		_ = admin.DeleteTopic(t)
	}
	for _, g := range groups {
		_ = admin.DeleteConsumerGroup(g)
	}
	clearBenchRows(ctx, pool, likeEscape(run)+".%", started, os.Stderr)
	// What billing published to the run's topics (WB), forwarded or not:
	// an event on its way to a topic deleted above would hold up the
	// outbox forwarder of every pipeline on this database. Its payment
	// rows went above; an attempt that committed after its measurement's
	// own cleanup left its event here.
	if !b.KeepTopics {
		if _, err := pool.Exec(ctx, `DELETE FROM `+schema.Config{}.OutboxTable().Qualified+` WHERE payload->>'destination_topic' = ANY($1)`, topics); err != nil {
			fmt.Fprintf(os.Stderr, "bench: cleanup left rows behind: the outbox's events to %v: %v\n", topics, err)
		}
	}
}

// clearBenchRows deletes the claims of the consumer groups that match the
// LIKE pattern groups, made since the run started (the bound spares the
// older daily partitions of a big claim table a scan), and the rows the
// generated events added: analytics', and billing's (WB), with its payment
// events in the outbox and the simulator's charges in the groups' accounts.
// What it cannot delete it says.
func clearBenchRows(ctx context.Context, pool *pgxpool.Pool, groups string, since time.Time, log io.Writer) {
	from := uuid.Nil
	if !since.IsZero() {
		from, _ = retention.DayRange(since)
	}
	// Billing's payments commit with their claims: the claims find them.
	const claimed = `SELECT event_id FROM processed_event WHERE consumer_group LIKE $1 AND event_id >= $2`
	accounts := likeEscape(benchAccount("")) + groups
	for _, q := range []struct {
		sql  string
		args []any
		peer bool // the Python peer's table, missing where it never ran
	}{
		// The outbox row is the forwarder's envelope around the event.
		{`DELETE FROM ` + schema.Config{}.OutboxTable().Qualified + ` WHERE payload->>'uuid' IN (SELECT payment_event_id::text FROM billing.payments WHERE event_id IN (` + claimed + `))`, []any{groups, from}, false},
		{`DELETE FROM billing.payments WHERE event_id IN (` + claimed + `)`, []any{groups, from}, false},
		// An intent commits before the provider's call, alone: one whose
		// attempt was cut off at the measurement's end has no claim. The
		// generated orders' intents made since, whose payment (if any)
		// was the bench's.
		{`DELETE FROM billing.charge_intents i WHERE order_id >= $1 AND order_id < $2 AND created_at >= $3
AND NOT EXISTS (SELECT FROM billing.payments p WHERE p.order_id = i.order_id)`, []any{benchCustomers, benchCustomers + benchOrders, since}, false},
		{`DELETE FROM payment_provider.idempotency_key WHERE account LIKE $1`, []any{accounts}, false},
		{`DELETE FROM payment_provider.charge WHERE account LIKE $1`, []any{accounts}, false},
		{`DELETE FROM processed_event WHERE consumer_group LIKE $1 AND event_id >= $2`, []any{groups, from}, false},
		{`DELETE FROM analytics.customer_daily_revenue WHERE customer_id >= $1 AND customer_id < $2 AND day = $3`, []any{benchCustomers, benchCustomers + benchCustomerCount, throughputDay}, false},
		{`DELETE FROM seedpeer.processed_event WHERE consumer_group LIKE $1`, []any{groups}, true},
		{`DELETE FROM seedpeer.revenue WHERE customer_id >= $1 AND customer_id < $2 AND day = $3`, []any{benchCustomers, benchCustomers + benchCustomerCount, throughputDay}, true},
	} {
		if _, err := pool.Exec(ctx, q.sql, q.args...); err != nil {
			var pgErr *pgconn.PgError
			if q.peer && errors.As(err, &pgErr) && pgErr.Code == "42P01" {
				continue
			}
			fmt.Fprintf(log, "bench: cleanup left rows behind: %s: %v\n", strings.SplitN(q.sql, " WHERE", 2)[0], err)
		}
	}
}

func likeEscape(s string) string {
	return strings.NewReplacer(`\`, `\\`, `%`, `\%`, `_`, `\_`).Replace(s)
}

// median is the round with the median rate, and the rates' range ("-" for
// one round).
func median(fs []benchFigures) (benchFigures, string) {
	ok := slices.DeleteFunc(slices.Clone(fs), func(f benchFigures) bool { return f.Skipped != "" })
	if len(ok) == 0 {
		return fs[0], "-"
	}
	slices.SortFunc(ok, func(a, b benchFigures) int { return cmp.Compare(a.rate(), b.rate()) })
	if len(ok) == 1 {
		return ok[0], "-"
	}
	return ok[len(ok)/2], fmt.Sprintf("%.0f-%.0f", ok[0].rate(), ok[len(ok)-1].rate())
}
