package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	neturl "net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/oncetest"
	"github.com/once-dev/once/orderevents"
	"github.com/once-dev/once/pipeline"
	"github.com/once-dev/once/retention"
	"github.com/once-dev/once/schema"
)

// guidesPartitionedDDL is the style guide's other variant: the claim table
// partitioned by processed_at, which forces processed_at into the key (the
// trap the spec warns about), made before the guide's consumer starts (its
// own CREATE TABLE IF NOT EXISTS then leaves it).
const guidesPartitionedDDL = `CREATE SCHEMA seedpeer;
CREATE TABLE seedpeer.processed_event (event_id uuid NOT NULL, consumer_group text NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (event_id, consumer_group, processed_at))
    PARTITION BY RANGE (processed_at);
CREATE TABLE seedpeer.processed_event_recent PARTITION OF seedpeer.processed_event
    FOR VALUES FROM (now() - interval '30 days') TO (now() + interval '30 days');
CREATE TABLE seedpeer.processed_event_other PARTITION OF seedpeer.processed_event DEFAULT`

// 18. From the style guide's consumer to once, mid-stream (issue 33): the
// guide's own Python consumer (aiokafka, asyncpg, its processed_event)
// processes the first part of a topic with 25% of its events re-published,
// and stops part way; app migrate --adopt-claims copies its claims, and app
// serve takes the same group over (same group name, same Kafka group, its
// committed offsets). The rest, and re-published copies of events the
// Python side processed, run once: nothing the Python side processed runs
// again, nothing after the switch is skipped, no dead letter, no claim lost.
// Then the group's offsets are reset to the earliest and everything is
// delivered again: all duplicates. Both variants of the guide's table.
func TestFromTheGuidesConsumer(t *testing.T) {
	for _, v := range []struct{ name, ddl string }{
		{"plain", ""}, // consume.py makes the guide's plain table itself
		{"partitioned by processed_at", guidesPartitionedDDL},
	} {
		t.Run(v.name, func(t *testing.T) {
			fromTheGuidesConsumer(t, "18 from the guide's consumer ("+v.name+", "+partitionOrder.name+")", v.ddl)
		})
	}
}

