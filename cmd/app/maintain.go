package main

import (
	"context"
	"fmt"
	"time"

	"github.com/once-dev/once/retention"
)

// retentionSettings are shared by serve (its maintenance loop) and maintain.
type retentionSettings struct {
	Mode      string        `name:"retention-mode" env:"ONCE_RETENTION_MODE" default:"partitioned" enum:"partitioned,delete" help:"partitioned: daily partitions, dropped whole; delete: batch deletes from one table."`
	Retention time.Duration `name:"dedup-retention" env:"ONCE_DEDUP_RETENTION" default:"168h" help:"How long processed_event keeps a claim; the dedup horizon."`
	DaysAhead int           `name:"partitions-ahead" env:"ONCE_PARTITIONS_AHEAD" default:"2" help:"Daily partitions kept ready beyond today."`
	BatchSize int           `name:"delete-batch" env:"ONCE_DELETE_BATCH" default:"5000" help:"Rows per delete statement."`
}

func (r *retentionSettings) Validate() error {
	if r.Retention < 24*time.Hour {
		return fmt.Errorf("--dedup-retention (ONCE_DEDUP_RETENTION) must be at least 24h (one partition), got %s", r.Retention)
	}
	if r.DaysAhead < 2 {
		return fmt.Errorf("--partitions-ahead (ONCE_PARTITIONS_AHEAD) must be at least 2, got %d", r.DaysAhead)
	}
	if r.BatchSize < 1 {
		return fmt.Errorf("--delete-batch (ONCE_DELETE_BATCH) must be at least 1")
	}
	return nil
}

func (r *retentionSettings) config(d deps) retention.Config {
	return retention.Config{Mode: retention.Mode(r.Mode), Retention: r.Retention, DaysAhead: r.DaysAhead, BatchSize: r.BatchSize, Logger: d.log}
}

type maintainCmd struct {
	DB        dbSettings        `embed:""`
	Retention retentionSettings `embed:""`
}

func (m *maintainCmd) Run(ctx context.Context, d deps) error {
	pool, err := m.DB.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	cfg := m.Retention.config(d)
	cfg.DB = pool
	rep, err := retention.Run(ctx, cfg)
	if err != nil {
		return err
	}
	if rep.Busy {
		fmt.Fprintln(d.stdout, "another instance holds the maintenance lock; nothing done")
		return nil
	}
	fmt.Fprintf(d.stdout, "created %d partitions %v\ndropped %d partitions %v\ndeleted %d expired claims\nskipped %v\n",
		len(rep.Created), rep.Created, len(rep.Dropped), rep.Dropped, rep.Deleted, rep.Skipped)
	return nil
}
