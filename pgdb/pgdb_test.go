package pgdb_test

import (
	"context"
	"errors"
	"testing"

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
