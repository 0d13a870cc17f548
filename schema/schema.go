package schema

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"hash/crc64"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"

	watermillsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/once-dev/once/pgdb"
)

// Migrate applies every pending migration of the library to db and returns
// the versions it applied, then checks the claim table's shape.
//
// A claim table that exists where cfg names it before the first migration
// is adopted with its claims: the style guide's processed_event (plain, or
// partitioned by processed_at) or the library's own of an early release.
// A plain one keyed by (event_id, consumer_group) becomes the default
// partition in place; any other is renamed to ClaimTable + "_guide", kept,
// and its claims copied. Adopted claims have no fingerprint (they match by
// event id) and keep their processed_at, by which retention ages them out;
// the roles that could use the table may use the new one, which belongs to
// the old one's owner, so that the guide's consumer running as it keeps
// claiming there and running its start-up DDL. Adopting another role's
// table takes a superuser or a member of that role; a table it cannot
// adopt is refused with the SQL that fixes it. See also [AdoptClaims].
//
// It asks first: when nothing is pending it changes nothing and needs no
// privilege beyond reading the catalog, so that a service running under a
// least-privilege role starts after its tables' owner migrated. Instances
// migrating at once take turns on a row lock (goose's table locker), not on
// a session-level advisory lock, which a transaction pooler would strand on
// a server connection.
func Migrate(ctx context.Context, db *pgxpool.Pool, cfg Config) ([]int64, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	sqlDB := stdlib.OpenDBFromPool(db)
	defer sqlDB.Close()
	ms, err := migrations(cfg)
	if err != nil {
		return nil, err
	}
	lockID := int64(crc64.Checksum([]byte("once.schema."+cfg.Schema), crc64.MakeTable(crc64.ECMA)) >> 1)
	versions := cfg.Versions().Name
	pending, err := pendingMigrations(ctx, sqlDB, versions, ms)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42501" {
		// A role that may not read the versions may not migrate either:
		// whether the tables are there, and as this release needs them,
		// Check says.
		return nil, Check(ctx, db, cfg)
	}
	if err != nil {
		return nil, err
	}
	if !pending {
		return nil, Check(ctx, db, cfg)
	}
	// IF NOT EXISTS is not safe against a concurrent creator: instances
	// starting together take turns on a transaction's lock first.
	if err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", lockID); err != nil {
			return err
		}
		var exists bool
		if err := tx.QueryRow(ctx, "SELECT to_regnamespace($1) IS NOT NULL", cfg.Schema).Scan(&exists); err != nil || exists {
			return err
		}
		_, err := tx.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{cfg.Schema}.Sanitize())
		return err
	}); err != nil {
		return nil, fmt.Errorf("schema: create schema %s: %w", cfg.Schema, err)
	}
	locker, err := lock.NewPostgresTableLocker(lock.WithTableName(cfg.Schema+".once_migration_lock"), lock.WithTableLockID(lockID),
		lock.WithTableLockTimeout(500*time.Millisecond, 1200))
	if err != nil {
		return nil, fmt.Errorf("schema: migration locker: %w", err)
	}
	provider, err := goose.NewProvider(goose.DialectPostgres, sqlDB, nil,
		goose.WithLocker(locker),
		goose.WithTableName(versions),
		goose.WithDisableGlobalRegistry(true),
		goose.WithGoMigrations(ms...))
	if err != nil {
		return nil, fmt.Errorf("schema: %w", err)
	}
	results, err := provider.Up(ctx)
	if err != nil {
		return nil, fmt.Errorf("schema: migrate %s: %w", cfg.Schema, err)
	}
	if err := Check(ctx, db, cfg); err != nil {
		return nil, err
	}
	applied := make([]int64, 0, len(results))
	for _, r := range results {
		applied = append(applied, r.Source.Version)
	}
	return applied, nil
}

