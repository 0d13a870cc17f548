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
	DB             dbSettings    `embed:""`
	Retention      time.Duration `name:"dedup-retention" env:"ONCE_DEDUP_RETENTION" default:"168h" help:"The claims' retention, recorded for every process of the claim table to agree on (as app serve and app maintain are given it). Recorded here, by the tables' owner: a group's least-privilege role may read it, not record it."`
	GuideRetention time.Duration `name:"guide-retention" env:"ONCE_GUIDE_RETENTION" default:"0s" help:"How long the style guide's claim table being adopted (by the migration, or --adopt-claims) kept its claims: its cleanup job's retention (a table no job cleaned: --dedup-retention). The adopted claims cover that far back, or to the oldest one if further: the dedup horizon starts there and widens as once's own claims reach back; an older event is refused, not run again. At most --dedup-retention: in the adopted table the guide's consumer, which checks no horizon, relies on its claims for as long as its cleanup kept them. 0: as far as the oldest adopted claim."`
	AdoptClaims    []string      `name:"adopt-claims" env:"ONCE_ADOPT_CLAIMS" sep:"," placeholder:"SCHEMA.TABLE,..." help:"Copy the claims of the style guide's processed_event, kept apart because its consumers still claim there for the groups not moved yet, into processed_event: run it when a group moves from the guide's consumer to app serve, after that consumer stopped and before app serve starts. Each claim keeps its processed_at and matches by event id. Run again, it copies what was claimed since. (The guide's table at public.processed_event itself is adopted by the migration.)"`
}

func (m *migrateCmd) Validate() error {
	if m.Retention < 24*time.Hour {
		return fmt.Errorf("--dedup-retention (ONCE_DEDUP_RETENTION) must be at least 24h (one partition), got %s", m.Retention)
	}
	if m.GuideRetention < 0 || m.GuideRetention > m.Retention {
		return fmt.Errorf("--guide-retention (ONCE_GUIDE_RETENTION) %s: want from 0 to --dedup-retention (%s): the guide's consumer, claiming in the adopted table, "+
			"checks no horizon, and once's retention would delete its claims before its own cleanup did; set --dedup-retention to at least the guide's retention", m.GuideRetention, m.Retention)
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
	if err := retention.Agree(ctx, retention.Config{DB: pool, Retention: m.Retention, GuideRetention: m.GuideRetention, Logger: d.log}); err != nil {
		return fmt.Errorf("--dedup-retention (ONCE_DEDUP_RETENTION): %w", err)
	}
	for _, from := range m.AdoptClaims {
		n, err := schema.AdoptClaims(ctx, pool, schema.Config{}, from, m.GuideRetention)
		if err != nil {
			return fmt.Errorf("--adopt-claims (ONCE_ADOPT_CLAIMS) %s: %w", from, err)
		}
		d.log.Info("claims adopted from the style guide's table", "from", from, "into", schema.Config{}.Claims().Name, "copied", n)
	}
	// Adopted claims may reach back less than the retention: say how far
	// the dedup horizon reaches now, and that it widens.
	claims, policy := schema.Config{}.Claims(), schema.Config{}.RetentionPolicy()
	var seconds int64
	if err := pool.QueryRow(ctx, `SELECT `+schema.CoveredRetention("")+` FROM `+policy.Qualified+` WHERE claim_table = $1`, claims.Name).Scan(&seconds); err != nil {
		return fmt.Errorf("read the dedup horizon of %s: %w", claims, err)
	}
	if covered := time.Duration(seconds) * time.Second; covered < m.Retention {
		d.log.Warn("the claims adopted from the style guide's table reach back less than --dedup-retention: an older event is refused as too old, "+
			"not run again, until once's own claims reach back (--guide-retention says how long the guide's table kept its claims)",
			"claim_table", claims.Name, "horizon", covered, "dedup_retention", m.Retention, "full_from", time.Now().Add(m.Retention-covered).UTC().Format(time.RFC3339))
	}
	return nil
}
