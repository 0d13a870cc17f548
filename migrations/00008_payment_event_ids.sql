-- Each payment and refund names the payment event billing published for it
-- (through its outbox, in the same transaction): the id downstream
-- consumers dedup by, for audit and reconciliation.

-- +goose Up
ALTER TABLE billing.payments ADD COLUMN payment_event_id uuid UNIQUE;
ALTER TABLE billing.refunds ADD COLUMN payment_event_id uuid UNIQUE;
CREATE INDEX charge_intents_created_at_idx ON billing.charge_intents (created_at);

-- +goose Down
DROP INDEX billing.charge_intents_created_at_idx;
ALTER TABLE billing.refunds DROP COLUMN payment_event_id;
ALTER TABLE billing.payments DROP COLUMN payment_event_id;
