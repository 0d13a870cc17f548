package retention_test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/retention"
	"github.com/once-dev/once/schema"
)

// Tests run maintenance on days of 2025, when no other test's claims exist,
// and clean up the partitions they made.
func setup(t *testing.T) *pgxpool.Pool {
	t.Helper()
	pool := testenv.Postgres(t)
	t.Cleanup(func() {
		rows, _ := pool.Query(context.Background(), `SELECT relname FROM pg_class WHERE relname LIKE 'processed\_event\_p2025%' AND relkind = 'r'`)
		names, _ := pgx.CollectRows(rows, pgx.RowTo[string])
		for _, n := range names {
			_, _ = pool.Exec(context.Background(), "DROP TABLE IF EXISTS "+pgx.Identifier{n}.Sanitize())
		}
	})
	return pool
}

// v7At returns a valid UUIDv7 whose timestamp is t.
func v7At(t time.Time) uuid.UUID {
	id := retention.FirstIDAt(t)
	_, _ = rand.Read(id[6:])
	id[6] = 0x70 | id[6]&0x0f
	id[8] = 0x80 | id[8]&0x3f
	return id
}

func at(s string) time.Time {
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		panic(err)
	}
	return t
}

func run(t *testing.T, cfg retention.Config) retention.Report {
	t.Helper()
	rep, err := retention.Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

func partitionOf(t *testing.T, pool *pgxpool.Pool, id uuid.UUID, group string) string {
	t.Helper()
	var name string
	if err := pool.QueryRow(context.Background(), `SELECT tableoid::regclass::text FROM processed_event WHERE event_id = $1 AND consumer_group = $2`, id, group).Scan(&name); err != nil {
		t.Fatal(err)
	}
	return name
}

// The trap the spec describes: the style guide partitions by processed_at,
// which forces processed_at into the primary key, so two claims of one event
// at two moments both insert. Ours partitions by event_id and they conflict.
func TestPartitioningByProcessedAtBreaksDedupOursDoesNot(t *testing.T) {
	pool := setup(t)
	ctx := context.Background()
	guide := "guide_processed_event_" + uuid.NewString()[:8]
	ddl := fmt.Sprintf(`CREATE TABLE %[1]s (event_id uuid NOT NULL, consumer_group text NOT NULL,
		processed_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (event_id, consumer_group, processed_at))
		PARTITION BY RANGE (processed_at);
		CREATE TABLE %[1]s_all PARTITION OF %[1]s DEFAULT`, guide)
	if _, err := pool.Exec(ctx, ddl); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = pool.Exec(ctx, "DROP TABLE "+guide) })

	id := uuid.Must(uuid.NewV7())
	claimGuide := fmt.Sprintf(`INSERT INTO %s (event_id, consumer_group, processed_at) VALUES ($1, 'billing', $2) ON CONFLICT DO NOTHING`, guide)
	claimOurs := `INSERT INTO processed_event (event_id, consumer_group, payload_sha256, processed_at) VALUES ($1, $2, '\x00', $3) ON CONFLICT DO NOTHING`
	group := "trap-" + uuid.NewString()[:8]
	var guideInserted, oursInserted int64
	for _, moment := range []time.Time{time.Now(), time.Now().Add(3 * time.Hour)} {
		tag, err := pool.Exec(ctx, claimGuide, id, moment)
		if err != nil {
			t.Fatal(err)
		}
		guideInserted += tag.RowsAffected()
		tag, err = pool.Exec(ctx, claimOurs, id, group, moment)
		if err != nil {
			t.Fatal(err)
		}
		oursInserted += tag.RowsAffected()
	}
	if guideInserted != 2 {
		t.Fatalf("the guide's DDL inserted %d claims; the trap is that it inserts 2", guideInserted)
	}
	if oursInserted != 1 {
		t.Fatalf("our schema inserted %d claims for one event, want 1", oursInserted)
	}
}

