-- Least privilege: a role per consumer group, which may write its own
-- tables and the library's (claims, dead letters, the consumer outbox) and
-- nothing else. They cannot log in; give each group's login role one of
-- them (GRANT once_analytics TO analytics_svc) and its own DSN
-- (--group-database analytics=postgres://analytics_svc@...). Retention
-- drops partitions and so runs as the tables' owner (app maintain).
--
-- Roles belong to the cluster: one may exist already (another database,
-- another run), and the migrating user may lack CREATEROLE. Then the roles
-- are left to a DBA, with a notice, and the grants go to whichever exist.

-- +goose Up
-- +goose StatementBegin
DO $$
DECLARE
    grp text;
BEGIN
    FOREACH grp IN ARRAY ARRAY['analytics', 'billing'] LOOP
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'once_' || grp) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', 'once_' || grp);
            EXCEPTION WHEN insufficient_privilege THEN
                RAISE NOTICE 'role once_% not created (no CREATEROLE): a DBA must create it, then run: app migrate again', grp;
                CONTINUE;
            END;
        END IF;
        EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', grp, 'once_' || grp);
        EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA %I TO %I', grp, 'once_' || grp);
        EXECUTE format('GRANT USAGE ON ALL SEQUENCES IN SCHEMA %I TO %I', grp, 'once_' || grp);
        EXECUTE format('GRANT SELECT, INSERT ON public.processed_event TO %I', 'once_' || grp);
        EXECUTE format('GRANT SELECT ON public.once_retention_policy TO %I', 'once_' || grp);
        EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON public.once_dead_letter, public.once_outbox, public.once_outbox_offsets TO %I', 'once_' || grp);
        EXECUTE format('GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO %I', 'once_' || grp);
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
            EXECUTE format('REVOKE ALL ON ALL TABLES IN SCHEMA %I FROM %I', grp, 'once_' || grp);
            EXECUTE format('REVOKE ALL ON SCHEMA %I FROM %I', grp, 'once_' || grp);
            EXECUTE format('REVOKE ALL ON public.processed_event, public.once_retention_policy, public.once_dead_letter, public.once_outbox, public.once_outbox_offsets FROM %I', 'once_' || grp);
        END IF;
    END LOOP;
END $$;
-- +goose StatementEnd
