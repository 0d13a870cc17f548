package once_test

import (
	"context"
	"errors"
	"net/url"
	"os"
	"strings"
	"testing"
	"testing/fstest"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/schema"
)

// What a service declares it needs (once.Config.Needs) is checked at
// start-up, before Kafka, against the database URL's role, and every thing
// missing is named at once: a schema that does not exist, a table that
// does not, a privilege the role lacks on a table (with the GRANT, when no
// group role holds it), and a migration of the service not applied.
func TestStartUpNamesEveryNeedMissing(t *testing.T) {
	ctx := context.Background()
	admin := testenv.Postgres(t)
	tables := ownTables(t)
	if _, err := schema.Migrate(ctx, admin, tables); err != nil {
		t.Fatal(err)
	}
	id := strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	own, role := "needs_"+id, "needs_login_"+id
	for _, q := range []string{
		"CREATE SCHEMA " + own,
		"CREATE TABLE " + own + ".effects (n int)",
		"CREATE ROLE " + role + " LOGIN",
		"GRANT USAGE ON SCHEMA " + own + ", " + tables.Schema + " TO " + role,
		"GRANT SELECT ON " + own + ".effects TO " + role,
		"GRANT SELECT, INSERT ON ALL TABLES IN SCHEMA " + tables.Schema + " TO " + role,
		"GRANT UPDATE, DELETE ON " + tables.Schema + ".once_dead_letter, " + tables.Schema + ".once_dead_letter_sources, " +
			tables.Schema + ".once_outbox, " + tables.Schema + ".once_outbox_offsets TO " + role,
	} {
		if _, err := admin.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+own+" CASCADE")
		_, _ = admin.Exec(context.Background(), "DROP OWNED BY "+role)
		_, _ = admin.Exec(context.Background(), "DROP ROLE IF EXISTS "+role)
	})
	u, err := url.Parse(os.Getenv("DATABASE_URL"))
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(role)
	migrations := fstest.MapFS{"00001_first.sql": {Data: []byte("-- +goose Up\nSELECT 1;\n")}}
	_, err = once.New(ctx, once.Config{Brokers: testenv.Brokers(t), DatabaseURL: u.String(), Tables: tables, CheckOnly: true, Logger: quiet(),
		Needs: once.Needs{Migrations: migrations, MigrationsTable: own + ".versions", MigrateCommand: "migrate-it",
			Groups: map[string][]once.Grant{"g": {
				{Table: own + ".effects", Privileges: []string{"SELECT", "INSERT", "UPDATE"}},
				{Table: own + ".missing", Privileges: []string{"SELECT"}},
				{Table: "nosuch_" + id + ".t", Privileges: []string{"SELECT"}},
			}}},
		Topics: []once.Binding{once.Topic[ping]{Name: "never.consumed", Decode: decodePing,
			Groups: []once.Group[ping]{{Name: "g", Handle: func(context.Context, pgx.Tx, ping) error { return nil }}}}}})
	var se *once.SettingError
	if !errors.As(err, &se) || se.Setting != "DatabaseURL" {
		t.Fatalf("New: %v; want a DatabaseURL setting error", err)
	}
	t.Logf("refused: %v", err)
	for _, want := range []string{
		"1 migration pending (00001_first.sql): run migrate-it as the tables' owner",
		"group g: role " + role + " lacks INSERT, UPDATE on table " + own + ".effects (GRANT INSERT, UPDATE ON " + own + ".effects TO " + role + ")",
		"group g: table " + own + ".missing is missing",
		"group g: schema nosuch_" + id + " is missing",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the refusal does not say %q", want)
		}
	}
	if strings.Contains(err.Error(), tables.Schema+".processed_event") {
		t.Errorf("the library's tables, which the role may use, are named: %v", err)
	}

	bad := once.Config{Brokers: []string{"127.0.0.1:1"}, DatabaseURL: "postgres://x@127.0.0.1:1/x",
		Needs: once.Needs{Groups: map[string][]once.Grant{"g": {{Table: "effects", Privileges: []string{"TRUNCATE"}}}, "other": {}}},
		Topics: []once.Binding{once.Topic[ping]{Name: "t", Decode: decodePing,
			Groups: []once.Group[ping]{{Name: "g", Handle: func(context.Context, pgx.Tx, ping) error { return nil }}}}}}
	err = bad.Validate()
	for _, want := range []string{`table "effects": want it schema-qualified`, `privilege "TRUNCATE"`, `Needs.Groups names group "other"`} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Validate: %v; want %q", err, want)
		}
	}
}