// An event claimed a second before midnight lands in its day's partition.
// Redeliveries after midnight, and up to the retention, find the claim; once
// the partition is dropped, the horizon check refuses the event instead of
// running it again.
func TestDuplicatesDetectedAcrossMidnightUpToRetention(t *testing.T) {
	pool := setup(t)
	group := "midnight-" + uuid.NewString()[:8]
	const keep = 7 * 24 * time.Hour
	day := at("2025-03-10T00:00:00Z")
	cfg := retention.Config{DB: pool, Retention: keep}

	cfg.Now = func() time.Time { return at("2025-03-10T23:00:00Z") }
	if rep := run(t, cfg); len(rep.Created) != 3 {
		t.Fatalf("created %v; want today and 2 days ahead", rep.Created)
	}

	id := v7At(at("2025-03-10T23:59:59.500Z"))
	msg := message.NewMessage("m", []byte(fmt.Sprintf(`{"event_id":%q}`, id)))
	runs := 0
	deliver := func(now string, policy idempotency.TooOldPolicy) (idempotency.Outcome, error) {
		t.Helper()
		var out idempotency.Outcome
		m, err := idempotency.New(idempotency.Config{DB: pool, ConsumerGroup: group, MaxEventAge: keep, TooOld: policy,
			Now: func() time.Time { return at(now) }, OnResult: func(r idempotency.Result) { out = r.Outcome }})
		if err != nil {
			t.Fatal(err)
		}
		_, err = m.Middleware(func(*message.Message) ([]*message.Message, error) { runs++; return nil, nil })(msg.Copy())
		return out, err
	}

	if out, err := deliver("2025-03-10T23:59:59.600Z", idempotency.RejectTooOld); err != nil || out != idempotency.Processed {
		t.Fatalf("first delivery: %v %v", out, err)
	}
	if p := partitionOf(t, pool, id, group); p != retention.PartitionName(day) {
		t.Fatalf("claim in %s, want %s", p, retention.PartitionName(day))
	}
	for _, now := range []string{"2025-03-11T00:00:01Z", "2025-03-12T08:00:00Z", "2025-03-17T22:59:00Z"} {
		cfg.Now = func() time.Time { return at(now) }
		if rep := run(t, cfg); len(rep.Dropped) != 0 {
			t.Fatalf("at %s dropped %v within the retention", now, rep.Dropped)
		}
		if out, err := deliver(now, idempotency.RejectTooOld); err != nil || out != idempotency.Duplicate {
			t.Fatalf("redelivery at %s: %v %v; want duplicate", now, out, err)
		}
	}

	// The whole of 2025-03-10 is older than 7 days from 03-18 00:00:01 on.
	cfg.Now = func() time.Time { return at("2025-03-18T00:00:01Z") }
	rep := run(t, cfg)
	if fmt.Sprint(rep.Dropped) != fmt.Sprintf("[%s]", retention.PartitionName(day)) {
		t.Fatalf("dropped %v; want exactly the partition of 2025-03-10", rep.Dropped)
	}
	if _, err := deliver("2025-03-18T00:00:02Z", idempotency.RejectTooOld); !errors.Is(err, idempotency.ErrTooOld) || !idempotency.IsPermanent(err) {
		t.Fatalf("past the horizon: %v; want a permanent ErrTooOld", err)
	}
	if runs != 1 {
		t.Fatalf("handler ran %d times, want 1", runs)
	}
	if out, err := deliver("2025-03-18T00:00:02Z", idempotency.ProcessTooOld); err != nil || out != idempotency.Processed || runs != 2 {
		t.Fatalf("policy process: %v %v runs=%d; want it processed again, knowingly", out, err, runs)
	}
}

