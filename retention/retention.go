package retention

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/once-dev/once/pgdb"
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
	DB pgdb.DB
	// Tables names the claim table and the lease and policy tables beside
	// it, as package schema created them. Default: schema's defaults.
	Tables schema.Config
	// Mode: [Partitioned] (default) or [Delete].
	Mode Mode
	// Retention of claims. Default [DefaultRetention].
	Retention time.Duration
	// GuideRetention is how long the style guide's claim table that was
	// adopted into this one (schema.Migrate, schema.AdoptClaims) kept its
	// claims: its cleanup job's retention (a table no job cleaned: at
	// least Retention). When [Agree] records the first retention of a
	// claim table holding claims without a fingerprint, the dedup horizon
	// starts as far back as they reach, this or the time since the oldest
	// was processed if longer (schema.AdoptedCoverage), and widens as the
	// library's own claims reach back. Nothing else reads it. It may not be
	// longer than Retention: the guide's consumer checks no horizon, and
	// claiming in the adopted table, it relies on its claims for as long
	// as its cleanup kept them. Default 0: as far as the oldest reaches.
	GuideRetention time.Duration
	// DaysAhead: partitions exist for today and this many days after. Default 2.
	DaysAhead int
	// BatchSize of each delete in the default partition. Default 5000.
	BatchSize int
	// LockTimeout bounds each wait for a lock that partition DDL needs
	// (attaching and detaching take locks on the claim table that claims
	// queue behind): a pass that cannot get one gives up after it, so claims
	// wait at most that long, and tries again after a backoff, LockRetries
	// times. Defaults: 2s and 5.
	LockTimeout time.Duration
	LockRetries int
	// Now is the clock, for tests that move time. Default: the database's
	// clock, the one consumers judge an event's age by; the maintenance
	// host's own clock may be minutes off it.
	Now func() time.Time
	// OnPass is told of every pass of [Loop] (for metrics). Default: none.
	OnPass func(Report, error)
	Logger *slog.Logger
}

