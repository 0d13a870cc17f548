package migrations

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// groupGrantsSQL is what the migrations give a group's role (%[1]s, its
// name as a literal; %[2]s, as an identifier; %[3]s, its group's schema): the
// grants of 00010, 00011, 00012 and 00013, and the row-level security policies of
// 00013 and 00014 (00014 enables row security and restricts every role not
// a group's). Every statement may run again.
const groupGrantsSQL = `
GRANT USAGE ON SCHEMA %[3]s TO %[2]s;
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA %[3]s TO %[2]s;
GRANT USAGE ON ALL SEQUENCES IN SCHEMA %[3]s TO %[2]s;
ALTER DEFAULT PRIVILEGES IN SCHEMA %[3]s GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO %[2]s;
ALTER DEFAULT PRIVILEGES IN SCHEMA %[3]s GRANT USAGE ON SEQUENCES TO %[2]s;
GRANT SELECT, INSERT, DELETE ON public.processed_event TO %[2]s;
GRANT SELECT ON public.once_retention_policy TO %[2]s;
GRANT SELECT, INSERT, UPDATE, DELETE ON public.once_dead_letter, public.once_dead_letter_sources, public.once_outbox, public.once_outbox_offsets TO %[2]s;
GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO %[2]s;
GRANT SELECT ON public.goose_db_version, public.once_schema_version TO %[2]s;
DROP POLICY IF EXISTS %[2]s ON public.processed_event;
CREATE POLICY %[2]s ON public.processed_event TO %[2]s USING (starts_with(consumer_group, %[4]s)) WITH CHECK (starts_with(consumer_group, %[4]s));
DROP POLICY IF EXISTS %[2]s ON public.once_dead_letter_sources;
CREATE POLICY %[2]s ON public.once_dead_letter_sources TO %[2]s USING (starts_with(consumer_group, %[4]s)) WITH CHECK (starts_with(consumer_group, %[4]s));
DROP POLICY IF EXISTS %[2]s ON public.once_dead_letter;
CREATE POLICY %[2]s ON public.once_dead_letter TO %[2]s USING (group_role = %[1]s) WITH CHECK (group_role = %[1]s);
DROP POLICY IF EXISTS %[5]s ON public.once_outbox;
CREATE POLICY %[5]s ON public.once_outbox FOR SELECT TO %[2]s USING (group_role = %[1]s OR group_role IS NULL);
DROP POLICY IF EXISTS %[6]s ON public.once_outbox;
CREATE POLICY %[6]s ON public.once_outbox FOR INSERT TO %[2]s WITH CHECK (group_role = %[1]s);
DROP POLICY IF EXISTS %[7]s ON public.once_outbox;
CREATE POLICY %[7]s ON public.once_outbox FOR UPDATE TO %[2]s USING (group_role = %[1]s) WITH CHECK (group_role = %[1]s);
DROP POLICY IF EXISTS %[8]s ON public.once_outbox;
CREATE POLICY %[8]s ON public.once_outbox FOR DELETE TO %[2]s USING (group_role = %[1]s);
DROP POLICY IF EXISTS %[2]s ON public.once_outbox_offsets;
CREATE POLICY %[2]s ON public.once_outbox_offsets TO %[2]s USING (consumer_group = %[9]s) WITH CHECK (consumer_group = %[9]s);
INSERT INTO public.once_outbox_offsets (consumer_group, offset_acked, last_processed_transaction_id)
SELECT %[9]s, o.offset_acked, o.last_processed_transaction_id
FROM public.once_outbox_offsets o WHERE o.consumer_group = 'kafka_forwarder'
ON CONFLICT (consumer_group) DO NOTHING;
UPDATE public.once_outbox_offsets g SET offset_acked = s.offset_acked, last_processed_transaction_id = s.last_processed_transaction_id
FROM public.once_outbox_offsets s
WHERE g.consumer_group = %[9]s AND s.consumer_group = 'kafka_forwarder'
  AND (s.last_processed_transaction_id, s.offset_acked) > (g.last_processed_transaction_id, g.offset_acked);
`

