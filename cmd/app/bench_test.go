package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/internal/testenv"
)

// TestMain lets app bench run its measurements in processes of their own
// from a test: they are this test binary again, told to be the app.
func TestMain(m *testing.M) {
	if os.Getenv("ONCE_TEST_BINARY_IS_APP") == "1" {
		if err := run(context.Background(), os.Args[1:], os.Stdout, os.Stderr); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// app bench measures every variant it is asked for, prints their rows and
// ratios, and leaves none of its claims or rows behind, and touches no
// real customer's row (review finding: it deleted every customer above its
// first id).
func TestBenchMeasuresEachVariantAndLeavesNoRows(t *testing.T) {
	pool := reftest.Postgres(t)
	brokers := testenv.Brokers(t)
	t.Setenv("ONCE_TEST_BINARY_IS_APP", "1")
	// Real customers: one in the bench's id range with a real day's
	// orders, one just past the range on the bench's day.
	real := []struct {
		customer int64
		day      time.Time
	}{{benchCustomers + 5, time.Now().UTC()}, {benchCustomers + benchCustomerCount + 5, throughputDay}}
	for _, r := range real {
		if _, err := pool.Exec(context.Background(), `INSERT INTO analytics.customer_daily_revenue (customer_id, day, revenue, order_count)
VALUES ($1, $2::date, 12.34, 1) ON CONFLICT (customer_id, day) DO UPDATE SET revenue = 12.34, order_count = 1`, r.customer, r.day.Format(time.DateOnly)); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, r := range real {
			_, _ = pool.Exec(context.Background(), `DELETE FROM analytics.customer_daily_revenue WHERE customer_id = $1 AND day = $2::date`, r.customer, r.day.Format(time.DateOnly))
		}
	})
	claimsBefore, _ := benchRows(t, pool, "bench-%")
	out, err := runApp(t, "bench", "--kafka-brokers", strings.Join(brokers, ","), "--database-url", pool.Config().ConnString(),
		"--events", "1000", "--partitions", "2", "--only", "L1,L2,L2B,B,P,PB", "--sweep", "1", "--sweep-events", "1000")
	if err != nil {
		t.Fatalf("app bench: %v\n%s", err, out)
	}
	for _, want := range []string{"\nL1 ", "\nL2 ", "\nL2B ", "\nB ", "\nP ", "\nPB ", "P/B", "P/L2", "PB/P", "PB/L2B", "partitions"} {
		if !strings.Contains(out, want) {
			t.Errorf("the output has no %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "skipped") || strings.Contains(out, "left rows behind") {
		t.Errorf("a variant was skipped, or cleanup failed:\n%s", out)
	}
	if claims, rows := benchRows(t, pool, "bench-%"); claims != claimsBefore || rows != 1 {
		t.Fatalf("%d claims after, %d before; %d analytics rows in the bench's customer range, want only the real one", claims, claimsBefore, rows)
	}
	for _, r := range real {
		var revenue string
		var orders int
		if err := pool.QueryRow(context.Background(), `SELECT revenue::text, order_count FROM analytics.customer_daily_revenue WHERE customer_id = $1 AND day = $2::date`,
			r.customer, r.day.Format(time.DateOnly)).Scan(&revenue, &orders); err != nil || revenue != "12.34" || orders != 1 {
			t.Fatalf("real customer %d's row: %s over %d orders (%v), want 12.34 over 1, untouched", r.customer, revenue, orders, err)
		}
	}
}

// A measurement clears its group's claims and the generated rows when app
// bench asks it to (each measurement then starts from the same tables),
// and touches nothing when run by hand.
func TestABenchMeasurementClearsItsRowsOnlyWhenAsked(t *testing.T) {
	pool := reftest.Postgres(t)
	byHand, asked := "bench-test-"+uuid.NewString()[:8], "bench-test-"+uuid.NewString()[:8]
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), `DELETE FROM processed_event WHERE consumer_group = $1`, byHand)
		_, _ = pool.Exec(context.Background(), `DELETE FROM analytics.customer_daily_revenue WHERE customer_id >= $1 AND customer_id < $2 AND day = $3`,
			benchCustomers, benchCustomers+benchCustomerCount, throughputDay)
	})
	measure := func(group string, extra ...string) {
		t.Helper()
		out, err := runApp(t, append([]string{"bench-run", "--variant", "L2", "--group", group, "--events", "200", "--database-url", pool.Config().ConnString()}, extra...)...)
		if err != nil || !strings.Contains(out, `"events":200`) {
			t.Fatalf("app bench-run: %v\n%s", err, out)
		}
	}
	measure(byHand)
	if claims, rows := benchRows(t, pool, byHand); claims != 200 || rows == 0 {
		t.Fatalf("by hand: %d claims and %d generated rows kept, want 200 and some", claims, rows)
	}
	measure(asked, "--clear-after", "--claims-since", time.Now().Add(-time.Minute).Format(time.RFC3339))
	if claims, rows := benchRows(t, pool, asked); claims != 0 || rows != 0 {
		t.Fatalf("asked to clear: left %d claims and %d generated rows", claims, rows)
	}
	if claims, _ := benchRows(t, pool, byHand); claims != 200 {
		t.Fatalf("another group's claims: %d, want its 200 untouched", claims)
	}
}

