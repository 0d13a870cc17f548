package schema_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/retention"
	"github.com/once-dev/once/schema"
)

// newRole is a role of the test's own (roles belong to the cluster),
// dropped with what it owns when the test ends.
func newRole(t *testing.T, pool *pgxpool.Pool, name string) string {
	t.Helper()
	role := "schema_test_" + name + "_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	ctx := context.Background()
	if _, err := pool.Exec(ctx, "CREATE ROLE "+role+" NOLOGIN"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(ctx, "DROP OWNED BY "+role)
		_, _ = pool.Exec(ctx, "DROP ROLE "+role)
	})
	return role
}

func execAll(t *testing.T, pool *pgxpool.Pool, stmts ...string) {
	t.Helper()
	for _, st := range stmts {
		if _, err := pool.Exec(context.Background(), st); err != nil {
			t.Fatalf("%s: %v", st, err)
		}
	}
}

// guideClaim is the style guide's consumer's claim (consume.py's statement,
// in schema s): whether it inserted.
func guideClaim(t *testing.T, pool *pgxpool.Pool, s string, id uuid.UUID, group string) bool {
	t.Helper()
	tag, err := pool.Exec(context.Background(), `INSERT INTO `+s+`.processed_event (event_id, consumer_group) VALUES ($1, $2) ON CONFLICT DO NOTHING`, id, group)
	if err != nil {
		t.Fatalf("the guide's claim of %s: %v", id, err)
	}
	return tag.RowsAffected() == 1
}

// deliver runs one delivery of id through the library's claim in group,
// with the claim table cfg names, and returns its outcome.
func deliver(t *testing.T, pool *pgxpool.Pool, cfg schema.Config, group string, id uuid.UUID, runs *atomic.Int64) idempotency.Outcome {
	t.Helper()
	out, err := delivery(t, pool, cfg, group, id, runs)
	if err != nil {
		t.Fatalf("delivery of %s: %v", id, err)
	}
	return out
}

// delivery is deliver that returns the delivery's error too.
func delivery(t *testing.T, pool *pgxpool.Pool, cfg schema.Config, group string, id uuid.UUID, runs *atomic.Int64) (idempotency.Outcome, error) {
	t.Helper()
	var out idempotency.Outcome
	m, err := idempotency.New(idempotency.Config{DB: pool, ConsumerGroup: group, Schema: cfg.Schema, Table: cfg.ClaimTable,
		OnResult: func(r idempotency.Result) { out = r.Outcome }})
	if err != nil {
		t.Fatal(err)
	}
	msg := message.NewMessage(uuid.NewString(), []byte(`{"event_id":"`+id.String()+`","amount":"1.00"}`))
	msg.SetContext(context.Background())
	_, err = m.Middleware(func(*message.Message) ([]*message.Message, error) { runs.Add(1); return nil, nil })(msg)
	return out, err
}

// v7Ago is a UUIDv7 whose time is d ago.
func v7Ago(d time.Duration) uuid.UUID {
	id := uuid.Must(uuid.NewV7())
	ms := uint64(time.Now().Add(-d).UnixMilli())
	for i := range 6 {
		id[i] = byte(ms >> (40 - 8*i))
	}
	return id
}

// covered is how far back the claims of cfg's table reach, as the claim
// statement reads it (schema.CoveredRetention).
func covered(t *testing.T, pool *pgxpool.Pool, cfg schema.Config) time.Duration {
	t.Helper()
	var seconds int64
	if err := pool.QueryRow(context.Background(), `SELECT `+schema.CoveredRetention("")+` FROM `+cfg.RetentionPolicy().Qualified+
		` WHERE claim_table = $1`, cfg.Claims().Name).Scan(&seconds); err != nil {
		t.Fatal(err)
	}
	return time.Duration(seconds) * time.Second
}

func processedAt(t *testing.T, pool *pgxpool.Pool, table string, id uuid.UUID) time.Time {
	t.Helper()
	var at time.Time
	if err := pool.QueryRow(context.Background(), `SELECT processed_at FROM `+table+` WHERE event_id = $1`, id).Scan(&at); err != nil {
		t.Fatalf("the claim of %s in %s: %v", id, table, err)
	}
	return at
}

