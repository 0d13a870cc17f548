-- Least privilege inside a database two groups share, continued (00013):
-- each group's consumer outbox is its own, and a dead letter is its group's
-- only.
--
-- The consumer outbox: row-level security on once_outbox by the role that
-- wrote the row (group_role, by default once_group_role()), and the
-- forwarder's progress per group. 00010 granted every group role the whole
-- outbox: analytics' role could delete billing's unforwarded PaymentCharged
-- (charged, event lost) or insert one the forwarder would publish. Not an
-- outbox table per group: package outbox and the pipeline know one outbox
-- per database, which every group's handlers write in their claim's
-- transaction; the rule follows the row, as for claims.
--
-- A forwarder must never move its progress past a row it cannot see: so a
-- group role's forwarder keeps its own progress row ('kafka_forwarder:' and
-- its role), the only progress row its policy lets it see, and package
-- outbox reads it as its progress whenever row security applies to it. It
-- sees and forwards its group's rows and the rows written by no group
-- (group_role NULL: by the owner, or before this migration), which every
-- group's forwarder may then send (a duplicate, which consumers dedup by
-- event id, never a loss). A role of no group sees every row and the
-- shared progress (kafka_forwarder), and forwards by it. migrations.Grant
-- (every app migrate) keeps the progress rows in step: the shared one moves
-- up to the rows the groups' forwarders sent, each group's up to the shared
-- one, so a switch between the owner's forwarding and the groups', with
-- app migrate in between, sends nothing forwarded before again.
--
-- The group roles' policies and progress rows are not made here but by
-- migrations.Grant, which app migrate runs after the migrations every time
-- (a role that does not exist yet cannot be named in a policy); this
-- migration adds the columns and functions, backfills the letters, and
-- turns row security on.
--
-- Dead letters: a group role reads, drains and writes only letters tagged
-- with its own role. Letters parked before 00013 get the group of their
-- dead-lettered source (once_dead_letter_sources, by topic, partition and
-- offset of the message); the migrator's own membership stamped by 00013's
-- default is overwritten from the same source. A letter left NULL (no
-- source recorded) is the owner's to drain: app dlq replay and serve under
-- the owner's role see every letter.

-- +goose Up
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION public.once_group_role() RETURNS name
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $fn$
    -- The group role the current user acts as; NULL for a superuser (a
    -- member of every role), for a role of neither group, and for a role
    -- that is a member of both (on PostgreSQL 16 and later the CREATEROLE
    -- owner that created them is): such a role is not one group's, and a
    -- row it writes under a group's policy is refused rather than given to
    -- either.
    SELECT min(r.rolname) FROM pg_roles r
    WHERE r.rolname IN ('once_analytics', 'once_billing')
      AND NOT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
      AND pg_has_role(current_user, r.oid, 'MEMBER')
    HAVING count(*) = 1
$fn$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION public.once_in_a_group() RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $fn$
    -- Whether the current user is a member of a group role (a superuser
    -- is not taken for one), asked at each query: a role missing now and
    -- created later counts from then on.
    SELECT EXISTS (SELECT FROM pg_roles r
        WHERE r.rolname IN ('once_analytics', 'once_billing')
          AND NOT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
          AND pg_has_role(current_user, r.oid, 'MEMBER'))
$fn$;
-- +goose StatementEnd

-- The shared progress exists from now on (a role of no group, which sees
-- every row, forwards by it; package outbox takes a role that sees it for
-- one).
INSERT INTO public.once_outbox_offsets (consumer_group, offset_acked, last_processed_transaction_id)
VALUES ('kafka_forwarder', 0, '0') ON CONFLICT (consumer_group) DO NOTHING;

ALTER TABLE public.once_outbox ADD COLUMN IF NOT EXISTS group_role name;
-- Set after the column is added, so that existing rows stay NULL (a default
-- given in ADD COLUMN is evaluated for them, as the migrator).
ALTER TABLE public.once_outbox ALTER COLUMN group_role SET DEFAULT public.once_group_role();

-- +goose StatementBegin
DO $$
DECLARE
    tbl text;
    letter record;
    grp text;
