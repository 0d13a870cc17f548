-- The idempotent consumer's claim table (R-KFK-IDEM-2). The key is the event's
-- own id and the consumer group, never a Kafka offset (R-KFK-IDEM-X2): every
-- delivery of one event, from any partition, replay or reset, hits the same row.

-- +goose Up
CREATE TABLE processed_event (
    event_id       uuid        NOT NULL,
    consumer_group text        NOT NULL,
    -- SHA-256 of the payload first claimed: the same id with other bytes is a
    -- producer bug, not a duplicate.
    payload_sha256 bytea       NOT NULL,
    processed_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (event_id, consumer_group)
);

-- Retention deletes by age.
CREATE INDEX processed_event_processed_at_idx ON processed_event (processed_at);

-- +goose Down
DROP TABLE processed_event;
