// Package pipeline builds the Watermill router that runs the consumer groups
// of the order-confirmed topic: one handler per group, each with its own Kafka
// consumer group and its own idempotency middleware, so that the groups keep
// independent dedup (R-KFK-IDEM-2).
//
// # Middleware order, outermost first
//
//  1. release-revoked: a message given up because its partition was revoked
//     is acknowledged without processing; watermill-kafka does not mark the
//     offset of a message acknowledged after its session ended, so the new
//     owner receives it again.
//  2. correlation id: carried into anything the handler publishes.
//  3. poison queue: a message that can never succeed, or still fails after
//     the retries, goes to the dead-letter topic with the reason in the
//     "reason_poisoned" header, and is acknowledged: it never blocks its
//     partition.
//  4. shutdown guard: an error caused by the router closing is neither
//     retried nor dead-lettered; the message stays uncommitted.
//  5. retry: a failure of this message's processing (a 5xx from the payment
//     provider, a handler bug) is retried a bounded number of times with
//     exponential backoff. Errors marked [idempotency.Permanent] are not.
//  6. recoverer: a panic becomes an error (after the idempotency middleware
//     rolled its transaction back).
//  7. validation: the payload is decoded into an [order.Confirmed]; anything
//     else is permanent.
//  8. idempotency, innermost: claim, handler, commit in one transaction.
//
// # Database outages
//
// An unreachable PostgreSQL is never the message's fault: the idempotency
// middleware holds the message and retries with backoff until the database is
// back, and no retry budget or dead-letter is spent on it. watermill-kafka
// resends a nacked message forever without watching the consumer-group
// session, so the old owner of a revoked partition would keep processing it.
// The pipeline therefore records the session of every claimed partition (via
// watermill-kafka's tracer hook) and the middleware stops waiting as soon as
// that session ends: the rebalance proceeds, and the message is left, with its
// offset uncommitted, to the partition's new owner.
//
// # Offsets
//
// Only acknowledged messages are ever marked, and a message is acknowledged
// only after its transaction committed (or it was a duplicate or was
// dead-lettered). [CommitInterval], the default, lets sarama commit marked
// offsets every second: a crash then redelivers at most a second of processed
// events, which the claim skips. [CommitSync] commits after every message:
// fewer redeliveries, one broker round trip per message.
package pipeline
