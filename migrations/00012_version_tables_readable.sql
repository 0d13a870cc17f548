-- The group roles of 00010 may read which migrations are applied (the
-- service's, in goose_db_version, and the library's, in
-- once_schema_version): app serve --no-migrate under a group's role then
-- tells a database that is not migrated to this release's version from one
-- that is, and stops naming what is pending, instead of starting and
-- holding every message. Reading, no more: migrating stays the owner's.

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
        EXECUTE format('GRANT SELECT ON public.goose_db_version TO %I', 'once_' || grp);
        IF to_regclass('public.once_schema_version') IS NOT NULL THEN
            EXECUTE format('GRANT SELECT ON public.once_schema_version TO %I', 'once_' || grp);
        END IF;
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
            EXECUTE format('REVOKE SELECT ON public.goose_db_version FROM %I', 'once_' || grp);
            IF to_regclass('public.once_schema_version') IS NOT NULL THEN
                EXECUTE format('REVOKE SELECT ON public.once_schema_version FROM %I', 'once_' || grp);
            END IF;
        END IF;
    END LOOP;
END $$;
-- +goose StatementEnd