// pendingMigrations reports whether any of ms is not recorded in the
// version table; a missing table means all are.
func pendingMigrations(ctx context.Context, db *sql.DB, versions string, ms []*goose.Migration) (bool, error) {
	var exists bool
	if err := db.QueryRowContext(ctx, "SELECT to_regclass($1) IS NOT NULL", versions).Scan(&exists); err != nil {
		return false, fmt.Errorf("schema: look for %s: %w", versions, err)
	}
	if !exists {
		return true, nil
	}
	// goose records every up and down: a version's latest row says.
	rows, err := db.QueryContext(ctx, "SELECT version_id FROM (SELECT DISTINCT ON (version_id) version_id, is_applied FROM "+versions+
		" ORDER BY version_id, id DESC) latest WHERE is_applied")
	if err != nil {
		return false, fmt.Errorf("schema: read %s: %w", versions, err)
	}
	defer rows.Close()
	applied := map[int64]bool{}
	for rows.Next() {
		var v int64
		if err := rows.Scan(&v); err != nil {
			return false, err
		}
		applied[v] = true
	}
	if err := rows.Err(); err != nil {
		return false, err
	}
	for _, m := range ms {
		if !applied[m.Version] {
			return true, nil
		}
	}
	return false, nil
}

// migrations are Go migrations because their DDL carries the configured
// names; every name has passed Validate and is quoted by pgx.Identifier.
func migrations(cfg Config) ([]*goose.Migration, error) {
	messages, offsets := cfg.OutboxAdapters()
	var outboxDDL []string
	q, err := messages.SchemaInitializingQueries(watermillsql.SchemaInitializingQueriesParams{Topic: OutboxTopic})
	if err != nil {
		return nil, err
	}
	oq, err := offsets.SchemaInitializingQueries(watermillsql.OffsetsSchemaInitializingQueriesParams{Topic: OutboxTopic})
	if err != nil {
		return nil, err
	}
	for _, q := range append(q, oq...) {
		outboxDDL = append(outboxDDL, q.Query)
	}
	return []*goose.Migration{
		// 1: the claim table (R-KFK-IDEM-2), range-partitioned by event_id.
		// Partitioning by processed_at, as the style guide's DDL does, would
		// force processed_at into the key, and two deliveries at two moments
		// would both insert. A UUIDv7 starts with its millisecond timestamp,
		// so a day is a range of ids, and the key stays (event_id,
		// consumer_group). A claim table that exists already is adopted
		// (adopt.go): the reference service's own of before the library had
		// a schema, or the style guide's, whose claims must keep a
		// redelivery from running again. A plain one keyed by (event_id,
		// consumer_group) becomes the default partition without a row
		// copied; another (the guide's partitioned by processed_at) is kept
		// as ClaimTable + "_guide" and its claims are copied.
		goose.NewGoMigration(1, &goose.GoFunc{RunTx: func(ctx context.Context, tx *sql.Tx) error {
			return createClaimTable(ctx, tx, cfg)
		}}, nil),
		// 2: the consumer outbox: events a handler publishes in the claim's
		// transaction, moved to Kafka by outbox.Forwarder.
		up(2, outboxDDL...),
		// 3: dead letters, parked until Kafka has them (dlq.Store).
		up(3, `CREATE TABLE IF NOT EXISTS `+cfg.DeadLettersTable().Qualified+` (
    id              bigserial   PRIMARY KEY,
    topic           text        NOT NULL,
    key             bytea,
    payload         bytea       NOT NULL,
    -- JSON as bytes: a header may hold a NUL, which jsonb refuses.
    headers         bytea       NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    attempts        int         NOT NULL DEFAULT 0,
    last_error      text,
    next_attempt_at timestamptz NOT NULL DEFAULT now()
)`),
		// 4: the retention every process of a claim table agrees on
		// (retention.Agree): a maintenance with a shorter one than the
		// consumers' horizon would delete claims they still rely on.
		up(4, `CREATE TABLE IF NOT EXISTS `+cfg.RetentionPolicy().Qualified+` (
    claim_table       text        PRIMARY KEY,
    retention_seconds bigint      NOT NULL,
    set_at            timestamptz NOT NULL DEFAULT now()
)`),
		// 5: the messages dead-lettered, so that an offset reset does not
		// dead-letter them again (dlq.Store.ParkFrom).
		up(5, `CREATE TABLE IF NOT EXISTS `+cfg.DeadLetterSourcesTable().Qualified+` (
    consumer_group   text        NOT NULL,
    topic            text        NOT NULL,
    kafka_partition  int         NOT NULL,
    kafka_offset     bigint      NOT NULL,
    -- The same place with other bytes is another message (the topic was
    -- made again): it is dead-lettered too.
    payload_sha256   bytea       NOT NULL,
    dead_lettered_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, topic, kafka_partition, kafka_offset)
)`),
		// 6: leases instances take turns on (package retention): a row,
		// where a session-level advisory lock would not survive a
		// transaction pooler.
		up(6, `CREATE TABLE IF NOT EXISTS `+cfg.Lease().Qualified+` (
    name   text        PRIMARY KEY,
    holder uuid        NOT NULL,
    until  timestamptz NOT NULL
)`),
		// 7: a claim's fingerprint of its event's values in canonical form,
		// beside payload_sha256 of its bytes: a re-published event in another
		// byte form is a duplicate (idempotency.Config.Fingerprint). NULL in
		// claims made before it.
		up(7, `ALTER TABLE `+cfg.Claims().Qualified+` ADD COLUMN IF NOT EXISTS values_sha256 bytea`),
		// 8: how far back the claims reached when the retention was last
		// set: a retention made longer covers only what the shorter one
		// kept, growing from there (see CoveredRetention). NULL: all of
		// the retention.
		up(8, `ALTER TABLE `+cfg.RetentionPolicy().Qualified+` ADD COLUMN IF NOT EXISTS covered_seconds bigint`),
		// 9: a claim without a fingerprint: adopted from the style guide's
		// table by migration 1 or AdoptClaims, or made by the guide's own
		// consumer, which keeps claiming in the adopted table for the groups
		// not moved yet and writes neither hash. It matches by its id, and
		// ages out by its processed_at (package retention).
		up(9, `ALTER TABLE `+cfg.Claims().Qualified+` ALTER COLUMN payload_sha256 DROP NOT NULL`),
	}, nil
}

