// Package orderservice is the producer side: a minimal order service whose
// confirmation writes the order row and its order.confirmed.v1 event in one
// transaction, and whose cancellation marks the order cancelled and writes
// its order.cancelled.v1 event in one transaction, both into an outbox
// (package outbox, watermill-sql on that same pgx transaction), and a
// forwarder that moves outbox rows to Kafka, keyed by order id. The event id
// is generated here, once, and lives in the outbox row, so a forwarder that
// publishes a row twice (it crashed before acknowledging it) publishes the
// same event id twice, which consumers dedup.
package orderservice
