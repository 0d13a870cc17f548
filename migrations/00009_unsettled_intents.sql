-- A charge intent whose confirmation was dead-lettered without an outcome
-- (the provider holds another request under its key) says why: the order's
-- cancellation then goes to a person at once, instead of waiting for a
-- confirmation that will not come back by itself.

-- +goose Up
ALTER TABLE billing.charge_intents ADD COLUMN unsettled_reason text;

-- +goose Down
ALTER TABLE billing.charge_intents DROP COLUMN unsettled_reason;
