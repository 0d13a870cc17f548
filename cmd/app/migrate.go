package main

import (
	"context"
	"fmt"
	"time"

	"github.com/once-dev/once/retention"
)

type migrateCmd struct {
	DB        dbSettings    `embed:""`
	Retention time.Duration `name:"dedup-retention" env:"ONCE_DEDUP_RETENTION" default:"168h" help:"The claims' retention, recorded for every process of the claim table to agree on (as app serve and app maintain are given it). Recorded here, by the tables' owner: a group's least-privilege role may read it, not record it."`
}

func (m *migrateCmd) Validate() error {
	if m.Retention < 24*time.Hour {
		return fmt.Errorf("--dedup-retention (ONCE_DEDUP_RETENTION) must be at least 24h (one partition), got %s", m.Retention)
	}
	return nil
}

func (m *migrateCmd) Run(ctx context.Context, d deps) error {
	pool, err := m.DB.open(ctx, d, true)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := retention.Agree(ctx, retention.Config{DB: pool, Retention: m.Retention, Logger: d.log}); err != nil {
		return fmt.Errorf("--dedup-retention (ONCE_DEDUP_RETENTION): %w", err)
	}
	return nil
}
