package migrations_test

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/migrations"
	"github.com/once-dev/once/outbox"
	"github.com/once-dev/once/schema"
)

// forwarding is what the outbox tests below share: the owner's pool, the
// outbox, a topic of their own.
type forwarding struct {
	t       *testing.T
	admin   *pgxpool.Pool
	box     *outbox.Outbox
	brokers []string
	topic   string
}

func newForwarding(t *testing.T) *forwarding {
	t.Helper()
	admin := reftest.Postgres(t)
	box, err := outbox.New(schema.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	brokers := testenv.Brokers(t)
	f := &forwarding{t: t, admin: admin, box: box, brokers: brokers, topic: testenv.Topic(t, brokers, 1)}
	// The shared progress as it stood, put back after (the tests move it).
	var acked *int64
	var tx *string
	_ = admin.QueryRow(context.Background(), `SELECT offset_acked, last_processed_transaction_id::text FROM once_outbox_offsets WHERE consumer_group = 'kafka_forwarder'`).Scan(&acked, &tx)
	t.Cleanup(func() {
		if tx != nil {
			_, _ = admin.Exec(context.Background(), `UPDATE once_outbox_offsets SET offset_acked = $1, last_processed_transaction_id = $2::xid8 WHERE consumer_group = 'kafka_forwarder'`, acked, *tx)
		}
	})
	return f
}

// publish writes n rows to the outbox as pool's role and returns their ids.
func (f *forwarding) publish(pool *pgxpool.Pool, n int) []string {
	f.t.Helper()
	ctx := context.Background()
	var ids []string
	for range n {
		id := uuid.NewString()
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			return f.box.Publish(ctx, tx, outbox.Message{Topic: f.topic, Key: "k", ID: id, Payload: []byte(`"` + id + `"`)})
		}); err != nil {
			f.t.Fatalf("publish: %v", err)
		}
		ids = append(ids, id)
	}
	f.t.Cleanup(func() {
		_, _ = f.admin.Exec(context.Background(), `DELETE FROM once_outbox WHERE payload->>'uuid' = ANY($1)`, ids)
	})
	return ids
}

// acked is whether progress row name stands past every row of ids.
func (f *forwarding) acked(name string, ids []string) bool {
	var all bool
	err := f.admin.QueryRow(context.Background(), `SELECT bool_and(m.transaction_id < o.last_processed_transaction_id
		OR (m.transaction_id = o.last_processed_transaction_id AND m."offset" <= o.offset_acked))
		FROM once_outbox m, once_outbox_offsets o WHERE o.consumer_group = $1 AND m.payload->>'uuid' = ANY($2)`, name, ids).Scan(&all)
	return err == nil && all
}

// forward runs a forwarder as pool's role until progress row name
// acknowledged every row of ids.
func (f *forwarding) forward(pool *pgxpool.Pool, name string, ids []string) {
	f.t.Helper()
	fw, err := f.box.Forwarder(pool, outbox.KafkaPublisher{Producer: testenv.Producer(f.t, f.brokers)})
	if err != nil {
		f.t.Fatalf("forwarder keeping %s: %v", name, err)
	}
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- fw.Run(ctx) }()
	deadline := time.Now().Add(30 * time.Second)
	for !f.acked(name, ids) && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	stop()
	<-done
	if !f.acked(name, ids) {
		f.t.Fatalf("the forwarder did not acknowledge its rows in %s within 30s", name)
	}
}

// sent counts each id on the topic.
func (f *forwarding) sent() map[string]int {
	n := map[string]int{}
	for _, m := range testenv.ReadTopic(f.t, f.brokers, f.topic) {
		n[strings.Trim(string(m.Value), `"`)]++
	}
	return n
}

func (f *forwarding) eachOnce(ids ...[]string) {
	f.t.Helper()
	got := f.sent()
	want := 0
	for _, l := range ids {
		for _, id := range l {
			want++
			if got[id] != 1 {
				f.t.Errorf("row %s sent %d times; want once", id, got[id])
			}
		}
	}
	if len(got) != want {
		f.t.Errorf("%d distinct rows sent; want %d", len(got), want)
	}
}