func (c *Config) setDefaults() {
	c.Tables = c.Tables.WithDefaults()
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
	if c.LockTimeout == 0 {
		c.LockTimeout = 2 * time.Second
	}
	if c.LockRetries == 0 {
		c.LockRetries = 5
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Validate reports every missing or impossible setting at once, defaults
// applied. It has no side effects.
func (c Config) Validate() error {
	c.setDefaults()
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
	if c.GuideRetention < 0 || c.GuideRetention > c.Retention {
		errs = append(errs, fmt.Errorf("retention: GuideRetention %s: want from 0 to the retention, %s: the guide's consumer, claiming in the adopted "+
			"table, checks no horizon, and retention would delete its claims before its own cleanup did; keep claims at least as long", c.GuideRetention, c.Retention))
	}
	if c.DaysAhead < 1 || c.BatchSize < 1 || c.LockRetries < 0 || c.LockTimeout < 0 {
		errs = append(errs, errors.New("retention: DaysAhead and BatchSize must be at least 1, LockTimeout and LockRetries not negative"))
	}
	errs = append(errs, c.Tables.Validate())
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
	// Kept expired days whose partition holds claims without a fingerprint
	// processed within the retention (see deleteByProcessedAtSQL): it is
	// dropped once they aged out.
	Kept []string
	// LockWaits counts DDL statements that gave way to claims (their lock
	// was busy for the lock timeout) and were tried again.
	LockWaits int
}

// leaseName names the maintenance lease of one claim table: the same for
// every instance, different for every table.
func leaseName(cfg Config) string { return "retention:" + cfg.Tables.Claims().Name }

// leaseFor is how long a pass holds the maintenance lease without renewing
// it: a pass renews it before every step, and an instance that died in a
// pass leaves it to the others after this.
const leaseFor = 2 * time.Minute

const (
	// A row lease, not an advisory lock: a session-level lock lives on one
	// server connection, which a transaction pooler (PgBouncer) hands to
	// other clients between transactions, and its unlock may land on
	// another one, leaving it held for good. %s: the lease table.
	acquireLeaseSQL = `INSERT INTO %s AS l (name, holder, until) VALUES ($1, $2, now() + make_interval(secs => $3))
ON CONFLICT (name) DO UPDATE SET holder = EXCLUDED.holder, until = EXCLUDED.until
WHERE l.until < now() OR l.holder = EXCLUDED.holder
RETURNING holder`
	renewLeaseSQL   = `UPDATE %s SET until = now() + make_interval(secs => $3) WHERE name = $1 AND holder = $2`
	releaseLeaseSQL = `UPDATE %s SET until = now() WHERE name = $1 AND holder = $2`
	// %s: the default partition's qualified name.
	defaultHasRowsSQL = `SELECT EXISTS (SELECT 1 FROM %s WHERE event_id >= $1 AND event_id < $2)`
	// The library's own claims expire with their event's id: the dedup
	// horizon refuses an event older than the retention, so its claim is
	// not needed past it.
	deleteBatchSQL = `DELETE FROM %[1]s WHERE (event_id, consumer_group) IN (
SELECT event_id, consumer_group FROM %[1]s WHERE event_id < $1 AND payload_sha256 IS NOT NULL LIMIT $2)`
	// A claim without a fingerprint (adopted from the style guide's table,
	// or made by the guide's consumer, which may keep claiming in the
	// adopted table) expires with its processed_at, by the library's
	// retention, which replaces the guide's (and may not be shorter):
	// that consumer checks no horizon, so it may have processed an event
	// long after its id's time, and its redeliveries are held off for the
	// retention from then. $1: the cutoff.
	deleteByProcessedAtSQL = `DELETE FROM %[1]s WHERE (event_id, consumer_group) IN (
SELECT event_id, consumer_group FROM %[1]s WHERE payload_sha256 IS NULL AND processed_at < $1 LIMIT $2)`
	// For the same reason an expired day's partition is kept while such a
	// claim in it was processed within the retention. %s: the partition.
	recentWithoutFingerprintSQL = `SELECT EXISTS (SELECT 1 FROM %s WHERE payload_sha256 IS NULL AND processed_at >= $1)`
)

// errKeep rolls back the detach of a day's partition that, seen under the
// detach's lock, holds a claim to keep.
var errKeep = errors.New("retention: the partition holds a recent claim without a fingerprint")

// errLeaseLost stops a pass whose lease another instance took (it outlived
// the lease without renewing it): the other instance works now.
var errLeaseLost = errors.New("retention: the maintenance lease was taken by another instance; this pass stops")

// lease is one pass's hold on a claim table's maintenance.
type lease struct {
	db     pgdb.DB
	table  string // qualified lease table
	name   string
	holder uuid.UUID
}

// renew extends the lease before a step of the pass.
func (l lease) renew(ctx context.Context) error {
	return inTx(ctx, l.db, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, fmt.Sprintf(renewLeaseSQL, l.table), l.name, pgtype.UUID{Bytes: l.holder, Valid: true}, leaseFor.Seconds())
		if err != nil {
			return fmt.Errorf("retention: renew the maintenance lease: %w", err)
		}
		if tag.RowsAffected() == 0 {
			return errLeaseLost
		}
		return nil
	})
}

// inTx runs f in a transaction of its own: every statement of a pass is
// in one, whatever connection a pooler gives it. The server ends it after
// idleBound of silence: a pass's transactions run their own statements
// back to back, so silence means the pass is gone, and what it held must
// not outlive it by much (a detach holds the claim table's exclusive
// lock: every claim of every group waits on it).
func inTx(ctx context.Context, db pgdb.DB, f func(pgx.Tx) error) error {
	return pgdb.InTxBounded(ctx, db, idleBound, f)
}

// idleBound is how long a pass's transaction may sit idle on the server.
const idleBound = 10 * time.Second

// names are one claim table's relations.
type names struct {
	schema, table string
	parent        string // qualified, quoted
	defaultPart   string // qualified, quoted
	daily         *regexp.Regexp
}

func namesOf(cfg Config) names {
	return names{
		schema:      cfg.Tables.Schema,
		table:       cfg.Tables.ClaimTable,
		parent:      cfg.Tables.Claims().Qualified,
		defaultPart: cfg.Tables.ClaimsDefault().Qualified,
		daily:       regexp.MustCompile(`^` + regexp.QuoteMeta(cfg.Tables.ClaimTable) + `_p(\d{8})$`),
	}
}

