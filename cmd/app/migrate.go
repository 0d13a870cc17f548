package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/once-dev/once/retention"
	"github.com/once-dev/once/schema"
)

type migrateCmd struct {
	DB          dbSettings    `embed:""`
	Retention   time.Duration `name:"dedup-retention" env:"ONCE_DEDUP_RETENTION" default:"168h" help:"The claims' retention, recorded for every process of the claim table to agree on (as app serve and app maintain are given it). Recorded here, by the tables' owner: a group's least-privilege role may read it, not record it."`
	AdoptClaims []string      `name:"adopt-claims" env:"ONCE_ADOPT_CLAIMS" sep:"," placeholder:"SCHEMA.TABLE,..." help:"Copy the claims of the style guide's processed_event, kept apart because its consumers still claim there for the groups not moved yet, into processed_event: run it when a group moves from the guide's consumer to app serve, after that consumer stopped and before app serve starts. Each claim keeps its processed_at and matches by event id. Run again, it copies what was claimed since. (The guide's table at public.processed_event itself is adopted by the migration.)"`
}

func (m *migrateCmd) Validate() error {
	if m.Retention < 24*time.Hour {
		return fmt.Errorf("--dedup-retention (ONCE_DEDUP_RETENTION) must be at least 24h (one partition), got %s", m.Retention)
	}
	for _, from := range m.AdoptClaims {
		if strings.Count(from, ".") != 1 || strings.HasPrefix(from, ".") || strings.HasSuffix(from, ".") {
			return fmt.Errorf("--adopt-claims (ONCE_ADOPT_CLAIMS) %q: want the guide's table as schema.table", from)
		}
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
	for _, from := range m.AdoptClaims {
		n, err := schema.AdoptClaims(ctx, pool, schema.Config{}, from)
		if err != nil {
			return fmt.Errorf("--adopt-claims (ONCE_ADOPT_CLAIMS) %s: %w", from, err)
		}
		d.log.Info("claims adopted from the style guide's table", "from", from, "into", schema.Config{}.Claims().Name, "copied", n)
	}
	return nil
}
