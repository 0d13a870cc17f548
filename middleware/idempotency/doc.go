// Package idempotency is a Watermill handler middleware that makes a
// consumer's database effects happen once per event and consumer group,
// although Kafka delivers at least once.
//
// For every message it begins a PostgreSQL transaction, claims
// (event_id, consumer_group) in processed_event with one
// INSERT ... ON CONFLICT DO NOTHING as the transaction's first statement,
// and, only when the claim inserted a row, runs the handler with that
// transaction in the message context ([TxFromContext]) and commits. A
// duplicate is acknowledged without running the handler. The offset is
// committed by the subscriber only after the handler returns, so after the
// transaction committed (R-KFK-IDEM-3).
//
// # Guarantee
//
// Every write the handler makes through the transaction from [TxFromContext]
// happens exactly once per (event id, consumer group), across redeliveries,
// rebalances, offset resets, replays and concurrent consumers: the claim's
// unique key serialises racing transactions, and a failed or panicking
// handler rolls the claim back with its writes, so the next delivery runs it
// again.
//
// # Limits
//
//   - Effects outside that transaction (HTTP calls, e-mails, other
//     databases) may run more than once: the handler can run, call out, and
//     fail to commit. They need their own idempotency, such as an
//     Idempotency-Key equal to the event id (R-KFK-IDEM-4).
//   - Dedup lasts as long as the claim row: once a retention job removed it,
//     a redelivery is processed again. Bound the age of what you accept
//     (Config.MaxEventAge, checked at every first claim on the database's
//     clock; a duplicate is a duplicate whatever its age).
//   - The key is the event's own id (R-KFK-IDEM-1), never a Kafka offset
//     (R-KFK-IDEM-X2). The same id with other values is reported as
//     [ErrPayloadMismatch], not skipped (see Fingerprints). An event whose
//     producer sends ids of its own gets a UUIDv7 derived from that id and a
//     time it carries ([DeriveEventID], in a Config.Key).
//
// # Fingerprints
//
// A claim stores the SHA-256 of the payload's bytes and of its values in
// canonical form (Config.Fingerprint). A redelivery under a claimed id is a
// duplicate when either matches, and a mismatch when neither does, so the
// canonical form must never make two different values one: [CanonicalJSON]
// refuses what it cannot write one way (invalid UTF-8, a repeated member
// name, bytes after the value), and the payload's bytes then stand for its
// values. Which byte forms are one value:
//
//   - [PayloadSHA256], the default, knows JSON only: member order, space,
//     12.5 or 12.50, Z or +00:00 for one instant are one value; the number
//     12.5 and the string "12.50" are two.
//   - [FingerprintWithDecimals] names the members that are decimals: there
//     a number and a string holding a number are one value.
//   - Package pipeline fingerprints the decoded event, which knows its
//     types: "12.50" and 12.5 decoded into one decimal are one value (an
//     event type encoding/json cannot see whole: its payload, as
//     PayloadSHA256).
//
// # Errors
//
// Every error the middleware returns is either permanent ([IsPermanent]: the
// message itself can never succeed, so dead-letter it) or not (the attempt
// rolled back; the database, the network or the handler's environment
// failed, and the same message may pass later: hold it and retry). The
// middleware makes one attempt per call; holding, backoff and giving a
// partition up on a rebalance are the router's job (package pipeline does
// all three).
package idempotency