// CoveredRetention is an SQL expression, over a row of the retention
// policy table (named row; "" for unqualified columns), of how far back,
// in seconds, the claims reach now: the recorded retention, unless it was
// made longer, whose claims between the old and the new retention were
// deleted under the old one, or claims were adopted from the style
// guide's table, which reach as far as it kept them (see
// [AdoptedCoverage]); the claims then reach as far as they did when it was
// set, plus the time since, up to the retention. A dedup horizon is no
// wider than it.
func CoveredRetention(row string) string {
	if row != "" {
		row += "."
	}
	return fmt.Sprintf(`LEAST(%[1]sretention_seconds, COALESCE(%[1]scovered_seconds + floor(extract(epoch FROM now() - %[1]sset_at))::bigint, %[1]sretention_seconds))`, row)
}

// AdoptedCoverage is an SQL aggregate expression, over rows of a claim
// table of the style guide's shape (their processed_at), of how far back,
// in seconds, those claims reach: the guide's retention (guideRetention, an
// SQL expression of seconds), or the time since the oldest was processed if
// that is longer; NULL over no row. The guide's cleanup job deletes by
// processed_at, so every claim it deleted was processed before the oldest
// one left, and an event whose id is later than that, processed after its
// id's time, still has its claim. Further back nothing says which events
// were processed and their claims deleted: the dedup horizon must not
// reach there (covered_seconds of the retention policy).
func AdoptedCoverage(guideRetention string) string {
	return `CASE WHEN min(processed_at) IS NOT NULL THEN GREATEST((` + guideRetention + `)::bigint, 0,
  floor(extract(epoch FROM now() - min(processed_at)))::bigint) END`
}

