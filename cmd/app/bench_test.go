package main

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

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
// ratios, and leaves no claim or generated analytics row behind.
func TestBenchMeasuresEachVariantAndLeavesNoRows(t *testing.T) {
	pool := testenv.Postgres(t)
	brokers := testenv.Brokers(t)
	t.Setenv("ONCE_TEST_BINARY_IS_APP", "1")
	// A customer of the bench's id range with a real day's orders: not
	// the bench's to delete.
	real := benchCustomers + 5
	if _, err := pool.Exec(context.Background(), `INSERT INTO analytics.customer_daily_revenue (customer_id, day, revenue, order_count)
VALUES ($1, current_date, 12.34, 1) ON CONFLICT DO NOTHING`, real); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), `DELETE FROM analytics.customer_daily_revenue WHERE customer_id = $1 AND day = current_date`, real)
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
	if strings.Contains(out, "skipped") {
		t.Errorf("a variant was skipped:\n%s", out)
	}
	if claims, rows := benchRows(t, pool, "bench-%"); claims != claimsBefore || rows != 0 {
		t.Fatalf("%d claims and %d generated analytics rows after, %d claims before", claims, rows, claimsBefore)
	}
	var kept int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM analytics.customer_daily_revenue WHERE customer_id = $1 AND day = current_date`, real).Scan(&kept); err != nil || kept != 1 {
		t.Fatalf("the real customer's row: %d (%v), want it kept", kept, err)
	}
}

// A measurement clears what it wrote as soon as it is done, so that the
// next one starts from the same tables (not from rows to update, nor from a
// claim table grown by earlier measurements).
func TestABenchMeasurementClearsItsRows(t *testing.T) {
	pool := testenv.Postgres(t)
	group := "bench-test-" + uuid.NewString()[:8]
	out, err := runApp(t, "bench-run", "--variant", "L2", "--group", group, "--events", "200", "--database-url", pool.Config().ConnString(),
		"--customers-from", strconv.FormatInt(benchCustomers, 10))
	if err != nil {
		t.Fatalf("app bench-run: %v\n%s", err, out)
	}
	if !strings.Contains(out, `"events":200`) {
		t.Fatalf("no figures for 200 events:\n%s", out)
	}
	if claims, rows := benchRows(t, pool, group); claims != 0 || rows != 0 {
		t.Fatalf("left %d claims and %d generated analytics rows", claims, rows)
	}
}

// benchRows counts the claims of the groups matching pattern, and the
// analytics rows of app bench's generated events.
func benchRows(t *testing.T, pool *pgxpool.Pool, pattern string) (claims, rows int) {
	t.Helper()
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM processed_event WHERE consumer_group LIKE $1`, pattern).Scan(&claims); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM analytics.customer_daily_revenue WHERE customer_id >= $1 AND day = $2`, int64(benchCustomers), throughputDay).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	return claims, rows
}
