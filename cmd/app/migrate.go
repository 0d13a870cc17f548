package main

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/once-dev/once/internal/reference"
	"github.com/once-dev/once/migrations"
	"github.com/once-dev/once/retention"
	"github.com/once-dev/once/schema"
)

type migrateCmd struct {
	DB             dbSettings        `embed:""`
	GroupDatabases map[string]string `name:"group-database" env:"ONCE_GROUP_DATABASES" mapsep:";" placeholder:"GROUP=URL;..." help:"The databases of groups that have one of their own, as serve takes them: each is migrated too and made its groups' own: CONNECT revoked from PUBLIC and granted to their roles (once_GROUP), the other groups' roles left no privilege there. Run as each database's owner."`
	Retention      retentionSettings `embed:""`
	GuideRetention time.Duration     `name:"guide-retention" env:"ONCE_GUIDE_RETENTION" default:"0s" help:"How long the style guide's claim table being adopted (by the migration, or --adopt-claims) kept its claims: its cleanup job's retention (a table no job cleaned: --dedup-retention). The adopted claims cover that far back, or to the oldest one if further: the dedup horizon starts there and widens as once's own claims reach back; an older event is refused, not run again. At most --dedup-retention: in the adopted table the guide's consumer, which checks no horizon, relies on its claims for as long as its cleanup kept them. 0: as far as the oldest adopted claim."`
	AdoptClaims    []string          `name:"adopt-claims" env:"ONCE_ADOPT_CLAIMS" sep:"," placeholder:"SCHEMA.TABLE,..." help:"Copy the claims of the style guide's processed_event, kept apart because its consumers still claim there for the groups not moved yet, into processed_event: run it when a group moves from the guide's consumer to app serve, after that consumer stopped and before app serve starts. Each claim keeps its processed_at and matches by event id. Run again, it copies what was claimed since. (The guide's table at public.processed_event itself is adopted by the migration.)"`
}

func (m *migrateCmd) Validate() error {
	if m.GuideRetention < 0 || m.GuideRetention > m.Retention.Retention {
		return fmt.Errorf("--guide-retention (ONCE_GUIDE_RETENTION) %s: want from 0 to --dedup-retention (%s): the guide's consumer, claiming in the adopted table, "+
			"checks no horizon, and once's retention would delete its claims before its own cleanup did; set --dedup-retention to at least the guide's retention", m.GuideRetention, m.Retention.Retention)
	}
	for _, from := range m.AdoptClaims {
		if strings.Count(from, ".") != 1 || strings.HasPrefix(from, ".") || strings.HasSuffix(from, ".") {
			return fmt.Errorf("--adopt-claims (ONCE_ADOPT_CLAIMS) %q: want the guide's table as schema.table", from)
		}
	}
	for g := range m.GroupDatabases {
		if !slices.Contains(reference.Groups, g) {
			return fmt.Errorf("--group-database (ONCE_GROUP_DATABASES): unknown group %q", g)
		}
	}
	return nil
}

// migrateTarget is a database app migrate migrates, and the groups it is
// the own database of (none: the main one).
type migrateTarget struct {
	db     dbSettings
	groups []string
}

// targets are the main database, then each group's own, once each. A
// database is known by what the server says it is (the cluster's system
// identifier, or its address, and the database's name), not by the text
// of its URL: the main database written another way in --group-database
// (another host name, a parameter) is still the main one, which serves
// every group, and must not be made one group's own.
func (m *migrateCmd) targets(ctx context.Context) ([]migrateTarget, error) {
	mainID, err := databaseIdentity(ctx, m.DB)
	if err != nil {
		return nil, err
	}
	out := []migrateTarget{{db: m.DB}}
	at := map[string]int{}
	for _, g := range slices.Sorted(maps.Keys(m.GroupDatabases)) {
		db := m.DB.forGroup(m.GroupDatabases[g])
		id, err := databaseIdentity(ctx, db)
		if err != nil {
			return nil, err
		}
		if id == mainID {
			continue
		}
		if i, ok := at[id]; ok {
			return nil, fmt.Errorf("--group-database (ONCE_GROUP_DATABASES): %s and %s name one database (%s): a database of a group's own serves that group alone "+
				"(its CONNECT is its group's); give each group its own, or leave both in the main database", out[i].groups[0], g, id)
		}
		at[id] = len(out)
		out = append(out, migrateTarget{db: db, groups: []string{g}})
	}
	return out, nil
}

