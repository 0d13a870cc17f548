// Package payment charges orders through an HTTP payment provider and
// simulates such a provider.
//
// [Client] sends every charge with an Idempotency-Key header (the event id,
// R-KFK-IDEM-4) and retries network errors, timeouts, 409, 429 and 5xx with
// backoff, always with the same key and byte-for-byte the same body, so the
// provider charges at most once per key. [Provider] is a simulator that
// behaves like real providers' idempotency keys (Stripe's, and the IETF
// Idempotency-Key header draft), keeps its state in PostgreSQL, and injects
// faults on request. The package imports nothing else of this module.
package payment