// OutboxTopic is the watermill-sql topic of every outbox: its tables are
// named by Config, and the forwarder's envelope carries each message's real
// topic.
const OutboxTopic = "outbox"

// OutboxAdapters are watermill-sql's PostgreSQL schema and offsets adapters
// of the consumer outbox's two tables, with one advisory lock of their own
// for creating them.
func (c Config) OutboxAdapters() (watermillsql.DefaultPostgreSQLSchema, watermillsql.DefaultPostgreSQLOffsetsAdapter) {
	messages, offsets := c.OutboxTable(), c.OutboxOffsetsTable()
	return watermillsql.DefaultPostgreSQLSchema{
			GenerateMessagesTableName: func(string) string { return messages.Qualified },
			InitializeSchemaLock:      int(watermillsql.DefaultSchemaInitializationLock(messages.Name)),
		}, watermillsql.DefaultPostgreSQLOffsetsAdapter{
			GenerateMessagesOffsetsTableName: func(string) string { return offsets.Qualified },
		}
}

func up(version int64, statements ...string) *goose.Migration {
	return goose.NewGoMigration(version, &goose.GoFunc{RunTx: func(ctx context.Context, tx *sql.Tx) error {
		for _, s := range statements {
			if _, err := tx.ExecContext(ctx, s); err != nil {
				return fmt.Errorf("%.60s...: %w", s, err)
			}
		}
		return nil
	}}, nil)
}

// createClaimTable creates the claim table, or adopts the one that exists
// (see adopt.go): the library's own plain table of a first release, or the
// style guide's, plain or partitioned by processed_at.
func createClaimTable(ctx context.Context, tx *sql.Tx, cfg Config) error {
	claims := cfg.Claims().Qualified
	defaultName := cfg.ClaimTable + "_default"
	defaultPart := cfg.ClaimsDefault().Qualified
	exec := func(st string) error {
		if _, err := tx.ExecContext(ctx, st); err != nil {
			return fmt.Errorf("%.80s...: %w", st, err)
		}
		return nil
	}
	shape, exists, err := readShape(ctx, sqlRows(tx), claims)
	if err != nil {
		return err
	}
	var after []string
	inPlace := false
	if exists {
		if after, inPlace, err = adoptExisting(ctx, sqlRows(tx), exec, cfg, shape); err != nil {
			return err
		}
	}
	var stmts []string
	if inPlace {
		// A plain claim table (the reference service's first migration,
		// or the style guide's): it becomes the default partition of a
		// new partitioned table.
		stmts = append(stmts,
			`ALTER TABLE `+claims+` RENAME TO `+pgx.Identifier{defaultName}.Sanitize(),
			`ALTER INDEX IF EXISTS `+pgx.Identifier{cfg.Schema, cfg.ClaimTable + "_pkey"}.Sanitize()+` RENAME TO `+pgx.Identifier{defaultName + "_pkey"}.Sanitize(),
			`ALTER INDEX IF EXISTS `+pgx.Identifier{cfg.Schema, cfg.ClaimTable + "_processed_at_idx"}.Sanitize()+` RENAME TO `+pgx.Identifier{defaultName + "_processed_at_idx"}.Sanitize(),
		)
	}
	stmts = append(stmts,
		`CREATE TABLE IF NOT EXISTS `+claims+` (
    event_id       uuid        NOT NULL,
    consumer_group text        NOT NULL,
    -- SHA-256 of the payload's bytes first claimed (migration 7 adds
    -- values_sha256, of its values): the same id with other values is a
    -- producer bug, not a duplicate. NULL in a claim made without one (the
    -- style guide's consumer, or adopted from its table): it matches by id.
    payload_sha256 bytea,
    processed_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (event_id, consumer_group)
) PARTITION BY RANGE (event_id)`,
		`CREATE INDEX IF NOT EXISTS `+pgx.Identifier{cfg.ClaimTable + "_processed_at_idx"}.Sanitize()+` ON `+claims+` (processed_at)`,
	)
	if inPlace {
		stmts = append(stmts, `ALTER TABLE `+claims+` ATTACH PARTITION `+defaultPart+` DEFAULT`)
	} else {
		stmts = append(stmts, `CREATE TABLE IF NOT EXISTS `+defaultPart+` PARTITION OF `+claims+` DEFAULT`)
	}
	for _, st := range append(stmts, after...) {
		if err := exec(st); err != nil {
			return err
		}
	}
	return nil
}

