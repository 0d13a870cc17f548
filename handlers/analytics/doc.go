// Package analytics keeps revenue, refunds and payments per customer per
// day, from order.confirmed.v1 and from billing's payment events. Its upserts
// add to running totals and are not idempotent by themselves: the claim made
// in the same transaction by the idempotency middleware is what keeps the
// totals right under redelivery.
package analytics