BEGIN
    -- Dead letters: the group that parked them (Watermill's
    -- handler_poisoned header, the consumer group of their dead-lettered
    -- source), whoever migrates: not the migrator's membership, which
    -- 00013's default stamped on every existing letter. A letter whose
    -- headers cannot be read (a key that is not UTF-8, a \u0000 that jsonb
    -- refuses) is left NULL, the owner's to drain, rather than stopping
    -- the migration: each letter is read in a block of its own. (Before
    -- this, such a letter failed the migration, which goose rolled back
    -- whole: a database it failed on has 00014 pending, and the next app
    -- migrate applies it; one it was applied to had no such letter.)
    FOR letter IN SELECT id, headers FROM public.once_dead_letter LOOP
        BEGIN
            SELECT CASE jsonb_typeof(j.doc)
                     WHEN 'array' THEN (SELECT convert_from(decode(e->>'v', 'base64'), 'UTF8') FROM jsonb_array_elements(j.doc) e
                                        WHERE convert_from(decode(e->>'k', 'base64'), 'UTF8') = 'handler_poisoned' LIMIT 1)
                     WHEN 'object' THEN j.doc->>'handler_poisoned' END
            INTO grp
            FROM (SELECT convert_from(letter.headers, 'UTF8')::jsonb AS doc) j;
        EXCEPTION WHEN others THEN
            grp := NULL;
        END;
        UPDATE public.once_dead_letter SET group_role = CASE
                WHEN starts_with(grp, 'billing') THEN 'once_billing'
                WHEN starts_with(grp, 'analytics') THEN 'once_analytics' END
        WHERE id = letter.id;
    END LOOP;

    -- Row security on the five tables, whichever group roles exist now:
    -- a role of neither group is not restricted by rows (its privileges
    -- decide); a group's role sees only what its policies, which
    -- migrations.Grant makes once the role exists, let it see. Asked at
    -- each query (once_in_a_group), so that a group role created after
    -- this migration is not taken for another role, unrestricted.
    FOREACH tbl IN ARRAY ARRAY['processed_event', 'once_dead_letter_sources', 'once_dead_letter', 'once_outbox', 'once_outbox_offsets'] LOOP
        EXECUTE format('DROP POLICY IF EXISTS once_other_roles ON public.%I', tbl);
        EXECUTE format('CREATE POLICY once_other_roles ON public.%I USING (NOT public.once_in_a_group()) WITH CHECK (NOT public.once_in_a_group())', tbl);
        EXECUTE format('ALTER TABLE public.%I ENABLE ROW LEVEL SECURITY', tbl);
    END LOOP;
END $$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
DO $$
DECLARE
    tbl text;
    pol record;
BEGIN
    FOREACH tbl IN ARRAY ARRAY['once_outbox', 'once_outbox_offsets'] LOOP
        EXECUTE format('ALTER TABLE public.%I DISABLE ROW LEVEL SECURITY', tbl);
        FOR pol IN SELECT policyname FROM pg_policies WHERE schemaname = 'public' AND tablename = tbl LOOP
            EXECUTE format('DROP POLICY %I ON public.%I', pol.policyname, tbl);
        END LOOP;
    END LOOP;
    DELETE FROM public.once_outbox_offsets WHERE starts_with(consumer_group, 'kafka_forwarder:');
    -- 00013's rule for other roles, naming the group roles that exist.
    FOREACH tbl IN ARRAY ARRAY['processed_event', 'once_dead_letter_sources', 'once_dead_letter'] LOOP
        EXECUTE format('DROP POLICY IF EXISTS once_other_roles ON public.%I', tbl);
        EXECUTE format('CREATE POLICY once_other_roles ON public.%I USING (%s) WITH CHECK (%s)', tbl,
            coalesce((SELECT string_agg(format('NOT pg_has_role(current_user, %L, ''MEMBER'')', rolname), ' AND ') FROM pg_roles WHERE rolname IN ('once_analytics', 'once_billing')), 'true'),
            coalesce((SELECT string_agg(format('NOT pg_has_role(current_user, %L, ''MEMBER'')', rolname), ' AND ') FROM pg_roles WHERE rolname IN ('once_analytics', 'once_billing')), 'true'));
    END LOOP;
    FOREACH tbl IN ARRAY ARRAY['once_analytics', 'once_billing'] LOOP
        IF EXISTS (SELECT FROM pg_roles WHERE rolname = tbl) THEN
            EXECUTE format('DROP POLICY IF EXISTS %I ON public.once_dead_letter', tbl);
            EXECUTE format('CREATE POLICY %I ON public.once_dead_letter TO %I USING (group_role IS NULL OR group_role = %L) WITH CHECK (group_role IS NULL OR group_role = %L)', tbl, tbl, tbl, tbl);
        END IF;
    END LOOP;
END $$;
-- +goose StatementEnd
ALTER TABLE public.once_outbox DROP COLUMN IF EXISTS group_role;
DROP FUNCTION IF EXISTS public.once_in_a_group();
