package main

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/retention"
)

// The least-privilege path of docs/operating.md ("Least privilege"), its
// database steps: the owner's app migrate makes each group's database its
// own and today's and the next partitions there (before it, the first
// day's claims landed in the default partition for good); the group's role
// forgets its own claims (before, "permission denied for table
// processed_event"); app maintain, as the cron job, writes its last success
// for node_exporter after a pass that succeeded everywhere, and leaves it
// as it was after one that failed.
func TestLeastPrivilegeMigrateForgetAndMaintain(t *testing.T) {
	ctx := context.Background()
	shared := reftest.Postgres(t)
	testenv.LoginRole(t, shared, "billing_svc", "once_billing")
	testenv.LoginRole(t, shared, "analytics_svc", "once_analytics")
	owner := testenv.Where{Mode: pgx.QueryExecModeCacheStatement}.URL(t)
	dbs := map[string]string{"billing": "once_lp_billing", "analytics": "once_lp_analytics"}
	pools := map[string]interface {
		QueryRow(context.Context, string, ...any) pgx.Row
	}{}
	for g, name := range dbs {
		pools[g] = testenv.OtherPostgres(t, name)
	}
	groupDBs := "billing=" + testenv.URLAs(owner, "once", dbs["billing"]) + ";analytics=" + testenv.URLAs(owner, "once", dbs["analytics"])
	if out, err := runApp(t, "migrate", "--database-url", owner, "--group-database", groupDBs); err != nil {
		t.Fatalf("app migrate: %v\n%s", err, out)
	}
	for g, pool := range pools {
		var today time.Time
		if err := pool.QueryRow(ctx, `SELECT now()`).Scan(&today); err != nil {
			t.Fatal(err)
		}
		for _, day := range []time.Time{today.UTC(), today.UTC().AddDate(0, 0, 1)} {
			var attached bool
			if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_inherits WHERE inhparent = 'public.processed_event'::regclass
				AND inhrelid = to_regclass('public.' || $1))`, retention.PartitionName(day)).Scan(&attached); err != nil || !attached {
				t.Errorf("%s's database: partition %s attached: %v (%v); want app migrate to make it", g, retention.PartitionName(day), attached, err)
			}
		}
		var public bool
		if err := pool.QueryRow(ctx, `SELECT has_database_privilege('public', current_database(), 'CONNECT')`).Scan(&public); err != nil || public {
			t.Errorf("%s's database: PUBLIC may connect (%v); want only its group's roles", g, err)
		}
	}

	// Forget, under the role that may forget: the group's own.
	billing := testenv.URLAs(owner, "billing_svc", dbs["billing"])
	id := uuid.Must(uuid.NewV7())
	if _, err := testenv.PoolAt(t, billing).Exec(ctx, `INSERT INTO processed_event (event_id, consumer_group) VALUES ($1, 'billing')`, id); err != nil {
		t.Fatal(err)
	}
	if out, err := runApp(t, "inbox", "forget", id.String(), "--group", "billing", "--force", "--database-url", testenv.URLAs(owner, "analytics_svc", dbs["billing"])); err == nil {
		t.Errorf("analytics_svc forgot billing's claim:\n%s", out)
	}
	if out, err := runApp(t, "inbox", "forget", id.String(), "--group", "billing", "--force", "--database-url", billing); err != nil {
		t.Errorf("billing_svc forgets billing's claim: %v\n%s", err, out)
	}

	// maintain's last success, for the alert.
	file := filepath.Join(t.TempDir(), "once_maintain.prom")
	before := time.Now()
	if out, err := runApp(t, "maintain", "--database-url", owner, "--group-database", groupDBs, "--metrics-file", file); err != nil {
		t.Fatalf("app maintain: %v\n%s", err, out)
	}
	written := lastSuccessIn(t, file)
	if written.Before(before.Add(-time.Second)) || written.After(time.Now().Add(time.Second)) {
		t.Fatalf("last success %s; want the pass just made (after %s)", written, before)
	}
	// A pass that fails (a group's role may not run one) leaves it.
	if out, err := runApp(t, "maintain", "--database-url", billing, "--metrics-file", file); err == nil {
		t.Fatalf("app maintain under billing_svc succeeded:\n%s", out)
	}
	if again := lastSuccessIn(t, file); !again.Equal(written) {
		t.Fatalf("a failed pass moved the last success from %s to %s", written, again)
	}
}

func lastSuccessIn(t *testing.T, file string) time.Time {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "once_retention_last_success_timestamp_seconds "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatal(err)
			}
			return time.Unix(0, int64(f*1e9))
		}
	}
	t.Fatalf("no once_retention_last_success_timestamp_seconds in %s:\n%s", file, b)
	return time.Time{}
}