// The database: the style guide's plain table, exactly as its DDL
// has it (processed_at nullable), owned by the guide's consumer's role,
// with months of claims. Migrate adopts it in place: every claim stays, with
// its processed_at (one without gets now(): kept one retention from here),
// without a fingerprint, in the default partition; a redelivery through the
// library's claim is a duplicate; and the guide's consumer, under its own
// role, keeps claiming in the adopted table. Before, Migrate refused it
// ("exists with another shape ... payload_sha256").
func TestTheGuidesPlainTableIsAdoptedInPlace(t *testing.T) {
	pool := testenv.Postgres(t)
	ctx := context.Background()
	cfg := schema.Config{Schema: freshSchema(t, pool)}
	s := cfg.Schema
	guide := newRole(t, pool, "guide")
	execAll(t, pool, `CREATE SCHEMA `+s, `GRANT USAGE ON SCHEMA `+s+` TO `+guide,
		`CREATE TABLE `+s+`.processed_event (event_id uuid, consumer_group text, processed_at timestamptz DEFAULT now(),
			PRIMARY KEY (event_id, consumer_group))`,
		`CREATE INDEX ix_processed_at ON `+s+`.processed_event (processed_at)`,
		`ALTER TABLE `+s+`.processed_event OWNER TO `+guide)
	old, undated := uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())
	execAll(t, pool, `INSERT INTO `+s+`.processed_event VALUES ('`+old.String()+`', 'seed-analytics', now() - interval '3 days'),
		('`+undated.String()+`', 'seed-analytics', NULL)`)
	before := processedAt(t, pool, s+".processed_event", old)

	if _, err := schema.Migrate(ctx, pool, cfg); err != nil {
		t.Fatalf("migrate a database holding the guide's table: %v", err)
	}
	if err := schema.Check(ctx, pool, cfg); err != nil {
		t.Fatalf("check after the adoption: %v", err)
	}
	rows, err := pool.Query(ctx, `SELECT event_id, tableoid::regclass::text, processed_at, payload_sha256 IS NULL AND values_sha256 IS NULL
		FROM `+s+`.processed_event`)
	if err != nil {
		t.Fatal(err)
	}
	type claim struct {
		id            uuid.UUID
		part          string
		at            time.Time
		noFingerprint bool
	}
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (c claim, err error) {
		return c, r.Scan(&c.id, &c.part, &c.at, &c.noFingerprint)
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 {
		t.Fatalf("%d claims after the adoption, want the 2 of the guide's table", len(got))
	}
	for _, c := range got {
		if c.part != s+".processed_event_default" || !c.noFingerprint {
			t.Errorf("claim %s: in %s, without a fingerprint %v; want the default partition and none", c.id, c.part, c.noFingerprint)
		}
		switch c.id {
		case old:
			if !c.at.Equal(before) {
				t.Errorf("the claim's processed_at is %s, was %s: retention must count from when it was processed", c.at, before)
			}
		case undated:
			if time.Since(c.at) > time.Minute {
				t.Errorf("the claim without processed_at got %s, want now", c.at)
			}
		}
	}

	var runs atomic.Int64
	if out := deliver(t, pool, cfg, "seed-analytics", old, &runs); out != idempotency.Duplicate || runs.Load() != 0 {
		t.Fatalf("a redelivery of an adopted claim's event: %v, handler ran %d times; want a duplicate", out, runs.Load())
	}
	asGuide := testenv.PoolAs(t, pool, guide)
	if guideClaim(t, asGuide, s, undated, "seed-analytics") {
		t.Error("the guide's consumer claimed an adopted claim's event again")
	}
	fresh := uuid.Must(uuid.NewV7())
	if !guideClaim(t, asGuide, s, fresh, "seed-analytics") {
		t.Error("the guide's consumer could not claim a new event in the adopted table")
	}
	if out := deliver(t, pool, cfg, "seed-analytics", fresh, &runs); out != idempotency.Duplicate {
		t.Errorf("the library's claim of an event the guide's consumer claimed beside it: %v, want a duplicate", out)
	}
}