func TestEventsFromTheFutureAreRefused(t *testing.T) {
	pool := setup(t)
	now := at("2025-05-01T12:00:00Z")
	m, err := idempotency.New(idempotency.Config{DB: pool, ConsumerGroup: "future-" + uuid.NewString()[:8],
		MaxClockSkew: time.Minute, Now: func() time.Time { return now }})
	if err != nil {
		t.Fatal(err)
	}
	msg := message.NewMessage("m", []byte(fmt.Sprintf(`{"event_id":%q}`, v7At(now.Add(2*time.Minute)))))
	if _, err := m.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })(msg); !errors.Is(err, idempotency.ErrFromTheFuture) {
		t.Fatalf("got %v, want ErrFromTheFuture", err)
	}
}

// Several instances maintaining at once: one works, the rest see the lock
// held; a second round changes nothing.
func TestConcurrentMaintenanceIsSafeAndIdempotent(t *testing.T) {
	setup(t)
	now := func() time.Time { return at("2025-06-01T10:00:00Z") }
	var wg sync.WaitGroup
	reports := make(chan retention.Report, 6)
	for range 6 {
		pool := testenv.Postgres(t) // one pool per instance
		wg.Go(func() {
			rep, err := retention.Run(context.Background(), retention.Config{DB: pool, Now: now})
			if err != nil {
				t.Error(err)
			}
			reports <- rep
		})
	}
	wg.Wait()
	close(reports)
	created := 0
	for rep := range reports {
		created += len(rep.Created)
	}
	if created != 3 {
		t.Fatalf("%d partitions created by the instances together, want 3", created)
	}
	if rep := run(t, retention.Config{DB: testenv.Postgres(t), Now: now}); len(rep.Created)+len(rep.Dropped) != 0 || rep.Busy {
		t.Fatalf("second round %+v; want nothing to do", rep)
	}
}

// Delete mode: expired claims in the default partition go in bounded batches;
// a day that already has claims in the default partition gets no partition
// (switching from delete to partitioned mode needs no migration).
func TestDeleteModeAndSwitchingModes(t *testing.T) {
	pool := setup(t)
	ctx := context.Background()
	group := "delete-" + uuid.NewString()[:8]
	rows := make([][]any, 12345)
	for i := range rows {
		rows[i] = []any{v7At(at("2025-01-05T10:00:00Z").Add(time.Duration(i) * time.Second)), group, []byte{0}}
	}
	if _, err := pool.CopyFrom(ctx, pgx.Identifier{"processed_event_default"}, []string{"event_id", "consumer_group", "payload_sha256"}, pgx.CopyFromRows(rows)); err != nil {
		t.Fatal(err)
	}
	fresh := v7At(at("2025-01-14T10:00:00Z"))
	if _, err := pool.Exec(ctx, `INSERT INTO processed_event (event_id, consumer_group, payload_sha256) VALUES ($1, $2, '\x00')`, fresh, group); err != nil {
		t.Fatal(err)
	}

	// Partitioned mode on 01-14 cannot create that day's partition: the
	// default partition already holds a claim of it.
	rep := run(t, retention.Config{DB: pool, Now: func() time.Time { return at("2025-01-14T12:00:00Z") }, Retention: 30 * 24 * time.Hour})
	if fmt.Sprint(rep.Skipped) != "[processed_event_p20250114]" || len(rep.Created) != 2 {
		t.Fatalf("report %+v; want 01-14 skipped, 01-15 and 01-16 created", rep)
	}

	rep = run(t, retention.Config{DB: pool, Mode: retention.Delete, BatchSize: 1000, Now: func() time.Time { return at("2025-01-14T12:00:00Z") }})
	if rep.Deleted < 12345 || len(rep.Created) != 0 {
		t.Fatalf("report %+v; want the 12,345 expired claims deleted and nothing created", rep)
	}
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM processed_event WHERE consumer_group = $1`, group).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != 1 {
		t.Fatalf("%d claims left, want 1 (the one within the retention)", left)
	}
}

// A claim table under a schema and name of the team's choosing is
// maintained like the default one: its partitions are created and dropped
// there, and the default table is left alone.
func TestNamedClaimTable(t *testing.T) {
	pool := setup(t)
	ctx := context.Background()
	names := namedClaimTable(t, pool)
	now := at("2025-03-10T12:00:00Z")
	cfg := retention.Config{DB: pool, Tables: names, Retention: 48 * time.Hour, Now: func() time.Time { return now }}
	rep := run(t, cfg)
	if len(rep.Created) != 3 || rep.Created[0] != "claims_p20250310" {
		t.Fatalf("created %v; want today's and 2 ahead in the named table", rep.Created)
	}
	var inSchema int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename LIKE 'claims\_p2025%'`, names.Schema).Scan(&inSchema); err != nil || inSchema != 3 {
		t.Fatalf("%d partitions in schema %s (%v), want 3", inSchema, names.Schema, err)
	}
	now = now.AddDate(0, 0, 4)
	rep = run(t, cfg)
	if len(rep.Dropped) != 2 || rep.Dropped[0] != "claims_p20250310" {
		t.Fatalf("dropped %v; want the two expired days of the named table", rep.Dropped)
	}
}

