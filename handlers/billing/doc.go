// Package billing charges each confirmed order once. Money gets two locks
// (R-KFK-IDEM-4): the claim of the idempotency middleware keeps our own
// records once per event, and the provider dedups the charge itself on the
// Idempotency-Key, which is the event id, for the window in which our
// transaction may have rolled back after the provider charged.
package billing