// The guide's variant partitioned by processed_at, with the trap sprung (one
// event claimed at two moments), partitions named as the library names its
// own, and an index named as the library's: Migrate keeps the table as
// processed_event_guide and claims each event once in the new table, with
// its latest processed_at; the guide's consumer's next claim of it then
// conflicts. Before, Migrate refused it.
func TestTheGuidesPartitionedTableIsAdoptedByCopy(t *testing.T) {
	pool := testenv.Postgres(t)
	ctx := context.Background()
	cfg := schema.Config{Schema: freshSchema(t, pool)}
	s := cfg.Schema
	guide := newRole(t, pool, "guide")
	execAll(t, pool, `CREATE SCHEMA `+s, `GRANT USAGE ON SCHEMA `+s+` TO `+guide,
		`CREATE TABLE `+s+`.processed_event (event_id uuid NOT NULL, consumer_group text NOT NULL, processed_at timestamptz NOT NULL DEFAULT now(),
			PRIMARY KEY (event_id, consumer_group, processed_at)) PARTITION BY RANGE (processed_at)`,
		`CREATE TABLE `+s+`.processed_event_recent PARTITION OF `+s+`.processed_event FOR VALUES FROM (now() - interval '40 days') TO (now() + interval '40 days')`,
		`CREATE TABLE `+s+`.processed_event_default PARTITION OF `+s+`.processed_event DEFAULT`,
		`CREATE INDEX processed_event_processed_at_idx ON `+s+`.processed_event (processed_at)`,
		`GRANT SELECT, INSERT ON `+s+`.processed_event TO `+guide)
	twice, once, ancient := uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())
	execAll(t, pool, `INSERT INTO `+s+`.processed_event VALUES
		('`+twice.String()+`', 'g', now() - interval '2 days'), ('`+twice.String()+`', 'g', now() - interval '1 day'),
		('`+once.String()+`', 'g', now() - interval '5 days'), ('`+ancient.String()+`', 'g', '2020-01-01T00:00:00Z')`)
	var latest time.Time
	if err := pool.QueryRow(ctx, `SELECT max(processed_at) FROM `+s+`.processed_event WHERE event_id = $1`, twice).Scan(&latest); err != nil {
		t.Fatal(err)
	}

	if _, err := schema.Migrate(ctx, pool, cfg); err != nil {
		t.Fatalf("migrate a database holding the guide's partitioned table: %v", err)
	}
	if err := schema.Check(ctx, pool, cfg); err != nil {
		t.Fatalf("check after the adoption: %v", err)
	}
	var n, kept, renamedDefault int
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+s+`.processed_event), (SELECT count(*) FROM `+s+`.processed_event_guide),
		(SELECT count(*) FROM `+s+`.processed_event_guide_default)`).Scan(&n, &kept, &renamedDefault); err != nil {
		t.Fatal(err)
	}
	if n != 3 || kept != 4 || renamedDefault != 1 {
		t.Fatalf("%d claims in the new table, %d kept in processed_event_guide, %d in its renamed default partition; want 3, 4 and 1", n, kept, renamedDefault)
	}
	if at := processedAt(t, pool, s+".processed_event", twice); !at.Equal(latest) {
		t.Errorf("the event claimed twice has processed_at %s, want its latest claim's %s", at, latest)
	}
	if at := processedAt(t, pool, s+".processed_event", ancient); !at.Equal(time.Date(2020, 1, 1, 0, 0, 0, 0, time.UTC)) {
		t.Errorf("the oldest claim has processed_at %s, want its own", at)
	}
	asGuide := testenv.PoolAs(t, pool, guide)
	if guideClaim(t, asGuide, s, twice, "g") {
		t.Error("the guide's consumer claimed an adopted event again: the trap is still there")
	}
	var runs atomic.Int64
	if out := deliver(t, pool, cfg, "g", once, &runs); out != idempotency.Duplicate || runs.Load() != 0 {
		t.Fatalf("a redelivery of an adopted claim's event: %v, handler ran %d times; want a duplicate", out, runs.Load())
	}
}

