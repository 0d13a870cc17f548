-- Billing's payments, and the payment provider simulator's own state (a
-- separate schema: in production it is another company's database).

-- +goose Up
CREATE SCHEMA billing;

CREATE TABLE billing.payments (
    event_id           uuid           PRIMARY KEY,
    -- One payment per order: a second event for an order that was already
    -- charged is refused before the provider is called.
    order_id           uuid           NOT NULL UNIQUE,
    customer_id        uuid           NOT NULL,
    amount             numeric(20, 2) NOT NULL,
    currency           char(3)        NOT NULL,
    status             text           NOT NULL CHECK (status IN ('charged', 'failed')),
    provider_charge_id text,
    failure_reason     text,
    created_at         timestamptz    NOT NULL DEFAULT now()
);

CREATE SCHEMA payment_provider;

-- Idempotency keys are scoped to the merchant account, as at real providers.
CREATE TABLE payment_provider.idempotency_key (
    account         text        NOT NULL,
    key             text        NOT NULL,
    request_sha256  bytea       NOT NULL,
    state           text        NOT NULL CHECK (state IN ('in_flight', 'done')),
    locked_at       timestamptz NOT NULL DEFAULT now(),
    response_status int,
    response_body   bytea,
    created_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (account, key)
);
CREATE INDEX idempotency_key_created_at_idx ON payment_provider.idempotency_key (created_at);

CREATE TABLE payment_provider.charge (
    charge_id       text           PRIMARY KEY,
    account         text           NOT NULL,
    idempotency_key text           NOT NULL,
    order_id        text           NOT NULL,
    amount          numeric(20, 2) NOT NULL,
    currency        char(3)        NOT NULL,
    created_at      timestamptz    NOT NULL DEFAULT now()
);
CREATE INDEX charge_account_idx ON payment_provider.charge (account, created_at);

-- +goose Down
DROP SCHEMA payment_provider CASCADE;
DROP SCHEMA billing CASCADE;