// databaseIdentity is the database db names, as the server knows it.
func databaseIdentity(ctx context.Context, db dbSettings) (string, error) {
	pool, err := db.connect(ctx)
	if err != nil {
		return "", err
	}
	defer pool.Close()
	var id string
	if err := pool.QueryRow(ctx, `SELECT (SELECT system_identifier FROM pg_control_system())::text || '/' || current_database()`).Scan(&id); err == nil {
		return id, nil
	}
	// pg_control_system() may be revoked from PUBLIC: the server's address.
	if err := pool.QueryRow(ctx, `SELECT coalesce(host(inet_server_addr()), 'socket') || ':' || current_setting('port') || '/' || current_database()`).Scan(&id); err != nil {
		return "", fmt.Errorf("%s: which database: %w", db.setting(), err)
	}
	return id, nil
}

// leastPrivilege is whether this run sets up least privilege (a database
// per group): then a missing group role is an error, not a warning.
func (m *migrateCmd) leastPrivilege() bool { return len(m.GroupDatabases) > 0 }

func (m *migrateCmd) Run(ctx context.Context, d deps) error {
	targets, err := m.targets(ctx)
	if err != nil {
		return err
	}
	for i, t := range targets {
		if err := m.migrate(ctx, d, t, i == 0); err != nil {
			if t.groups != nil {
				return fmt.Errorf("%s: %w", t.db.setting(), err)
			}
			return err
		}
	}
	return nil
}

// migrate applies the migrations to one database, makes it its groups' own
// (a group's database), records the claims' retention there, and runs a
// retention pass, which makes today's and the next days' partitions (the
// first day's claims would land in the default partition for good).
func (m *migrateCmd) migrate(ctx context.Context, d deps, t migrateTarget, main bool) error {
	pool, err := t.db.open(ctx, d, true)
	if err != nil {
		return err
	}
	defer pool.Close()
	// Every time, not only when something was pending: a group role that
	// did not exist when a migration ran got nothing from it.
	// A group's database is made its own first: Grant then grants no
	// other group anything there, not even for a moment.
	grant := migrations.Groups
	if t.groups != nil {
		grant = t.groups
		if err := migrations.Dedicate(ctx, pool, t.groups); err != nil {
			return err
		}
		d.log.Info("the database is its groups' own", "database", pool.Config().ConnConfig.Database, "groups", t.groups)
	} else if err := migrations.Share(ctx, pool); err != nil {
		return err
	}
	err = migrations.Grant(ctx, pool, grant)
	var missing *migrations.MissingRolesError
	if errors.As(err, &missing) && !m.leastPrivilege() {
		// The set-up without least privilege (no --group-database) uses
		// no group role: it is not refused for the ones missing, which
		// get nothing (row security shows a role made later no row until
		// app migrate runs again). Safe either way; said once.
		d.log.Warn("group roles missing; the others granted (run again once they exist, for least privilege)", "err", err.Error())
		err = migrations.Grant(ctx, pool, missing.Existing(grant))
	}
	if err != nil {
		return err
	}
	cfg := m.Retention.config(d)
	cfg.DB, cfg.GuideRetention = pool, m.GuideRetention
	if err := retention.Agree(ctx, cfg); err != nil {
		return fmt.Errorf("--dedup-retention (ONCE_DEDUP_RETENTION): %w", err)
	}
	if main {
		for _, from := range m.AdoptClaims {
			n, err := schema.AdoptClaims(ctx, pool, schema.Config{}, from, m.GuideRetention)
			if err != nil {
				return fmt.Errorf("--adopt-claims (ONCE_ADOPT_CLAIMS) %s: %w", from, err)
			}
			d.log.Info("claims adopted from the style guide's table", "from", from, "into", schema.Config{}.Claims().Name, "copied", n)
		}
	}
	rep, err := retention.Run(ctx, cfg)
	if err != nil {
		return fmt.Errorf("retention pass (today's and the next partitions): %w", err)
	}
	d.log.Info("retention pass", "database", pool.Config().ConnConfig.Database, "created", rep.Created, "busy", rep.Busy)
	// Adopted claims may reach back less than the retention: say how far
	// the dedup horizon reaches now, and that it widens.
	claims, policy := schema.Config{}.Claims(), schema.Config{}.RetentionPolicy()
	var seconds int64
	if err := pool.QueryRow(ctx, `SELECT `+schema.CoveredRetention("")+` FROM `+policy.Qualified+` WHERE claim_table = $1`, claims.Name).Scan(&seconds); err != nil {
		return fmt.Errorf("read the dedup horizon of %s: %w", claims, err)
	}
	if covered := time.Duration(seconds) * time.Second; covered < m.Retention.Retention {
		d.log.Warn("the claims adopted from the style guide's table reach back less than --dedup-retention: an older event is refused as too old, "+
			"not run again, until once's own claims reach back (--guide-retention says how long the guide's table kept its claims)",
			"claim_table", claims.Name, "horizon", covered, "dedup_retention", m.Retention.Retention, "full_from", time.Now().Add(m.Retention.Retention-covered).UTC().Format(time.RFC3339))
	}
	return nil
}