// Run makes one maintenance pass. It is safe to call from many instances at
// once: only the holder of the table's maintenance lease works, the others
// report Busy.
func Run(ctx context.Context, cfg Config) (Report, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return Report{}, err
	}
	l := lease{db: cfg.DB, table: cfg.Tables.Lease().Qualified, name: leaseName(cfg), holder: uuid.New()}
	var got bool
	if err := inTx(ctx, cfg.DB, func(tx pgx.Tx) error {
		var holder pgtype.UUID
		err := tx.QueryRow(ctx, fmt.Sprintf(acquireLeaseSQL, l.table), l.name, pgtype.UUID{Bytes: l.holder, Valid: true}, leaseFor.Seconds()).Scan(&holder)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		got = err == nil
		return err
	}); err != nil {
		return Report{}, fmt.Errorf("retention: take the maintenance lease: %w", err)
	}
	if !got {
		return Report{Busy: true}, nil
	}
	defer func() {
		// Released even when ctx ended: the next pass need not wait for
		// the lease to run out.
		release := context.WithoutCancel(ctx)
		_ = inTx(release, cfg.DB, func(tx pgx.Tx) error {
			_, err := tx.Exec(release, fmt.Sprintf(releaseLeaseSQL, l.table), l.name, pgtype.UUID{Bytes: l.holder, Valid: true})
			return err
		})
	}()

	var rep Report
	n := namesOf(cfg)
	var now time.Time
	if cfg.Now != nil {
		now = cfg.Now()
	} else if err := inTx(ctx, cfg.DB, func(tx pgx.Tx) error { return tx.QueryRow(ctx, `SELECT now()`).Scan(&now) }); err != nil {
		return Report{}, fmt.Errorf("retention: read the database's clock: %w", err)
	}
	now = now.UTC()
	// By the longer of this process's retention and the recorded one: an
	// instance still running with a shorter one than was set since must
	// not delete claims the others rely on.
	keep := cfg.Retention
	var recorded int64
	err := inTx(ctx, cfg.DB, func(tx pgx.Tx) error {
		return tx.QueryRow(ctx, `SELECT retention_seconds FROM `+cfg.Tables.RetentionPolicy().Qualified+` WHERE claim_table = $1`,
			cfg.Tables.Claims().Name).Scan(&recorded)
	})
	switch {
	case err == nil:
		if r := time.Duration(recorded) * time.Second; r > keep {
			cfg.Logger.Warn("retention: this process keeps claims for less than the recorded retention; deleting by the recorded one",
				"claim_table", cfg.Tables.Claims().Qualified, "retention", cfg.Retention, "recorded", r)
			keep = r
		}
	case !errors.Is(err, pgx.ErrNoRows):
		return Report{}, fmt.Errorf("retention: read the recorded retention: %w", err)
	}
	cutoff := now.Add(-keep)
	ddl := ddlRunner{db: cfg.DB, lease: l, timeout: cfg.LockTimeout, retries: cfg.LockRetries, log: cfg.Logger, rep: &rep}
	// Tomorrow's partition first: a drop that keeps giving way to long
	// claim transactions must not leave new days in the default partition.
	if cfg.Mode == Partitioned {
		if err := createAhead(ctx, ddl, n, now, cfg.DaysAhead, &rep); err != nil {
			return rep, err
		}
	}
	if err := dropExpired(ctx, ddl, n, cutoff, &rep); err != nil {
		return rep, err
	}
	if err := deleteExpired(ctx, ddl, n, cutoff, cfg.BatchSize, &rep); err != nil {
		return rep, err
	}
	if len(rep.Created)+len(rep.Dropped)+len(rep.Kept) > 0 || rep.Deleted > 0 {
		cfg.Logger.Info("retention pass", "mode", cfg.Mode, "created", rep.Created, "dropped", rep.Dropped, "deleted", rep.Deleted,
			"skipped", rep.Skipped, "kept", rep.Kept)
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
		rep, err := Run(ctx, cfg)
		if err != nil && ctx.Err() == nil {
			cfg.Logger.Error("retention pass failed", "err", err)
		}
		if cfg.OnPass != nil && ctx.Err() == nil {
			cfg.OnPass(rep, err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// ddlRunner runs partition DDL without holding claims up for long: each
// statement waits at most timeout for its lock, and a statement that could
// not get it is tried again after a backoff.
type ddlRunner struct {
	db      pgdb.DB
	lease   lease
	timeout time.Duration
	retries int
	log     *slog.Logger
	rep     *Report
}

// plain runs a statement that takes no lock claims wait for, with the
// lease renewed first.
func (d ddlRunner) plain(ctx context.Context, stmt string) error {
	if err := d.lease.renew(ctx); err != nil {
		return err
	}
	return inTx(ctx, d.db, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, stmt)
		return err
	})
}

func (d ddlRunner) exec(ctx context.Context, what, stmt string) error {
	return d.execTx(ctx, what, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, stmt)
		return err
	})
}

