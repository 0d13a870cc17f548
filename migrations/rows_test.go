package migrations_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/migrations"
)

// refused is a statement PostgreSQL refused for privileges: a missing
// grant, a row-level security policy's check, or CONNECT.
func refused(err error) bool {
	var pg *pgconn.PgError
	return errors.As(err, &pg) && pg.Code == "42501"
}

// Logged in as billing's login role (never SET ROLE: as an operator's
// service logs in, directly and through PgBouncer, in every pgx exec mode),
// in the database both groups share: it cannot insert a claim, a dead
// letter or a dead-lettered source for analytics, and analytics' rows are
// not there for it to read, update or delete; its own it may write and
// forget. A partition named directly is refused.
func TestAGroupsRoleCannotForgeAnotherGroupsRows(t *testing.T) {
	ctx := context.Background()
	admin := reftest.Postgres(t)
	testenv.LoginRole(t, admin, "billing_svc", "once_billing")
	testenv.LoginRole(t, admin, "analytics_svc", "once_analytics")

	for _, where := range testenv.EveryWay {
		t.Run(where.String(), func(t *testing.T) {
			billing := testenv.PoolAt(t, testenv.URLAs(where.URL(t), "billing_svc", ""))
			analytics := testenv.PoolAt(t, testenv.URLAs(where.URL(t), "analytics_svc", ""))
			var who string
			if err := billing.QueryRow(ctx, `SELECT current_user`).Scan(&who); err != nil || who != "billing_svc" {
				t.Fatalf("logged in as %q (%v), want billing_svc", who, err)
			}

			// Analytics' own rows, written under its role.
			theirs := uuid.Must(uuid.NewV7())
			var letter int64
			for _, st := range []struct {
				sql  string
				args []any
			}{
				{`INSERT INTO processed_event (event_id, consumer_group) VALUES ($1, 'analytics')`, []any{theirs}},
				{`INSERT INTO once_dead_letter_sources (consumer_group, topic, kafka_partition, kafka_offset, payload_sha256) VALUES ('analytics', $1, 0, 1, '\x00')`, []any{theirs.String()}},
			} {
				if _, err := analytics.Exec(ctx, st.sql, st.args...); err != nil {
					t.Fatalf("analytics' role on its own rows: %s: %v", st.sql, err)
				}
			}
			if err := analytics.QueryRow(ctx, `INSERT INTO once_dead_letter (topic, payload, headers) VALUES ($1, '\x00', '\x5b5d') RETURNING id`,
				theirs.String()).Scan(&letter); err != nil {
				t.Fatalf("analytics' role parks a letter: %v", err)
			}

			forged := uuid.Must(uuid.NewV7())
			for _, st := range []struct {
				what string
				sql  string
				args []any
			}{
				{"insert a claim of analytics", `INSERT INTO processed_event (event_id, consumer_group) VALUES ($1, 'analytics')`, []any{forged}},
				{"insert a claim of a suffixed analytics", `INSERT INTO processed_event (event_id, consumer_group) VALUES ($1, 'analytics.e2e-x')`, []any{forged}},
				{"insert a claim of analytics suffixed with _", `INSERT INTO processed_event (event_id, consumer_group) VALUES ($1, 'analytics_blue')`, []any{forged}},
				{"insert a dead-lettered source of analytics", `INSERT INTO once_dead_letter_sources (consumer_group, topic, kafka_partition, kafka_offset, payload_sha256) VALUES ('analytics', $1, 0, 2, '\x00')`, []any{forged.String()}},
				{"park a letter as analytics", `INSERT INTO once_dead_letter (topic, payload, headers, group_role) VALUES ($1, '\x00', '\x5b5d', 'once_analytics')`, []any{forged.String()}},
				{"move its claim to analytics", `UPDATE processed_event SET consumer_group = 'analytics' WHERE event_id = $1`, nil},
				{"read the default partition", `SELECT count(*) FROM processed_event_default`, nil},
				{"delete from the default partition", `DELETE FROM processed_event_default WHERE event_id = $1`, []any{theirs}},
			} {
				if st.what == "move its claim to analytics" {
					mine := uuid.Must(uuid.NewV7())
					if _, err := billing.Exec(ctx, `INSERT INTO processed_event (event_id, consumer_group) VALUES ($1, 'billing')`, mine); err != nil {
						t.Fatalf("billing's role claims for billing: %v", err)
					}
					st.args = []any{mine}
				}
				if _, err := billing.Exec(ctx, st.sql, st.args...); !refused(err) {
					t.Errorf("billing's role may %s: %v; want it refused (42501)", st.what, err)
				}
			}
			for _, st := range []struct {
				what string
				sql  string
				arg  any
			}{
				{"read analytics' claim", `SELECT count(*) FROM processed_event WHERE event_id = $1`, theirs},
				{"read analytics' source", `SELECT count(*) FROM once_dead_letter_sources WHERE topic = $1`, theirs.String()},
				{"read analytics' letter", `SELECT count(*) FROM once_dead_letter WHERE id = $1`, letter},
			} {
				var n int
				if err := billing.QueryRow(ctx, st.sql, st.arg).Scan(&n); err != nil || n != 0 {
					t.Errorf("billing's role could %s: %d rows (%v); want none", st.what, n, err)
				}
			}
			for _, st := range []struct {
				what string
				sql  string
				arg  any
			}{
				{"update analytics' claim", `UPDATE processed_event SET processed_at = now() WHERE event_id = $1`, theirs},
				{"delete analytics' claim", `DELETE FROM processed_event WHERE event_id = $1`, theirs},
				{"delete analytics' source", `DELETE FROM once_dead_letter_sources WHERE topic = $1`, theirs.String()},
				{"update analytics' letter", `UPDATE once_dead_letter SET attempts = attempts + 1 WHERE id = $1`, letter},
				{"delete analytics' letter", `DELETE FROM once_dead_letter WHERE id = $1`, letter},
			} {
				// Refused (no UPDATE on claims at all) or no row touched.
				tag, err := billing.Exec(ctx, st.sql, st.arg)
				if !refused(err) && (err != nil || tag.RowsAffected() != 0) {
					t.Errorf("billing's role could %s: %d rows (%v); want none", st.what, tag.RowsAffected(), err)
				}
			}
			var claims, sources, letters int
			if err := admin.QueryRow(ctx, `SELECT (SELECT count(*) FROM processed_event WHERE event_id = $1 AND consumer_group = 'analytics'),
				(SELECT count(*) FROM once_dead_letter_sources WHERE topic = $2), (SELECT count(*) FROM once_dead_letter WHERE id = $3 AND attempts = 0)`,
				theirs, theirs.String(), letter).Scan(&claims, &sources, &letters); err != nil || claims != 1 || sources != 1 || letters != 1 {
				t.Errorf("analytics' rows after billing's attempts: claim %d, source %d, letter %d (%v); want each untouched", claims, sources, letters, err)
			}
			var forgedRows int
			if err := admin.QueryRow(ctx, `SELECT count(*) FROM processed_event WHERE event_id = $1`, forged).Scan(&forgedRows); err != nil || forgedRows != 0 {
				t.Errorf("forged claims: %d (%v); want none", forgedRows, err)
			}

			// Its own group's rows billing's role writes, reads and forgets
			// (the console's Forget runs under it), a suffixed group too.
			mine := uuid.Must(uuid.NewV7())
			if _, err := billing.Exec(ctx, `INSERT INTO processed_event (event_id, consumer_group) VALUES ($1, 'billing'), ($1, 'billing.e2e-x')`, mine); err != nil {
				t.Fatalf("billing's role claims for billing: %v", err)
			}
			if tag, err := billing.Exec(ctx, `DELETE FROM processed_event WHERE event_id = $1`, mine); err != nil || tag.RowsAffected() != 2 {
				t.Errorf("billing's role forgets its claims: %d (%v); want 2", tag.RowsAffected(), err)
			}
			var own int64
			if err := billing.QueryRow(ctx, `INSERT INTO once_dead_letter (topic, payload, headers) VALUES ('t', '\x00', '\x5b5d') RETURNING id`).Scan(&own); err != nil {
				t.Fatalf("billing's role parks a letter: %v", err)
			}
			if tag, err := billing.Exec(ctx, `DELETE FROM once_dead_letter WHERE id = $1`, own); err != nil || tag.RowsAffected() != 1 {
				t.Errorf("billing's role drains its letter: %d (%v)", tag.RowsAffected(), err)
			}
			_, _ = admin.Exec(ctx, `DELETE FROM once_dead_letter WHERE id = $1`, letter)
		})
	}
}