func fromTheGuidesConsumer(t *testing.T, name, ddl string) {
	python, dir := seedpeer(t)
	s := newScenario(t, name, 6)
	group := s.group(analyticsGroup) // the Python side's --group: the same group name and Kafka group
	dbURL, db := freshDatabase(t)
	ctx := context.Background()
	if ddl != "" {
		if _, err := db.Exec(ctx, ddl); err != nil {
			t.Fatal(err)
		}
	}
	produce := guidesProducer(t, s, python, dir)

	// Before: the guide's consumer on the first part, stopping part way.
	first := produce(scale(200))
	expect := first.Produced * 3 / 5
	if out, err := guidesConsumer(t, s, python, dir, dbURL, group, expect).CombinedOutput(); err != nil {
		t.Fatalf("consume.py: %v\n%s", err, out)
	}
	pyClaims := guideClaims(t, db, group)
	pyIDs := map[uuid.UUID]time.Time{} // each event the Python side claimed, and its latest claim
	for _, c := range pyClaims {
		if c.at.After(pyIDs[c.id]) {
			pyIDs[c.id] = c.at
		}
	}
	if len(pyIDs) == 0 || len(pyIDs) >= first.Distinct {
		t.Fatalf("the guide's consumer claimed %d of the first part's %d events; the switch must come part way", len(pyIDs), first.Distinct)
	}
	if trapped := len(pyClaims) - len(pyIDs); trapped > 0 {
		t.Logf("before the switch, the guide's table keyed by processed_at let %d re-published events run twice (the spec's trap)", trapped)
	}

	// The switch: app migrate takes the claims over, app serve the group.
	// No job ever cleaned the guide's table: it kept every claim for at
	// least the library's retention (--guide-retention), and the events
	// before its oldest claim that the Python side never read are not too
	// old for the horizon.
	env := []string{"DATABASE_URL=" + dbURL}
	migrate := s.startEnv("migrate", env, "migrate", "--adopt-claims", "seedpeer.processed_event", "--guide-retention", "168h", "--log-format", "json")
	select {
	case <-migrate.done:
	case <-time.After(time.Minute):
		t.Fatalf("app migrate did not finish within a minute: %s", tail(migrate.log, 20))
	}
	if migrate.err != nil {
		t.Fatalf("app migrate --adopt-claims: %v\n%s", migrate.err, tail(migrate.log, 20))
	}
	serve := func(name string) *proc {
		return s.startEnv(name, env, "serve", "--topic-suffix", s.suffix, "--group-suffix", s.suffix, "--groups", analyticsGroup,
			"--partitions", strconv.Itoa(int(s.parts)), "--session-timeout", "6s", "--maintenance-interval", "0",
			"--ops-listen", "127.0.0.1:0", "--log-level", "debug", "--log-format", "json", "--concurrency", "0")
	}
	once := serve("once")

	// After: the rest, and copies of events the Python side processed.
	second := produce(scale(150))
	republished := 0
	for _, m := range testenv.ReadTopic(t, s.brokers, s.topic) {
		ev, err := orderevents.DecodeConfirmed(m.Value)
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := pyIDs[ev.EventID()]; ok && republished < len(pyIDs)/4+1 {
			s.send(string(m.Key), m.Value)
			republished++
		}
	}
	waitCaughtUp(t, s, group, 2*time.Minute)
	once.stop(t)

	// Whatever is re-delivered: the group read again from the start.
	s.resetOffsetsToEarliest(group, s.topic)
	again := serve("once-again")
	waitCaughtUp(t, s, group, 2*time.Minute)
	again.stop(t)

	// Every event on the topic, once.
	events := map[uuid.UUID]orderevents.Confirmed{}
	messages := testenv.ReadTopic(t, s.brokers, s.topic)
	for _, m := range messages {
		ev, err := orderevents.DecodeConfirmed(m.Value)
		if err != nil {
			t.Fatal(err)
		}
		events[ev.EventID()] = ev
	}
	if want := first.Produced + second.Produced + republished; len(messages) != want || len(events) != first.Distinct+second.Distinct {
		t.Fatalf("the topic holds %d messages of %d events; want %d of %d", len(messages), len(events), want, first.Distinct+second.Distinct)
	}

	o := s.readOutcomes()
	processed := map[uuid.UUID]int{}
	for _, id := range o.ids[group]["processed"] {
		processed[uuid.MustParse(id)]++
	}
	ranAgain, ranTwice, skipped := 0, 0, 0
	for id := range events {
		_, byPython := pyIDs[id]
		switch n := processed[id]; {
		case byPython && n > 0:
			ranAgain++
		case !byPython && n == 0:
			skipped++
		case n > 1:
			ranTwice++
		}
	}
	if ranAgain+ranTwice+skipped > 0 {
		t.Errorf("of %d events, %d the Python side processed ran again under once, %d ran twice under once, %d after the switch never ran",
			len(events), ranAgain, ranTwice, skipped)
	}
	if n, want := o.count[group]["duplicate"], republished+len(messages)-len(events); n < want {
		t.Errorf("once skipped %d duplicates; want at least %d (the copies re-published, and every message again after the reset)", n, want)
	}

	// The effects: the Python side's in its revenue table, as many as its
	// claims; once's analytics, one per event the Python side never claimed.
	pyEffects, onceEffects := figures{}, figures{}
	for _, c := range pyClaims {
		pyEffects.add(events[c.id])
	}
	for id, ev := range events {
		if _, ok := pyIDs[id]; !ok {
			onceEffects.add(ev)
		}
	}
	if got := readFigures(t, db, `SELECT customer_id, day::text, revenue, order_count FROM seedpeer.revenue`); !got.equal(pyEffects) {
		t.Errorf("the Python side's revenue %v; want its claims' %v", got, pyEffects)
	}
	if got := readFigures(t, db, `SELECT customer_id, day::text, revenue, order_count FROM analytics.customer_daily_revenue`); !got.equal(onceEffects) {
		t.Errorf("once's analytics %v; want one order per event the Python side did not process %v", got, onceEffects)
	}

	// No claim lost: one per event, the Python side's with its
	// processed_at and no fingerprint, once's with one.
	rows, err := db.Query(ctx, `SELECT event_id, processed_at, payload_sha256 IS NULL FROM processed_event WHERE consumer_group = $1`, group)
	if err != nil {
		t.Fatal(err)
	}
	lost := len(events)
	for rows.Next() {
		var id uuid.UUID
		var at time.Time
		var noFingerprint bool
		if err := rows.Scan(&id, &at, &noFingerprint); err != nil {
			t.Fatal(err)
		}
		if _, ok := events[id]; ok {
			lost--
		}
		if pyAt, byPython := pyIDs[id]; byPython != noFingerprint || (byPython && !at.Equal(pyAt)) {
			t.Errorf("claim %s: processed_at %s, without a fingerprint %v; the Python side's claim (%v) has its processed_at %s and none",
				id, at, noFingerprint, byPython, pyAt)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if lost != 0 {
		t.Errorf("%d events have no claim in processed_event", lost)
	}

	var parked int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM once_dead_letter`).Scan(&parked); err != nil {
		t.Fatal(err)
	}
	if n := testenv.MessageCount(t, s.brokers, s.dlq); n+int64(parked)+int64(o.deadLettered()) != 0 {
		t.Errorf("%d dead letters on %s, %d parked, %d logged; want none", n, s.dlq, parked, o.deadLettered())
	}
	t.Logf("%s: %d events (%d messages); the Python side claimed %d, once processed %d, skipped %d duplicates",
		name, len(events), len(messages), len(pyIDs), len(o.ids[group]["processed"]), o.count[group]["duplicate"])
	r := result{Scenario: name, Events: len(events), Deliveries: o.total(group), Duplicates: o.count[group]["duplicate"], Lost: lost}
	t.Cleanup(func() { r.Pass = !t.Failed(); record(r) })
}

// guidesProducer returns a function that publishes n events with the
// guide's Python producer, 25% of them re-published, on the scenario's
// topic, each call with orders of its own.
func guidesProducer(t *testing.T, s *scenario, python, dir string) func(n int) produced {
	firstOrder := 1_000_000_000 + rand.Int64N(1<<50)
	return func(n int) produced {
		t.Helper()
		out, err := exec.Command(python, filepath.Join(dir, "produce.py"), "--brokers", s.brokers[0], "--topic", s.topic,
			"-n", strconv.Itoa(n), "--dup-rate", "0.25", "--first-order", strconv.FormatInt(firstOrder, 10)).Output()
		if err != nil {
			t.Fatalf("produce.py: %v\n%s", err, stderrOf(err))
		}
		firstOrder += int64(n)
		var p produced
		if err := json.Unmarshal(out, &p); err != nil {
			t.Fatalf("produce.py printed %q: %v", out, err)
		}
		return p
	}
}

// guidesConsumer is the guide's Python consumer of group on the scenario's
// topic, claiming in seedpeer.processed_event of dbURL, until it has seen
// expect messages; killed when the test ends.
func guidesConsumer(t *testing.T, s *scenario, python, dir, dbURL, group string, expect int) *exec.Cmd {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	return exec.CommandContext(ctx, python, filepath.Join(dir, "consume.py"), "--brokers", s.brokers[0], "--topic", s.topic,
		"--dsn", dbURL, "--group", group, "--expect", strconv.Itoa(expect))
}

// freshDatabase is a database of the test's own on the test cluster, as a
// team's that never ran once: nothing of the library in it. Dropped when
// the test ends.
func freshDatabase(t *testing.T) (string, *pgxpool.Pool) {
	t.Helper()
	admin := testenv.Postgres(t)
	name := "once_adopt_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	if _, err := admin.Exec(context.Background(), "CREATE DATABASE "+name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = admin.Exec(context.Background(), "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)") })
	u, err := neturl.Parse(os.Getenv("DATABASE_URL"))
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	return u.String(), testenv.PoolAt(t, u.String())
}

// loginRole is a login role of the test's own (roles belong to the
// cluster), dropped when the test ends, after the databases made after it.
func loginRole(t *testing.T, name string) string {
	t.Helper()
	admin := testenv.Postgres(t)
	role := "e2e_" + name + "_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	if _, err := admin.Exec(context.Background(), "CREATE ROLE "+role+" LOGIN"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = admin.Exec(context.Background(), "DROP ROLE IF EXISTS "+role) })
	return role
}

// urlAs is databaseURL with role as its user.
func urlAs(t *testing.T, databaseURL, role string) string {
	t.Helper()
	u, err := neturl.Parse(databaseURL)
	if err != nil {
		t.Fatal(err)
	}
	u.User = neturl.User(role)
	return u.String()
}

type guideClaim struct {
	id uuid.UUID
	at time.Time
}

// guideClaims are the rows of the guide's table for group: one per event,
// or more where its key let an event be claimed twice.
func guideClaims(t *testing.T, db *pgxpool.Pool, group string) []guideClaim {
	t.Helper()
	rows, err := db.Query(context.Background(), `SELECT event_id, processed_at FROM seedpeer.processed_event WHERE consumer_group = $1`, group)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (c guideClaim, err error) { return c, r.Scan(&c.id, &c.at) })
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// waitCaughtUp waits until group committed the end of every partition of
// the scenario's topic.
func waitCaughtUp(t *testing.T, s *scenario, group string, timeout time.Duration) {
	t.Helper()
	client, err := sarama.NewClient(s.brokers, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	admin, err := sarama.NewClusterAdminFromClient(client)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(timeout)
	for {
		_ = client.RefreshMetadata(s.topic)
		lag, err := pipeline.GroupLag(client, admin, group, s.topic)
		if err == nil && lag == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s still lags %d behind %s after %s (%v)", group, lag, s.topic, timeout, err)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// figures are revenue and orders per customer and day.
type figures map[string]struct {
	revenue decimal.Decimal
	orders  int64
}

func (f figures) add(ev orderevents.Confirmed) {
	k := fmt.Sprintf("%d %s", ev.CustomerID(), ev.OccurredAt().UTC().Format(time.DateOnly))
	v := f[k]
	v.revenue, v.orders = v.revenue.Add(ev.TotalAmount()), v.orders+1
	f[k] = v
}

func (f figures) equal(g figures) bool {
	if len(f) != len(g) {
		return false
	}
	for k, v := range f {
		if w, ok := g[k]; !ok || !w.revenue.Equal(v.revenue) || w.orders != v.orders {
			return false
		}
	}
	return true
}

func readFigures(t *testing.T, db *pgxpool.Pool, query string) figures {
	t.Helper()
	rows, err := db.Query(context.Background(), query)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	f := figures{}
	for rows.Next() {
		var customer, orders int64
		var day string
		var revenue decimal.Decimal
		if err := rows.Scan(&customer, &day, &revenue, &orders); err != nil {
			t.Fatal(err)
		}
		k := fmt.Sprintf("%d %s", customer, day)
		v := f[k]
		v.revenue, v.orders = v.revenue.Add(revenue), v.orders+orders
		f[k] = v
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return f
}

// 19. Side by side (issue 33), under roles of their own: the guide's
// consumer runs as the role that made its schema and table (a login role
// that may create in the database, no superuser), the library's tables
// are migrated as another role, granted the guide's as the refusal to
// adopt another role's table says, which also runs once. The guide's table
// is where the library's claim table is (once.Config.Tables names schema
// seedpeer, where the guide's consumer keeps it), so the migration adopts
// it in place, and it stays the guide's role's. One group moves to once
// (its handler the Go port of the guide's revenue upsert, into the same
// table); another keeps the guide's Python consumer, unchanged, which
// starts (its start-up DDL included), reads the whole topic while once
// works and keeps claiming in the adopted table, writing neither hash.
// Every event counts once per group in the one revenue table, the moving
// group's claims of the Python side match by id, and nothing is
// dead-lettered, parked or refused as a mismatch.
func TestTheGuidesConsumerBesideOnce(t *testing.T) {
	python, dir := seedpeer(t)
	s := newScenario(t, "19 the guide's consumer beside once", 6)
	moving, staying := s.group("seed-analytics"), s.group("seed-reports")
	guide, migrator := loginRole(t, "guide"), loginRole(t, "migrator")
	dbURL, db := freshDatabase(t)
	ctx := context.Background()
	if _, err := db.Exec(ctx, `GRANT CREATE ON DATABASE `+pgx.Identifier{db.Config().ConnConfig.Database}.Sanitize()+` TO `+guide+`;
		GRANT `+guide+` TO `+migrator); err != nil {
		t.Fatal(err)
	}
	guideURL, migratorURL := urlAs(t, dbURL, guide), urlAs(t, dbURL, migrator)
	produce := guidesProducer(t, s, python, dir)

	first := produce(scale(150))
	if out, err := guidesConsumer(t, s, python, dir, guideURL, moving, first.Produced).CombinedOutput(); err != nil {
		t.Fatalf("consume.py of %s: %v\n%s", moving, err, out)
	}
	pyIDs := map[uuid.UUID]bool{}
	for _, c := range guideClaims(t, db, moving) {
		pyIDs[c.id] = true
	}

	// The adoption, as app migrate runs it: the migration, then the
	// retention recorded with the guide's. No job ever cleaned the guide's
	// table, so it kept its claims for at least the library's retention;
	// recorded by once.New without it, the horizon would start at its
	// oldest claim, a minute ago.
	tables := schema.Config{Schema: "seedpeer"}
	asMigrator := testenv.PoolAt(t, migratorURL)
	if _, err := schema.Migrate(ctx, asMigrator, tables); err != nil {
		t.Fatalf("migrate the guide's database as %s: %v", migrator, err)
	}
	if err := retention.Agree(ctx, retention.Config{DB: asMigrator, Tables: tables, GuideRetention: retention.DefaultRetention}); err != nil {
		t.Fatal(err)
	}

	var mu sync.Mutex
	processed := map[uuid.UUID]int{}
	outcomes := map[string]int{}
	svc, err := once.New(ctx, once.Config{Brokers: s.brokers, DatabaseURL: migratorURL, Tables: tables,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Hooks: once.Hooks{OnResult: func(r idempotency.Result) {
			mu.Lock()
			defer mu.Unlock()
			outcomes[r.Outcome.String()]++
			if r.Outcome == idempotency.Processed {
				processed[r.EventID]++
			}
		}},
		Topics: []once.Binding{once.Topic[orderevents.Confirmed]{Name: s.topic, Decode: orderevents.DecodeConfirmed,
			Groups: []once.Group[orderevents.Confirmed]{{Name: moving, Handle: guidesRevenueUpsert}}}}})
	if err != nil {
		t.Fatalf("once.New on the guide's database: %v", err)
	}
	oncetest.Run(t, svc)

	second := produce(scale(150))
	republished := 0
	for _, m := range testenv.ReadTopic(t, s.brokers, s.topic) {
		if ev, err := orderevents.DecodeConfirmed(m.Value); err == nil && pyIDs[ev.EventID()] && republished < len(pyIDs)/4+1 {
			s.send(string(m.Key), m.Value)
			republished++
		}
	}
	all := first.Produced + second.Produced + republished
	if out, err := guidesConsumer(t, s, python, dir, guideURL, staying, all).CombinedOutput(); err != nil {
		t.Fatalf("consume.py of %s beside once: %v\n%s", staying, err, out)
	}
	waitCaughtUp(t, s, moving, 2*time.Minute)

	events := map[uuid.UUID]orderevents.Confirmed{}
	for _, m := range testenv.ReadTopic(t, s.brokers, s.topic) {
		ev, err := orderevents.DecodeConfirmed(m.Value)
		if err != nil {
			t.Fatal(err)
		}
		events[ev.EventID()] = ev
	}
	want := figures{}
	for _, ev := range events {
		want.add(ev) // the moving group's
		want.add(ev) // the staying group's
	}
	if got := readFigures(t, db, `SELECT customer_id, day::text, revenue, order_count FROM seedpeer.revenue`); !got.equal(want) {
		t.Errorf("revenue %v; want every event once per group %v", got, want)
	}
	mu.Lock()
	for id := range events {
		if n := processed[id]; n != 0 && (pyIDs[id] || n > 1) || n == 0 && !pyIDs[id] {
			t.Errorf("event %s: once processed it %d times, the Python side had it %v", id, n, pyIDs[id])
		}
	}
	t.Logf("once: %v", outcomes)
	onceProcessed, onceDuplicates := outcomes["processed"], outcomes["duplicate"]
	if n := outcomes["payload_mismatch"] + outcomes["outside_horizon"]; n != 0 {
		t.Errorf("once's outcomes %v; want no payload mismatch (a claim of the Python side's matches by id) and none outside the horizon", outcomes)
	}
	mu.Unlock()

	var claims, stayingClaims, stayingFingerprinted, parked int
	var partitionedBy, owner string
	if err := db.QueryRow(ctx, `SELECT (SELECT count(*) FROM seedpeer.processed_event WHERE consumer_group = $1),
		(SELECT count(*) FROM seedpeer.processed_event WHERE consumer_group = $2),
		(SELECT count(*) FROM seedpeer.processed_event WHERE consumer_group = $2 AND payload_sha256 IS NOT NULL),
		(SELECT a.attname FROM pg_partitioned_table p JOIN pg_attribute a ON a.attrelid = p.partrelid AND a.attnum = p.partattrs[0]
			WHERE p.partrelid = 'seedpeer.processed_event'::regclass),
		(SELECT tableowner FROM pg_tables WHERE schemaname = 'seedpeer' AND tablename = 'processed_event'),
		(SELECT count(*) FROM `+tables.DeadLettersTable().Qualified+`)`, moving, staying).Scan(&claims, &stayingClaims, &stayingFingerprinted, &partitionedBy, &owner, &parked); err != nil {
		t.Fatal(err)
	}
	if partitionedBy != "event_id" || claims != len(events) || stayingClaims != len(events) || stayingFingerprinted != 0 || owner != guide {
		t.Errorf("the guide's table, partitioned by %q and owned by %s, holds %d claims of %s and %d of %s (%d with a fingerprint); want it adopted "+
			"(by event_id), still %s's, one claim per event in each group, the Python side's without a fingerprint",
			partitionedBy, owner, claims, moving, stayingClaims, staying, stayingFingerprinted, guide)
	}
	if dead := testenv.MessageCount(t, s.brokers, s.dlq); dead+int64(parked) != 0 {
		t.Errorf("%d messages dead-lettered, %d parked; want none", dead, parked)
	}
	r := result{Scenario: "19 the guide's consumer beside once (" + partitionOrder.name + ")", Events: len(events), Deliveries: onceProcessed + onceDuplicates,
		Duplicates: onceDuplicates, Lost: 2*len(events) - claims - stayingClaims}
	t.Cleanup(func() { r.Pass = !t.Failed(); record(r) })
}

// guidesRevenueUpsert is the guide's consumer's business write (consume.py),
// ported to a once handler: the team's own table, in the claim's
// transaction.
func guidesRevenueUpsert(ctx context.Context, tx pgx.Tx, ev orderevents.Confirmed) error {
	_, err := tx.Exec(ctx, `INSERT INTO seedpeer.revenue AS r VALUES ($1, $2::date, $3::numeric, 1) ON CONFLICT (customer_id, day)
DO UPDATE SET revenue = r.revenue + EXCLUDED.revenue, order_count = r.order_count + 1`,
		ev.CustomerID(), ev.OccurredAt().UTC().Format(time.DateOnly), ev.TotalAmount().String())
	return err
}