// progressSQL keeps the forwarder's progress rows of once_outbox in step,
// before the groups' (groupGrantsSQL, which then moves each group's up to
// the shared one). The shared progress (kafka_forwarder) is the forwarder's
// of a role that row security does not restrict to a group (the owner, a
// role of no group: package outbox); a group role's forwarder keeps
// kafka_forwarder:once_GROUP. Whichever forwarded last, the others' progress
// stayed behind, and a switch between the set-ups would send again what the
// other forwarded. So, each time app migrate runs:
//   - the shared row exists (a role of no group sees it and keeps it);
//   - the shared progress moves up to the last row before the first row
//     that no forwarder sent yet (a group's row is sent once its group's
//     progress is past it, a row of no group once any group's is: every
//     group's forwarder sends those);
//   - then each group's moves up to the shared one (below it every row was
//     sent, by the shared forwarder, which sees them all, or by its group's).
//
// Nothing is skipped: a progress only moves past rows that were sent, and
// only rows of transactions that have ended lie below a sent row (the
// forwarder reads a transaction's rows once every older one has ended). Run
// between one set-up and the other, with the forwarders stopped, it has each
// row sent once; a forwarder left running across it may send again what it
// had read and not yet acknowledged.
const progressSQL = `
INSERT INTO public.once_outbox_offsets (consumer_group, offset_acked, last_processed_transaction_id)
VALUES ('kafka_forwarder', 0, '0') ON CONFLICT (consumer_group) DO NOTHING;
UPDATE public.once_outbox_offsets s SET offset_acked = p."offset", last_processed_transaction_id = p.transaction_id
FROM (
  WITH sh AS (SELECT last_processed_transaction_id AS t, offset_acked AS o FROM public.once_outbox_offsets WHERE consumer_group = 'kafka_forwarder'),
  pr AS (SELECT substr(consumer_group, length('kafka_forwarder:') + 1) AS role, last_processed_transaction_id AS t, offset_acked AS o
         FROM public.once_outbox_offsets WHERE starts_with(consumer_group, 'kafka_forwarder:')),
  ahead AS (SELECT m.transaction_id, m."offset", EXISTS (SELECT FROM pr
                WHERE (pr.role = m.group_role OR m.group_role IS NULL) AND (m.transaction_id, m."offset") <= (pr.t, pr.o)) AS sent
            FROM public.once_outbox m, sh WHERE (m.transaction_id, m."offset") > (sh.t, sh.o)),
  gap AS (SELECT transaction_id, "offset" FROM ahead WHERE NOT sent ORDER BY transaction_id, "offset" LIMIT 1)
  SELECT a.transaction_id, a."offset" FROM ahead a
  WHERE a.sent AND NOT EXISTS (SELECT FROM gap WHERE (a.transaction_id, a."offset") >= (gap.transaction_id, gap."offset"))
  ORDER BY a.transaction_id DESC, a."offset" DESC LIMIT 1) p
WHERE s.consumer_group = 'kafka_forwarder';
`

// grantLock serializes Grant between migrators (two app migrate at once:
// GRANT on one database by both fails with "tuple concurrently updated").
const grantLock = 0x6f6e63655f677200 // "once_gr\0"

