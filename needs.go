package once

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"path"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/pressly/goose/v3"

	"github.com/once-dev/once/pgdb"
)

// DefaultMigrationsTable is goose's version table, where [Needs.Migrations]
// are recorded.
const DefaultMigrationsTable = "goose_db_version"

// Needs is what a service's own handlers need of its databases, checked at
// start-up beside what the library needs (its tables, and on them the
// privileges every group's role needs): a role that lacks a grant, or a
// migration not applied, would otherwise pass start-up and readiness and
// then hold every message it gets.
type Needs struct {
	// Migrations are the service's own goose migrations (the .sql files at
	// the root of the file system, as goose reads them): start-up stops,
	// naming them, where one is not recorded as applied in
	// MigrationsTable. Reading that table takes SELECT on it, no more.
	// Default: none.
	Migrations fs.FS
	// MigrationsTable is goose's version table of Migrations, in every
	// database. Default: [DefaultMigrationsTable].
	MigrationsTable string
	// MigrateCommand is how an operator applies Migrations, for the errors
	// that say they are pending. Default: "goose up".
	MigrateCommand string
	// Groups are, by consumer group (its full name), the privileges its
	// handlers need on the service's own tables in the group's database:
	// start-up stops, naming each, where a table is missing or the
	// database URL's role lacks USAGE on its schema or a privilege on it.
	// Default: none.
	Groups map[string][]Grant
}

// Grant is privileges a group's handlers need on one table. With INSERT,
// USAGE on the sequences its columns' defaults take (a serial column's) is
// checked too.
type Grant struct {
	// Table, schema-qualified: billing.payments. Required.
	Table string
	// Privileges: any of SELECT, INSERT, UPDATE, DELETE (an INSERT ... ON
	// CONFLICT DO UPDATE takes UPDATE too). Required.
	Privileges []string
}

func (n Needs) validate() []error {
	var errs []error
	for group, grants := range n.Groups {
		for _, g := range grants {
			if schemaName, table, ok := strings.Cut(g.Table, "."); !ok || schemaName == "" || table == "" || strings.Contains(table, ".") {
				errs = append(errs, fmt.Errorf("once: Needs.Groups[%s]: table %q: want it schema-qualified, such as billing.payments", group, g.Table))
			}
			if len(g.Privileges) == 0 {
				errs = append(errs, fmt.Errorf("once: Needs.Groups[%s]: table %s: no privileges", group, g.Table))
			}
			for _, p := range g.Privileges {
				if !slices.Contains([]string{"SELECT", "INSERT", "UPDATE", "DELETE"}, p) {
					errs = append(errs, fmt.Errorf("once: Needs.Groups[%s]: table %s: privilege %q: want SELECT, INSERT, UPDATE or DELETE", group, g.Table, p))
				}
			}
		}
	}
	if n.Migrations != nil {
		if _, err := n.migrationFiles(); err != nil {
			errs = append(errs, fmt.Errorf("once: Needs.Migrations: %w", err))
		}
	}
	return errs
}

// migrationFiles are Migrations' files by version.
func (n Needs) migrationFiles() (map[int64]string, error) {
	names, err := fs.Glob(n.Migrations, "*.sql")
	if err != nil {
		return nil, err
	}
	out := map[int64]string{}
	for _, name := range names {
		v, err := goose.NumericComponent(path.Base(name))
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		if other, dup := out[v]; dup {
			return nil, fmt.Errorf("%s and %s have one version, %d", other, name, v)
		}
		out[v] = name
	}
	return out, nil
}

// libraryGrants are the privileges every group's role needs on the
// library's tables: claims are inserted and read, never changed; dead
// letters, their sources and the consumer outbox are written, drained and
// pruned by the group's process; the recorded retention is read.
func (c Config) libraryGrants() []Grant {
	dml := []string{"SELECT", "INSERT", "UPDATE", "DELETE"}
	t := c.Tables
	return []Grant{
		{Table: t.Claims().Qualified, Privileges: []string{"SELECT", "INSERT"}},
		{Table: t.RetentionPolicy().Qualified, Privileges: []string{"SELECT"}},
		{Table: t.DeadLettersTable().Qualified, Privileges: dml},
		{Table: t.DeadLetterSourcesTable().Qualified, Privileges: dml},
		{Table: t.OutboxTable().Qualified, Privileges: dml},
		{Table: t.OutboxOffsetsTable().Qualified, Privileges: dml},
	}
}

