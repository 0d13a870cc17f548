package migrations

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// groupGrantsSQL is what the migrations give a group's role (%[1]s, its
// name as a literal; %[2]s, as an identifier; %[3]s, its group's schema): the
// grants of 00010, 00011 and 00013, and the row-level security policies of
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
SELECT %[9]s, coalesce(o.offset_acked, 0), coalesce(o.last_processed_transaction_id, '0')
FROM (VALUES (1)) v LEFT JOIN public.once_outbox_offsets o ON o.consumer_group = 'kafka_forwarder'
ON CONFLICT (consumer_group) DO NOTHING;
`

// Grant gives the roles of groups (once_GROUP) what the migrations grant
// them, and their row-level security policies, in the database of pool,
// and CONNECT to it. A
// role that does not exist when a migration runs (an owner without
// CREATEROLE) gets nothing from it, and the migration is recorded applied
// all the same: so [Up] runs this after the migrations it applied, and app
// migrate after every Up. It is idempotent. A group role that does not
// exist is an error naming it, after nothing was granted: a role with
// CREATEROLE creates it (NOLOGIN), then app migrate runs again. Until then
// that role has no policy, and row security shows it no row (00014
// restricts every role that is not a group's; one that is, to its
// policies). Run it as the tables' owner.
func Grant(ctx context.Context, pool *pgxpool.Pool, groups []string) error {
	var missing []string
	for _, g := range groups {
		if !slices.Contains(Groups, g) {
			return fmt.Errorf("migrations: grant to %q: not a group of the service (%v)", g, Groups)
		}
		var exists bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_roles WHERE rolname = $1)`, "once_"+g).Scan(&exists); err != nil {
			return fmt.Errorf("migrations: grant to the group roles: %w", err)
		}
		if !exists {
			missing = append(missing, "once_"+g)
		}
	}
	if len(missing) > 0 {
		create := make([]string, len(missing))
		for i, r := range missing {
			create[i] = "CREATE ROLE " + r + " NOLOGIN;"
		}
		return fmt.Errorf("migrations: the group roles %s do not exist (the migrating role may not create roles): "+
			"have a role with CREATEROLE run %s then run app migrate again, which grants them their tables and row-level security policies",
			strings.Join(missing, ", "), strings.Join(create, " "))
	}
	var db string
	if err := pool.QueryRow(ctx, `SELECT current_database()`).Scan(&db); err != nil {
		return fmt.Errorf("migrations: grant to the group roles: %w", err)
	}
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for _, g := range groups {
			role := "once_" + g
			id := func(s string) string { return pgx.Identifier{s}.Sanitize() }
			// CONNECT too: a database once made another group's own by
			// mistake (PUBLIC's CONNECT revoked) serves this group again.
			if _, err := tx.Exec(ctx, `GRANT CONNECT ON DATABASE `+id(db)+` TO `+id(role)); err != nil {
				return fmt.Errorf("migrations: grant %s CONNECT on %s: %w (run app migrate as the database's owner)", role, db, err)
			}
			lit := func(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
			sql := fmt.Sprintf(groupGrantsSQL, lit(role), id(role), id(g), lit(g),
				id(role+"_read"), id(role+"_write"), id(role+"_change"), id(role+"_remove"), lit("kafka_forwarder:"+role))
			if _, err := tx.Exec(ctx, sql); err != nil {
				return fmt.Errorf("migrations: grant %s its tables and policies: %w (run app migrate as the tables' owner)", role, err)
			}
		}
		return nil
	})
}
