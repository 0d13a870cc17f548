-- processed_event becomes range-partitioned by event_id (R-KFK-IDEM-2 retention).
--
-- Partitioning by processed_at, as the style guide's DDL does, forces
-- processed_at into the primary key, and then two deliveries of one event at
-- two moments no longer conflict: dedup silently stops. event_id is the same
-- for every delivery, and UUIDv7 ids are time-ordered (48-bit Unix ms first),
-- so a day is a range of ids and the key stays (event_id, consumer_group).
--
-- The existing table is attached, without copying, as the DEFAULT partition.
-- It holds every claim no daily partition covers, and it is the whole table in
-- the "delete" retention mode. The retention package creates and drops the
-- daily partitions (mode "partitioned") and deletes expired rows from the
-- default partition in batches (both modes), so switching modes needs no
-- migration.

-- +goose Up
ALTER TABLE processed_event RENAME TO processed_event_default;
ALTER TABLE processed_event_default RENAME CONSTRAINT processed_event_pkey TO processed_event_default_pkey;
ALTER INDEX processed_event_processed_at_idx RENAME TO processed_event_default_processed_at_idx;

CREATE TABLE processed_event (
    event_id       uuid        NOT NULL,
    consumer_group text        NOT NULL,
    payload_sha256 bytea       NOT NULL,
    processed_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (event_id, consumer_group)
) PARTITION BY RANGE (event_id);

CREATE INDEX processed_event_processed_at_idx ON processed_event (processed_at);

ALTER TABLE processed_event ATTACH PARTITION processed_event_default DEFAULT;

-- +goose Down
-- Daily partitions' rows are moved back into the plain table.
CREATE TABLE processed_event_plain (LIKE processed_event INCLUDING DEFAULTS);
INSERT INTO processed_event_plain SELECT * FROM processed_event;
DROP TABLE processed_event;
ALTER TABLE processed_event_plain RENAME TO processed_event;
ALTER TABLE processed_event ADD PRIMARY KEY (event_id, consumer_group);
CREATE INDEX processed_event_processed_at_idx ON processed_event (processed_at);