// checkNeeds checks db for its groups (those whose database it is): the
// service's migrations applied, every table they need there, and the
// privileges the database URL's role needs on them. The error names each
// thing missing.
func (s *Service) checkNeeds(ctx context.Context, db database, groups []string) error {
	var errs []error
	if s.cfg.Needs.Migrations != nil {
		if err := s.pendingMigrations(ctx, db); err != nil {
			errs = append(errs, err)
		}
	}
	for _, group := range groups {
		grants := append(s.cfg.libraryGrants(), s.cfg.Needs.Groups[group]...)
		errs = append(errs, checkGrants(ctx, db.pool, group, grants)...)
	}
	if len(errs) == 0 {
		return nil
	}
	return settingError(db.setting, errors.Join(errs...))
}

// pendingMigrations names the service's migrations not applied in db.
func (s *Service) pendingMigrations(ctx context.Context, db database) error {
	n := s.cfg.Needs
	files, err := n.migrationFiles()
	if err != nil {
		return err
	}
	table := n.MigrationsTable
	if table == "" {
		table = DefaultMigrationsTable
	}
	command := n.MigrateCommand
	if command == "" {
		command = "goose up"
	}
	applied := map[int64]bool{}
	err = pgdb.InTx(ctx, db.pool, func(tx pgx.Tx) error {
		var exists bool
		if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, table).Scan(&exists); err != nil || !exists {
			return err
		}
		// goose records every up and down: a version's latest row says.
		// Only read: a role that may run the service need not migrate it.
		rows, err := tx.Query(ctx, `SELECT version_id FROM (SELECT DISTINCT ON (version_id) version_id, is_applied FROM `+
			pgx.Identifier(strings.Split(table, ".")).Sanitize()+` ORDER BY version_id, id DESC) latest WHERE is_applied`)
		if err != nil {
			return err
		}
		var v int64
		_, err = pgx.ForEachRow(rows, []any{&v}, func() error { applied[v] = true; return nil })
		return err
	})
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42501" {
		role := currentUser(ctx, db.pool)
		return fmt.Errorf("role %s may not read %s, so pending migrations cannot be told apart: grant it SELECT on %s (no more), or run %s as the tables' owner",
			role, table, table, command)
	}
	if err != nil {
		return fmt.Errorf("read %s: %w", table, err)
	}
	var pending []string
	for _, v := range slices.Sorted(maps.Keys(files)) {
		if !applied[v] {
			pending = append(pending, files[v])
		}
	}
	switch len(pending) {
	case 0:
		return nil
	case 1:
		return fmt.Errorf("1 migration pending (%s): run %s as the tables' owner", pending[0], command)
	default:
		return fmt.Errorf("%d migrations pending (%s): run %s as the tables' owner", len(pending), strings.Join(pending, ", "), command)
	}
}

func currentUser(ctx context.Context, db pgdb.DB) string {
	var role string
	if err := db.QueryRow(ctx, `SELECT current_user`).Scan(&role); err != nil {
		return "(unknown)"
	}
	return role
}

// The checks of one group's grants, all in one round trip per table. A
// privilege is asked of the role as it is (has_*_privilege of
// current_user): one inherited from a group role counts.
const (
	// By the schema's oid: a schema that does not exist is no error here
	// (the privilege functions are strict, NULL in, NULL out).
	checkSchemaSQL = `SELECT n.oid IS NOT NULL, coalesce(has_schema_privilege(n.oid, 'USAGE'), false),
  (SELECT coalesce(string_agg(quote_ident(r.rolname), ', ' ORDER BY r.rolname), '') FROM pg_roles r
   WHERE NOT r.rolcanlogin AND NOT r.rolsuper AND r.rolname !~ '^pg_' AND has_schema_privilege(r.oid, n.oid, 'USAGE'))
FROM (SELECT $1::text AS name) w LEFT JOIN pg_namespace n ON n.nspname = w.name`
	checkTableSQL = `SELECT coalesce(array_agg(p ORDER BY ord), '{}') FROM unnest($2::text[]) WITH ORDINALITY AS w(p, ord)
WHERE NOT has_table_privilege($1::regclass, p)`
	holdersSQL = `SELECT coalesce(string_agg(quote_ident(rolname), ', ' ORDER BY rolname), '') FROM pg_roles r
WHERE NOT rolcanlogin AND NOT rolsuper AND rolname !~ '^pg_'
  AND (SELECT bool_and(has_table_privilege(r.oid, $1::regclass, p)) FROM unnest($2::text[]) AS w(p))`
	// The sequences an INSERT into the table calls nextval on: those its
	// columns' defaults depend on (a serial or bigserial column's, such as
	// the dead letters' id and the outbox's offset), which the role may not
	// use; and group roles that may use them all. An identity column's
	// sequence is not among them: PostgreSQL takes its next value without
	// asking the inserting role.
	// (Materialized: has_sequence_privilege fails on what is not a
	// sequence, and the planner may ask it before the join would drop it.)
	checkSequencesSQL = `WITH seqs AS MATERIALIZED (
  SELECT DISTINCT s.oid AS seq FROM pg_attrdef ad
  JOIN pg_depend d ON d.classid = 'pg_attrdef'::regclass AND d.objid = ad.oid AND d.refclassid = 'pg_class'::regclass
  JOIN pg_class s ON s.oid = d.refobjid AND s.relkind = 'S'
  WHERE ad.adrelid = $1::regclass),
missing AS MATERIALIZED (SELECT seq FROM seqs WHERE NOT has_sequence_privilege(seq, 'USAGE'))
SELECT coalesce((SELECT array_agg(seq::regclass::text ORDER BY seq::regclass::text) FROM missing), '{}'),
  (SELECT coalesce(string_agg(quote_ident(r.rolname), ', ' ORDER BY r.rolname), '') FROM pg_roles r
   WHERE NOT r.rolcanlogin AND NOT r.rolsuper AND r.rolname !~ '^pg_'
     AND NOT EXISTS (SELECT FROM missing WHERE NOT has_sequence_privilege(r.oid, missing.seq, 'USAGE')))`
)

