-- Analytics aggregates. "+=" upserts are not idempotent by themselves: only the
-- claim in processed_event, in the same transaction, keeps them right.

-- +goose Up
CREATE SCHEMA analytics;

CREATE TABLE analytics.customer_daily_revenue (
    customer_id uuid           NOT NULL,
    day         date           NOT NULL,
    currency    char(3)        NOT NULL,
    revenue     numeric(20, 2) NOT NULL,
    order_count bigint         NOT NULL,
    PRIMARY KEY (customer_id, day, currency)
);

-- +goose Down
DROP SCHEMA analytics CASCADE;