// A table that is no claim table of the guide's shape is refused with its
// name, what is wrong, and the SQL that fixes it; run, the SQL fixes it.
func TestAClaimTableThatCannotBeAdoptedIsRefusedWithTheFix(t *testing.T) {
	for _, tc := range []struct {
		name, ddl, columns, values, wrong, placeholder, value string
	}{
		{"event_id text", `(event_id text PRIMARY KEY, consumer_group text NOT NULL, processed_at timestamptz NOT NULL DEFAULT now())`,
			"event_id, consumer_group", ", 'g'", "event_id is text, want uuid", "", ""},
		{"no consumer_group", `(event_id uuid PRIMARY KEY, processed_at timestamptz NOT NULL DEFAULT now())`,
			"event_id", "", "no column consumer_group", "<the consumer group whose claims these are>", "billing"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pool := testenv.Postgres(t)
			ctx := context.Background()
			cfg := schema.Config{Schema: freshSchema(t, pool)}
			id := uuid.Must(uuid.NewV7())
			execAll(t, pool, `CREATE SCHEMA `+cfg.Schema, `CREATE TABLE `+cfg.Schema+`.processed_event `+tc.ddl,
				`INSERT INTO `+cfg.Schema+`.processed_event (`+tc.columns+`) VALUES ('`+id.String()+`'`+tc.values+`)`)
			_, err := schema.Migrate(ctx, pool, cfg)
			const fixFollows = "migrate again (app migrate): "
			if err == nil || !strings.Contains(err.Error(), cfg.Schema+".processed_event") || !strings.Contains(err.Error(), tc.wrong) ||
				!strings.Contains(err.Error(), fixFollows) {
				t.Fatalf("got %v; want a refusal naming the table, %q and the fix", err, tc.wrong)
			}
			fix := err.Error()[strings.Index(err.Error(), fixFollows)+len(fixFollows):]
			for _, st := range strings.Split(strings.ReplaceAll(fix, tc.placeholder, tc.value), "; ") {
				execAll(t, pool, st)
			}
			if _, err := schema.Migrate(ctx, pool, cfg); err != nil {
				t.Fatalf("after the refusal's fix (%s): %v", fix, err)
			}
			if at := processedAt(t, pool, cfg.Claims().Qualified, id); at.IsZero() {
				t.Fatal("the claim is gone")
			}
		})
	}
}

// consumeDDL is the start-up DDL of the style guide's consumer
// (consume.py) for its claim table in schema s.
func consumeDDL(s string) string {
	return `CREATE TABLE IF NOT EXISTS ` + s + `.processed_event (
    event_id uuid NOT NULL, consumer_group text NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (event_id, consumer_group));
CREATE INDEX IF NOT EXISTS ix_seed_processed_at ON ` + s + `.processed_event(processed_at)`
}

// The guide's consumer's role made its table and owns it. Migrating as
// another role is refused with whose table it is and the fix: a grant of
// the owner's role to the migrating one, not the table handed over (that
// took the owner's privileges with it). After the fix, and when a
// superuser migrates, the adopted table stays the owner's: the guide's
// consumer, under its own role, still claims in it and still runs its
// start-up DDL (CREATE INDEX ... IF NOT EXISTS checks that it owns the
// table first), and the migrating role still runs retention passes on it.
// An owner that may no longer create in the schema cannot be given the
// new table: it keeps its privileges on it by grants, and claims. Before,
// after the fix the refusal gave (ALTER TABLE ... OWNER TO), the guide's
// claim failed (permission denied) and its DDL failed (must be owner), and
// after a superuser's migration its DDL failed.
func TestAdoptingAnotherRolesTableLeavesItTheirs(t *testing.T) {
	for _, tc := range []struct {
		by         string
		granted    bool // the migrating role is granted the owner's, as the refusal says
		mayCreate  bool // the owner may create in the schema
		ownerAfter string
	}{
		{"a role granted the owner's", true, true, "guide"},
		{"a superuser", false, true, "guide"},
		{"a role granted the owner's, the owner may not create in the schema", true, false, "migrator"},
	} {
		t.Run(tc.by, func(t *testing.T) {
			pool := testenv.Postgres(t)
			ctx := context.Background()
			cfg := schema.Config{Schema: freshSchema(t, pool)}
			s := cfg.Schema
			guide, migrator := newRole(t, pool, "guide"), newRole(t, pool, "migrator")
			execAll(t, pool, `CREATE SCHEMA `+s, `GRANT USAGE, CREATE ON SCHEMA `+s+` TO `+migrator+`, `+guide)
			asGuide := testenv.PoolAs(t, pool, guide)
			execAll(t, asGuide, consumeDDL(s))
			adopted := uuid.Must(uuid.NewV7())
			guideClaim(t, asGuide, s, adopted, "seed-reports")
			if !tc.mayCreate {
				execAll(t, pool, `REVOKE CREATE ON SCHEMA `+s+` FROM `+guide)
			}

			migrating := pool
			if tc.granted {
				migrating = testenv.PoolAs(t, pool, migrator)
				_, err := schema.Migrate(ctx, migrating, cfg)
				fix := fmt.Sprintf("GRANT %q TO %q", guide, migrator)
				if err == nil || !strings.Contains(err.Error(), "needs its owner (role "+guide+")") || !strings.Contains(err.Error(), fix) {
					t.Fatalf("got %v; want a refusal naming the owner and the fix %s", err, fix)
				}
				execAll(t, pool, fix)
			}
			if _, err := schema.Migrate(ctx, migrating, cfg); err != nil {
				t.Fatalf("migrate as %s: %v", tc.by, err)
			}

			var owner string
			if err := pool.QueryRow(ctx, `SELECT tableowner FROM pg_tables WHERE schemaname = $1 AND tablename = 'processed_event'`, s).Scan(&owner); err != nil {
				t.Fatal(err)
			}
			if want := map[string]string{"guide": guide, "migrator": migrator}[tc.ownerAfter]; owner != want {
				t.Errorf("the adopted claim table belongs to %s; want %s", owner, want)
			}
			if guideClaim(t, asGuide, s, adopted, "seed-reports") {
				t.Error("the guide's consumer claimed an adopted claim's event again")
			}
			if !guideClaim(t, asGuide, s, uuid.Must(uuid.NewV7()), "seed-reports") {
				t.Error("the guide's consumer could not claim a new event in the adopted table")
			}
			if _, err := asGuide.Exec(ctx, consumeDDL(s)); (err == nil) != (tc.ownerAfter == "guide") {
				t.Errorf("the guide's consumer's start-up DDL after the adoption: %v; want it to run where the table stays the guide's", err)
			}
			// Today's claims are in the default partition: the days ahead
			// are made and attached.
			rep, err := retention.Run(ctx, retention.Config{DB: migrating, Tables: cfg})
			if err != nil || len(rep.Created) < 2 {
				t.Errorf("a retention pass as the migrating role: %+v, %v; want the days ahead created", rep, err)
			}
		})
	}
}