// rowReader runs a query of one row: a *sql.Tx in a migration, a pgx
// transaction afterwards.
type rowReader func(ctx context.Context, query string, args ...any) interface{ Scan(...any) error }

func sqlRows(tx *sql.Tx) rowReader {
	return func(ctx context.Context, q string, args ...any) interface{ Scan(...any) error } {
		return tx.QueryRowContext(ctx, q, args...)
	}
}

func pgxRows(tx pgx.Tx) rowReader {
	return func(ctx context.Context, q string, args ...any) interface{ Scan(...any) error } {
		return tx.QueryRow(ctx, q, args...)
	}
}

// noRows is either driver's "no row".
func noRows(err error) bool { return errors.Is(err, sql.ErrNoRows) || errors.Is(err, pgx.ErrNoRows) }

// claimColumns are the claim table's columns as migration 1 made them;
// migration 7 adds values_sha256.
var claimColumns = map[string]string{"event_id": "uuid", "consumer_group": "text", "payload_sha256": "bytea", "processed_at": "timestamp with time zone"}

func checkColumns(ctx context.Context, row rowReader, claims Table, want map[string]string) error {
	var missing []string
	for col, typ := range want {
		var got string
		err := row(ctx, `SELECT format_type(a.atttypid, a.atttypmod) FROM pg_attribute a
			WHERE a.attrelid = to_regclass($1) AND a.attname = $2 AND NOT a.attisdropped`, claims.Qualified, col).Scan(&got)
		if err != nil || got != typ {
			missing = append(missing, col+" "+typ)
		}
	}
	slices.Sort(missing)
	var key string
	err := row(ctx, `SELECT string_agg(a.attname, ',' ORDER BY k.n) FROM pg_index i
		CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, n)
		JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
		WHERE i.indrelid = to_regclass($1) AND i.indisprimary`, claims.Qualified).Scan(&key)
	if err != nil && !noRows(err) {
		return err
	}
	var problems []string
	if len(missing) > 0 {
		problems = append(problems, fmt.Sprintf("columns missing or of another type: %v", missing))
	}
	if key != "event_id,consumer_group" {
		problems = append(problems, fmt.Sprintf("primary key (%s), want exactly (event_id, consumer_group): "+
			"a key with processed_at in it, as the style guide's partitioned DDL has, lets two deliveries of one event both claim it", key))
	}
	if len(problems) > 0 {
		return fmt.Errorf("schema: %s exists with another shape: %v; migrate the database (schema.Migrate, app migrate): "+
			"its first migration adopts a claim table that exists, the style guide's too, and says what it cannot adopt", claims, problems)
	}
	return nil
}

// ErrMissingTable means a table of the library is not in the database: it
// was never migrated there, or the names (Config) do not match its.
var ErrMissingTable = errors.New("schema: a table of the library is missing")

