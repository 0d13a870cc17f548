package schema_test

import (
	"context"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/schema"
)

func freshSchema(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	name := "schema_test_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+name+" CASCADE") })
	return name
}

func TestMigrateIntoANamedSchemaTwice(t *testing.T) {
	pool := testenv.Postgres(t)
	ctx := context.Background()
	cfg := schema.Config{Schema: freshSchema(t, pool), ClaimTable: "claims", Outbox: "box", DeadLetters: "letters"}
	applied, err := schema.Migrate(ctx, pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if len(applied) != 9 {
		t.Fatalf("applied %v, want 9 versions", applied)
	}
	if again, err := schema.Migrate(ctx, pool, cfg); err != nil || len(again) != 0 {
		t.Fatalf("second run applied %v (%v), want nothing", again, err)
	}
	for _, table := range []string{"claims", "claims_default", "box", "box_offsets", "letters", "letters_sources", "once_lease", "once_schema_version", "once_retention_policy"} {
		var ok bool
		if err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, cfg.Schema+"."+table).Scan(&ok); err != nil || !ok {
			t.Errorf("table %s.%s missing", cfg.Schema, table)
		}
	}
}

// A service under a least-privilege role starts after the tables' owner
// migrated: with nothing pending, Migrate creates nothing, so it needs no
// CREATE on the database or the schema (review finding: it ran CREATE
// SCHEMA IF NOT EXISTS at every start, which such a role may not).
func TestMigrateWithNothingPendingNeedsNoCreatePrivilege(t *testing.T) {
	owner := testenv.Postgres(t)
	ctx := context.Background()
	cfg := schema.Config{Schema: freshSchema(t, owner)}
	if _, err := schema.Migrate(ctx, owner, cfg); err != nil {
		t.Fatal(err)
	}
	role := "schema_test_reader_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	for _, stmt := range []string{
		"CREATE ROLE " + role + " NOLOGIN",
		"GRANT USAGE ON SCHEMA " + cfg.Schema + " TO " + role,
		"GRANT SELECT ON ALL TABLES IN SCHEMA " + cfg.Schema + " TO " + role,
	} {
		if _, err := owner.Exec(ctx, stmt); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		_, _ = owner.Exec(ctx, "DROP OWNED BY "+role)
		_, _ = owner.Exec(ctx, "DROP ROLE "+role)
	})
	limited := testenv.PoolAs(t, owner, role)
	var mayCreate bool
	if err := limited.QueryRow(ctx, "SELECT has_database_privilege(current_database(), 'CREATE') OR has_schema_privilege($1, 'CREATE')", cfg.Schema).Scan(&mayCreate); err != nil || mayCreate {
		t.Fatalf("the role may create (%v): the test proves nothing", err)
	}
	if applied, err := schema.Migrate(ctx, limited, cfg); err != nil || len(applied) != 0 {
		t.Fatalf("migrate with nothing pending under a role without CREATE: applied %v, %v; want nothing and no error", applied, err)
	}
}

// A plain claim table of the right shape (what the reference service's first
// migration made) becomes the default partition, its rows kept.
func TestAPlainClaimTableIsAdopted(t *testing.T) {
	pool := testenv.Postgres(t)
	ctx := context.Background()
	cfg := schema.Config{Schema: freshSchema(t, pool)}
	if _, err := pool.Exec(ctx, `CREATE SCHEMA `+cfg.Schema+`;
		CREATE TABLE `+cfg.Schema+`.processed_event (event_id uuid NOT NULL, consumer_group text NOT NULL,
		payload_sha256 bytea NOT NULL, processed_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (event_id, consumer_group));
		CREATE INDEX processed_event_processed_at_idx ON `+cfg.Schema+`.processed_event (processed_at)`); err != nil {
		t.Fatal(err)
	}
	id := uuid.Must(uuid.NewV7())
	if _, err := pool.Exec(ctx, `INSERT INTO `+cfg.Schema+`.processed_event (event_id, consumer_group, payload_sha256) VALUES ($1, 'g', '\x01')`, id); err != nil {
		t.Fatal(err)
	}
	if _, err := schema.Migrate(ctx, pool, cfg); err != nil {
		t.Fatal(err)
	}
	var part string
	if err := pool.QueryRow(ctx, `SELECT tableoid::regclass::text FROM `+cfg.Schema+`.processed_event WHERE event_id = $1`, id).Scan(&part); err != nil {
		t.Fatal(err)
	}
	if part != cfg.Schema+".processed_event_default" {
		t.Fatalf("the old claim is in %s, want the default partition", part)
	}
	// And it still dedups.
	tag, err := pool.Exec(ctx, `INSERT INTO `+cfg.Schema+`.processed_event (event_id, consumer_group, payload_sha256) VALUES ($1, 'g', '\x01') ON CONFLICT DO NOTHING`, id)
	if err != nil || tag.RowsAffected() != 0 {
		t.Fatalf("a second claim of the adopted row inserted %d (%v), want 0", tag.RowsAffected(), err)
	}
}

func TestNamesAreValidated(t *testing.T) {
	err := schema.Config{Schema: "Bad Schema", ClaimTable: "x;drop", Outbox: "ok"}.Validate()
	if err == nil || !strings.Contains(err.Error(), "Schema") || !strings.Contains(err.Error(), "ClaimTable") {
		t.Fatalf("got %v; want both bad names reported", err)
	}
}

// A database an older release migrated has every table the checks look at
// but lacks a newer migration: start-up says so, naming the versions pending.
func TestCheckRefusesADatabaseAMigrationBehind(t *testing.T) {
	pool := testenv.Postgres(t)
	ctx := context.Background()
	cfg := schema.Config{Schema: freshSchema(t, pool)}
	if _, err := schema.Migrate(ctx, pool, cfg); err != nil {
		t.Fatal(err)
	}
	if err := schema.Check(ctx, pool, cfg); err != nil {
		t.Fatalf("a migrated schema: %v", err)
	}
	// goose records a rollback as a newer row with is_applied false.
	if _, err := pool.Exec(ctx, `INSERT INTO `+cfg.Versions().Qualified+` (version_id, is_applied)
		SELECT max(version_id), false FROM `+cfg.Versions().Qualified); err != nil {
		t.Fatal(err)
	}
	err := schema.Check(ctx, pool, cfg)
	if err == nil || !strings.Contains(err.Error(), "1 of this release's 9 library migrations pending") || !strings.Contains(err.Error(), "(version 9)") {
		t.Fatalf("Check with the newest migration rolled back: %v; want the version pending named", err)
	}
}
