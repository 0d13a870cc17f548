// Package migrations holds the database schema as goose SQL files embedded in
// the binary, and applies them. Every instance may call [Up] at start-up:
// goose serialises concurrent runs with a PostgreSQL advisory lock.
package migrations
