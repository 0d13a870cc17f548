package retention

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"regexp"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/schema"
)

// Mode selects how expired claims are removed.
type Mode string

const (
	// Partitioned keeps one partition per UTC day and drops expired ones whole.
	Partitioned Mode = "partitioned"
	// Delete keeps every claim in the default partition and deletes expired
	// rows in batches.
	Delete Mode = "delete"
)

// DefaultRetention is how long claims are kept unless configured: duplicates
// arrive within hours, rarely days.
const DefaultRetention = 7 * 24 * time.Hour

// Config configures maintenance. Zero values of optional fields work.
type Config struct {
	DB *pgxpool.Pool
	// Schema and Table name the claim table, as package schema created it.
	// Defaults: "public" and "processed_event".
	Schema string
	Table  string
	// Mode: [Partitioned] (default) or [Delete].
	Mode Mode
	// Retention of claims. Default [DefaultRetention].
	Retention time.Duration
	// DaysAhead: partitions exist for today and this many days after. Default 2.
	DaysAhead int
	// BatchSize of each delete in the default partition. Default 5000.
	BatchSize int
	// Now is the clock. Default time.Now.
	Now    func() time.Time
	Logger *slog.Logger
}

func (c *Config) setDefaults() {
	if c.Schema == "" {
		c.Schema = "public"
	}
	if c.Table == "" {
		c.Table = "processed_event"
	}
	if c.Mode == "" {
		c.Mode = Partitioned
	}
	if c.Retention == 0 {
		c.Retention = DefaultRetention
	}
	if c.DaysAhead == 0 {
		c.DaysAhead = 2
	}
	if c.BatchSize == 0 {
		c.BatchSize = 5000
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Validate reports every missing or impossible setting at once.
func (c Config) Validate() error {
	var errs []error
	if c.DB == nil {
		errs = append(errs, errors.New("retention: Config.DB is required"))
	}
	if c.Mode != Partitioned && c.Mode != Delete {
		errs = append(errs, fmt.Errorf("retention: mode %q: want %q or %q", c.Mode, Partitioned, Delete))
	}
	if c.Retention < 24*time.Hour {
		errs = append(errs, fmt.Errorf("retention: retention %s is shorter than one day, the partition size", c.Retention))
	}
	if c.DaysAhead < 1 || c.BatchSize < 1 {
		errs = append(errs, errors.New("retention: DaysAhead and BatchSize must be at least 1"))
	}
	errs = append(errs, schema.Config{Schema: c.Schema, ClaimTable: c.Table}.Validate())
	return errors.Join(errs...)
}

// Report says what one pass did.
type Report struct {
	// Busy: another instance holds the maintenance lock; this pass did nothing.
	Busy    bool
	Created []string
	Dropped []string
	// Deleted rows from the default partition.
	Deleted int64
	// Skipped days whose range already has claims in the default partition:
	// their partition cannot be created; the rows age out by deletion.
	Skipped []string
}

// lockKey identifies the maintenance advisory lock of one claim table: the
// same for every instance, different for every table. The default table
// keeps the constant of the releases before tables had names, so that old
// and new instances of a rolling deploy still take turns.
func lockKey(cfg Config) int64 {
	if cfg.Schema == "public" && cfg.Table == "processed_event" {
		return 0x6f6e63655f726574 // "once_ret"
	}
	h := fnv.New64a()
	h.Write([]byte("once_retention:" + cfg.Schema + "." + cfg.Table))
	return int64(h.Sum64() >> 1)
}

const (
	tryLockSQL = `SELECT pg_try_advisory_lock($1)`
	unlockSQL  = `SELECT pg_advisory_unlock($1)`
	// Daily partitions are named <table>_pYYYYMMDD by this package only.
	listPartitionsSQL = `SELECT c.relname FROM pg_inherits i
JOIN pg_class c ON c.oid = i.inhrelid
JOIN pg_class p ON p.oid = i.inhparent
JOIN pg_namespace n ON n.oid = p.relnamespace
WHERE n.nspname = $1 AND p.relname = $2`
	// %s: the default partition's qualified name.
	defaultHasRowsSQL = `SELECT EXISTS (SELECT 1 FROM %s WHERE event_id >= $1 AND event_id < $2)`
	deleteBatchSQL    = `DELETE FROM %[1]s WHERE (event_id, consumer_group) IN (
SELECT event_id, consumer_group FROM %[1]s WHERE event_id < $1 LIMIT $2)`
)

// names are one claim table's relations.
type names struct {
	schema, table string
	parent        string // qualified, quoted
	defaultPart   string // qualified, quoted
	daily         *regexp.Regexp
}

func namesOf(cfg Config) names {
	return names{
		schema:      cfg.Schema,
		table:       cfg.Table,
		parent:      pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize(),
		defaultPart: pgx.Identifier{cfg.Schema, cfg.Table + "_default"}.Sanitize(),
		daily:       regexp.MustCompile(`^` + regexp.QuoteMeta(cfg.Table) + `_p(\d{8})$`),
	}
}

// Run makes one maintenance pass. It is safe to call from many instances at
// once: only the holder of the advisory lock works, the others report Busy.
func Run(ctx context.Context, cfg Config) (Report, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return Report{}, err
	}
	conn, err := cfg.DB.Acquire(ctx)
	if err != nil {
		return Report{}, fmt.Errorf("retention: acquire connection: %w", err)
	}
	defer conn.Release()
	var locked bool
	key := lockKey(cfg)
	if err := conn.QueryRow(ctx, tryLockSQL, key).Scan(&locked); err != nil {
		return Report{}, fmt.Errorf("retention: advisory lock: %w", err)
	}
	if !locked {
		return Report{Busy: true}, nil
	}
	defer func() {
		// A session lock outlives a failed statement; release it even when ctx ended.
		_, _ = conn.Exec(context.WithoutCancel(ctx), unlockSQL, key)
	}()

	var rep Report
	n := namesOf(cfg)
	now := cfg.Now().UTC()
	cutoff := now.Add(-cfg.Retention)
	if err := dropExpired(ctx, conn.Conn(), n, cutoff, &rep); err != nil {
		return rep, err
	}
	if cfg.Mode == Partitioned {
		if err := createAhead(ctx, conn.Conn(), n, now, cfg.DaysAhead, &rep); err != nil {
			return rep, err
		}
	}
	if err := deleteExpired(ctx, conn.Conn(), n, cutoff, cfg.BatchSize, &rep); err != nil {
		return rep, err
	}
	if len(rep.Created)+len(rep.Dropped) > 0 || rep.Deleted > 0 {
		cfg.Logger.Info("retention pass", "mode", cfg.Mode, "created", rep.Created, "dropped", rep.Dropped, "deleted", rep.Deleted, "skipped", rep.Skipped)
	}
	return rep, nil
}

// Loop runs a pass every interval until ctx ends. Errors are logged, not
// fatal: a missed pass only delays cleanup, and the next one catches up.
func Loop(ctx context.Context, cfg Config, interval time.Duration) {
	cfg.setDefaults()
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		if _, err := Run(ctx, cfg); err != nil && ctx.Err() == nil {
			cfg.Logger.Error("retention pass failed", "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func dropExpired(ctx context.Context, conn *pgx.Conn, n names, cutoff time.Time, rep *Report) error {
	rows, err := conn.Query(ctx, listPartitionsSQL, n.schema, n.table)
	if err != nil {
		return fmt.Errorf("retention: list partitions: %w", err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("retention: list partitions: %w", err)
	}
	for _, name := range names {
		m := n.daily.FindStringSubmatch(name)
		if m == nil {
			continue
		}
		day, err := time.Parse("20060102", m[1])
		if err != nil {
			continue
		}
		// Only when every id of the day is older than the retention.
		if day.AddDate(0, 0, 1).After(cutoff) {
			continue
		}
		if _, err := conn.Exec(ctx, "DROP TABLE IF EXISTS "+pgx.Identifier{n.schema, name}.Sanitize()); err != nil {
			return fmt.Errorf("retention: drop %s: %w", name, err)
		}
		rep.Dropped = append(rep.Dropped, name)
	}
	return nil
}

func createAhead(ctx context.Context, conn *pgx.Conn, n names, now time.Time, daysAhead int, rep *Report) error {
	today := now.Truncate(24 * time.Hour)
	for i := 0; i <= daysAhead; i++ {
		day := today.AddDate(0, 0, i)
		lo, hi := DayRange(day)
		name := n.table + "_p" + day.UTC().Format("20060102")
		var exists bool
		if err := conn.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, pgx.Identifier{n.schema, name}.Sanitize()).Scan(&exists); err != nil {
			return fmt.Errorf("retention: look up %s: %w", name, err)
		}
		if exists {
			continue
		}
		var occupied bool
		if err := conn.QueryRow(ctx, fmt.Sprintf(defaultHasRowsSQL, n.defaultPart), lo, hi).Scan(&occupied); err != nil {
			return fmt.Errorf("retention: check default partition for %s: %w", name, err)
		}
		if occupied {
			rep.Skipped = append(rep.Skipped, name)
			continue
		}
		// DDL takes no bind parameters: the name and bounds are formatted from
		// a date and two UUID values this function computed, never from input.
		ddl := fmt.Sprintf("CREATE TABLE IF NOT EXISTS %s PARTITION OF %s FOR VALUES FROM ('%s') TO ('%s')",
			pgx.Identifier{n.schema, name}.Sanitize(), n.parent, lo, hi)
		if _, err := conn.Exec(ctx, ddl); err != nil {
			return fmt.Errorf("retention: create %s: %w", name, err)
		}
		rep.Created = append(rep.Created, name)
	}
	return nil
}

func deleteExpired(ctx context.Context, conn *pgx.Conn, n names, cutoff time.Time, batch int, rep *Report) error {
	bound := FirstIDAt(cutoff)
	q := fmt.Sprintf(deleteBatchSQL, n.defaultPart)
	for {
		tag, err := conn.Exec(ctx, q, bound, batch)
		if err != nil {
			return fmt.Errorf("retention: delete expired claims: %w", err)
		}
		rep.Deleted += tag.RowsAffected()
		if tag.RowsAffected() < int64(batch) {
			return nil
		}
	}
}

// FirstIDAt returns the smallest UUID whose UUIDv7 timestamp is t's
// millisecond: every UUIDv7 generated at t or later sorts at or above it.
func FirstIDAt(t time.Time) uuid.UUID {
	var id uuid.UUID
	var ms [8]byte
	binary.BigEndian.PutUint64(ms[:], uint64(t.UnixMilli()))
	copy(id[:6], ms[2:])
	return id
}

// DayRange returns the ids of one UTC day: [lo, hi).
func DayRange(day time.Time) (lo, hi uuid.UUID) {
	start := day.UTC().Truncate(24 * time.Hour)
	return FirstIDAt(start), FirstIDAt(start.AddDate(0, 0, 1))
}

// PartitionName is the name of the daily partition of the default claim
// table (public.processed_event) holding day's ids.
func PartitionName(day time.Time) string {
	return "processed_event_p" + day.UTC().Format("20060102")
}
