package schema

import (
	"errors"
	"fmt"
	"regexp"

	"github.com/jackc/pgx/v5"
)

// Config names where the library's tables live: every package of the
// library that names a table takes one. The zero value is the defaults
// below, in schema public.
type Config struct {
	// Schema holds the tables; it is created if missing. Default
	// [DefaultSchema].
	Schema string
	// ClaimTable is the claim table's name (R-KFK-IDEM-2). Its default
	// partition is ClaimTable + "_default", and retention names its daily
	// partitions ClaimTable + "_pYYYYMMDD". Default [DefaultClaimTable].
	ClaimTable string
	// Outbox is the table of events that handlers publish in the claim's
	// transaction (package outbox). Default [DefaultOutbox].
	Outbox string
	// OutboxOffsets keeps the outbox forwarder's progress. Default:
	// Outbox + "_offsets".
	OutboxOffsets string
	// DeadLetters parks dead letters until Kafka has them (package dlq);
	// DeadLetters + "_sources" remembers what was dead-lettered. Default
	// [DefaultDeadLetters].
	DeadLetters string
}

// The names a zero [Config] stands for, and the library's tables whose names
// are fixed, in the configured schema.
const (
	DefaultSchema      = "public"
	DefaultClaimTable  = "processed_event"
	DefaultOutbox      = "once_outbox"
	DefaultDeadLetters = "once_dead_letter"
	// LeaseTable holds leases, one row each, that instances take turns on
	// (the retention pass of a claim table).
	LeaseTable = "once_lease"
	// RetentionPolicyTable records the claims' retention every process of
	// a claim table agrees on (package retention).
	RetentionPolicyTable = "once_retention_policy"
	// VersionTable records the applied migrations (goose's).
	VersionTable = "once_schema_version"
)

// identifier is what the library accepts as a schema or table name: plain
// lower-case SQL identifiers, so that a name needs no quoting anywhere (goose,
// watermill-sql and log lines use them verbatim) and leaves room for suffixes.
var identifier = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,39}$`)

// WithDefaults is c with every empty name set to its default.
func (c Config) WithDefaults() Config {
	if c.Schema == "" {
		c.Schema = DefaultSchema
	}
	if c.ClaimTable == "" {
		c.ClaimTable = DefaultClaimTable
	}
	if c.Outbox == "" {
		c.Outbox = DefaultOutbox
	}
	if c.OutboxOffsets == "" {
		c.OutboxOffsets = c.Outbox + "_offsets"
	}
	if c.DeadLetters == "" {
		c.DeadLetters = DefaultDeadLetters
	}
	return c
}

// Validate reports every name that is not a plain lower-case identifier of at
// most 40 characters.
func (c Config) Validate() error {
	c = c.WithDefaults()
	return errors.Join(CheckIdentifier("schema: Schema", c.Schema), CheckIdentifier("schema: ClaimTable", c.ClaimTable),
		CheckIdentifier("schema: Outbox", c.Outbox), CheckIdentifier("schema: OutboxOffsets", c.OutboxOffsets),
		CheckIdentifier("schema: DeadLetters", c.DeadLetters))
}

// CheckIdentifier reports whether name is usable as a schema or table name
// of the library; setting names the setting in the error.
func CheckIdentifier(setting, name string) error {
	if !identifier.MatchString(name) {
		return fmt.Errorf("%s %q: want a lower-case SQL identifier (letters, digits, underscore; at most 40 characters)", setting, name)
	}
	return nil
}

// Table is one of the library's tables: its name in the schema, and its
// quoted, schema-qualified form for SQL.
type Table struct {
	Name, Qualified string
}

// String is the table as a person reads it: schema.name.
func (t Table) String() string { return t.Name }

func (c Config) table(name string) Table {
	c = c.WithDefaults()
	return Table{Name: c.Schema + "." + name, Qualified: pgx.Identifier{c.Schema, name}.Sanitize()}
}

// Claims is the claim table; ClaimsDefault its default partition.
func (c Config) Claims() Table        { return c.table(c.WithDefaults().ClaimTable) }
func (c Config) ClaimsDefault() Table { return c.table(c.WithDefaults().ClaimTable + "_default") }

// OutboxTable and OutboxOffsetsTable are the consumer outbox and its
// forwarder's progress.
func (c Config) OutboxTable() Table        { return c.table(c.WithDefaults().Outbox) }
func (c Config) OutboxOffsetsTable() Table { return c.table(c.WithDefaults().OutboxOffsets) }

// DeadLettersTable parks dead letters; DeadLetterSourcesTable remembers the
// messages dead-lettered.
func (c Config) DeadLettersTable() Table { return c.table(c.WithDefaults().DeadLetters) }
func (c Config) DeadLetterSourcesTable() Table {
	return c.table(c.WithDefaults().DeadLetters + "_sources")
}

// Lease, RetentionPolicy and Versions are the tables of fixed names.
func (c Config) Lease() Table           { return c.table(LeaseTable) }
func (c Config) RetentionPolicy() Table { return c.table(RetentionPolicyTable) }
func (c Config) Versions() Table        { return c.table(VersionTable) }

// Tables are every table the library needs, in the order migrations make
// them.
func (c Config) Tables() []Table {
	return []Table{c.Claims(), c.ClaimsDefault(), c.OutboxTable(), c.OutboxOffsetsTable(), c.DeadLettersTable(),
		c.RetentionPolicy(), c.DeadLetterSourcesTable(), c.Lease()}
}