// A pass that needs the claim table's exclusive lock while a claim
// transaction is open (a slow handler) gives way: it waits at most the lock
// timeout, so the claims queued behind it wait no longer, and tries again;
// once the transaction ends, a pass detaches and drops the expired day.
func TestRetentionGivesWayToOpenClaims(t *testing.T) {
	pool := setup(t)
	ctx := context.Background()
	names := namedClaimTable(t, pool)
	cfg := retention.Config{DB: pool, Tables: names, Retention: 48 * time.Hour,
		LockTimeout: 200 * time.Millisecond, LockRetries: 2}
	then := at("2025-04-01T12:00:00Z")
	cfg.Now = func() time.Time { return then }
	if rep := run(t, cfg); len(rep.Created) != 3 {
		t.Fatalf("created %v", rep.Created)
	}
	claim := `INSERT INTO ` + names.Schema + `.claims (event_id, consumer_group, payload_sha256) VALUES ($1, 'g', '\x00')`

	// A claim transaction that stays open, as a slow handler's does.
	long, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := long.Exec(ctx, claim, v7At(then)); err != nil {
		t.Fatal(err)
	}
	cfg.Now = func() time.Time { return then.AddDate(0, 0, 5) } // 2025-04-01..03 expired
	passDone := make(chan retention.Report, 1)
	passErr := make(chan error, 1)
	go func() {
		rep, err := retention.Run(ctx, cfg)
		passDone <- rep
		passErr <- err
	}()
	// Claims keep flowing while the pass waits for its lock.
	time.Sleep(100 * time.Millisecond)
	for i := range 5 {
		start := time.Now()
		if _, err := pool.Exec(ctx, claim, v7At(then.Add(time.Duration(i+1)*time.Hour))); err != nil {
			t.Fatal(err)
		}
		if waited := time.Since(start); waited > 800*time.Millisecond {
			t.Fatalf("a claim waited %s behind the retention pass; want at most about its 200ms lock timeout", waited)
		}
		time.Sleep(50 * time.Millisecond)
	}
	rep, err := <-passDone, <-passErr
	var pgErr *pgconn.PgError
	if err == nil || !errors.As(err, &pgErr) || pgErr.Code != "55P03" || rep.LockWaits != 2 {
		t.Fatalf("pass with a claim open: report %+v, error %v; want it to give way twice and report the lock timeout", rep, err)
	}
	// The days ahead need no lock a claim holds: they are there even while
	// the drop keeps giving way, so new claims never land in the default
	// partition.
	if fmt.Sprint(rep.Created) != "[claims_p20250406 claims_p20250407 claims_p20250408]" {
		t.Fatalf("a pass whose drop gave way created %v; want the days ahead all the same", rep.Created)
	}
	if err := long.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	rep = run(t, cfg)
	if fmt.Sprint(rep.Dropped) != "[claims_p20250401 claims_p20250402 claims_p20250403]" {
		t.Fatalf("after the claim committed: dropped %v, want the three expired days", rep.Dropped)
	}
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename IN ('claims_p20250401', 'claims_p20250402', 'claims_p20250403')`, names.Schema).Scan(&left); err != nil || left != 0 {
		t.Fatalf("%d expired day tables left (%v), want none: detached and dropped", left, err)
	}
}

// Processes that keep and judge claims by different retentions are refused:
// the first records its retention, a later one with another is an error
// until the retention is changed on purpose.
func TestProcessesAgreeOnTheRetention(t *testing.T) {
	pool := setup(t)
	ctx := context.Background()
	names := namedClaimTable(t, pool)
	week := retention.Config{DB: pool, Tables: names, Retention: 7 * 24 * time.Hour}
	day := week
	day.Retention = 24 * time.Hour
	if err := retention.Agree(ctx, week); err != nil {
		t.Fatal(err)
	}
	if err := retention.Agree(ctx, week); err != nil {
		t.Fatalf("the same retention again: %v", err)
	}
	if err := retention.Agree(ctx, day); !errors.Is(err, retention.ErrRetentionDisagrees) || !strings.Contains(err.Error(), "168h") {
		t.Fatalf("a shorter retention: %v; want ErrRetentionDisagrees naming the recorded one", err)
	}
	if err := retention.SetRetention(ctx, day); err != nil {
		t.Fatal(err)
	}
	if err := retention.Agree(ctx, day); err != nil {
		t.Fatalf("after setting it on purpose: %v", err)
	}
	if err := retention.Agree(ctx, week); !errors.Is(err, retention.ErrRetentionDisagrees) {
		t.Fatalf("the old retention after the change: %v; want refused", err)
	}
	// A restarted instance during a failover meets a read-only database:
	// the recorded policy must still be checkable.
	roCfg := pool.Config().Copy()
	roCfg.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
	ro, err := pgxpool.NewWithConfig(ctx, roCfg)
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	if _, err := ro.Exec(ctx, "INSERT INTO "+names.Schema+".once_retention_policy VALUES ('x', 1)"); err == nil || !strings.Contains(err.Error(), "25006") {
		t.Fatalf("the pool is not read-only: %v", err)
	}
	readOnly := day
	readOnly.DB = ro
	if err := retention.Agree(ctx, readOnly); err != nil {
		t.Fatalf("agreeing on a read-only database with the policy recorded: %v", err)
	}
	readOnly.Retention = week.Retention
	if err := retention.Agree(ctx, readOnly); !errors.Is(err, retention.ErrRetentionDisagrees) {
		t.Fatalf("a disagreement on a read-only database: %v; want refused", err)
	}
}

// The maintenance lease: a pass finds a live lease of another instance and
// reports Busy, changing nothing; once that lease has run out (its holder
// died mid-pass) a pass takes it and works; a pass releases its own lease,
// so the next one need not wait for it.
func TestTheMaintenanceLease(t *testing.T) {
	pool := setup(t)
	ctx := context.Background()
	names := namedClaimTable(t, pool)
	now := at("2025-03-10T12:00:00Z")
	cfg := retention.Config{DB: pool, Tables: names, Now: func() time.Time { return now }}
	lease := names.Schema + "." + schema.LeaseTable
	if _, err := pool.Exec(ctx, `INSERT INTO `+lease+` (name, holder, until) VALUES ($1, $2, now() + interval '1 hour')`,
		"retention:"+names.Schema+"."+names.ClaimTable, uuid.New()); err != nil {
		t.Fatal(err)
	}
	if rep := run(t, cfg); !rep.Busy || len(rep.Created) != 0 {
		t.Fatalf("with another instance's live lease: %+v; want Busy and nothing done", rep)
	}
	if _, err := pool.Exec(ctx, `UPDATE `+lease+` SET until = now() - interval '1 second'`); err != nil {
		t.Fatal(err)
	}
	if rep := run(t, cfg); rep.Busy || len(rep.Created) != 3 {
		t.Fatalf("after the other's lease ran out: %+v; want the pass done", rep)
	}
	if rep := run(t, cfg); rep.Busy {
		t.Fatalf("right after a pass: %+v; want its lease released", rep)
	}
}

// namedClaimTable migrates the library's tables into a schema of the test's
// own, its claim table named "claims"; dropped when the test ends.
func namedClaimTable(t *testing.T, pool *pgxpool.Pool) schema.Config {
	t.Helper()
	names := schema.Config{Schema: "once_ret_" + strings.ReplaceAll(uuid.NewString()[:8], "-", ""), ClaimTable: "claims"}
	if _, err := schema.Migrate(context.Background(), pool, names); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA "+names.Schema+" CASCADE") })
	return names
}

// A claim without a fingerprint (adopted from the style guide's table, or
// made by the guide's consumer, which checked no horizon) ages out by its
// processed_at, by the library's retention, not by its event's id:
// one processed long after its event's time stays its retention from then,
// one whose id says nothing of time (not a UUIDv7) still goes, and an
// expired day's partition holding one processed within the retention is
// kept until it aged out. The library's own claims still go by their id.
func TestClaimsWithoutAFingerprintAgeOutByProcessedAt(t *testing.T) {
	pool := setup(t)
	ctx := context.Background()
	names := namedClaimTable(t, pool)
	const keep = 7 * 24 * time.Hour
	now := at("2025-07-01T12:00:00Z")
	cfg := retention.Config{DB: pool, Tables: names, Retention: keep, Now: func() time.Time { return now }}
	if rep := run(t, cfg); fmt.Sprint(rep.Created) != "[claims_p20250701 claims_p20250702 claims_p20250703]" {
		t.Fatalf("created %v", rep.Created)
	}
	noTime := uuid.New()
	noTime[0] = 0xf0 // a random id whose "time" lies centuries ahead
	claims := []struct {
		name        string
		id          uuid.UUID
		fingerprint []byte
		processedAt string
	}{
		{"late", v7At(at("2025-06-15T10:00:00Z")), nil, "2025-08-09T00:00:00Z"},
		{"expired", v7At(at("2025-06-15T11:00:00Z")), nil, "2025-07-20T00:00:00Z"},
		{"not a v7", noTime, nil, "2025-07-20T00:00:00Z"},
		{"ours", v7At(at("2025-06-15T12:00:00Z")), []byte{1}, "2025-08-09T00:00:00Z"},
		{"late, in a day's partition", v7At(at("2025-07-01T10:00:00Z")), nil, "2025-08-05T00:00:00Z"},
		{"ours, in a day's partition", v7At(at("2025-07-02T10:00:00Z")), []byte{1}, "2025-07-02T10:00:00Z"},
	}
	for _, c := range claims {
		if _, err := pool.Exec(ctx, `INSERT INTO `+names.Claims().Qualified+` (event_id, consumer_group, payload_sha256, processed_at) VALUES ($1, 'g', $2, $3)`,
			c.id, c.fingerprint, at(c.processedAt)); err != nil {
			t.Fatal(err)
		}
	}
	left := func() string {
		t.Helper()
		var out []string
		for _, c := range claims {
			var n int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+names.Claims().Qualified+` WHERE event_id = $1`, c.id).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if n > 0 {
				out = append(out, c.name)
			}
		}
		return strings.Join(out, ", ")
	}

	now = at("2025-08-10T12:00:00Z")
	rep := run(t, cfg)
	if got := left(); got != "late, late, in a day's partition" {
		t.Errorf("on 08-10 the claims left are [%s]; want the two processed within the retention", got)
	}
	if fmt.Sprint(rep.Kept) != "[claims_p20250701]" || fmt.Sprint(rep.Dropped) != "[claims_p20250702 claims_p20250703]" {
		t.Errorf("on 08-10 kept %v and dropped %v; want 07-01 kept for its recent claim, 07-02 and 07-03 dropped", rep.Kept, rep.Dropped)
	}
	now = at("2025-08-12T12:00:01Z")
	if rep := run(t, cfg); fmt.Sprint(rep.Dropped) != "[claims_p20250701]" || len(rep.Kept) != 0 {
		t.Errorf("on 08-12, past its claim's retention: dropped %v, kept %v; want 07-01 dropped", rep.Dropped, rep.Kept)
	}
	if got := left(); got != "late" {
		t.Errorf("on 08-12 the claims left are [%s]; want the one processed on 08-09", got)
	}
	now = at("2025-08-16T00:00:01Z")
	run(t, cfg)
	if got := left(); got != "" {
		t.Errorf("on 08-16 the claims left are [%s]; want none", got)
	}
}

// The guide's consumer, which checks no horizon, claims an old event in an
// expired day's partition, and its transaction is still open when a pass
// looks for recent claims without a fingerprint there: the look cannot see
// it, and the pass's detach waits for the transaction's lock. The claim
// commits while the detach waits; the pass sees it under the detach's lock
// and keeps the day. Before, the day was detached and dropped with the
// claim just committed, and a redelivery of the event ran its effect again.
// Directly and behind PgBouncer in transaction pooling: the look and the
// detach are one transaction.
func TestAClaimCommittedWhileTheDetachWaitsKeepsItsDay(t *testing.T) {
	for _, w := range []testenv.Where{{Pooled: false, Mode: pgx.QueryExecModeCacheStatement},
		{Pooled: true, Mode: pgx.QueryExecModeExec}, {Pooled: true, Mode: pgx.QueryExecModeSimpleProtocol}} {
		t.Run(w.String(), func(t *testing.T) { aClaimCommittedWhileTheDetachWaitsKeepsItsDay(t, w) })
	}
}

func aClaimCommittedWhileTheDetachWaitsKeepsItsDay(t *testing.T, w testenv.Where) {
	pool := setup(t)
	ctx := context.Background()
	names := namedClaimTable(t, pool)
	now := at("2025-07-01T12:00:00Z")
	// A lock timeout longer than the test's wait: the detach waits for the
	// claim in one attempt.
	cfg := retention.Config{DB: w.Pool(t), Tables: names, Retention: 7 * 24 * time.Hour, LockTimeout: 20 * time.Second,
		Now: func() time.Time { return now }}
	run(t, cfg) // claims_p20250701..03
	id := v7At(at("2025-07-01T10:00:00Z"))

	// consume.py's claim: INSERT ... ON CONFLICT DO NOTHING, then its
	// business write, then the commit; processed_at is now.
	claim, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = claim.Rollback(ctx) }()
	if _, err := claim.Exec(ctx, `INSERT INTO `+names.Claims().Qualified+` (event_id, consumer_group) VALUES ($1, 'seed-reports') ON CONFLICT DO NOTHING`, id); err != nil {
		t.Fatal(err)
	}
	now = at("2025-07-10T12:00:00Z") // every id of 07-01..02 older than the retention
	type result struct {
		rep retention.Report
		err error
	}
	done := make(chan result, 1)
	go func() {
		rep, err := retention.Run(ctx, cfg)
		done <- result{rep, err}
	}()
	// The fault: the detach of 07-01 waits for the open claim's lock.
	deadline := time.Now().Add(10 * time.Second)
	for {
		var waiting int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'
			AND query LIKE '%DETACH PARTITION%' AND query LIKE '%' || $1 || '%claims_p20250701%'`, names.Schema).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the pass's detach of claims_p20250701 never waited for the open claim")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := claim.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	var left int
	var partition string
	if err := pool.QueryRow(ctx, `SELECT count(*), coalesce(max(tableoid::regclass::text), '') FROM `+names.Claims().Qualified+` WHERE event_id = $1`, id).Scan(&left, &partition); err != nil {
		t.Fatal(err)
	}
	if left != 1 || fmt.Sprint(r.rep.Kept) != "[claims_p20250701]" || fmt.Sprint(r.rep.Dropped) != "[claims_p20250702]" {
		t.Fatalf("claims of the event left: %d (in %q); kept %v, dropped %v; want the claim committed during the detach kept in its day, claims_p20250701 kept, claims_p20250702 dropped",
			left, partition, r.rep.Kept, r.rep.Dropped)
	}
	if partition != names.Schema+".claims_p20250701" {
		t.Fatalf("the claim is in %s; want its day's partition, still attached", partition)
	}
}

