package main

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/migrations"
)

// Finding 3 of priv's review: a group role that did not exist when the
// migrations ran (an owner without CREATEROLE; a DBA creates the role
// later) gets its grants and policies from the next app migrate, which
// runs migrations.Grant every time, not only when a migration is pending.
// Before, goose recorded 00010/00011/00013 applied and "run app migrate
// again" did nothing. Meanwhile the role is restricted by row security
// (no policy of its own: no row), never taken for a role of no group. And
// a group role that does not exist stops Grant with the statement that
// creates it.
func TestAppMigrateGrantsARoleMadeAfterTheMigrations(t *testing.T) {
	ctx := context.Background()
	admin := testenv.OtherPostgres(t, "once_regrant")
	testenv.LoginRole(t, admin, "billing_svc", "once_billing")
	owner := testenv.URLAs(testenv.Where{Mode: pgx.QueryExecModeCacheStatement}.URL(t), "once", "once_regrant")
	if out, err := runApp(t, "migrate", "--database-url", owner); err != nil {
		t.Fatalf("app migrate: %v\n%s", err, out)
	}
	// What the migrations leave once_billing when it did not exist as they
	// ran: nothing granted, no policy of its own.
	for _, s := range []string{
		`REVOKE ALL ON ALL TABLES IN SCHEMA public FROM once_billing`,
		`REVOKE ALL ON ALL TABLES IN SCHEMA billing FROM once_billing`,
		`REVOKE ALL ON SCHEMA billing FROM once_billing`,
		`DROP POLICY once_billing ON processed_event`,
		`DROP POLICY once_billing ON once_dead_letter`,
		`DROP POLICY once_billing_read ON once_outbox`,
		`DROP POLICY once_billing_write ON once_outbox`,
	} {
		if _, err := admin.Exec(ctx, s); err != nil {
			t.Fatalf("%s: %v", s, err)
		}
	}
	// Granted a table again but with no policy of its own, its role sees
	// no claim: not another role's free run of the table.
	if _, err := admin.Exec(ctx, `GRANT SELECT, INSERT ON processed_event TO once_billing`); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, `INSERT INTO processed_event (event_id, consumer_group) VALUES ($1, 'analytics')`, uuid.Must(uuid.NewV7())); err != nil {
		t.Fatal(err)
	}
	billing := testenv.PoolAt(t, testenv.URLAs(owner, "billing_svc", "once_regrant"))
	var seen int
	if err := billing.QueryRow(ctx, `SELECT count(*) FROM processed_event`).Scan(&seen); err != nil || seen != 0 {
		t.Errorf("billing's role without its policies sees %d claims (%v); want none", seen, err)
	}
	claim := func() error {
		_, err := billing.Exec(ctx, `INSERT INTO processed_event (event_id, consumer_group) VALUES ($1, 'billing')`, uuid.Must(uuid.NewV7()))
		return err
	}
	if err := claim(); err == nil {
		t.Fatal("billing's role claims without its policy: the staged state is not the one the migrations leave a missing role")
	}

	// The DBA made the role; the owner runs app migrate again, nothing pending.
	if out, err := runApp(t, "migrate", "--database-url", owner); err != nil {
		t.Fatalf("app migrate again: %v\n%s", err, out)
	}
	if err := claim(); err != nil {
		t.Errorf("billing's role claims for billing after app migrate ran again: %v", err)
	}
	if err := pgx.BeginFunc(ctx, billing, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO once_outbox (uuid, payload, transaction_id) VALUES ($1, '{}', pg_current_xact_id())`, uuid.NewString())
		return err
	}); err != nil {
		t.Errorf("billing's role writes its outbox after app migrate ran again: %v", err)
	}
	if _, err := billing.Exec(ctx, `SELECT count(*) FROM billing.payments`); err != nil {
		t.Errorf("billing's role reads its schema after app migrate ran again: %v", err)
	}

	// A group role that does not exist: named, with what creates it.
	saved := migrations.Groups
	migrations.Groups = append(slices.Clone(saved), "ghost")
	t.Cleanup(func() { migrations.Groups = saved })
	err := migrations.Grant(ctx, admin, []string{"billing", "ghost"})
	var pg *pgconn.PgError
	if err == nil || errors.As(err, &pg) || !strings.Contains(err.Error(), "CREATE ROLE once_ghost NOLOGIN") || !strings.Contains(err.Error(), "app migrate again") {
		t.Errorf("Grant with once_ghost missing: %v; want an error naming the statement that creates it and the re-run", err)
	}
}

// Finding 5 of priv's review: app migrate told databases apart by the text
// of their URLs, so the main database written another way in
// --group-database (here with a parameter) was made billing's own:
// analytics lost its grants there and PUBLIC its CONNECT. Databases are now
// known by the server's identity; two groups naming one database of their
// own are refused; and a run after such a mistake gives the main
// database's groups back their privileges and CONNECT.
func TestAppMigrateKnowsTheMainDatabaseWrittenAnotherWay(t *testing.T) {
	ctx := context.Background()
	main := testenv.OtherPostgres(t, "once_ident_main")
	testenv.OtherPostgres(t, "once_ident_both")
	base := testenv.Where{Mode: pgx.QueryExecModeCacheStatement}.URL(t)
	owner := testenv.URLAs(base, "once", "once_ident_main")
	sep := "?"
	if strings.Contains(owner, "?") {
		sep = "&"
	}
	sameMain := owner + sep + "application_name=billing-migrate"
	if out, err := runApp(t, "migrate", "--database-url", owner); err != nil {
		t.Fatalf("app migrate: %v\n%s", err, out)
	}
	check := func(when string) {
		t.Helper()
		var public, analytics bool
		if err := main.QueryRow(ctx, `SELECT has_database_privilege('public', current_database(), 'CONNECT'),
			has_table_privilege('once_analytics', 'public.processed_event', 'INSERT') AND has_schema_privilege('once_analytics', 'analytics', 'USAGE')`).Scan(&public, &analytics); err != nil {
			t.Fatal(err)
		}
		if !public || !analytics {
			t.Errorf("%s: main database: PUBLIC connects %v, analytics' role keeps its grants %v; want both", when, public, analytics)
		}
	}
	if out, err := runApp(t, "migrate", "--database-url", owner, "--group-database", "billing="+sameMain); err != nil {
		t.Fatalf("app migrate with billing's database the main one written another way: %v\n%s", err, out)
	}
	check("billing's database the main one, written another way")

	// Two groups on one database of their own: refused, naming both.
	both := testenv.URLAs(base, "once", "once_ident_both")
	out, err := runApp(t, "migrate", "--database-url", owner, "--group-database", "billing="+both+";analytics="+both)
	if err == nil || !strings.Contains(out+err.Error(), "name one database") {
		t.Errorf("app migrate with billing and analytics on one database of their own: %v\n%s; want it refused", err, out)
	}

	// The mistake made before the fix: the main database made billing's
	// own. The next run gives analytics its grants and CONNECT back.
	if err := migrations.Dedicate(ctx, main, []string{"billing"}); err != nil {
		t.Fatal(err)
	}
	if out, err := runApp(t, "migrate", "--database-url", owner); err != nil {
		t.Fatalf("app migrate after the mistake: %v\n%s", err, out)
	}
	// PUBLIC's CONNECT is the operator's to give back (it may have been
	// revoked on purpose); the groups' roles get theirs.
	var connect, analytics bool
	if err := main.QueryRow(ctx, `SELECT has_database_privilege('once_analytics', current_database(), 'CONNECT'),
		has_table_privilege('once_analytics', 'public.processed_event', 'INSERT') AND has_schema_privilege('once_analytics', 'analytics', 'USAGE')`).Scan(&connect, &analytics); err != nil || !connect || !analytics {
		t.Errorf("a run after the main database was made billing's own: once_analytics connects %v, keeps its grants %v (%v); want both", connect, analytics, err)
	}
	if _, err := main.Exec(ctx, `GRANT CONNECT ON DATABASE once_ident_main TO PUBLIC`); err != nil {
		t.Fatal(err)
	}
}

// Item 8 of priv's second review: app migrate without --group-database
// (the set-up without least privilege) is not refused for a group role
// that does not exist: it says so and grants the others; with
// --group-database (least privilege) it is refused, naming the role.
func TestAppMigrateWarnsOfAMissingGroupRoleUnlessLeastPrivilege(t *testing.T) {
	ctx := context.Background()
	admin := testenv.OtherPostgres(t, "once_missing_role_app")
	testenv.OtherPostgres(t, "once_missing_role_app_billing")
	base := testenv.Where{Mode: pgx.QueryExecModeCacheStatement}.URL(t)
	owner := testenv.URLAs(base, "once", "once_missing_role_app")
	if out, err := runApp(t, "migrate", "--database-url", owner); err != nil {
		t.Fatalf("app migrate: %v\n%s", err, out)
	}
	if _, err := admin.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS ghost`); err != nil {
		t.Fatal(err)
	}
	saved := migrations.Groups
	migrations.Groups = append(slices.Clone(saved), "ghost")
	t.Cleanup(func() { migrations.Groups = saved })
	out, err := runApp(t, "migrate", "--database-url", owner)
	if err != nil || !strings.Contains(out, "group roles missing") || !strings.Contains(out, "CREATE ROLE once_ghost NOLOGIN") {
		t.Errorf("app migrate without --group-database, once_ghost missing: %v\n%s; want it to go on, saying which role is missing", err, out)
	}
	out, err = runApp(t, "migrate", "--database-url", owner, "--group-database", "billing="+testenv.URLAs(base, "once", "once_missing_role_app_billing"))
	if err == nil || !strings.Contains(out+err.Error(), "CREATE ROLE once_ghost NOLOGIN") {
		t.Errorf("app migrate with --group-database, once_ghost missing: %v\n%s; want it refused, naming the role", err, out)
	}
}
