package migrations_test

import (
	"context"
	"encoding/base64"
	"errors"
	"os"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/migrations"
	"github.com/once-dev/once/schema"
)

// Item 4 of priv's second review: 00014's backfill of the dead letters'
// group reads each letter's headers; a letter whose header key is not
// UTF-8, or whose old plain-object headers hold a \u0000 (which jsonb
// refuses), used to abort the migration. Such letters are left NULL (the
// owner's to drain); a readable one still gets its group.
func TestGroupOutboxMigrationSkipsLettersItCannotRead(t *testing.T) {
	ctx := context.Background()
	main := testenv.Postgres(t)
	const name = "once_backfill_test"
	if _, err := main.Exec(ctx, `DROP DATABASE IF EXISTS `+name+` WITH (FORCE)`); err != nil {
		t.Fatal(err)
	}
	db := testenv.OtherPostgres(t, name)
	t.Cleanup(func() {
		db.Close()
		_, _ = main.Exec(context.Background(), `DROP DATABASE IF EXISTS `+name+` WITH (FORCE)`)
	})
	if _, err := schema.Migrate(ctx, db, schema.Config{}); err != nil {
		t.Fatal(err)
	}
	sqlDB := stdlib.OpenDBFromPool(db)
	defer sqlDB.Close()
	provider, err := goose.NewProvider(goose.DialectPostgres, sqlDB, os.DirFS("."))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := provider.UpTo(ctx, 13); err != nil {
		t.Fatal(err)
	}
	b64 := func(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }
	letters := map[string]string{
		"readable":     `[{"k":"` + b64("handler_poisoned") + `","v":"` + b64("billing.payments") + `"}]`,
		"key not utf8": `[{"k":"` + base64.StdEncoding.EncodeToString([]byte{0xff, 0xfe}) + `","v":"` + b64("x") + `"},{"k":"` + b64("handler_poisoned") + `","v":"` + b64("billing") + `"}]`,
		"nul":          `{"handler_poisoned":"analytics","x":"a\u0000b"}`,
	}
	ids := map[string]int64{}
	for what, headers := range letters {
		var id int64
		if err := db.QueryRow(ctx, `INSERT INTO once_dead_letter (topic, payload, headers) VALUES ('t', '\x00', convert_to($1, 'UTF8')) RETURNING id`, headers).Scan(&id); err != nil {
			t.Fatalf("park the %s letter: %v", what, err)
		}
		ids[what] = id
	}
	// The fault: reading the unreadable ones as 00014 did fails.
	for _, what := range []string{"key not utf8", "nul"} {
		_, err := db.Exec(ctx, `SELECT convert_from(headers, 'UTF8')::jsonb, (SELECT array_agg(convert_from(decode(e->>'k', 'base64'), 'UTF8')) FROM jsonb_array_elements(CASE jsonb_typeof(convert_from(headers, 'UTF8')::jsonb) WHEN 'array' THEN convert_from(headers, 'UTF8')::jsonb ELSE '[]' END) e)
			FROM once_dead_letter WHERE id = $1`, ids[what])
		if err == nil {
			t.Fatalf("the %s letter's headers read without error; want the fault", what)
		}
	}
	if _, err := provider.UpTo(ctx, 14); err != nil {
		t.Fatalf("00014 on letters it cannot read: %v; want it applied", err)
	}
	want := map[string]*string{"readable": ptr("once_billing"), "key not utf8": nil, "nul": nil}
	for what, id := range ids {
		var got *string
		if err := db.QueryRow(ctx, `SELECT group_role FROM once_dead_letter WHERE id = $1`, id).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if (got == nil) != (want[what] == nil) || (got != nil && *got != *want[what]) {
			t.Errorf("the %s letter's group_role %v; want %v", what, deref(got), deref(want[what]))
		}
	}
}

func ptr(s string) *string { return &s }

func deref(s *string) string {
	if s == nil {
		return "NULL"
	}
	return *s
}