// The style guide's retention, told for an adoption, may not be longer than
// the library's: claiming in the adopted table, the guide's consumer checks
// no horizon and relies on its claims for as long as its cleanup kept them.
func TestAGuidesRetentionLongerThanTheLibrarysIsRefused(t *testing.T) {
	cfg := retention.Config{DB: testenv.Postgres(t), Retention: 7 * 24 * time.Hour}
	for _, tc := range []struct {
		guide time.Duration
		ok    bool
	}{{0, true}, {7 * 24 * time.Hour, true}, {30 * 24 * time.Hour, false}, {-time.Hour, false}} {
		cfg.GuideRetention = tc.guide
		if err := cfg.Validate(); (err == nil) != tc.ok || !tc.ok && !strings.Contains(err.Error(), "GuideRetention "+tc.guide.String()) {
			t.Errorf("GuideRetention %s: %v; want accepted: %v, else refused by name", tc.guide, err, tc.ok)
		}
	}
}

// A pass whose client vanished behind a network black hole right after its
// DETACH leaves a transaction holding the claim table's exclusive lock:
// every claim of every group waits on it. The pass's transactions bound
// their idle time on the server, so the orphan ends and claims go on.
// Before, nothing bounded it, and claims waited until TCP keepalive
// noticed (two hours).
func TestAPassThatVanishedMidDetachReleasesTheClaimTable(t *testing.T) {
	pool := setup(t)
	names := namedClaimTable(t, pool)
	now := at("2025-07-01T12:00:00Z")
	run(t, retention.Config{DB: pool, Tables: names, Retention: 7 * 24 * time.Hour, Now: func() time.Time { return now }})

	proxied, proxy := testenv.ProxiedPostgres(t, pool)
	t.Cleanup(func() { proxy.BlackHole(false); proxy.Cut() }) // before the proxied pool closes
	// Right after the pass's DETACH ran, the network swallows everything:
	// its client is gone with the claim table's exclusive lock taken, and
	// the server never hears of it.
	var detached atomic.Bool
	db := &testenv.Intercepted{DB: proxied, AfterExec: func(_ context.Context, sql string) {
		if strings.Contains(sql, "DETACH PARTITION") && detached.CompareAndSwap(false, true) {
			proxy.BlackHole(true)
		}
	}}
	now = at("2025-07-10T12:00:00Z")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		_, _ = retention.Run(ctx, retention.Config{DB: db, Tables: names, Retention: 7 * 24 * time.Hour, Now: func() time.Time { return now }})
	}()
	testenv.Eventually(t, 30*time.Second, "the pass detaches a day", detached.Load)
	var orphans int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' AND query LIKE '%DETACH PARTITION%' || $1 || '%'`, names.Schema).Scan(&orphans); err != nil {
		t.Fatal(err)
	}
	if orphans != 1 {
		t.Fatalf("%d transactions idle after their DETACH; want the vanished pass's: the fault did not happen", orphans)
	}

	// A claim, on a working connection, of an event of today.
	claimed := time.Now()
	claimCtx, stop := context.WithTimeout(ctx, 30*time.Second)
	defer stop()
	if _, err := pool.Exec(claimCtx, `INSERT INTO `+names.Claims().Qualified+` (event_id, consumer_group) VALUES ($1, 'g') ON CONFLICT DO NOTHING`, v7At(now)); err != nil {
		t.Fatalf("a claim waited on the vanished pass's lock for %s: %v", time.Since(claimed).Round(time.Millisecond), err)
	}
	t.Logf("the claim went in %s after the pass vanished", time.Since(claimed).Round(time.Millisecond))
}