// The guide's table stays where it is, apart from the library's (its
// consumers keep claiming there for the groups not moved yet): AdoptClaims
// copies its claims, each once with its latest processed_at and no
// fingerprint, leaves a claim the library's table has alone, and copies
// only what was claimed since when run again. Sources it cannot take are
// refused by name.
func TestAdoptClaimsFromTheGuidesTableApart(t *testing.T) {
	pool := testenv.Postgres(t)
	ctx := context.Background()
	cfg := schema.Config{Schema: freshSchema(t, pool)}
	if _, err := schema.Migrate(ctx, pool, cfg); err != nil {
		t.Fatal(err)
	}
	guide := freshSchema(t, pool)
	execAll(t, pool, `CREATE SCHEMA `+guide,
		`CREATE TABLE `+guide+`.processed_event (event_id uuid NOT NULL, consumer_group text NOT NULL, processed_at timestamptz NOT NULL DEFAULT now(),
			PRIMARY KEY (event_id, consumer_group, processed_at)) PARTITION BY RANGE (processed_at)`,
		`CREATE TABLE `+guide+`.processed_event_all PARTITION OF `+guide+`.processed_event DEFAULT`,
		`CREATE TABLE `+guide+`.bad (event_id text, consumer_group text, processed_at timestamptz)`)
	twice, plain, ours := uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())
	execAll(t, pool, `INSERT INTO `+guide+`.processed_event VALUES ('`+twice.String()+`', 'g', now() - interval '2 days'),
		('`+twice.String()+`', 'g', now() - interval '1 day'), ('`+plain.String()+`', 'g', now() - interval '6 days'), ('`+ours.String()+`', 'g', now())`,
		`INSERT INTO `+cfg.Claims().Qualified+` (event_id, consumer_group, payload_sha256) VALUES ('`+ours.String()+`', 'g', '\x01')`)
	from := guide + ".processed_event"

	if n, err := schema.AdoptClaims(ctx, pool, cfg, from, 0); err != nil || n != 2 {
		t.Fatalf("adopt claims: %d, %v; want the 2 the library's table lacks", n, err)
	}
	if at, want := processedAt(t, pool, cfg.Claims().Qualified, twice), processedAt(t, pool, guide+".processed_event_all", twice); at.Before(want) {
		t.Errorf("the event claimed twice has processed_at %s, want its latest claim's", at)
	}
	var fingerprint []byte
	if err := pool.QueryRow(ctx, `SELECT payload_sha256 FROM `+cfg.Claims().Qualified+` WHERE event_id = $1`, ours).Scan(&fingerprint); err != nil || string(fingerprint) != "\x01" {
		t.Errorf("the library's own claim now has fingerprint %x (%v); want it left alone", fingerprint, err)
	}
	if n, err := schema.AdoptClaims(ctx, pool, cfg, from, 0); err != nil || n != 0 {
		t.Fatalf("adopt claims again: %d, %v; want nothing new", n, err)
	}
	later := uuid.Must(uuid.NewV7())
	guideClaim(t, pool, guide, later, "g")
	if n, err := schema.AdoptClaims(ctx, pool, cfg, from, 0); err != nil || n != 1 {
		t.Fatalf("adopt claims after one more: %d, %v; want 1", n, err)
	}
	var runs atomic.Int64
	if out := deliver(t, pool, cfg, "g", later, &runs); out != idempotency.Duplicate || runs.Load() != 0 {
		t.Fatalf("a redelivery of an adopted claim's event: %v, handler ran %d times; want a duplicate", out, runs.Load())
	}

	for _, tc := range []struct{ from, want string }{
		{"processed_event", "want the guide's table as schema.table"},
		{guide + ".nosuch", "no such table"},
		{cfg.Schema + ".processed_event", "the library's claim table itself"},
		{guide + ".bad", "event_id is text, want uuid"},
	} {
		if _, err := schema.AdoptClaims(ctx, pool, cfg, tc.from, 0); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("adopt claims from %s: %v; want %q", tc.from, err, tc.want)
		}
	}
	unmigrated := schema.Config{Schema: freshSchema(t, pool)}
	execAll(t, pool, `CREATE SCHEMA `+unmigrated.Schema)
	if _, err := schema.AdoptClaims(ctx, pool, unmigrated, from, 0); !errors.Is(err, schema.ErrMissingTable) {
		t.Errorf("adopt claims into a schema never migrated: %v; want ErrMissingTable", err)
	}
}

