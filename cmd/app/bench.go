package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/internal/progress"
	"github.com/once-dev/once/retention"
	"github.com/once-dev/once/schema"
)

type benchRetentionCmd struct {
	DB   dbSettings `embed:""`
	Rows int        `name:"rows" default:"1000000" help:"Rows per measurement (N)."`
}

func (b *benchRetentionCmd) Validate() error {
	if b.Rows < 10000 {
		return fmt.Errorf("--rows must be at least 10000, got %d", b.Rows)
	}
	return nil
}

// The measurements run the real retention code on the real processed_event
// table, on days of 2024 that hold no real claims, and clean up after.
var benchDay = time.Date(2024, 2, 1, 0, 0, 0, 0, time.UTC)

const (
	benchSchemaSQL = `CREATE SCHEMA IF NOT EXISTS once_bench`
	benchDropSQL   = `DROP SCHEMA IF EXISTS once_bench CASCADE`
	// Same shape as processed_event: the claim key and the processed_at index.
	benchTableSQL = `CREATE TABLE once_bench.%s (
    event_id uuid NOT NULL, consumer_group text NOT NULL, payload_sha256 bytea NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (event_id, consumer_group))`
	benchClaimSQL = `INSERT INTO once_bench.%s (event_id, consumer_group, payload_sha256)
SELECT id, 'billing', '\x00' FROM unnest($1::uuid[]) AS id ON CONFLICT DO NOTHING`
	benchIndexSizeSQL = `SELECT pg_relation_size('once_bench.%s_pkey')`
)

