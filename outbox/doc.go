// Package outbox publishes events from inside a database transaction: a
// producer's, or a consumer handler's own, in the claim's transaction. The
// events and the writes beside them commit or roll back together; a
// [Forwarder] moves committed events to Kafka and marks a row forwarded only
// after Kafka acknowledged it, so a crash in between publishes the row again,
// with the same event id, for the consumers to skip.
//
// An outbox is a watermill-sql message table (and its offsets table) in a
// schema of the database; package schema creates the library's default one.
// [EventID] derives an outgoing event's id from the incoming one, so a
// handler that runs twice across a rolled-back attempt publishes the same id.
package outbox
