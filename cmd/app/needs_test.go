package main

import (
	"context"
	"fmt"
	"io/fs"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/migrations"
)

// app serve --no-migrate checks, before it consumes, what the groups it
// runs need of the database: the billing group under a login role given
// analytics' group role is refused naming the schema and the role to
// grant; a migration of the service not applied is refused naming it;
// billing under billing's own role starts and becomes ready.
func TestServeNoMigrateRefusesWhatCannotWork(t *testing.T) {
	ctx := context.Background()
	admin := reftest.Postgres(t) // migrated by the owner, as operating.md says
	brokers := testenv.Brokers(t)
	loginAs := func(groupRole string) (dsn, role string) {
		t.Helper()
		role = groupRole + "_login_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
		if _, err := admin.Exec(ctx, "CREATE ROLE "+role+" LOGIN IN ROLE "+groupRole); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _, _ = admin.Exec(context.Background(), "DROP ROLE IF EXISTS "+role) })
		u, err := url.Parse(admin.Config().ConnString())
		if err != nil {
			t.Fatal(err)
		}
		u.User = url.User(role)
		return u.String(), role
	}
	suffix := "_" + uuid.NewString()[:8]
	serve := func(ctx context.Context, dsn, ops string, logs *testenv.Logs) error {
		return run(ctx, []string{"serve", "--no-migrate", "--kafka-brokers", strings.Join(brokers, ","), "--database-url", dsn,
			"--topic-suffix", suffix, "--group-suffix", suffix, "--groups", "billing", "--partitions", "1",
			"--ops-listen", ops, "--watch-interval", "1s", "--maintenance-interval", "0", "--session-timeout", "6s"}, logs, logs)
	}
	refused := func(t *testing.T, dsn string, want ...string) {
		t.Helper()
		var logs testenv.Logs
		ctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		err := serve(ctx, dsn, "", &logs)
		if err == nil {
			t.Fatalf("serve started; want it refused naming %q\n%s", want, logs.String())
		}
		t.Logf("refused: %v", err)
		for _, w := range want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("serve's refusal does not name %q:\n%v", w, err)
			}
		}
	}

	t.Run("billing under analytics' role", func(t *testing.T) {
		dsn, role := loginAs("once_analytics")
		refused(t, dsn,
			"group billing"+suffix+": role "+role+" lacks USAGE on schema billing (grant once_billing to it)",
			"DATABASE_URL")
	})

	t.Run("a migration pending", func(t *testing.T) {
		dsn, _ := loginAs("once_billing")
		// goose's latest row of a version says whether it is applied: one
		// saying it is not makes the newest migration pending, as in a
		// database the owner has not migrated to this release yet.
		// The newest this binary knows, not the database's: a database
		// migrated by a newer release has versions this one has not.
		names, err := fs.Glob(migrations.FS, "*.sql")
		if err != nil || len(names) == 0 {
			t.Fatalf("the reference service's migrations: %v %v", names, err)
		}
		newest, err := strconv.ParseInt(strings.SplitN(slices.Max(names), "_", 2)[0], 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		var id int64
		if err := admin.QueryRow(ctx, `INSERT INTO goose_db_version (version_id, is_applied) VALUES ($1, false) RETURNING id`, newest).Scan(&id); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _, _ = admin.Exec(context.Background(), `DELETE FROM goose_db_version WHERE id = $1`, id) })
		refused(t, dsn, fmt.Sprintf("1 migration pending (%05d_", newest), ".sql): run app migrate as the tables' owner")
	})

	t.Run("billing under its own role starts", func(t *testing.T) {
		dsn, _ := loginAs("once_billing")
		ops := testenv.FreeAddr(t)
		var logs testenv.Logs
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		done := make(chan error, 1)
		go func() { done <- serve(ctx, dsn, ops, &logs) }()
		testenv.Eventually(t, time.Minute, "/readyz under the billing role", func() bool {
			select {
			case err := <-done:
				t.Fatalf("serve stopped: %v\n%s", err, logs.String())
			default:
			}
			code, _ := get("http://" + ops + "/readyz")
			return code == 200
		})
		cancel()
		if err := <-done; err != nil {
			t.Fatalf("serve: %v\n%s", err, logs.String())
		}
	})
}