// nearly: got is want within a minute (the test's own run time).
func nearly(got, want time.Duration) bool { return got > want-time.Minute && got < want+time.Minute }

// A team whose guide's cleanup job kept 2 days of claims adopts its table
// (in place): the claims cover 2 days, not the library's 7. The first
// retention recorded (retention.Agree, as app migrate and once.New record
// it) starts the dedup horizon where the adopted claims reach: an event the
// guide's consumer processed 4 days ago, whose claim its cleanup deleted,
// is refused as too old instead of run again; one whose claim is there is
// a duplicate. Told how long the guide kept its claims (GuideRetention),
// the horizon starts there: an event of 2.5 days ago runs. Before, the
// horizon was the library's 7 days at once, and the event processed 4 days
// ago ran again.
func TestTheHorizonAfterAnAdoptionReachesOnlyAsFarAsTheGuidesClaims(t *testing.T) {
	const day = 24 * time.Hour
	for _, tc := range []struct {
		name         string
		guide, cover time.Duration
		newerRuns    bool // the event of 2.5 days ago, which no claim holds
	}{
		{"as far as the oldest claim", 0, day, false},
		{"the guide's retention told", 3 * day, 3 * day, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pool := testenv.Postgres(t)
			ctx := context.Background()
			cfg := schema.Config{Schema: freshSchema(t, pool)}
			s := cfg.Schema
			execAll(t, pool, `CREATE SCHEMA `+s,
				`CREATE TABLE `+s+`.processed_event (event_id uuid, consumer_group text, processed_at timestamptz DEFAULT now(),
					PRIMARY KEY (event_id, consumer_group))`)
			fourDaysAgo, oneDayAgo, newer := v7Ago(4*day), v7Ago(day), v7Ago(60*time.Hour)
			execAll(t, pool, `INSERT INTO `+s+`.processed_event VALUES ('`+fourDaysAgo.String()+`', 'g', now() - interval '4 days'),
				('`+oneDayAgo.String()+`', 'g', now() - interval '1 day')`,
				// The guide's cleanup job, 2 days (the guide fixes no length).
				`DELETE FROM `+s+`.processed_event WHERE processed_at < now() - interval '2 days'`)

			if _, err := schema.Migrate(ctx, pool, cfg); err != nil {
				t.Fatal(err)
			}
			if err := retention.Agree(ctx, retention.Config{DB: pool, Tables: cfg, Retention: 7 * day, GuideRetention: tc.guide}); err != nil {
				t.Fatal(err)
			}
			if got := covered(t, pool, cfg); !nearly(got, tc.cover) {
				t.Errorf("the claims cover %s after the adoption; want %s", got, tc.cover)
			}
			var runs atomic.Int64
			if out, err := delivery(t, pool, cfg, "g", fourDaysAgo, &runs); out != idempotency.OutsideHorizon || !errors.Is(err, idempotency.ErrTooOld) || runs.Load() != 0 {
				t.Fatalf("a redelivery of the event processed 4 days ago, its claim deleted by the guide's cleanup: %v, %v, the handler ran %d times; "+
					"want it refused as too old, not run again", out, err, runs.Load())
			}
			if out := deliver(t, pool, cfg, "g", oneDayAgo, &runs); out != idempotency.Duplicate || runs.Load() != 0 {
				t.Fatalf("a redelivery of the event processed a day ago: %v; want a duplicate", out)
			}
			out, err := delivery(t, pool, cfg, "g", newer, &runs)
			if ran := out == idempotency.Processed && err == nil && runs.Load() == 1; ran != tc.newerRuns {
				t.Fatalf("an event of 2.5 days ago that no claim holds: %v, %v; want it run: %v", out, err, tc.newerRuns)
			}
		})
	}
}