// Grant gives the roles of groups (once_GROUP) what the migrations grant
// them, and their row-level security policies, in the database of pool,
// and CONNECT to it. A
// role that does not exist when a migration runs (an owner without
// CREATEROLE) gets nothing from it, and the migration is recorded applied
// all the same: so [Up] runs this after the migrations it applied, and app
// migrate after every Up. It is idempotent. A group role that does not
// exist is an error naming it (a [*MissingRolesError]), after nothing was granted: a role with
// CREATEROLE creates it (NOLOGIN), then app migrate runs again. Until then
// that role has no policy, and row security shows it no row (00014
// restricts every role that is not a group's; one that is, to its
// policies). In a database of groups' own ([Dedicate]) it grants only
// those of groups that the database serves, and skips the others. Runs
// of it serialize on an advisory lock (app migrate run twice at once). Run
// it as the tables' owner.
func Grant(ctx context.Context, pool *pgxpool.Pool, groups []string) error {
	for _, g := range groups {
		if !slices.Contains(Groups, g) {
			return fmt.Errorf("migrations: grant to %q: not a group of the service (%v)", g, Groups)
		}
	}
	var db string
	var served []string
	if err := pool.QueryRow(ctx, `SELECT current_database()`).Scan(&db); err != nil {
		return fmt.Errorf("migrations: grant to the group roles: %w", err)
	}
	// A database of groups' own (Dedicate) serves those groups alone: no
	// other group gets anything here, whoever asks (Up for every group,
	// as serve's --migrate runs it).
	var dedicated bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass('public.`+servedTable+`') IS NOT NULL`).Scan(&dedicated); err != nil {
		return fmt.Errorf("migrations: grant to the group roles: %w", err)
	}
	if dedicated {
		rows, err := pool.Query(ctx, `SELECT group_name FROM public.`+servedTable)
		if err != nil {
			return fmt.Errorf("migrations: grant to the group roles: which groups %s serves: %w", db, err)
		}
		if served, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
			return fmt.Errorf("migrations: grant to the group roles: which groups %s serves: %w", db, err)
		}
	}
	if len(served) > 0 {
		groups = slices.DeleteFunc(slices.Clone(groups), func(g string) bool { return !slices.Contains(served, g) })
	}
	var missing []string
	for _, g := range groups {
		var exists bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_roles WHERE rolname = $1)`, "once_"+g).Scan(&exists); err != nil {
			return fmt.Errorf("migrations: grant to the group roles: %w", err)
		}
		if !exists {
			missing = append(missing, "once_"+g)
		}
	}
	if len(missing) > 0 {
		return &MissingRolesError{Roles: missing}
	}
	return grant(ctx, pool, db, groups)
}

// MissingRolesError is Grant's error when group roles do not exist: it
// granted nothing. Such a role, created later, sees no row of the claims,
// dead letters or outbox until Grant runs again (row security restricts it
// to its policies, and it has none): nothing is open meanwhile.
type MissingRolesError struct {
	// Roles are the group roles that do not exist (once_GROUP).
	Roles []string
}

func (e *MissingRolesError) Error() string {
	create := make([]string, len(e.Roles))
	for i, r := range e.Roles {
		create[i] = "CREATE ROLE " + r + " NOLOGIN;"
	}
	return fmt.Sprintf("migrations: the group roles %s do not exist (the migrating role may not create roles): "+
		"have a role with CREATEROLE run %s then run app migrate again, which grants them their tables and row-level security policies",
		strings.Join(e.Roles, ", "), strings.Join(create, " "))
}

// Existing are the groups of groups whose roles are not missing.
func (e *MissingRolesError) Existing(groups []string) []string {
	return slices.DeleteFunc(slices.Clone(groups), func(g string) bool { return slices.Contains(e.Roles, "once_"+g) })
}

func grant(ctx context.Context, pool *pgxpool.Pool, db string, groups []string) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, int64(grantLock)); err != nil {
			return fmt.Errorf("migrations: grant to the group roles: wait for another app migrate: %w", err)
		}
		if _, err := tx.Exec(ctx, progressSQL); err != nil {
			return fmt.Errorf("migrations: the outbox forwarder's progress: %w%s", err, ownerHint(err))
		}
		for _, g := range groups {
			role := "once_" + g
			id := func(s string) string { return pgx.Identifier{s}.Sanitize() }
			// CONNECT too: a database once made another group's own by
			// mistake (PUBLIC's CONNECT revoked) serves this group again.
			if _, err := tx.Exec(ctx, `GRANT CONNECT ON DATABASE `+id(db)+` TO `+id(role)); err != nil {
				return fmt.Errorf("migrations: grant %s CONNECT on %s: %w%s", role, db, err, ownerHint(err))
			}
			lit := func(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
			sql := fmt.Sprintf(groupGrantsSQL, lit(role), id(role), id(g), lit(g),
				id(role+"_read"), id(role+"_write"), id(role+"_change"), id(role+"_remove"), lit("kafka_forwarder:"+role))
			if _, err := tx.Exec(ctx, sql); err != nil {
				return fmt.Errorf("migrations: grant %s its tables and policies: %w%s", role, err, ownerHint(err))
			}
		}
		return nil
	})
}

// ownerHint is the advice for an error of Grant: a permission denied is
// fixed by migrating as the owner; other errors say for themselves.
func ownerHint(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42501" {
		return " (run app migrate as the database's and the tables' owner)"
	}
	return ""
}