// Item 1 of priv's second review: a service role that neither owns the
// tables nor is a member of a group role (the set-up before least
// privilege, one role for every service) forwards and prunes by the shared
// progress. Row security is active for it (00014 enabled it), and its
// policy (once_other_roles) lets it see every progress row: it used to see
// both groups' and refuse to start, for ever.
func TestARoleOfNoGroupForwardsAndPrunesByTheSharedProgress(t *testing.T) {
	ctx := context.Background()
	f := newForwarding(t)
	if err := migrations.Grant(ctx, f.admin, migrations.Groups); err != nil {
		t.Fatal(err)
	}
	testenv.LoginRole(t, f.admin, "plain_svc")
	if _, err := f.admin.Exec(ctx, `GRANT SELECT, INSERT, UPDATE, DELETE ON once_outbox, once_outbox_offsets TO plain_svc; GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO plain_svc`); err != nil {
		t.Fatal(err)
	}
	plain := testenv.PoolAt(t, testenv.URLAs(testenv.Where{Mode: pgx.QueryExecModeExec}.URL(t), "plain_svc", ""))
	var restricted bool
	var groups int
	if err := plain.QueryRow(ctx, `SELECT row_security_active('once_outbox_offsets'), (SELECT count(*) FROM once_outbox_offsets WHERE starts_with(consumer_group, 'kafka_forwarder:'))`).Scan(&restricted, &groups); err != nil || !restricted || groups < 2 {
		t.Fatalf("plain_svc: row security active %v, groups' progress rows seen %d (%v); want active and at least 2 (the fault)", restricted, groups, err)
	}

	ids := f.publish(plain, 3)
	f.forward(plain, "kafka_forwarder", ids)
	f.eachOnce(ids)

	if _, err := f.admin.Exec(ctx, `UPDATE once_outbox SET created_at = created_at - interval '2 days' WHERE payload->>'uuid' = ANY($1)`, ids); err != nil {
		t.Fatal(err)
	}
	if _, err := f.box.Prune(ctx, plain, time.Hour, 1000); err != nil {
		t.Fatalf("prune as plain_svc: %v", err)
	}
	var left int
	if err := f.admin.QueryRow(ctx, `SELECT count(*) FROM once_outbox WHERE payload->>'uuid' = ANY($1)`, ids).Scan(&left); err != nil || left != 0 {
		t.Errorf("after plain_svc's prune: %d forwarded rows left (%v); want 0", left, err)
	}
}

// Item 2 of priv's second review: a forwarder running under a group's role
// while app migrate turns on row security for the progress rows (00014)
// loses sight of the shared progress row it started with. It now notices,
// stops (its Run returns, and package pipeline starts it again), and the
// forwarder started again keeps its group's row and sends every row once.
func TestARunningForwarderLeavesAProgressRowAMigrationHid(t *testing.T) {
	ctx := context.Background()
	f := newForwarding(t)
	if err := migrations.Grant(ctx, f.admin, migrations.Groups); err != nil {
		t.Fatal(err)
	}
	testenv.LoginRole(t, f.admin, "billing_svc", "once_billing")
	billing := testenv.PoolAt(t, testenv.URLAs(testenv.Where{Mode: pgx.QueryExecModeExec}.URL(t), "billing_svc", ""))
	// Before 00014: no row security on the progress rows.
	if _, err := f.admin.Exec(ctx, `ALTER TABLE once_outbox_offsets DISABLE ROW LEVEL SECURITY`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = f.admin.Exec(ctx, `ALTER TABLE once_outbox_offsets ENABLE ROW LEVEL SECURITY`) })
	// The forwarder's own log: the restart is said as one, not as an outage
	// (the merged review: the backoff took the watch's error for the
	// database being unreachable, a WARN never followed by a recovery).
	var logged testenv.Logs
	box, err := outbox.New(schema.Config{}, slog.New(slog.NewJSONHandler(&logged, nil)))
	if err != nil {
		t.Fatal(err)
	}
	fw, err := box.Forwarder(billing, outbox.KafkaPublisher{Producer: testenv.Producer(t, f.brokers)})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- fw.Run(runCtx) }()
	select {
	case <-fw.Running():
	case <-time.After(30 * time.Second):
		t.Fatal("the forwarder did not start")
	}
	// app migrate applies 00014.
	if _, err := f.admin.Exec(ctx, `ALTER TABLE once_outbox_offsets ENABLE ROW LEVEL SECURITY`); err != nil {
		t.Fatal(err)
	}
	var seen int
	if err := billing.QueryRow(ctx, `SELECT count(*) FROM once_outbox_offsets WHERE consumer_group = 'kafka_forwarder'`).Scan(&seen); err != nil || seen != 0 {
		t.Fatalf("billing_svc sees the shared progress row: %d (%v); want 0 (the fault)", seen, err)
	}
	ids := f.publish(billing, 3)
	select {
	case err := <-done:
		t.Logf("the forwarder stopped: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("the forwarder ran on for 30s on a progress row it no longer sees; want it stopped")
	}
	if out := logged.String(); !strings.Contains(out, "outbox forwarder restarts on its new progress row") ||
		strings.Contains(out, `"error_class":"unreachable"`) || strings.Contains(out, `"level":"WARN"`) || strings.Contains(out, `"level":"ERROR"`) {
		t.Errorf("the forwarder's log; want its restart said once at INFO, no outage, no error:\n%s", out)
	}
	f.forward(billing, "kafka_forwarder:once_billing", ids)
	f.eachOnce(ids)
}