// Check verifies, without changing anything, that every table of the
// library exists under cfg's names, and that the claim table has the shape
// dedup depends on: the library's columns, the primary key (event_id,
// consumer_group), and range partitioning by event_id with a default
// partition. An error names the table.
func Check(ctx context.Context, db pgdb.DB, cfg Config) error {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return err
	}
	return pgdb.InTx(ctx, db, func(tx pgx.Tx) error {
		var missing []string
		for _, t := range cfg.Tables() {
			var exists bool
			if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, t.Qualified).Scan(&exists); err != nil {
				return fmt.Errorf("schema: look for %s: %w", t, err)
			}
			if !exists {
				missing = append(missing, t.Name)
			}
		}
		if len(missing) > 0 {
			return fmt.Errorf("%w: %s (migrate the database first: schema.Migrate, once.Config.Migrate, or app migrate; or name the tables where they are)",
				ErrMissingTable, strings.Join(missing, ", "))
		}
		claims := cfg.Claims()
		want := maps.Clone(claimColumns)
		want["values_sha256"] = "bytea"
		if err := checkColumns(ctx, pgxRows(tx), claims, want); err != nil {
			return err
		}
		var strategy, column string
		var hasDefault bool
		err := tx.QueryRow(ctx, `SELECT p.partstrat::text, a.attname, p.partdefid <> 0
		FROM pg_partitioned_table p JOIN pg_attribute a ON a.attrelid = p.partrelid AND a.attnum = p.partattrs[0]
		WHERE p.partrelid = to_regclass($1) AND p.partnatts = 1`, claims.Qualified).Scan(&strategy, &column, &hasDefault)
		if noRows(err) || (err == nil && (strategy != "r" || column != "event_id")) {
			return fmt.Errorf("schema: %s is not range-partitioned by event_id alone (got %q on %q): retention depends on it; "+
				"migrate the database (schema.Migrate, app migrate), whose first migration adopts a claim table that exists, the style guide's too",
				claims, strategy, column)
		}
		if err != nil {
			return fmt.Errorf("schema: check %s: %w", claims, err)
		}
		if !hasDefault {
			return fmt.Errorf("schema: %s has no default partition: claims outside its daily partitions would fail (CREATE TABLE %s PARTITION OF %s DEFAULT)",
				claims, cfg.ClaimsDefault().Qualified, claims.Qualified)
		}
		// Every migration applied, where this role may read the versions;
		// where it may not, the newest migration's column below says.
		if ms, err := migrations(cfg); err == nil {
			var applied []int64
			// In a savepoint: a refusal must not abort the checks after it.
			sp, err := tx.Begin(ctx)
			if err != nil {
				return err
			}
			err = sp.QueryRow(ctx, `SELECT coalesce(array_agg(version_id), '{}') FROM (SELECT DISTINCT ON (version_id) version_id, is_applied FROM `+cfg.Versions().Qualified+
				` WHERE version_id > 0 ORDER BY version_id, id DESC) latest WHERE is_applied`).Scan(&applied)
			_ = sp.Rollback(ctx)
			var pending []string
			for _, m := range ms {
				if !slices.Contains(applied, m.Version) {
					pending = append(pending, strconv.FormatInt(m.Version, 10))
				}
			}
			var pgErr *pgconn.PgError
			switch {
			case errors.As(err, &pgErr) && (pgErr.Code == "42501" || pgErr.Code == "42P01"):
				// Not ours to read, or a schema made without goose: the
				// shape checks decide.
			case err != nil:
				return fmt.Errorf("schema: read %s: %w", cfg.Versions(), err)
			case len(pending) > 0:
				versions := "versions"
				if len(pending) == 1 {
					versions = "version"
				}
				return fmt.Errorf("schema: %d of this release's %d library migrations pending in %s (%s %s): migrate the database as the tables' owner first (schema.Migrate, app migrate)",
					len(pending), len(ms), cfg.Schema, versions, strings.Join(pending, ", "))
			}
		}
		// The newest migration's column: the claim statement reads it, and
		// a database that lacks it would fail every claim.
		policy := cfg.RetentionPolicy()
		var covered string
		if err := tx.QueryRow(ctx, `SELECT format_type(a.atttypid, a.atttypmod) FROM pg_attribute a
			WHERE a.attrelid = to_regclass($1) AND a.attname = 'covered_seconds' AND NOT a.attisdropped`, policy.Qualified).Scan(&covered); err != nil || covered != "bigint" {
			return fmt.Errorf("schema: %s has no covered_seconds bigint: the database is not migrated to this release's version (migrate it: schema.Migrate, app migrate)", policy)
		}
		return nil
	})
}
