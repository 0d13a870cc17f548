// Package schema creates and upgrades the tables the once library needs in a
// PostgreSQL database, and nothing else: the claim table (processed_event,
// range-partitioned by event id, with its default partition) and the
// consumer outbox (once_outbox, package outbox). A team applies
// it to each database a consumer group claims in, into a schema it names;
// its own business tables stay in its own migrations.
//
// [Migrate] is idempotent and safe to call from every instance at start-up:
// concurrent runs take turns on goose's row lock (once_migration_lock; a
// transaction-scoped advisory lock guards the schema's creation), never on a
// session-level lock a pooler would strand, and the applied versions are
// recorded in a table of the schema (once_schema_version).
package schema
