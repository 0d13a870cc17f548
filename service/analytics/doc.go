// Package analytics keeps revenue and order count per customer per day. Its
// upserts add to running totals and are not idempotent by themselves: the
// claim made in the same transaction by the idempotency middleware is what
// keeps the totals right under redelivery.
package analytics
