-- Refunds (order.cancelled.v1), and billing's record of what it intends to
-- charge before it calls the provider.

-- +goose Up
ALTER TABLE orders.orders ADD COLUMN cancelled_at timestamptz, ADD COLUMN cancelled_event_id uuid UNIQUE;

-- A charge intent is committed, on its own, before billing calls the
-- provider: it outlives a rolled-back attempt, so a later event for the same
-- order learns that a charge may have happened under this key.
CREATE TABLE billing.charge_intents (
    order_id        bigint      PRIMARY KEY,
    event_id        uuid        NOT NULL,
    idempotency_key text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);

-- A payment can now also be 'cancelled': its order was cancelled before it
-- was charged, and it never will be. The check 00006 made has a generated
-- name (it differs where the UUID-era table kept the plain one): drop it by
-- what it is.
-- +goose StatementBegin
DO $$
DECLARE c text;
BEGIN
    FOR c IN SELECT conname FROM pg_constraint WHERE conrelid = 'billing.payments'::regclass AND contype = 'c' LOOP
        EXECUTE format('ALTER TABLE billing.payments DROP CONSTRAINT %I', c);
    END LOOP;
END $$;
-- +goose StatementEnd
ALTER TABLE billing.payments ADD CONSTRAINT payments_status CHECK (status IN ('charged', 'failed', 'cancelled'));

-- A cancellation that arrived before its order was charged: it blocks the
-- charge when the confirmation arrives.
CREATE TABLE billing.cancellations (
    order_id   bigint      PRIMARY KEY,
    event_id   uuid        NOT NULL UNIQUE,
    reason     text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE billing.refunds (
    event_id           uuid           PRIMARY KEY, -- the order.cancelled.v1 event
    order_id           bigint         NOT NULL UNIQUE REFERENCES billing.payments (order_id),
    provider_charge_id text           NOT NULL,
    provider_refund_id text           NOT NULL,
    amount             numeric(20, 2) NOT NULL,
    currency           char(3)        NOT NULL,
    created_at         timestamptz    NOT NULL DEFAULT now()
);

CREATE TABLE payment_provider.refund (
    refund_id       text           PRIMARY KEY,
    account         text           NOT NULL,
    idempotency_key text           NOT NULL,
    charge_id       text           NOT NULL REFERENCES payment_provider.charge (charge_id),
    order_id        text           NOT NULL,
    amount          numeric(20, 2) NOT NULL,
    currency        char(3)        NOT NULL,
    created_at      timestamptz    NOT NULL DEFAULT now()
);
CREATE INDEX refund_charge_idx ON payment_provider.refund (charge_id);
CREATE INDEX refund_account_idx ON payment_provider.refund (account, created_at);

-- Analytics applies billing's payment events: a refund is subtracted from
-- its customer's revenue on the day of the refund (net = revenue -
-- refunded), and charges and failures are counted per customer and day.
ALTER TABLE analytics.customer_daily_revenue
    ADD COLUMN refunded     numeric(20, 2) NOT NULL DEFAULT 0,
    ADD COLUMN refund_count bigint         NOT NULL DEFAULT 0;
CREATE TABLE analytics.customer_daily_payments (
    customer_id   bigint         NOT NULL,
    day           date           NOT NULL,
    charged_count bigint         NOT NULL DEFAULT 0,
    charged_total numeric(20, 2) NOT NULL DEFAULT 0,
    failed_count  bigint         NOT NULL DEFAULT 0,
    PRIMARY KEY (customer_id, day)
);

-- +goose Down
DROP TABLE analytics.customer_daily_payments;
ALTER TABLE analytics.customer_daily_revenue DROP COLUMN refunded, DROP COLUMN refund_count;
DROP TABLE payment_provider.refund;
DROP TABLE billing.refunds;
DROP TABLE billing.cancellations;
ALTER TABLE billing.payments DROP CONSTRAINT payments_status;
-- Payments of orders cancelled before their charge were never charged.
UPDATE billing.payments SET status = 'failed', failure_reason = coalesce(failure_reason, 'cancelled before the charge') WHERE status = 'cancelled';
ALTER TABLE billing.payments ADD CONSTRAINT payments_status CHECK (status IN ('charged', 'failed'));
DROP TABLE billing.charge_intents;
ALTER TABLE orders.orders DROP COLUMN cancelled_at, DROP COLUMN cancelled_event_id;
