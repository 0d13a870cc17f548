package schema

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"hash/crc64"
	"regexp"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
)

// Config names where the library's tables live. The zero value is
// public.processed_event.
type Config struct {
	// Schema holds the tables; it is created if missing. Default "public".
	Schema string
	// ClaimTable is the claim table's name (R-KFK-IDEM-2). Its default
	// partition is ClaimTable + "_default", and retention names its daily
	// partitions ClaimTable + "_pYYYYMMDD". Default "processed_event".
	ClaimTable string
}

// DefaultSchema and DefaultClaimTable are the names [Config] uses when its
// fields are empty.
const (
	DefaultSchema     = "public"
	DefaultClaimTable = "processed_event"
)

// identifier is what the library accepts as a schema or table name: plain
// lower-case SQL identifiers, so that a name needs no quoting anywhere (goose,
// watermill-sql and log lines use them verbatim) and leaves room for suffixes.
var identifier = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,39}$`)

func (c *Config) setDefaults() {
	if c.Schema == "" {
		c.Schema = DefaultSchema
	}
	if c.ClaimTable == "" {
		c.ClaimTable = DefaultClaimTable
	}
}

// Validate reports every name that is not a plain lower-case identifier of at
// most 40 characters.
func (c Config) Validate() error {
	c.setDefaults()
	return errors.Join(CheckIdentifier("schema: Schema", c.Schema), CheckIdentifier("schema: ClaimTable", c.ClaimTable))
}

// CheckIdentifier reports whether name is usable as a schema or table name
// of the library; setting names the setting in the error.
func CheckIdentifier(setting, name string) error {
	if !identifier.MatchString(name) {
		return fmt.Errorf("%s %q: want a lower-case SQL identifier (letters, digits, underscore; at most 40 characters)", setting, name)
	}
	return nil
}

// Qualified returns the claim table as a quoted, schema-qualified name.
func (c Config) Qualified() string {
	c.setDefaults()
	return pgx.Identifier{c.Schema, c.ClaimTable}.Sanitize()
}

// Migrate applies every pending migration of the library to db and returns
// the versions it applied.
func Migrate(ctx context.Context, db *pgxpool.Pool, cfg Config) ([]int64, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if _, err := db.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{cfg.Schema}.Sanitize()); err != nil {
		return nil, fmt.Errorf("schema: create schema %s: %w", cfg.Schema, err)
	}
	sqlDB := stdlib.OpenDBFromPool(db)
	defer sqlDB.Close()

	// A lock of its own, per schema: the reference service's migrations use
	// goose's default lock, and two schemas may migrate at once.
	locker, err := lock.NewPostgresSessionLocker(lock.WithLockID(int64(crc64.Checksum([]byte("once.schema."+cfg.Schema), crc64.MakeTable(crc64.ECMA)) >> 1)))
	if err != nil {
		return nil, fmt.Errorf("schema: session locker: %w", err)
	}
	provider, err := goose.NewProvider(goose.DialectPostgres, sqlDB, nil,
		goose.WithSessionLocker(locker),
		goose.WithTableName(cfg.Schema+".once_schema_version"),
		goose.WithDisableGlobalRegistry(true),
		goose.WithGoMigrations(migrations(cfg)...))
	if err != nil {
		return nil, fmt.Errorf("schema: %w", err)
	}
	results, err := provider.Up(ctx)
	if err != nil {
		return nil, fmt.Errorf("schema: migrate %s: %w", cfg.Schema, err)
	}
	applied := make([]int64, 0, len(results))
	for _, r := range results {
		applied = append(applied, r.Source.Version)
	}
	return applied, nil
}

// migrations are Go migrations because their DDL carries the configured
// names; every name has passed Validate and is quoted by pgx.Identifier.
func migrations(cfg Config) []*goose.Migration {
	claims := pgx.Identifier{cfg.Schema, cfg.ClaimTable}.Sanitize()
	defaultPart := pgx.Identifier{cfg.Schema, cfg.ClaimTable + "_default"}.Sanitize()
	processedAtIdx := pgx.Identifier{cfg.ClaimTable + "_processed_at_idx"}.Sanitize()
	return []*goose.Migration{
		// 1: the claim table (R-KFK-IDEM-2), range-partitioned by event_id.
		// Partitioning by processed_at, as the style guide's DDL does, would
		// force processed_at into the key, and two deliveries at two moments
		// would both insert. A UUIDv7 starts with its millisecond timestamp,
		// so a day is a range of ids, and the key stays (event_id,
		// consumer_group). IF NOT EXISTS: databases of the reference service
		// created the same table before the library had a schema of its own.
		up(1,
			`CREATE TABLE IF NOT EXISTS `+claims+` (
    event_id       uuid        NOT NULL,
    consumer_group text        NOT NULL,
    payload_sha256 bytea       NOT NULL,
    processed_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (event_id, consumer_group)
) PARTITION BY RANGE (event_id)`,
			`CREATE TABLE IF NOT EXISTS `+defaultPart+` PARTITION OF `+claims+` DEFAULT`,
			`CREATE INDEX IF NOT EXISTS `+processedAtIdx+` ON `+claims+` (processed_at)`,
		),
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