// Item 5 of priv's second review: serve's default --migrate (Up, which runs
// Grant for every group when it applied a migration) on a database made
// billing's own grants analytics nothing there: not CONNECT, not the
// library's tables.
func TestUpGrantsNoOtherGroupInADedicatedDatabase(t *testing.T) {
	ctx := context.Background()
	main := testenv.Postgres(t)
	const name = "once_dedicated_up_test"
	if _, err := main.Exec(ctx, `DROP DATABASE IF EXISTS `+name+` WITH (FORCE)`); err != nil {
		t.Fatal(err)
	}
	db := testenv.OtherPostgres(t, name)
	t.Cleanup(func() {
		db.Close()
		_, _ = main.Exec(context.Background(), `DROP DATABASE IF EXISTS `+name+` WITH (FORCE)`)
	})
	if _, err := migrations.Up(ctx, db); err != nil {
		t.Fatal(err)
	}
	// As app migrate --group-database billing=... does it.
	if err := migrations.Dedicate(ctx, db, []string{"billing"}); err != nil {
		t.Fatal(err)
	}
	if err := migrations.Grant(ctx, db, []string{"billing"}); err != nil {
		t.Fatal(err)
	}
	analytics := func() (connect, insert bool) {
		t.Helper()
		if err := db.QueryRow(ctx, `SELECT has_database_privilege('once_analytics', current_database(), 'CONNECT'),
			has_table_privilege('once_analytics', 'public.processed_event', 'INSERT')`).Scan(&connect, &insert); err != nil {
			t.Fatal(err)
		}
		return connect, insert
	}
	if c, i := analytics(); c || i {
		t.Fatalf("after app migrate: once_analytics CONNECT %v, INSERT on processed_event %v; want neither", c, i)
	}
	// A release with a migration pending: 00014 forgotten, applied again.
	if _, err := db.Exec(ctx, `DELETE FROM goose_db_version WHERE version_id = 14`); err != nil {
		t.Fatal(err)
	}
	applied, err := migrations.Up(ctx, db)
	if err != nil || len(applied) == 0 {
		t.Fatalf("serve's migrate applied %v (%v); want 00014 again", applied, err)
	}
	if c, i := analytics(); c || i {
		t.Errorf("after serve's migrate: once_analytics CONNECT %v, INSERT on processed_event %v; want neither", c, i)
	}
	var billing bool
	if err := db.QueryRow(ctx, `SELECT has_database_privilege('once_billing', current_database(), 'CONNECT')`).Scan(&billing); err != nil || !billing {
		t.Errorf("after serve's migrate: once_billing CONNECT %v (%v); want it", billing, err)
	}
}

// Item 8 of priv's second review: the set-up without least privilege (one
// role migrates and serves: serve's default --migrate runs Up), whose
// owner may not create roles, is not refused for group roles it does not
// use: Up applies its migrations and grants the group roles that exist.
// (once_ghost stands for a group role that does not exist.)
func TestUpGoesOnWhenAGroupRoleIsMissing(t *testing.T) {
	ctx := context.Background()
	main := testenv.Postgres(t)
	const name = "once_missing_role_test"
	if _, err := main.Exec(ctx, `DROP DATABASE IF EXISTS `+name+` WITH (FORCE)`); err != nil {
		t.Fatal(err)
	}
	db := testenv.OtherPostgres(t, name)
	t.Cleanup(func() {
		db.Close()
		_, _ = main.Exec(context.Background(), `DROP DATABASE IF EXISTS `+name+` WITH (FORCE)`)
	})
	if _, err := migrations.Up(ctx, db); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(ctx, `CREATE SCHEMA ghost; DELETE FROM goose_db_version WHERE version_id = 14;
		REVOKE ALL ON public.processed_event FROM once_billing; DROP POLICY once_billing ON public.processed_event`); err != nil {
		t.Fatal(err)
	}
	saved := migrations.Groups
	migrations.Groups = append(slices.Clone(saved), "ghost")
	t.Cleanup(func() { migrations.Groups = saved })
	var missing *migrations.MissingRolesError
	if err := migrations.Grant(ctx, db, migrations.Groups); !errors.As(err, &missing) {
		t.Fatalf("Grant with once_ghost missing: %v; want a MissingRolesError (the fault)", err)
	}
	applied, err := migrations.Up(ctx, db)
	if err != nil || len(applied) == 0 {
		t.Fatalf("Up with once_ghost missing applied %v: %v; want 00014 applied and no error", applied, err)
	}
	var granted, policy bool
	if err := db.QueryRow(ctx, `SELECT has_table_privilege('once_billing', 'public.processed_event', 'INSERT'),
		EXISTS (SELECT FROM pg_policies WHERE tablename = 'processed_event' AND policyname = 'once_billing')`).Scan(&granted, &policy); err != nil || !granted || !policy {
		t.Errorf("after Up: once_billing granted %v, its policy %v (%v); want both (the roles that exist are granted)", granted, policy, err)
	}
}