// Item 3 of priv's second review: switching from the owner's forwarding to
// the groups' and back, with app migrate in between (operating.md, Least
// privilege), sends each row once: each progress follows the others'
// (migrations.Grant), instead of starting where the shared one stood when
// 00014 first ran.
func TestSwitchingBetweenOwnerAndGroupForwardingSendsEachRowOnce(t *testing.T) {
	ctx := context.Background()
	f := newForwarding(t)
	testenv.LoginRole(t, f.admin, "billing_svc", "once_billing")
	testenv.LoginRole(t, f.admin, "analytics_svc", "once_analytics")
	billing := testenv.PoolAt(t, testenv.URLAs(testenv.Where{Mode: pgx.QueryExecModeExec}.URL(t), "billing_svc", ""))
	analytics := testenv.PoolAt(t, testenv.URLAs(testenv.Where{Mode: pgx.QueryExecModeExec}.URL(t), "analytics_svc", ""))
	grant := func() {
		t.Helper()
		if err := migrations.Grant(ctx, f.admin, migrations.Groups); err != nil {
			t.Fatal(err)
		}
	}
	grant()

	// The owner forwards rows of no group.
	owners := f.publish(f.admin, 3)
	f.forward(f.admin, "kafka_forwarder", owners)
	grant()
	// The groups forward: billing its own rows; both see the owner's.
	f.forward(billing, "kafka_forwarder:once_billing", owners)
	billings := f.publish(billing, 3)
	f.forward(billing, "kafka_forwarder:once_billing", billings)
	f.forward(analytics, "kafka_forwarder:once_analytics", owners)
	grant()
	// The owner forwards again.
	more := f.publish(f.admin, 2)
	f.forward(f.admin, "kafka_forwarder", append(append([]string{}, billings...), more...))
	f.eachOnce(owners, billings, more)
}

// Item 6 of priv's second review: app migrate run twice at once (two init
// containers) grants without colliding ("tuple concurrently updated").
func TestGrantRunsConcurrently(t *testing.T) {
	ctx := context.Background()
	_ = reftest.Postgres(t)
	var mu sync.Mutex
	var failures []string
	for range 4 {
		var wg sync.WaitGroup
		for range 3 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				pool := testenv.PoolAt(t, testenv.Where{Mode: pgx.QueryExecModeExec}.URL(t))
				if err := migrations.Grant(ctx, pool, migrations.Groups); err != nil {
					mu.Lock()
					failures = append(failures, err.Error())
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
	}
	if len(failures) > 0 {
		t.Errorf("%d of 12 concurrent Grants failed, first: %s", len(failures), failures[0])
	}
}

// Item 8 of priv's second review: in a set-up where only the groups' roles
// forward, rows of no group (the owner's) are pruned once a group's
// forwarder sent them, though the shared progress stays behind them.
func TestRowsOfNoGroupArePrunedOnceAGroupSentThem(t *testing.T) {
	ctx := context.Background()
	f := newForwarding(t)
	if err := migrations.Grant(ctx, f.admin, migrations.Groups); err != nil {
		t.Fatal(err)
	}
	testenv.LoginRole(t, f.admin, "billing_svc", "once_billing")
	billing := testenv.PoolAt(t, testenv.URLAs(testenv.Where{Mode: pgx.QueryExecModeExec}.URL(t), "billing_svc", ""))
	owners := f.publish(f.admin, 3)
	f.forward(billing, "kafka_forwarder:once_billing", owners)
	if f.acked("kafka_forwarder", owners) {
		t.Fatal("the shared progress stands past the owner's rows; want it behind (no shared forwarder ran)")
	}
	if _, err := f.admin.Exec(ctx, `UPDATE once_outbox SET created_at = created_at - interval '2 days' WHERE payload->>'uuid' = ANY($1)`, owners); err != nil {
		t.Fatal(err)
	}
	if _, err := f.box.Prune(ctx, f.admin, time.Hour, 1000); err != nil {
		t.Fatalf("prune as the owner: %v", err)
	}
	var left int
	if err := f.admin.QueryRow(ctx, `SELECT count(*) FROM once_outbox WHERE payload->>'uuid' = ANY($1)`, owners).Scan(&left); err != nil || left != 0 {
		t.Errorf("after the owner's prune: %d rows of no group left that billing's forwarder sent (%v); want 0", left, err)
	}
	f.eachOnce(owners)
}
