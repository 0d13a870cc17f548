package pgdb_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/pgdb"
)

// Behind PgBouncer in transaction pooling, the two exec modes that cannot
// work there are refused with the setting named; the others, and every mode
// directly, pass. A URL that names cache_statement on purpose passes too.
func TestCheckPoolerRefusesWhatAPoolerBreaks(t *testing.T) {
	ctx := context.Background()
	ways := append([]testenv.Where{{Pooled: true, Mode: pgx.QueryExecModeCacheStatement}, {Pooled: true, Mode: pgx.QueryExecModeDescribeExec}},
		testenv.EveryWay...)
	for _, w := range ways {
		t.Run(w.String(), func(t *testing.T) {
			pool := w.Pool(t)
			pooled, err := pgdb.Pooled(ctx, pool)
			if err != nil || pooled != w.Pooled {
				t.Fatalf("Pooled: %t (%v); want %t", pooled, err, w.Pooled)
			}
			err = pgdb.CheckPooler(ctx, pool, "DATABASE_URL")
			refused := w.Pooled && (w.Mode == pgx.QueryExecModeDescribeExec)
			if refused != (err != nil) || (err != nil && !errors.Is(err, pgdb.ErrModeBehindPooler)) {
				t.Fatalf("CheckPooler: %v; want refused %t", err, refused)
			}
		})
	}
	// pgx's default, not named in the URL, behind the pooler: refused.
	pooled := testenv.Where{Pooled: true, Mode: pgx.QueryExecModeExec}.URL(t)
	defaultMode := testenv.PoolAt(t, testenv.WithoutParam(pooled, "default_query_exec_mode"))
	err := pgdb.CheckPooler(ctx, defaultMode, "DATABASE_URL")
	if !errors.Is(err, pgdb.ErrModeBehindPooler) {
		t.Fatalf("the default mode behind the pooler: %v; want it refused", err)
	}
	t.Log(err)
}

// A writing transaction whose client vanished behind a network black hole
// before its commit holds a transaction id: watermill-sql's forwarders of
// every database on the server send only rows older than the oldest one
// still running, so every outbox stops behind it. InTxBounded's bound ends
// it on the server, and the horizon moves on.
func TestABoundedTransactionWhoseClientVanishedEnds(t *testing.T) {
	pool := testenv.Postgres(t)
	ctx := context.Background()
	proxied, proxy := testenv.ProxiedPostgres(t, pool)
	t.Cleanup(func() { proxy.BlackHole(false); proxy.Cut() })
	var xid uint64
	vanished := make(chan struct{})
	go func() {
		defer close(vanished)
		_ = pgdb.InTxBounded(ctx, proxied, 2*time.Second, func(tx pgx.Tx) error {
			if err := tx.QueryRow(ctx, `SELECT pg_current_xact_id()::text::bigint`).Scan(&xid); err != nil {
				return err
			}
			proxy.BlackHole(true) // the commit never reaches the server
			return nil
		})
	}()
	testenv.Eventually(t, 10*time.Second, "the transaction takes its id", func() bool { return proxy.Swallowed() })
	horizon := func() (held bool) {
		var xmin uint64
		if err := pool.QueryRow(ctx, `SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint`).Scan(&xmin); err != nil {
			t.Fatal(err)
		}
		return xmin <= xid
	}
	if !horizon() {
		t.Fatal("the vanished transaction does not hold the horizon back: the fault did not happen")
	}
	testenv.Eventually(t, 15*time.Second, "the server ends the vanished transaction and the horizon moves past it", func() bool { return !horizon() })
}
