package migrations

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"

	"github.com/once-dev/once/schema"
)

//go:embed *.sql
var files embed.FS

// FS holds the reference service's migrations (goose's .sql files at its
// root), for a start-up that checks none is pending (once.Needs).
var FS fs.FS = files

// Up applies the library's tables (package schema, in public) and then every
// pending migration of the reference service, then, if it applied any,
// [Grant] for every group whose role exists (a missing one is left to app
// migrate, and gets nothing meanwhile), and returns the versions of the
// migrations it applied.
func Up(ctx context.Context, pool *pgxpool.Pool) ([]int64, error) {
	if _, err := schema.Migrate(ctx, pool, schema.Config{}); err != nil {
		return nil, err
	}
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()

	// A row lock, not a session-level advisory lock: behind a transaction
	// pooler the session's lock would stay on a server connection.
	locker, err := lock.NewPostgresTableLocker(lock.WithTableLockTimeout(500*time.Millisecond, 1200))
	if err != nil {
		return nil, fmt.Errorf("migrations: locker: %w", err)
	}
	provider, err := goose.NewProvider(goose.DialectPostgres, db, files, goose.WithLocker(locker))
	if err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	// Asked first, without the lock: a service under a least-privilege
	// role starts once the owner migrated, and creates nothing.
	if pending, err := provider.HasPending(ctx); err == nil && !pending {
		return nil, nil
	}
	results, err := provider.Up(ctx)
	if err != nil {
		return nil, fmt.Errorf("migrations: up: %w", err)
	}
	applied := make([]int64, 0, len(results))
	for _, r := range results {
		applied = append(applied, r.Source.Version)
	}
	if len(applied) > 0 {
		// Group roles that do not exist are not an error here: the set-up
		// without least privilege (one role migrates and serves, maybe
		// without CREATEROLE) uses none, and a role created later gets
		// nothing until app migrate grants it (which names what is
		// missing).
		var missing *MissingRolesError
		err := Grant(ctx, pool, Groups)
		if errors.As(err, &missing) {
			err = Grant(ctx, pool, missing.Existing(Groups))
		}
		if err != nil {
			return applied, err
		}
	}
	return applied, nil
}

// Share makes the database of pool one that every group shares (app
// migrate's main database): it forgets the groups [Dedicate] recorded, so
// that [Grant] grants every group it is asked for again (a database made a
// group's own by mistake). PUBLIC's CONNECT, if Dedicate revoked it, stays
// revoked: Grant grants each group's role CONNECT. Idempotent; run as the
// tables' owner.
func Share(ctx context.Context, pool *pgxpool.Pool) error {
	if _, err := pool.Exec(ctx, `DROP TABLE IF EXISTS public.`+servedTable); err != nil {
		return fmt.Errorf("migrations: share the database among every group: %w", err)
	}
	return nil
}

// servedTable lists the groups a database of groups' own serves (written
// by [Dedicate], read by [Grant]).
const servedTable = "once_database_groups"

// Groups are the consumer groups the migrations make a role for
// (once_analytics, once_billing: 00010) and a schema each.
var Groups = []string{"analytics", "billing"}

