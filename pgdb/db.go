package pgdb

import (
	"context"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// DB is the one database type of the library: where a group's claims, its
// business tables, its consumer outbox and its dead letters live. A
// *pgxpool.Pool is one. (The idempotency middleware, which imports nothing
// of the library, asks only for the part it uses.)
type DB interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// BoundConnect bounds opening each of cfg's connections by d, unless its
// URL set connect_timeout: a host that drops packets would otherwise hold a
// pool's slot for the kernel's TCP timeout, minutes.
func BoundConnect(cfg *pgxpool.Config, d time.Duration) {
	if cfg.ConnConfig.ConnectTimeout == 0 && d > 0 && !strings.Contains(cfg.ConnString(), "connect_timeout") {
		cfg.ConnConfig.ConnectTimeout = d
	}
}