// L2 and L2B at an offered load (bench-run --rate) are handed their
// events at the rate: the run cannot end before its last event was due,
// and every event but the warm-up's is measured. The rate is refused for a
// variant that reads Kafka, whose rate is its producer's.
func TestTheDatabasesOwnLatencyIsMeasuredAtTheOfferedRate(t *testing.T) {
	pool := reftest.Postgres(t)
	t.Setenv("ONCE_TEST_BINARY_IS_APP", "1")
	const rate, events, warmup = 400, 200, 100
	for _, variant := range []string{"L2", "L2B"} {
		group := "bench-test-" + uuid.NewString()[:8]
		out, err := runApp(t, "bench-run", "--variant", variant, "--group", group, "--events", fmt.Sprint(events), "--rate", fmt.Sprint(rate), "--warmup-events", fmt.Sprint(warmup),
			"--database-url", pool.Config().ConnString(), "--clear-after", "--claims-since", time.Now().Add(-time.Minute).Format(time.RFC3339))
		if err != nil {
			t.Fatalf("%s: app bench-run: %v\n%s", variant, err, out)
		}
		var f benchFigures
		if err := json.NewDecoder(strings.NewReader(out[max(strings.Index(out, "{"), 0):])).Decode(&f); err != nil {
			t.Fatalf("%s: %v\n%s", variant, err, out)
		}
		// The last measured event was due (events-1)/rate after the first;
		// the run's seconds start when the first one started, which may be
		// a little after its instant: 90% of the span, where events handed
		// over at once would take a few ms.
		if span := float64(events-1) / rate; f.Events != events || f.Seconds < 0.9*span || f.P50ms <= 0 || f.P99ms < f.P50ms {
			t.Errorf("%s at %d events/s after %d warm-up events: %+v; want %d events measured over at least 90%% of %.3fs (the last one was due that much after the first), p50 > 0, p99 >= p50", variant, rate, warmup, f, events, span)
		}
	}
	// A load above what one goroutine can do: every event is due within a
	// few ms, and they queue. Their latency starts at their instant, so
	// the queueing counts: the last ones waited for nearly the whole run.
	out, err := runApp(t, "bench-run", "--variant", "L2", "--group", "bench-test-"+uuid.NewString()[:8], "--events", "200", "--rate", "100000", "--concurrency", "1",
		"--database-url", pool.Config().ConnString(), "--clear-after", "--claims-since", time.Now().Add(-time.Minute).Format(time.RFC3339))
	if err != nil {
		t.Fatalf("app bench-run: %v\n%s", err, out)
	}
	var f benchFigures
	if err := json.NewDecoder(strings.NewReader(out[max(strings.Index(out, "{"), 0):])).Decode(&f); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if f.P99ms < 0.8*f.Seconds*1000 {
		t.Errorf("200 events due at once on one goroutine: p99 %.2f ms over a %.1f ms run; want the queueing counted (p99 near the run's length)", f.P99ms, f.Seconds*1000)
	}
	if out, err := runApp(t, "bench-run", "--variant", "P", "--group", "g", "--events", "1", "--rate", "10", "--database-url", pool.Config().ConnString()); err == nil || !strings.Contains(err.Error(), "--rate 10") {
		t.Errorf("--rate with P: %v\n%s; want it refused naming --rate", err, out)
	}
}

// benchRows counts the claims of the groups matching pattern, and the
// analytics rows of app bench's customer range, on any day.
func benchRows(t *testing.T, pool *pgxpool.Pool, pattern string) (claims, rows int) {
	t.Helper()
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM processed_event WHERE consumer_group LIKE $1`, pattern).Scan(&claims); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM analytics.customer_daily_revenue WHERE customer_id >= $1 AND customer_id < $2`,
		benchCustomers, benchCustomers+benchCustomerCount).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	return claims, rows
}

