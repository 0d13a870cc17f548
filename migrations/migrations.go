package migrations

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"

	"github.com/once-dev/once/schema"
)

//go:embed *.sql
var files embed.FS

// FS holds the reference service's migrations (goose's .sql files at its
// root), for a start-up that checks none is pending (once.Needs).
var FS fs.FS = files

// Up applies the library's tables (package schema, in public) and then every
// pending migration of the reference service, and returns the versions of
// the latter it applied.
func Up(ctx context.Context, pool *pgxpool.Pool) ([]int64, error) {
	if _, err := schema.Migrate(ctx, pool, schema.Config{}); err != nil {
		return nil, err
	}
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()

	// A row lock, not a session-level advisory lock: behind a transaction
	// pooler the session's lock would stay on a server connection.
	locker, err := lock.NewPostgresTableLocker(lock.WithTableLockTimeout(500*time.Millisecond, 1200))
	if err != nil {
		return nil, fmt.Errorf("migrations: locker: %w", err)
	}
	provider, err := goose.NewProvider(goose.DialectPostgres, db, files, goose.WithLocker(locker))
	if err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	// Asked first, without the lock: a service under a least-privilege
	// role starts once the owner migrated, and creates nothing.
	if pending, err := provider.HasPending(ctx); err == nil && !pending {
		return nil, nil
	}
	results, err := provider.Up(ctx)
	if err != nil {
		return nil, fmt.Errorf("migrations: up: %w", err)
	}
	applied := make([]int64, 0, len(results))
	for _, r := range results {
		applied = append(applied, r.Source.Version)
	}
	return applied, nil
}
