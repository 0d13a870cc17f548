-- Least privilege inside a database two groups share: a group's role may
-- not forge, read or remove another group's claims or dead letters. A claim
-- of analytics inserted by billing's role would make analytics skip that
-- event as a duplicate; a letter removed would be lost.
--
-- Row-level security, not a claim table per group: the claim table, its
-- daily partitions and retention stay one (package schema and retention
-- know one), and the rule follows the row's own group. The policies name
-- the group roles (TO once_billing), so they hold for whichever login role
-- is granted one, in every connection, behind a transaction pooler and in
-- every pgx exec mode: nothing is set per session. The tables' owner (app
-- migrate, app maintain, the console) is not subject to them (no FORCE),
-- and retention's statements on partitions by name run as the owner; a
-- group role has no privilege on a partition itself, only on the parent,
-- through which the policies apply.
--
-- Claims and dead-lettered sources carry their consumer group: a group's
-- role sees and writes the rows of its group: billing, and every name that
-- starts with it (app serve --group-suffix appends to it; app inbox forget
-- takes such a name as billing's too). A role
-- that is neither group's is not restricted by rows; its table privileges
-- decide, as before.
--
-- A dead letter carries no group: it gets the group role of whoever parks
-- it (group_role, by default). NULL (parked by the owner, or before this
-- migration) is every group's to drain, as before.
--
-- The consumer outbox is left whole: every forwarder of a database reads it
-- in order under one progress row (kafka_forwarder), and a forwarder that
-- could not see some rows would move that progress past them, and they
-- would never be sent. Groups that must not reach each other's outbox get a
-- database each (app migrate --group-database), whose CONNECT only their
-- roles have.
--
-- Forgetting a claim (the console's Forget, app inbox forget) is the
-- group's own role's to do: it may now delete its group's claims.

-- +goose Up
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION public.once_group_role() RETURNS name
-- Its catalog, whatever the caller's search_path says.
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $fn$
    -- The group role the current user acts as: the first of the groups'
    -- roles it is a member of; NULL for a superuser (a member of every
    -- role) and for a role of neither group.
    SELECT r.rolname FROM pg_roles r
    WHERE r.rolname IN ('once_analytics', 'once_billing')
      AND NOT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
      AND pg_has_role(current_user, r.oid, 'MEMBER')
    ORDER BY r.rolname LIMIT 1
$fn$;
-- +goose StatementEnd

ALTER TABLE public.once_dead_letter ADD COLUMN IF NOT EXISTS group_role name DEFAULT public.once_group_role();

-- +goose StatementBegin
DO $$
DECLARE
    grp text;
    role text;
    roles text[] := ARRAY[]::text[];
    own text;
    tbl text;
BEGIN
    FOREACH grp IN ARRAY ARRAY['analytics', 'billing'] LOOP
        role := 'once_' || grp;
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = role) THEN
            RAISE NOTICE 'role % does not exist: a DBA must create it, then run: app migrate again', role;
            CONTINUE;
        END IF;
        roles := roles || role;
        EXECUTE format('GRANT DELETE ON public.processed_event TO %I', role);
        own := format('starts_with(consumer_group, %L)', grp);
        FOREACH tbl IN ARRAY ARRAY['processed_event', 'once_dead_letter_sources'] LOOP
            EXECUTE format('DROP POLICY IF EXISTS %I ON public.%I', role, tbl);
            EXECUTE format('CREATE POLICY %I ON public.%I TO %I USING (%s) WITH CHECK (%s)', role, tbl, role, own, own);
        END LOOP;
    END LOOP;
    IF cardinality(roles) = 0 THEN
        RETURN;
    END IF;
    -- Every other role: not restricted by rows (its privileges decide).
    own := (SELECT string_agg(format('NOT pg_has_role(current_user, %L, ''MEMBER'')', r), ' AND ') FROM unnest(roles) r);
    FOREACH tbl IN ARRAY ARRAY['processed_event', 'once_dead_letter_sources', 'once_dead_letter'] LOOP
        EXECUTE format('DROP POLICY IF EXISTS once_other_roles ON public.%I', tbl);
        EXECUTE format('CREATE POLICY once_other_roles ON public.%I USING (%s) WITH CHECK (%s)', tbl, own, own);
        EXECUTE format('ALTER TABLE public.%I ENABLE ROW LEVEL SECURITY', tbl);
    END LOOP;
    FOREACH role IN ARRAY roles LOOP
        EXECUTE format('DROP POLICY IF EXISTS %I ON public.once_dead_letter', role);
        EXECUTE format('CREATE POLICY %I ON public.once_dead_letter TO %I USING (group_role IS NULL OR group_role = %L) WITH CHECK (group_role IS NULL OR group_role = %L)',
            role, role, role, role);
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
    FOREACH tbl IN ARRAY ARRAY['processed_event', 'once_dead_letter_sources', 'once_dead_letter'] LOOP
        EXECUTE format('ALTER TABLE public.%I DISABLE ROW LEVEL SECURITY', tbl);
        FOR pol IN SELECT policyname FROM pg_policies WHERE schemaname = 'public' AND tablename = tbl LOOP
            EXECUTE format('DROP POLICY %I ON public.%I', pol.policyname, tbl);
        END LOOP;
    END LOOP;
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'once_analytics') THEN
        REVOKE DELETE ON public.processed_event FROM once_analytics;
    END IF;
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'once_billing') THEN
        REVOKE DELETE ON public.processed_event FROM once_billing;
    END IF;
END $$;
-- +goose StatementEnd
ALTER TABLE public.once_dead_letter DROP COLUMN IF EXISTS group_role;
DROP FUNCTION IF EXISTS public.once_group_role();
