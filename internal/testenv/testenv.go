// Package testenv connects tests to the real services dev/test.sh starts: a
// PostgreSQL (DATABASE_URL) and a Kafka broker (KAFKA_BROKERS). Run without
// them, integration tests skip with a message naming the command to use; under
// dev/test.sh and .ci/run (ONCE_REQUIRE_SERVICES=1) a missing service fails.
package testenv

import (
	"context"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/migrations"
)

func need(t testing.TB, name string) string {
	t.Helper()
	v := os.Getenv(name)
	if v != "" {
		return v
	}
	if os.Getenv("ONCE_REQUIRE_SERVICES") != "" {
		t.Fatalf("%s is not set, but ONCE_REQUIRE_SERVICES is: the services were not started", name)
	}
	t.Skipf("%s is not set: run the suite with dev/test.sh, which starts real Kafka and PostgreSQL", name)
	return ""
}

var migrateOnce sync.Once
var migrateErr error

// Postgres returns a pool on the test database with every migration applied.
func Postgres(t testing.TB) *pgxpool.Pool {
	t.Helper()
	url := need(t, "DATABASE_URL")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatalf("connect to DATABASE_URL: %v", err)
	}
	t.Cleanup(pool.Close)
	migrateOnce.Do(func() { _, migrateErr = migrations.Up(ctx, pool) })
	if migrateErr != nil {
		t.Fatalf("migrate: %v", migrateErr)
	}
	return pool
}

// Brokers returns the Kafka bootstrap addresses.
func Brokers(t testing.TB) []string {
	t.Helper()
	return strings.Split(need(t, "KAFKA_BROKERS"), ",")
}