// The guide's table kept apart kept 2 days of claims: AdoptClaims narrows
// the recorded dedup horizon of the library's table (of all its groups) to
// what the copied claims cover, where it was wider, so that an event the
// guide's consumer processed 4 days ago is refused instead of run again.
// Told that the guide kept them for the library's retention, it narrows
// nothing; a guide's table without a claim changes nothing. Before, the
// horizon stayed the library's 7 days.
func TestAdoptClaimsNarrowsTheHorizonToWhatTheGuidesTableKept(t *testing.T) {
	const day = 24 * time.Hour
	pool := testenv.Postgres(t)
	ctx := context.Background()
	cfg := schema.Config{Schema: freshSchema(t, pool)}
	if _, err := schema.Migrate(ctx, pool, cfg); err != nil {
		t.Fatal(err)
	}
	if err := retention.Agree(ctx, retention.Config{DB: pool, Tables: cfg, Retention: 7 * day}); err != nil {
		t.Fatal(err)
	}
	guide := freshSchema(t, pool)
	execAll(t, pool, `CREATE SCHEMA `+guide,
		`CREATE TABLE `+guide+`.processed_event (event_id uuid NOT NULL, consumer_group text NOT NULL, processed_at timestamptz NOT NULL DEFAULT now(),
			PRIMARY KEY (event_id, consumer_group))`,
		`CREATE TABLE `+guide+`.empty (LIKE `+guide+`.processed_event INCLUDING ALL)`)
	fourDaysAgo, twoDaysAgo := v7Ago(4*day), v7Ago(2*day)
	execAll(t, pool, `INSERT INTO `+guide+`.processed_event VALUES ('`+fourDaysAgo.String()+`', 'g', now() - interval '4 days'),
		('`+twoDaysAgo.String()+`', 'g', now() - interval '2 days')`,
		`DELETE FROM `+guide+`.processed_event WHERE processed_at < now() - interval '3 days'`)

	for _, step := range []struct {
		from  string
		guide time.Duration
		cover time.Duration
	}{
		{guide + ".empty", 0, 7 * day},
		{guide + ".processed_event", 7 * day, 7 * day},
		{guide + ".processed_event", 0, 2 * day},
	} {
		if _, err := schema.AdoptClaims(ctx, pool, cfg, step.from, step.guide); err != nil {
			t.Fatal(err)
		}
		if got := covered(t, pool, cfg); !nearly(got, step.cover) {
			t.Fatalf("after adopting the claims of %s (the guide's retention %s), the claims cover %s; want %s", step.from, step.guide, got, step.cover)
		}
	}
	var runs atomic.Int64
	if out, err := delivery(t, pool, cfg, "g", fourDaysAgo, &runs); out != idempotency.OutsideHorizon || !errors.Is(err, idempotency.ErrTooOld) || runs.Load() != 0 {
		t.Fatalf("a redelivery of the event processed 4 days ago, its claim deleted by the guide's cleanup: %v, %v, the handler ran %d times; "+
			"want it refused as too old", out, err, runs.Load())
	}
	if out := deliver(t, pool, cfg, "g", twoDaysAgo, &runs); out != idempotency.Duplicate {
		t.Fatalf("a redelivery of the event processed 2 days ago: %v; want a duplicate", out)
	}
}