// A database of each group's own (app migrate --group-database): the other
// group's login role may not even connect, directly or through PgBouncer,
// and the group's own role keeps no privilege of the other's (its schema,
// the library's tables: claims, dead letters, the consumer outbox).
func TestADatabasePerGroupIsClosedToTheOtherGroup(t *testing.T) {
	ctx := context.Background()
	admin := reftest.Postgres(t)
	testenv.LoginRole(t, admin, "billing_svc", "once_billing")
	testenv.LoginRole(t, admin, "analytics_svc", "once_analytics")
	dbs := map[string]*pgxpool.Pool{"billing": testenv.OtherPostgres(t, "once_rows_billing"), "analytics": testenv.OtherPostgres(t, "once_rows_analytics")}
	for g, pool := range dbs {
		if _, err := migrations.Up(ctx, pool); err != nil {
			t.Fatal(err)
		}
		if err := migrations.Dedicate(ctx, pool, []string{g}); err != nil {
			t.Fatal(err)
		}
		// Again, as every app migrate does: idempotent.
		if err := migrations.Dedicate(ctx, pool, []string{g}); err != nil {
			t.Fatal(err)
		}
	}
	for _, base := range []struct{ name, url string }{{"direct", testenv.Where{Mode: pgx.QueryExecModeCacheStatement}.URL(t)}, {"pgbouncer", testenv.Where{Pooled: true, Mode: pgx.QueryExecModeExec}.URL(t)}} {
		for g, other := range map[string]string{"billing": "analytics", "analytics": "billing"} {
			own := testenv.PoolAt(t, testenv.URLAs(base.url, g+"_svc", "once_rows_"+g))
			if _, err := own.Exec(ctx, `INSERT INTO processed_event (event_id, consumer_group) VALUES ($1, $2)`, uuid.Must(uuid.NewV7()), g); err != nil {
				t.Errorf("%s: %s_svc claims in its own database: %v", base.name, g, err)
			}
			if _, err := own.Exec(ctx, `INSERT INTO once_outbox (uuid, payload, transaction_id) VALUES ($1, '{}', pg_current_xact_id())`, uuid.NewString()); err != nil {
				t.Errorf("%s: %s_svc writes its outbox in its own database: %v", base.name, g, err)
			}
			// Into the other's database: refused at the door.
			stranger := testenv.PoolAt(t, testenv.URLAs(base.url, g+"_svc", "once_rows_"+other))
			// PgBouncer passes the server's refusal on as its own error (08P01).
			if _, err := stranger.Exec(ctx, `SELECT 1`); !refused(err) && !(err != nil && strings.Contains(err.Error(), "permission denied for database")) {
				t.Errorf("%s: %s_svc connects to %s's database: %v; want CONNECT refused (42501)", base.name, g, other, err)
			}
		}
	}
	// Behind the door, nothing either: were CONNECT granted by mistake, the
	// other group's role still has no privilege there.
	for g, pool := range dbs {
		other := map[string]string{"billing": "analytics", "analytics": "billing"}[g]
		for _, obj := range []string{"public.processed_event", "public.once_dead_letter", "public.once_dead_letter_sources", "public.once_outbox", "public.once_outbox_offsets"} {
			var any bool
			if err := pool.QueryRow(ctx, `SELECT has_table_privilege($1, $2, 'SELECT, INSERT, UPDATE, DELETE')`, "once_"+other, obj).Scan(&any); err != nil || any {
				t.Errorf("%s's database: once_%s has a privilege on %s (%v)", g, other, obj, err)
			}
		}
		var usage, connect bool
		if err := pool.QueryRow(ctx, `SELECT has_schema_privilege($1, $2, 'USAGE'), has_database_privilege('public', current_database(), 'CONNECT')`,
			"once_"+other, other).Scan(&usage, &connect); err != nil || usage || connect {
			t.Errorf("%s's database: once_%s uses schema %s: %v, PUBLIC connects: %v (%v)", g, other, other, usage, connect, err)
		}
	}
}