func (b *benchRetentionCmd) Run(ctx context.Context, d deps) error {
	pool, err := b.DB.open(ctx, d, true)
	if err != nil {
		return err
	}
	defer pool.Close()
	var version string
	var fsync string
	_ = pool.QueryRow(ctx, `SELECT current_setting('server_version'), current_setting('fsync')`).Scan(&version, &fsync)
	defer cleanupBench(pool)

	progress := progress.New(d.stderr)
	drop, err := b.measureDrop(ctx, pool, progress)
	if err != nil {
		return err
	}
	del, err := b.measureDelete(ctx, pool, progress)
	if err != nil {
		return err
	}
	v7, err := b.measureInserts(ctx, pool, "claim_v7", func() uuid.UUID { return uuid.Must(uuid.NewV7()) }, progress)
	if err != nil {
		return err
	}
	v4, err := b.measureInserts(ctx, pool, "claim_v4", uuid.New, progress)
	if err != nil {
		return err
	}
	progress.Done()

	w := tabwriter.NewWriter(d.stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(d.stdout, "retention benchmark: N = %d rows, PostgreSQL %s (fsync=%s)\n\n", b.Rows, version, fsync)
	fmt.Fprintln(w, "expire one day of claims\ttime\trows/s\t")
	fmt.Fprintf(w, "drop its partition\t%s\t\t\n", drop.Round(time.Microsecond))
	fmt.Fprintf(w, "delete the rows in batches of 5000\t%s\t%.0f\t\n", del.Round(time.Millisecond), float64(b.Rows)/del.Seconds())
	fmt.Fprintf(w, "delete / drop\t%.0fx\t\t\n", del.Seconds()/drop.Seconds())
	w.Flush()
	fmt.Fprintln(d.stdout)
	w = tabwriter.NewWriter(d.stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "claim table at N rows\tUUIDv7\tUUIDv4\tv4 / v7\t")
	fmt.Fprintf(w, "insert rate (rows/s)\t%.0f\t%.0f\t%.2f\t\n", v7.rate, v4.rate, v4.rate/v7.rate)
	fmt.Fprintf(w, "primary-key index size (MiB)\t%.1f\t%.1f\t%.2f\t\n", mib(v7.indexBytes), mib(v4.indexBytes), float64(v4.indexBytes)/float64(v7.indexBytes))
	return w.Flush()
}

func mib(b int64) float64 { return float64(b) / (1 << 20) }

func cleanupBench(pool *pgxpool.Pool) {
	ctx := context.Background()
	_, _ = pool.Exec(ctx, benchDropSQL)
	for i := -1; i < 12; i++ {
		name := retention.PartitionName(benchDay.AddDate(0, 0, i))
		_, _ = pool.Exec(ctx, "DROP TABLE IF EXISTS "+pgx.Identifier{name}.Sanitize())
	}
	lo, hi := retention.DayRange(benchDay)
	_, _ = pool.Exec(ctx, `DELETE FROM processed_event_default WHERE event_id >= $1 AND event_id < $2`, lo, hi)
}

// loadDay copies N claims with UUIDv7 ids spread over benchDay into
// processed_event, where they land in the day's partition or the default one.
func (b *benchRetentionCmd) loadDay(ctx context.Context, pool *pgxpool.Pool, p *progress.Line, what string) error {
	step := 24 * time.Hour / time.Duration(b.Rows)
	const chunk = 50000
	for start := 0; start < b.Rows; start += chunk {
		n := min(chunk, b.Rows-start)
		rows := make([][]any, n)
		for i := range rows {
			id := retention.FirstIDAt(benchDay.Add(time.Duration(start+i) * step))
			r := uuid.New() // random tail, then the v7 version and variant bits
			copy(id[6:], r[6:])
			id[6] = 0x70 | id[6]&0x0f
			id[8] = 0x80 | id[8]&0x3f
			rows[i] = []any{id, "billing", []byte{0}}
		}
		if _, err := pool.CopyFrom(ctx, pgx.Identifier{schema.DefaultClaimTable}, []string{"event_id", "consumer_group", "payload_sha256"}, pgx.CopyFromRows(rows)); err != nil {
			return fmt.Errorf("load %s: %w", what, err)
		}
		p.Set("loading %s: %d/%d rows", what, start+n, b.Rows)
	}
	return nil
}

func (b *benchRetentionCmd) measureDrop(ctx context.Context, pool *pgxpool.Pool, p *progress.Line) (time.Duration, error) {
	cfg := retention.Config{DB: pool, Logger: quiet, Now: func() time.Time { return benchDay.Add(time.Hour) }}
	if _, err := retention.Run(ctx, cfg); err != nil {
		return 0, err
	}
	if err := b.loadDay(ctx, pool, p, "a daily partition"); err != nil {
		return 0, err
	}
	// The pass that finds the day expired drops it (and creates the partitions
	// of its own today, which is part of any real pass).
	// Delete mode: the pass drops expired partitions in every mode, and with
	// no partitions to create and no rows to delete, it times the drop alone.
	cfg.Mode = retention.Delete
	cfg.Now = func() time.Time { return benchDay.AddDate(0, 0, 8) }
	p.Set("dropping the partition")
	start := time.Now()
	rep, err := retention.Run(ctx, cfg)
	took := time.Since(start)
	if err != nil {
		return 0, err
	}
	if len(rep.Dropped) != 1 {
		return 0, fmt.Errorf("bench: expected one dropped partition, got %v", rep.Dropped)
	}
	return took, nil
}

func (b *benchRetentionCmd) measureDelete(ctx context.Context, pool *pgxpool.Pool, p *progress.Line) (time.Duration, error) {
	// With the day's partition gone, the same rows land in the default partition.
	if err := b.loadDay(ctx, pool, p, "the default partition"); err != nil {
		return 0, err
	}
	p.Set("deleting in batches")
	start := time.Now()
	rep, err := retention.Run(ctx, retention.Config{DB: pool, Mode: retention.Delete, BatchSize: 5000, Logger: quiet,
		Now: func() time.Time { return benchDay.AddDate(0, 0, 8) }})
	took := time.Since(start)
	if err != nil {
		return 0, err
	}
	if rep.Deleted < int64(b.Rows) {
		return 0, fmt.Errorf("bench: deleted %d rows, want %d", rep.Deleted, b.Rows)
	}
	return took, nil
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

type insertFigures struct {
	rate       float64
	indexBytes int64
}

// measureInserts claims N ids, 1,000 per statement, into a table shaped like
// processed_event: the B-tree work per row is what differs between id kinds.
func (b *benchRetentionCmd) measureInserts(ctx context.Context, pool *pgxpool.Pool, table string, next func() uuid.UUID, p *progress.Line) (insertFigures, error) {
	if _, err := pool.Exec(ctx, benchSchemaSQL); err != nil {
		return insertFigures{}, err
	}
	if _, err := pool.Exec(ctx, fmt.Sprintf(benchTableSQL, table)); err != nil {
		return insertFigures{}, err
	}
	const batch = 1000
	ids := make([]uuid.UUID, batch)
	claim := fmt.Sprintf(benchClaimSQL, table)
	var spent time.Duration
	for done := 0; done < b.Rows; done += batch {
		for i := range ids {
			ids[i] = next()
		}
		start := time.Now()
		if _, err := pool.Exec(ctx, claim, ids); err != nil {
			return insertFigures{}, fmt.Errorf("claim into %s: %w", table, err)
		}
		spent += time.Since(start)
		if done%50000 == 0 {
			p.Set("claiming into %s: %d/%d rows", table, done, b.Rows)
		}
	}
	var size int64
	if err := pool.QueryRow(ctx, fmt.Sprintf(benchIndexSizeSQL, table)).Scan(&size); err != nil {
		return insertFigures{}, err
	}
	return insertFigures{rate: float64(b.Rows) / spent.Seconds(), indexBytes: size}, nil
}
