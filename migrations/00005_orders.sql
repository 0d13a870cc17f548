-- The order service's own table. Its outbox (watermill_orders_outbox) is
-- created by watermill-sql's schema adapter at start-up.

-- +goose Up
CREATE SCHEMA orders;

CREATE TABLE orders.orders (
    order_id           uuid           PRIMARY KEY,
    customer_id        uuid           NOT NULL,
    amount             numeric(20, 2) NOT NULL,
    currency           char(3)        NOT NULL,
    confirmed_event_id uuid           NOT NULL UNIQUE,
    confirmed_at       timestamptz    NOT NULL DEFAULT now()
);

-- +goose Down
DROP SCHEMA orders CASCADE;