// A serial column's default calls nextval, which takes USAGE on its
// sequence: a role given every table grant the check asks for, and no more,
// would pass start-up and then fail every insert ("permission denied for
// sequence"): no dead letter parked (its partition held), no outbox event
// written. Start-up names those sequences, of the library's tables and of a
// service's own, and not an identity column's (PostgreSQL asks no
// privilege of the inserting role there); once granted, the role parks a
// dead letter and writes the outbox.
func TestStartUpNamesTheSequencesInsertsTake(t *testing.T) {
	ctx := context.Background()
	admin := testenv.Postgres(t)
	tables := ownTables(t)
	if _, err := schema.Migrate(ctx, admin, tables); err != nil {
		t.Fatal(err)
	}
	id := strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	own, role := "seqs_"+id, "seqs_login_"+id
	for _, q := range []string{
		"CREATE SCHEMA " + own,
		"CREATE TABLE " + own + ".serials (n bigserial, v int)",
		"CREATE TABLE " + own + ".identities (n bigint GENERATED BY DEFAULT AS IDENTITY, v int)",
		"CREATE ROLE " + role + " LOGIN",
		"GRANT USAGE ON SCHEMA " + own + ", " + tables.Schema + " TO " + role,
		"GRANT SELECT, INSERT ON ALL TABLES IN SCHEMA " + own + " TO " + role,
		"GRANT SELECT, INSERT ON ALL TABLES IN SCHEMA " + tables.Schema + " TO " + role,
		"GRANT UPDATE, DELETE ON " + tables.Schema + ".once_dead_letter, " + tables.Schema + ".once_dead_letter_sources, " +
			tables.Schema + ".once_outbox, " + tables.Schema + ".once_outbox_offsets TO " + role,
	} {
		if _, err := admin.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+own+" CASCADE")
		_, _ = admin.Exec(context.Background(), "DROP OWNED BY "+role)
		_, _ = admin.Exec(context.Background(), "DROP ROLE IF EXISTS "+role)
	})
	var letterSeq, outboxSeq, ownSeq string
	if err := admin.QueryRow(ctx, `SELECT pg_get_serial_sequence($1, 'id'), pg_get_serial_sequence($2, 'offset'), pg_get_serial_sequence($3, 'n')`,
		tables.DeadLettersTable().Qualified, tables.OutboxTable().Qualified, own+".serials").Scan(&letterSeq, &outboxSeq, &ownSeq); err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(os.Getenv("DATABASE_URL"))
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(role)
	cfg := once.Config{Brokers: testenv.Brokers(t), DatabaseURL: u.String(), Tables: tables, CheckOnly: true, Logger: quiet(),
		Needs: once.Needs{Groups: map[string][]once.Grant{"g" + id: {
			{Table: own + ".serials", Privileges: []string{"SELECT", "INSERT"}},
			{Table: own + ".identities", Privileges: []string{"SELECT", "INSERT"}},
		}}},
		Topics: []once.Binding{once.Topic[ping]{Name: "never.consumed." + id, Decode: decodePing,
			Groups: []once.Group[ping]{{Name: "g" + id, Handle: func(context.Context, pgx.Tx, ping) error { return nil }}}}}}

	_, err = once.New(ctx, cfg)
	if err == nil {
		t.Fatal("start-up passed a role that may not take the next value of the dead letters' and the outbox's sequences")
	}
	t.Logf("refused: %v", err)
	for _, want := range []string{
		"role " + role + " lacks USAGE on sequence " + letterSeq + ", which an insert into table " + tables.DeadLettersTable().Qualified + " takes its next value from (GRANT USAGE ON SEQUENCE " + letterSeq + " TO " + role + ")",
		"lacks USAGE on sequence " + outboxSeq + ", which an insert into table " + tables.OutboxTable().Qualified,
		"lacks USAGE on sequence " + ownSeq + ", which an insert into table " + own + ".serials",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the refusal does not say %q", want)
		}
	}
	if strings.Contains(err.Error(), own+".identities") {
		t.Errorf("an identity column's sequence, which takes no privilege, is named")
	}

	if _, err := admin.Exec(ctx, "GRANT USAGE ON ALL SEQUENCES IN SCHEMA "+tables.Schema+", "+own+" TO "+role); err != nil {
		t.Fatal(err)
	}
	svc, err := once.New(ctx, cfg)
	if err != nil {
		t.Fatalf("start-up refused the role granted the sequences: %v", err)
	}
	defer svc.Close()
	conn, err := pgx.Connect(ctx, u.String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	for _, q := range []string{
		"INSERT INTO " + tables.DeadLettersTable().Qualified + " (topic, payload, headers) VALUES ('t', 'x', 'y')",
		"INSERT INTO " + tables.OutboxTable().Qualified + " (uuid, payload, metadata, transaction_id) VALUES ('u', '{}', '{}', pg_current_xact_id())",
		"INSERT INTO " + own + ".serials (v) VALUES (1)",
		"INSERT INTO " + own + ".identities (v) VALUES (1)",
	} {
		if _, err := conn.Exec(ctx, q); err != nil {
			t.Errorf("as the role that passed start-up: %s: %v", q, err)
		}
	}
}
