package main

import (
	"context"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/once-dev/once/handlers/billing"
	"github.com/once-dev/once/metrics"
	"github.com/once-dev/once/outbox"
	"github.com/once-dev/once/retention"
)

// retentionSettings are shared by serve (its maintenance loop) and maintain.
type retentionSettings struct {
	Mode        string        `name:"retention-mode" env:"ONCE_RETENTION_MODE" default:"partitioned" enum:"partitioned,delete" help:"partitioned: daily partitions, dropped whole; delete: batch deletes from one table."`
	Retention   time.Duration `name:"dedup-retention" env:"ONCE_DEDUP_RETENTION" default:"168h" help:"How long processed_event keeps a claim; the dedup horizon."`
	DaysAhead   int           `name:"partitions-ahead" env:"ONCE_PARTITIONS_AHEAD" default:"2" help:"Daily partitions kept ready beyond today."`
	BatchSize   int           `name:"delete-batch" env:"ONCE_DELETE_BATCH" default:"5000" help:"Rows per delete statement."`
	LockTimeout time.Duration `name:"retention-lock-timeout" env:"ONCE_RETENTION_LOCK_TIMEOUT" default:"2s" help:"Longest wait of partition DDL for its lock on the claim table; claims queue behind it no longer."`
	LockRetries int           `name:"retention-lock-retries" env:"ONCE_RETENTION_LOCK_RETRIES" default:"5" help:"Tries of a partition statement whose lock was busy, with a growing pause."`
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
	if r.LockTimeout <= 0 || r.LockRetries < 0 {
		return fmt.Errorf("--retention-lock-timeout must be positive and --retention-lock-retries not negative")
	}
	return nil
}

func (r *retentionSettings) config(d deps) retention.Config {
	return retention.Config{Mode: retention.Mode(r.Mode), Retention: r.Retention, DaysAhead: r.DaysAhead, BatchSize: r.BatchSize,
		LockTimeout: r.LockTimeout, LockRetries: r.LockRetries, Logger: d.log}
}

type maintainCmd struct {
	DB              dbSettings        `embed:""`
	GroupDatabases  map[string]string `name:"group-database" env:"ONCE_GROUP_DATABASES" mapsep:";" placeholder:"GROUP=URL;..." help:"The databases of groups that have one of their own, as serve takes them; each is maintained too."`
	Retention       retentionSettings `embed:""`
	SetRetention    bool              `name:"set-retention" help:"Record --dedup-retention as the claim tables' retention, replacing the one recorded; restart every serve with it afterwards."`
	OutboxRetention time.Duration     `name:"outbox-retention" env:"ONCE_OUTBOX_RETENTION" default:"24h" help:"Forwarded rows of the consumer outbox older than this are deleted, as serve does."`
	MetricsFile     string            `name:"metrics-file" env:"ONCE_MAINTAIN_METRICS_FILE" placeholder:"PATH" help:"After a pass that succeeded in every database, write once_retention_last_success_timestamp_seconds to this file (Prometheus text format, replaced atomically), for node_exporter's textfile collector: a cron job is gone before anyone scrapes it. A failed pass leaves the file as it was, so the time ages and OnceRetentionFailing fires. Name it *.prom in the collector's directory."`
}

// writeLastSuccess records now as the last successful retention pass in
// file, as the services export theirs (once_retention_last_success_...).
func writeLastSuccess(file string, now time.Time) error {
	reg := prometheus.NewRegistry()
	g := prometheus.NewGauge(prometheus.GaugeOpts{Namespace: metrics.Namespace, Name: "retention_last_success_timestamp_seconds",
		Help: "When app maintain last completed a retention pass in every database (Unix seconds)."})
	g.Set(float64(now.UnixNano()) / 1e9)
	reg.MustRegister(g)
	if err := prometheus.WriteToTextfile(file, reg); err != nil {
		return fmt.Errorf("--metrics-file (ONCE_MAINTAIN_METRICS_FILE): %w", err)
	}
	return nil
}

func (m *maintainCmd) Run(ctx context.Context, d deps) error {
	pool, err := m.DB.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	groups := make([]string, 0, len(m.GroupDatabases))
	for g := range m.GroupDatabases {
		groups = append(groups, g)
	}
	pools, err := m.DB.groupPools(ctx, d, pool, m.GroupDatabases, groups, false)
	if err != nil {
		return err
	}
	defer pools.close()
	passed := 0
	for _, db := range pools.all {
		cfg := m.Retention.config(d)
		cfg.DB = db
		if m.SetRetention {
			if err := retention.SetRetention(ctx, cfg); err != nil {
				return err
			}
		} else if err := retention.Agree(ctx, cfg); err != nil {
			return fmt.Errorf("--dedup-retention (ONCE_DEDUP_RETENTION): %w; to change it on purpose, pass --set-retention", err)
		}
		rep, err := retention.Run(ctx, cfg)
		if err != nil {
			return fmt.Errorf("database %s: %w", db.Config().ConnConfig.Database, err)
		}
		fmt.Fprintf(d.stdout, "database %s\n", db.Config().ConnConfig.Database)
		if rep.Busy {
			fmt.Fprintln(d.stdout, "  another instance holds the maintenance lock; nothing done")
			continue
		}
		fmt.Fprintf(d.stdout, "  created %d partitions %v\n  dropped %d partitions %v\n  deleted %d expired claims\n  skipped %v\n",
			len(rep.Created), rep.Created, len(rep.Dropped), rep.Dropped, rep.Deleted, rep.Skipped)
		// What serve prunes beside retention, for a serve that runs no
		// maintenance of its own.
		box, err := outbox.New(cfg.Tables, d.log)
		if err != nil {
			return err
		}
		forwarded, err := box.Prune(ctx, db, m.OutboxRetention, 5000)
		if err != nil {
			return fmt.Errorf("database %s: %w", db.Config().ConnConfig.Database, err)
		}
		intents, err := billing.PruneIntents(ctx, db, cfg.Retention)
		if err != nil {
			return fmt.Errorf("database %s: %w", db.Config().ConnConfig.Database, err)
		}
		fmt.Fprintf(d.stdout, "  pruned %d forwarded outbox rows, %d settled charge intents\n", forwarded, intents)
		passed++
	}
	// Only a pass of its own in every database is a success: one that found
	// another instance at work did nothing, and that instance says so.
	if m.MetricsFile != "" && passed == len(pools.all) {
		return writeLastSuccess(m.MetricsFile, time.Now())
	}
	return nil
}
