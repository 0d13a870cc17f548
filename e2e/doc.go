// Package e2e holds black-box tests: they build the real app binary, run it
// as separate processes against real Kafka, real PostgreSQL and the payment
// provider simulator, break things on purpose (kill -9, rebalances, database
// restarts, provider faults, poison messages) and then check that every valid
// order was charged once and counted once, that nothing was lost, and that
// the consumer groups drained. Run them with dev/test.sh; -e2e.soak runs a
// longer variant.
package e2e