// Dedicate makes the database of pool a database of groups' own (app
// migrate --group-database): only their roles keep privileges on the
// service's tables there, and only they may connect (besides the owner and
// superusers), so that another group's role reaches nothing of it, not even
// the library's tables, which all groups' roles get by 00010. Run as the
// database's owner after [Up], and again after every Up (a later migration
// may grant every group): it is idempotent. The other groups' schemas stay,
// empty, because later migrations of theirs change them in every database.
func Dedicate(ctx context.Context, pool *pgxpool.Pool, groups []string) error {
	var stmts []string
	for _, g := range groups {
		if !slices.Contains(Groups, g) {
			return fmt.Errorf("migrations: dedicate a database to %q: not a group of the service (%v)", g, Groups)
		}
	}
	// A role that does not own the database gets only a warning from
	// REVOKE CONNECT ... FROM PUBLIC, which leaves CONNECT open: refuse
	// it, naming the owner to run it as.
	var db, owner string
	var owns bool
	if err := pool.QueryRow(ctx, `SELECT d.datname, pg_get_userbyid(d.datdba),
		pg_has_role(current_user, d.datdba, 'USAGE') OR (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
		FROM pg_database d WHERE d.datname = current_database()`).Scan(&db, &owner, &owns); err != nil {
		return fmt.Errorf("migrations: dedicate a database: %w", err)
	}
	if !owns {
		return fmt.Errorf("migrations: dedicate database %s to %v: the current role does not own it, and CONNECT would stay open to PUBLIC: run app migrate as its owner, %s", db, groups, owner)
	}
	database := pgx.Identifier{db}.Sanitize()
	// The groups the database serves, where Grant (run by Up, as serve's
	// --migrate does, not only by app migrate) reads them: it grants no
	// other group anything here.
	served := make([]string, len(groups))
	for i, g := range groups {
		served[i] = "('" + strings.ReplaceAll(g, "'", "''") + "')"
	}
	stmts = append(stmts,
		`CREATE TABLE IF NOT EXISTS public.`+servedTable+` (group_name text PRIMARY KEY)`,
		`COMMENT ON TABLE public.`+servedTable+` IS 'The consumer groups this database is the own of (app migrate --group-database, migrations.Dedicate): migrations.Grant grants no other group anything here.'`,
		`DELETE FROM public.`+servedTable,
		`INSERT INTO public.`+servedTable+` (group_name) VALUES `+strings.Join(served, ", "),
		`REVOKE CONNECT, TEMPORARY ON DATABASE `+database+` FROM PUBLIC`)
	for _, g := range Groups {
		role := pgx.Identifier{"once_" + g}.Sanitize()
		var exists bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_roles WHERE rolname = $1)`, "once_"+g).Scan(&exists); err != nil {
			return fmt.Errorf("migrations: dedicate %s: %w", db, err)
		}
		if !exists {
			continue
		}
		if slices.Contains(groups, g) {
			stmts = append(stmts, `GRANT CONNECT ON DATABASE `+database+` TO `+role)
			continue
		}
		schema := pgx.Identifier{g}.Sanitize()
		stmts = append(stmts,
			`REVOKE CONNECT ON DATABASE `+database+` FROM `+role,
			`REVOKE ALL ON ALL TABLES IN SCHEMA `+schema+` FROM `+role,
			`REVOKE ALL ON ALL SEQUENCES IN SCHEMA `+schema+` FROM `+role,
			`REVOKE ALL ON SCHEMA `+schema+` FROM `+role,
			`ALTER DEFAULT PRIVILEGES IN SCHEMA `+schema+` REVOKE ALL ON TABLES FROM `+role,
			`ALTER DEFAULT PRIVILEGES IN SCHEMA `+schema+` REVOKE ALL ON SEQUENCES FROM `+role,
			`REVOKE ALL ON ALL TABLES IN SCHEMA public FROM `+role,
			`REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM `+role,
		)
	}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for _, s := range stmts {
			if _, err := tx.Exec(ctx, s); err != nil {
				var pg *pgconn.PgError
				if errors.As(err, &pg) && pg.Code == "42501" {
					return fmt.Errorf("migrations: dedicate database %s to %v: %s: %w (run app migrate as the database's owner, or have its owner run that statement)", db, groups, s, err)
				}
				return fmt.Errorf("migrations: dedicate database %s to %v: %s: %w", db, groups, s, err)
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	// What PostgreSQL did, not what was asked: a revoke it could not make
	// is only a warning.
	var open bool
	if err := pool.QueryRow(ctx, `SELECT has_database_privilege('public', current_database(), 'CONNECT')`).Scan(&open); err != nil {
		return fmt.Errorf("migrations: dedicate database %s: check CONNECT: %w", db, err)
	}
	if open {
		return fmt.Errorf("migrations: dedicate database %s to %v: PUBLIC may still connect: run app migrate as its owner, %s", db, groups, owner)
	}
	return nil
}
