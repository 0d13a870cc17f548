-- The group roles of 00010 on what was made after it, and on what later
-- migrations make: the library's table of dead-lettered sources (schema
-- migration 5, which a group writes with each dead letter), and default
-- privileges, so that a table a later migration adds to a group's own
-- schema is the group's to write without a grant of its own (what the
-- migrating role creates there). Not in public: a table made there later
-- may be meant for one group only, and gets its grants by name, as here.

-- +goose Up
-- +goose StatementBegin
DO $$
DECLARE
    grp text;
BEGIN
    FOREACH grp IN ARRAY ARRAY['analytics', 'billing'] LOOP
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'once_' || grp) THEN
            RAISE NOTICE 'role once_% does not exist: a DBA must create it, then run: app migrate again', grp;
            CONTINUE;
        END IF;
        EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON public.once_dead_letter_sources TO %I', 'once_' || grp);
        EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA %I GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO %I', grp, 'once_' || grp);
        EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA %I GRANT USAGE ON SEQUENCES TO %I', grp, 'once_' || grp);
    END LOOP;
END $$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
DO $$
DECLARE
    grp text;
BEGIN
    FOREACH grp IN ARRAY ARRAY['analytics', 'billing'] LOOP
        IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'once_' || grp) THEN
            EXECUTE format('REVOKE ALL ON public.once_dead_letter_sources FROM %I', 'once_' || grp);
            EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA %I REVOKE ALL ON TABLES FROM %I', grp, 'once_' || grp);
            EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA %I REVOKE ALL ON SEQUENCES FROM %I', grp, 'once_' || grp);
        END IF;
    END LOOP;
END $$;
-- +goose StatementEnd
