// Package pipeline runs Kafka consumer groups whose database effects happen
// exactly once, on any topics and event types, in one Watermill router.
//
// A team describes each topic as a [Topic] of its own event type E (any type
// with an EventID() uuid.UUID method): a [Decoder] from payload to E and the
// consumer groups that read it, each a [Group] with a [HandlerFunc]
// func(ctx, tx pgx.Tx, ev E) error. [New] wires every (topic, group) into
// the router with its own Kafka consumer group, its own dedup key and the
// whole safety chain; [Pipeline.Run] runs it.
//
//	p, err := pipeline.New(pipeline.Config{Brokers: brokers, DB: pool, Topics: []pipeline.Binding{
//		pipeline.Topic[Shipped]{Name: "shipment.dispatched.v1", Decode: DecodeShipped,
//			Groups: []pipeline.Group[Shipped]{{Name: "parcels", Handle: countParcels}}},
//	}})
//
// The handler runs inside the transaction that claims (event id, group) in
// the claim table (package schema creates it; package idempotency claims):
// its writes and the claim commit together, and the offset is committed only
// after. A duplicate is skipped before the handler runs.
//
// # The safety chain, outermost first
//
//  1. release-revoked: a message given up because its partition was revoked
//     is left, unmarked, to the partition's new owner.
//  2. Extra.Observe: the team's middleware that sees every delivery's end.
//  3. correlation id.
//  4. dead letter: a permanent failure goes to the topic's DLQ with its
//     reason in the "reason_poisoned" header, and is acknowledged.
//  5. shutdown guard: an error while the pipeline stops (decided by the
//     pipeline, never by a message context a middleware may have shortened)
//     is neither retried nor dead-lettered.
//  6. retry with backoff of what is not permanent.
//  7. recoverer: a panic becomes an error after the transaction rolled back.
//  8. decode: the payload becomes an E and its fingerprint (see [Topic]),
//     or the message is permanent.
//  9. Extra.BeforeClaim.
//  10. claim (package idempotency), with the transaction in the context.
//  11. Extra.InTx, for first deliveries, then the handler. A chain that
//     returns messages to publish is refused ([ErrReturnedMessages]).
//
// Middleware of a team's own [Config.Router] runs outside all of this. A
// batched group without Observe and BeforeClaim takes the direct path (see
// [Batch]): its messages skip the router and every stage before the claim
// but decoding, and only those the batch cannot decide pass them.
// Each group may keep its claims and tables in a database of its own
// ([Group.DB]); migrate and retain each of them.
//
// # Partitions and offsets
//
// While a message cannot be processed (the database is down), the consumer
// still gives its partition up on a rebalance: the pipeline records each
// partition's consumer-group session and the claim's wait ends when it does.
// Only acknowledged messages are ever marked. [CommitInterval], the default,
// commits marked offsets every second: a crash redelivers at most a second
// of processed events, which the claim skips. [CommitSync] commits after
// every message.
package pipeline