// execTx runs f in one transaction whose every lock wait is bounded by the
// lock timeout, tried again as exec is: what f checks under the locks its
// DDL took holds when it commits.
func (d ddlRunner) execTx(ctx context.Context, what string, f func(pgx.Tx) error) error {
	wait := 200 * time.Millisecond
	for attempt := 0; ; attempt++ {
		if err := d.lease.renew(ctx); err != nil {
			return err
		}
		err := inTx(ctx, d.db, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "SELECT set_config('lock_timeout', $1, true)", strconv.FormatInt(d.timeout.Milliseconds(), 10)); err != nil {
				return err
			}
			return f(tx)
		})
		var pgErr *pgconn.PgError
		if err == nil || !errors.As(err, &pgErr) || pgErr.Code != "55P03" || attempt >= d.retries {
			if err != nil {
				return fmt.Errorf("retention: %s: %w", what, err)
			}
			return nil
		}
		d.rep.LockWaits++
		d.log.Warn("retention: a lock on the claim table was busy; claims go first, trying again", "what", what, "lock_timeout", d.timeout, "retry_in", wait)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(wait):
		}
		wait *= 2
	}
}

// dailyTables lists the tables of the schema named like the claim table's
// daily partitions, and whether each is attached: a pass that failed half
// way may leave one created but not attached, or detached but not dropped.
func dailyTables(ctx context.Context, db pgdb.DB, n names) (map[string]bool, error) {
	out := map[string]bool{}
	err := inTx(ctx, db, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, `SELECT c.relname, EXISTS (SELECT 1 FROM pg_inherits i WHERE i.inhrelid = c.oid AND i.inhparent = to_regclass($3))
FROM pg_class c JOIN pg_namespace ns ON ns.oid = c.relnamespace
WHERE ns.nspname = $1 AND c.relkind = 'r' AND c.relname LIKE $2`, n.schema, strings.ReplaceAll(n.table, "_", `\_`)+`\_p%`, n.parent)
		if err != nil {
			return err
		}
		for rows.Next() {
			var name string
			var attached bool
			if err := rows.Scan(&name, &attached); err != nil {
				rows.Close()
				return err
			}
			if n.daily.MatchString(name) {
				out[name] = attached
			}
		}
		return rows.Err()
	})
	if err != nil {
		return nil, fmt.Errorf("retention: list partitions: %w", err)
	}
	return out, nil
}

// dropExpired detaches each daily partition whose whole day is older than the
// retention, then drops it: the detach takes the brief exclusive lock on the
// claim table (bounded by the lock timeout), the drop of a detached table
// takes none. DETACH ... CONCURRENTLY would take a weaker lock, but
// PostgreSQL refuses it on a table with a default partition, and the default
// partition is what holds claims outside daily partitions (and every claim in
// delete mode). A day whose partition holds a claim without a fingerprint
// processed within the retention is kept (Report.Kept), decided under the
// detach's lock.
func dropExpired(ctx context.Context, ddl ddlRunner, n names, cutoff time.Time, rep *Report) error {
	tables, err := dailyTables(ctx, ddl.db, n)
	if err != nil {
		return err
	}
	// Oldest first, in one order every pass: a pass cut short leaves the
	// newest days.
	for _, name := range slices.Sorted(maps.Keys(tables)) {
		attached := tables[name]
		day, err := time.Parse("20060102", n.daily.FindStringSubmatch(name)[1])
		if err != nil {
			continue
		}
		// Only when every id of the day is older than the retention.
		if day.AddDate(0, 0, 1).After(cutoff) {
			continue
		}
		qualified := pgx.Identifier{n.schema, name}.Sanitize()
		if attached {
			recent := fmt.Sprintf(recentWithoutFingerprintSQL, qualified)
			// A first look, without a lock: a day kept for its recent
			// claims is kept at every pass without the claim table's
			// exclusive lock.
			var kept bool
			if err := inTx(ctx, ddl.db, func(tx pgx.Tx) error { return tx.QueryRow(ctx, recent, cutoff).Scan(&kept) }); err != nil {
				return fmt.Errorf("retention: look for recent claims without a fingerprint in %s: %w", name, err)
			}
			// The look that decides comes after the detach, in its
			// transaction: the first cannot see a claim whose transaction
			// is still open (the guide's consumer, which checks no
			// horizon, claiming an old event in this day), and the detach
			// waits for that transaction's lock. Once it committed, this
			// look sees its claim, and the detach is rolled back: a day
			// dropped with it would let a redelivery run its effect again.
			// Detaching first takes the claim table's lock before the
			// partition's, the order a claim takes them in, so the two
			// cannot deadlock.
			if !kept {
				err := ddl.execTx(ctx, "detach "+name, func(tx pgx.Tx) error {
					if _, err := tx.Exec(ctx, "ALTER TABLE "+n.parent+" DETACH PARTITION "+qualified); err != nil {
						return err
					}
					if err := tx.QueryRow(ctx, recent, cutoff).Scan(&kept); err != nil {
						return fmt.Errorf("look for recent claims without a fingerprint: %w", err)
					}
					if kept {
						return errKeep
					}
					return nil
				})
				if err != nil && !errors.Is(err, errKeep) {
					return err
				}
			}
			if kept {
				rep.Kept = append(rep.Kept, name)
				continue
			}
		}
		if err := ddl.plain(ctx, "DROP TABLE IF EXISTS "+qualified); err != nil {
			return fmt.Errorf("retention: drop %s: %w", name, err)
		}
		rep.Dropped = append(rep.Dropped, name)
	}
	slices.Sort(rep.Dropped)
	slices.Sort(rep.Kept)
	return nil
}