// app bench --handler-latency measures a handler that waits (W), billing
// against the payment simulator (WB), in partition and in key order, and
// one key held (WH): its tables have their columns and positive figures,
// the held key was held (its failed attempts counted) and its events came
// after it in order, none lost, and no claim, billing row, payment event
// or simulator charge is left behind.
func TestBenchMeasuresAHandlerThatWaits(t *testing.T) {
	pool := reftest.Postgres(t)
	brokers := testenv.Brokers(t)
	t.Setenv("ONCE_TEST_BINARY_IS_APP", "1")
	claimsBefore, _ := benchRows(t, pool, "bench-%")
	plot := filepath.Join(t.TempDir(), "bench.svg")
	out, err := runApp(t, "bench", "--kafka-brokers", strings.Join(brokers, ","), "--database-url", pool.Config().ConnString(),
		"--only", "W,WB,WH", "--sweep", "", "--handler-latency", "20ms", "--wait-concurrency", "4", "--wait-pool", "8",
		"--wait-partitions", "2", "--wait-seconds", "1s", "--hold-for", "2s", "--hold-window", "40", "--plot", plot)
	if err != nil {
		t.Fatalf("app bench: %v\n%s", err, out)
	}
	header := "variant  partitions      order  N  events  events/s  ceiling  of ceiling  x partition ceiling  p50 ms  p99 ms  attempt ms  in handler ms  call ms  CPU us/event"
	if !strings.Contains(out, header) {
		t.Fatalf("no waiting table with its columns %q:\n%s", header, out)
	}
	rows := 0
	for _, l := range strings.Split(out, "\n") {
		f := strings.Fields(l)
		if len(f) != 15 || (f[0] != "W" && f[0] != "WB") || (f[2] != "partition" && f[2] != "key") {
			continue
		}
		rows++
		cols := []int{4, 5, 6, 7, 9, 10, 11, 12, 14} // events, events/s, ceiling, of ceiling, p50, p99, attempt, in handler, CPU
		if f[0] == "WB" {
			cols = append(cols, 13) // the provider's call
		}
		for _, i := range cols {
			if v, err := strconv.ParseFloat(f[i], 64); err != nil || v <= 0 {
				t.Errorf("row %q: column %d is %q, want a positive number", l, i, f[i])
			}
		}
		if want := map[string]string{"partition": "100", "key": "200"}[f[2]]; f[6] != want {
			t.Errorf("row %q: ceiling %s, want %s (2 partitions / 20ms, min(4, 8) / 20ms)", l, f[6], want)
		}
	}
	if rows != 4 {
		t.Errorf("%d rows of W and WB, want 4 (each in partition order and in key order at N 4):\n%s", rows, out)
	}
	held := regexp.MustCompile(`the held key +(\d+) attempts held over [0-9.]+ s; its 5 events processed after it, in offset order: yes`).FindStringSubmatch(out)
	if held == nil {
		t.Fatalf("the held key's events are not all accounted for, in order:\n%s", out)
	}
	if n, _ := strconv.Atoi(held[1]); n < 1 {
		t.Fatalf("the held key was never held (%s attempts):\n%s", held[1], out)
	}
	for _, want := range []string{"events processed  120 of 120 (lost 0)", "the other keys before the hold", "the window full, behind the held key"} {
		if !strings.Contains(strings.Join(strings.Fields(out), " "), strings.Join(strings.Fields(want), " ")) {
			t.Errorf("the output has no %q:\n%s", want, out)
		}
	}
	if svg, err := os.ReadFile(filepath.Join(filepath.Dir(plot), "bench-wait.svg")); err != nil || !strings.Contains(string(svg), "2 partitions, key order") {
		t.Errorf("the waiting handler's picture: %v", err)
	}
	if strings.Contains(out, "left rows behind") {
		t.Errorf("cleanup failed:\n%s", out)
	}
	if claims, rows := benchRows(t, pool, "bench-%"); claims != claimsBefore || rows != 0 {
		t.Errorf("%d claims after, %d before; %d analytics rows in the bench's customer range", claims, claimsBefore, rows)
	}
	var payments, intents, charges, keys, events int
	if err := pool.QueryRow(context.Background(), `SELECT
(SELECT count(*) FROM billing.payments WHERE customer_id >= $1 AND customer_id < $2),
(SELECT count(*) FROM billing.charge_intents WHERE order_id >= $1 AND order_id < $3),
(SELECT count(*) FROM payment_provider.charge WHERE account LIKE 'acct\_bench-%'),
(SELECT count(*) FROM payment_provider.idempotency_key WHERE account LIKE 'acct\_bench-%'),
(SELECT count(*) FROM once_outbox WHERE payload->>'destination_topic' LIKE 'bench-%')`,
		benchCustomers, benchCustomers+benchCustomerCount, benchCustomers+benchOrders).Scan(&payments, &intents, &charges, &keys, &events); err != nil {
		t.Fatal(err)
	}
	if payments+intents+charges+keys+events != 0 {
		t.Fatalf("left behind: %d payments, %d charge intents, %d simulator charges, %d idempotency keys, %d payment events in the outbox", payments, intents, charges, keys, events)
	}
}