// checkGrants checks that every table of grants exists in db and that the
// role db connects as has USAGE on its schema and the privileges on it.
func checkGrants(ctx context.Context, db pgdb.DB, group string, grants []Grant) []error {
	role := currentUser(ctx, db)
	var errs []error
	fail := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("group %s: "+format, append([]any{group}, args...)...))
	}
	// A role to grant: group roles (those that cannot log in) that hold
	// what is missing, such as the migrations' once_billing.
	hint := func(holders, sql string) string {
		if holders != "" {
			return "grant " + holders + " to it"
		}
		return sql
	}
	schemas := map[string]bool{} // usable
	for _, g := range grants {
		schemaName, _, _ := strings.Cut(g.Table, ".")
		schemaName = strings.Trim(schemaName, `"`)
		usable, seen := schemas[schemaName]
		if !seen {
			var exists bool
			var holders string
			if err := db.QueryRow(ctx, checkSchemaSQL, schemaName).Scan(&exists, &usable, &holders); err != nil {
				fail("check schema %s: %v", schemaName, err)
				return errs
			}
			switch {
			case !exists:
				fail("schema %s is missing: migrate the database as the tables' owner first", schemaName)
			case !usable:
				fail("role %s lacks USAGE on schema %s (%s)", role, schemaName, hint(holders, "GRANT USAGE ON SCHEMA "+schemaName+" TO "+role))
			}
			schemas[schemaName] = exists && usable
			usable = exists && usable
		}
		if !usable {
			continue // the schema's line says it: every table in it would repeat it
		}
		var exists bool
		if err := db.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, g.Table).Scan(&exists); err != nil {
			fail("look for %s: %v", g.Table, err)
			continue
		}
		if !exists {
			fail("table %s is missing: migrate the database as the tables' owner first", g.Table)
			continue
		}
		if slices.Contains(g.Privileges, "INSERT") {
			// Table grants alone pass this check, then every insert fails
			// "permission denied for sequence": a dead letter cannot be
			// parked (its partition held), no outbox event written.
			var seqs []string
			var holders string
			if err := db.QueryRow(ctx, checkSequencesSQL, g.Table).Scan(&seqs, &holders); err != nil {
				fail("check the sequences of %s: %v", g.Table, err)
			} else if len(seqs) > 0 {
				fail("role %s lacks USAGE on sequence %s, which an insert into table %s takes its next value from (%s)", role, strings.Join(seqs, ", "), g.Table,
					hint(holders, "GRANT USAGE ON SEQUENCE "+strings.Join(seqs, ", ")+" TO "+role))
			}
		}
		var missing []string
		if err := db.QueryRow(ctx, checkTableSQL, g.Table, g.Privileges).Scan(&missing); err != nil {
			fail("check privileges on %s: %v", g.Table, err)
			continue
		}
		if len(missing) == 0 {
			continue
		}
		var holders string
		if err := db.QueryRow(ctx, holdersSQL, g.Table, missing).Scan(&holders); err != nil {
			holders = ""
		}
		privs := strings.Join(missing, ", ")
		fail("role %s lacks %s on table %s (%s)", role, privs, g.Table, hint(holders, "GRANT "+privs+" ON "+g.Table+" TO "+role))
	}
	return errs
}

// checkAllNeeds checks every database for the groups whose database it is.
func (s *Service) checkAllNeeds(ctx context.Context) error {
	byDB := map[string][]string{}
	for _, group := range s.cfg.pipelineConfig(nil, nil).GroupNames() {
		pool := s.DB(group)
		for _, db := range s.dbs {
			if db.pool == pool {
				byDB[db.name] = append(byDB[db.name], group)
				break
			}
		}
	}
	var errs []error
	for _, db := range s.dbs {
		if err := s.checkNeeds(ctx, db, byDB[db.name]); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