// createAhead creates the daily partitions of today and the days ahead: each
// as a table of its own first, then attached, which locks the claim table
// less than CREATE ... PARTITION OF, and for at most the lock timeout.
func createAhead(ctx context.Context, ddl ddlRunner, n names, now time.Time, daysAhead int, rep *Report) error {
	tables, err := dailyTables(ctx, ddl.db, n)
	if err != nil {
		return err
	}
	today := now.Truncate(24 * time.Hour)
	for i := 0; i <= daysAhead; i++ {
		day := today.AddDate(0, 0, i)
		lo, hi := DayRange(day)
		name := n.table + "_p" + day.UTC().Format("20060102")
		attached, exists := tables[name]
		if attached {
			continue
		}
		var occupied bool
		if err := inTx(ctx, ddl.db, func(tx pgx.Tx) error {
			return tx.QueryRow(ctx, fmt.Sprintf(defaultHasRowsSQL, n.defaultPart), lo, hi).Scan(&occupied)
		}); err != nil {
			return fmt.Errorf("retention: check default partition for %s: %w", name, err)
		}
		if occupied {
			rep.Skipped = append(rep.Skipped, name)
			continue
		}
		qualified := pgx.Identifier{n.schema, name}.Sanitize()
		if !exists {
			if err := ddl.plain(ctx, "CREATE TABLE IF NOT EXISTS "+qualified+" (LIKE "+n.parent+" INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"); err != nil {
				return fmt.Errorf("retention: create %s: %w", name, err)
			}
		}
		// DDL takes no bind parameters: the bounds are formatted from two
		// UUID values this function computed, never from input.
		attach := fmt.Sprintf("ALTER TABLE %s ATTACH PARTITION %s FOR VALUES FROM ('%s') TO ('%s')", n.parent, qualified, lo, hi)
		if err := ddl.exec(ctx, "attach "+name, attach); err != nil {
			return err
		}
		rep.Created = append(rep.Created, name)
	}
	return nil
}

// deleteExpired deletes the expired claims of the default partition in
// batches: those without a fingerprint by their processed_at first (months
// of them, adopted, would otherwise be walked past by every batch of the
// second), then the library's own by their event's id.
func deleteExpired(ctx context.Context, ddl ddlRunner, n names, cutoff time.Time, batch int, rep *Report) error {
	if err := deleteBatches(ctx, ddl, fmt.Sprintf(deleteByProcessedAtSQL, n.defaultPart), cutoff, batch, rep); err != nil {
		return err
	}
	return deleteBatches(ctx, ddl, fmt.Sprintf(deleteBatchSQL, n.defaultPart), pgtype.UUID{Bytes: FirstIDAt(cutoff), Valid: true}, batch, rep)
}

