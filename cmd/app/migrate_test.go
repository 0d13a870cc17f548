package main

import (
	"context"
	"strings"
	"testing"

	"github.com/google/uuid"

	"github.com/once-dev/once/internal/reftest"
)

// app migrate --adopt-claims copies the claims of the style guide's table,
// kept in a schema of its own, into processed_event, each with its
// processed_at and no fingerprint; run again, it copies nothing twice. A
// source that is no schema.table is refused by the setting's name before
// anything connects.
func TestMigrateAdoptsTheGuidesClaims(t *testing.T) {
	pool := reftest.Postgres(t)
	ctx := context.Background()
	guide := "guide_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	group := "seed-analytics-" + guide
	id := uuid.Must(uuid.NewV7())
	if _, err := pool.Exec(ctx, `CREATE SCHEMA `+guide+`;
		CREATE TABLE `+guide+`.processed_event (event_id uuid NOT NULL, consumer_group text NOT NULL,
			processed_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (event_id, consumer_group))`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+guide+" CASCADE")
		_, _ = pool.Exec(context.Background(), "DELETE FROM processed_event WHERE consumer_group = $1", group)
	})
	if _, err := pool.Exec(ctx, `INSERT INTO `+guide+`.processed_event VALUES ($1, $2, now() - interval '2 days')`, id, group); err != nil {
		t.Fatal(err)
	}
	// The guide's table here was never cleaned: it kept its claims for at
	// least the library's retention, and the horizon stays whole.
	for range 2 {
		if out, err := runApp(t, "migrate", "--adopt-claims", guide+".processed_event", "--guide-retention", "168h"); err != nil {
			t.Fatalf("app migrate --adopt-claims: %v\n%s", err, out)
		}
	}
	var n int
	var sameTime bool
	if err := pool.QueryRow(ctx, `SELECT count(*), bool_and(p.processed_at = g.processed_at AND p.payload_sha256 IS NULL)
		FROM processed_event p JOIN `+guide+`.processed_event g USING (event_id, consumer_group) WHERE p.consumer_group = $1`, group).Scan(&n, &sameTime); err != nil {
		t.Fatal(err)
	}
	if n != 1 || !sameTime {
		t.Fatalf("%d claims adopted (processed_at kept, no fingerprint: %v); want the guide's one, as it was", n, sameTime)
	}
	if out, err := runApp(t, "migrate", "--database-url", "postgres://x@h/db", "--adopt-claims", "processed_event"); err == nil ||
		!strings.Contains(err.Error()+out, "--adopt-claims (ONCE_ADOPT_CLAIMS)") {
		t.Fatalf("an unqualified source: %v\n%s; want a refusal naming --adopt-claims", err, out)
	}
	// Once's retention may not delete the guide's consumer's claims before
	// its own cleanup did.
	if out, err := runApp(t, "migrate", "--database-url", "postgres://x@h/db", "--guide-retention", "720h"); err == nil ||
		!strings.Contains(err.Error()+out, "--guide-retention (ONCE_GUIDE_RETENTION) 720h0m0s: want from 0 to --dedup-retention (168h0m0s)") {
		t.Fatalf("a guide's retention longer than the library's: %v\n%s; want a refusal naming both settings", err, out)
	}
}
