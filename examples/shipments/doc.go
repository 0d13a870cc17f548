// Package shipments is a team's own topic on once, in under 40 lines
// (shipments.go): an event type with its id, a strict decoder, a handler whose
// writes happen once per event, and the topic that binds them, ready for
// pipeline.Config.Topics. shipments_test.go runs it against real Kafka and
// PostgreSQL with duplicates, and tests the handler with package oncetest.
package shipments
