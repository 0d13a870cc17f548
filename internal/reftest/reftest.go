// Package reftest connects the reference service's tests to the test
// database with the service's own tables migrated beside the library's; the
// library's tests use testenv alone.
package reftest

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/migrations"
)

var (
	migrateOnce sync.Once
	migrateErr  error
)

// Postgres returns a new pool on the test database with the library's and
// the reference service's tables migrated.
func Postgres(t testing.TB) *pgxpool.Pool {
	t.Helper()
	pool := testenv.Postgres(t)
	migrateOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, migrateErr = migrations.Up(ctx, pool)
	})
	if migrateErr != nil {
		t.Fatalf("migrate the reference service's tables: %v", migrateErr)
	}
	return pool
}
