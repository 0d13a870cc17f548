// Package migrations holds the reference service's tables (billing,
// analytics, the order service, the payment provider simulator) as goose SQL
// files embedded in the binary, and applies them after the library's own
// (package schema). Every instance may call [Up] at start-up: goose
// serialises concurrent runs with a PostgreSQL advisory lock.
package migrations