func deleteBatches(ctx context.Context, ddl ddlRunner, q string, bound any, batch int, rep *Report) error {
	for {
		if err := ddl.lease.renew(ctx); err != nil {
			return err
		}
		var deleted int64
		if err := inTx(ctx, ddl.db, func(tx pgx.Tx) error {
			tag, err := tx.Exec(ctx, q, bound, batch)
			deleted = tag.RowsAffected()
			return err
		}); err != nil {
			return fmt.Errorf("retention: delete expired claims: %w", err)
		}
		rep.Deleted += deleted
		if deleted < int64(batch) {
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
// table (schema.DefaultClaimTable) holding day's ids.
func PartitionName(day time.Time) string {
	return schema.DefaultClaimTable + "_p" + day.UTC().Format("20060102")
}

// ErrRetentionNotRecorded means no retention is recorded for the claim
// table and this process's role may not record one: the tables' owner must
// (app migrate does).
var ErrRetentionNotRecorded = errors.New("retention: no retention recorded")

// ErrRetentionDisagrees means a process was started with another retention
// than the one recorded for the claim table.
var ErrRetentionDisagrees = errors.New("retention: the retention differs from the one recorded for this claim table")

// Agree records cfg.Retention as the claim table's retention if none is
// recorded yet, and otherwise returns [ErrRetentionDisagrees] when they
// differ: consumers judge an event's age by the retention they were given,
// maintenance deletes by its own, and if maintenance's were shorter it would
// delete claims the consumers still rely on to skip a redelivery. Serve and
// maintain both call it at start-up; change the retention on purpose with
// [SetRetention]. A first record over claims adopted from the style guide's
// table starts the dedup horizon where they reach (Config.GuideRetention):
// run it, with the guide's retention, right after the migration that
// adopted them (app migrate does), before a consumer starts.
func Agree(ctx context.Context, cfg Config) error {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return err
	}
	policy := cfg.Tables.RetentionPolicy().Qualified
	table := cfg.Tables.Claims().Name
	var recorded int64
	var at time.Time
	read := func() error {
		return inTx(ctx, cfg.DB, func(tx pgx.Tx) error {
			return tx.QueryRow(ctx, `SELECT retention_seconds, set_at FROM `+policy+` WHERE claim_table = $1`, table).Scan(&recorded, &at)
		})
	}
	// Read before writing: a restarted instance must pass this check on a
	// read-only database (a failover in progress) whenever the policy is
	// already recorded.
	err := read()
	if errors.Is(err, pgx.ErrNoRows) {
		// Claims without a fingerprint in the table were adopted from the
		// style guide's (or made by its consumer since): they cover only
		// as far back as the guide kept them, and the horizon starts there.
		if err := inTx(ctx, cfg.DB, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO `+policy+` (claim_table, retention_seconds, covered_seconds)
SELECT $1, $2, (SELECT `+schema.AdoptedCoverage("$3")+` FROM `+cfg.Tables.Claims().Qualified+` WHERE payload_sha256 IS NULL)
ON CONFLICT DO NOTHING`, table, int64(cfg.Retention.Seconds()), int64(cfg.GuideRetention.Seconds()))
			return err
		}); err != nil {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "42501" {
				return fmt.Errorf("%w: no retention is recorded for %s, and this role may not record one (a group's role reads it): "+
					"record it as the tables' owner first (app migrate --dedup-retention %s, or retention.Agree): %w",
					ErrRetentionNotRecorded, table, cfg.Retention, err)
			}
			return fmt.Errorf("retention: record the retention of %s: %w", table, err)
		}
		err = read()
	}
	if err != nil {
		return fmt.Errorf("retention: read the retention of %s: %w", table, err)
	}
	if got := time.Duration(recorded) * time.Second; got != cfg.Retention.Truncate(time.Second) {
		return fmt.Errorf("%w: %s keeps claims for %s (recorded %s), this process was given %s",
			ErrRetentionDisagrees, table, got, at.Format(time.RFC3339), cfg.Retention)
	}
	return nil
}

// SetRetention records retention for the claim table, on purpose: every
// consumer and maintenance process must then be restarted with it. A longer
// one than before widens the dedup horizon only as fast as the claims
// reach back again (schema.CoveredRetention): those between the old and
// the new retention were deleted under the old one. Until every process
// runs with the new one, retention passes delete by the longer of theirs
// and the recorded one.
func SetRetention(ctx context.Context, cfg Config) error {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return err
	}
	policy := cfg.Tables.RetentionPolicy().Qualified
	err := inTx(ctx, cfg.DB, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+policy+` AS recorded (claim_table, retention_seconds) VALUES ($1, $2)
ON CONFLICT (claim_table) DO UPDATE SET retention_seconds = EXCLUDED.retention_seconds, set_at = now(),
    covered_seconds = `+schema.CoveredRetention("recorded"),
			cfg.Tables.Claims().Name, int64(cfg.Retention.Seconds()))
		return err
	})
	if err != nil {
		return fmt.Errorf("retention: set the retention: %w", err)
	}
	return nil
}
