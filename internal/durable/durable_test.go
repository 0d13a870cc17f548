package durable_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/internal/durable"
	"github.com/once-dev/once/internal/testenv"
)

// BenchmarkCommit measures what the raise costs a commit on a server whose
// synchronous_commit is off: "raised" waits for the WAL to be flushed (what
// the claim, a parked letter and a charge intent do), "lax" does not (what
// they would do without the raise), "server-on" is a server left at its
// default. Run side by side in one process:
//
//	go test -run '^$' -bench Commit -benchtime 2000x ./internal/durable
//
// The figure depends on the disk: with fsync=off (the dev database) a flush
// is almost free, on a real disk it is one fsync, shared by the commits that
// arrive together (PostgreSQL's group commit).
func BenchmarkCommit(b *testing.B) {
	direct := testenv.Postgres(b)
	ctx := context.Background()
	if _, err := direct.Exec(ctx, `CREATE TABLE IF NOT EXISTS durable_bench (n bigint)`); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _, _ = direct.Exec(context.Background(), `DROP TABLE durable_bench`) })
	for _, c := range []struct {
		name, server, insert string
	}{
		{"lax", "off", `INSERT INTO durable_bench (n) VALUES ($1)`},
		{"raised", "off", `INSERT INTO durable_bench (n) SELECT $1 FROM (SELECT ` + durable.RaiseSynchronousCommit + `) AS d`},
		{"server-on", "on", `INSERT INTO durable_bench (n) VALUES ($1)`},
	} {
		b.Run(c.name, func(b *testing.B) {
			cfg := direct.Config().Copy()
			cfg.ConnConfig.RuntimeParams["synchronous_commit"] = c.server
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				b.Fatal(err)
			}
			defer pool.Close()
			b.ResetTimer()
			for i := range b.N {
				tx, err := pool.Begin(ctx)
				if err != nil {
					b.Fatal(err)
				}
				if _, err := tx.Exec(ctx, c.insert, i); err != nil {
					b.Fatal(err)
				}
				if err := tx.Commit(ctx); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
