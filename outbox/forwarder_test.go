package outbox_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/outbox"
	"github.com/once-dev/once/schema"
)

// Issue 28, item 8: the stop of a service whose outbox forwarder was
// polling logs no ERROR. watermill-sql logged "could not commit tx for
// querying message" at ERROR when the stop cancelled a poll's commit, at
// the clean stop of every service, an outbox or not.
func TestAStopMidPollLogsNoError(t *testing.T) {
	pool := testenv.Postgres(t)
	var logged testenv.Logs
	ob, err := outbox.New(schema.Config{}, slog.New(slog.NewJSONHandler(&logged, &slog.HandlerOptions{Level: slog.LevelDebug})))
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	// The commit of one poll (a transaction that read the outbox; setting
	// up writes only) is held until the forwarder is told to stop: the
	// stop lands between a poll's read and its commit, which a real stop
	// hits now and then.
	var held atomic.Int64
	db := &testenv.Intercepted{DB: pool, OnCommit: func(ctx context.Context, polled bool) {
		if polled && held.Add(1) == 1 {
			stop()
			select {
			case <-ctx.Done(): // the poll's own context, which the stop ends
			case <-time.After(10 * time.Second):
			}
		}
	}}
	fw, err := ob.Forwarder(db, outbox.KafkaPublisher{Producer: testenv.Producer(t, testenv.Brokers(t))})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- fw.Run(ctx) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("the forwarder did not stop")
	}
	if held.Load() == 0 {
		t.Fatal("no poll reached its commit: the stop was not staged")
	}
	for _, line := range logged.JSONLines(t, "ERROR") {
		t.Errorf("the stop logged an ERROR: %v", line)
	}
}

// holdingPublisher passes messages to Kafka, except that the first one
// after hold is set waits there until its forwarder stops: the forwarder's
// transaction, which read it and holds the outbox's lock, stays open.
type holdingPublisher struct {
	outbox.KafkaPublisher
	hold    atomic.Bool
	holding chan struct{}
}

func (p *holdingPublisher) Publish(topic string, msgs ...*message.Message) error {
	if p.hold.CompareAndSwap(true, false) {
		close(p.holding)
		<-p.Stop.Done()
		return p.Stop.Err()
	}
	return p.KafkaPublisher.Publish(topic, msgs...)
}

// idleBoundOutbox is an outbox of tables of its own (name and name_offsets),
// made in pool, whose forwarder's transactions the server ends after idle.
func idleBoundOutbox(t *testing.T, pool *pgxpool.Pool, prefix string, log *slog.Logger, idle time.Duration) (ob *outbox.Outbox, name string) {
	t.Helper()
	name = fmt.Sprintf("%s_%d", prefix, time.Now().UnixNano()%1e9)
	ob, err := outbox.New(schema.Config{Outbox: name, OutboxOffsets: name + "_offsets"}, log)
	if err != nil {
		t.Fatal(err)
	}
	ob.IdleInTransactionTimeout = idle
	if err := ob.Init(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), `DROP TABLE IF EXISTS `+pgx.Identifier{name}.Sanitize()+`, `+pgx.Identifier{name + "_offsets"}.Sanitize())
	})
	return ob, name
}

// A forwarder that vanished behind a network black hole while Kafka was
// acknowledging what its transaction read cannot tell the server it gave
// up: its backend stays idle in the transaction, holding the outbox's
// lock. Another forwarder takes over once the server's idle bound ends
// that transaction. Before, nothing bounded it: every forwarder of the
// table waited for TCP keepalive (two hours), and no event of the outbox
// reached Kafka (e2e row 8 batched: 120 of 180 payment events never
// applied).
func TestAForwarderThatVanishedMidPollReleasesTheOutbox(t *testing.T) {
	pool := testenv.Postgres(t)
	brokers := testenv.Brokers(t)
	dest := testenv.Topic(t, brokers, 1)
	ctx := context.Background()
	ob, name := idleBoundOutbox(t, pool, "outbox_vanished", nil, 2*time.Second)
	write := func(id uuid.UUID) {
		t.Helper()
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		if err := ob.Publish(ctx, tx, outbox.Message{Topic: dest, Key: "k", ID: id.String(), Payload: []byte(`{}`)}); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	var sent sync.Map
	producer := testenv.Producer(t, brokers)
	afterPublish := func(_ string, m *message.Message) { sent.Store(m.UUID, true) }
	forwarded := func(ids ...uuid.UUID) func() bool {
		return func() bool {
			for _, id := range ids {
				if _, ok := sent.Load(id.String()); !ok {
					return false
				}
			}
			return true
		}
	}

	// Forwarder A reaches the database through a proxy. Its first poll
	// acknowledges a row, so that the forwarder's progress row exists and
	// the next poll locks it.
	proxied, proxy := testenv.ProxiedPostgres(t, pool)
	stopA, cancelA := context.WithCancel(ctx)
	defer cancelA()
	a := &holdingPublisher{KafkaPublisher: outbox.KafkaPublisher{Producer: producer, AfterPublish: afterPublish, Stop: stopA},
		holding: make(chan struct{})}
	fwA, err := ob.Forwarder(proxied, a)
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = fwA.Run(stopA) }()
	first, second := uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())
	write(first)
	testenv.Eventually(t, 30*time.Second, "forwarder A forwards the first row", forwarded(first))
	a.hold.Store(true)
	write(second)
	select {
	case <-a.holding:
	case <-time.After(30 * time.Second):
		t.Fatal("forwarder A never read the second row")
	}
	// The fault: the network swallows everything, and A gives up; its
	// goodbye never reaches the server.
	proxy.BlackHole(true)
	cancelA()
	testenv.Eventually(t, 10*time.Second, "the black hole swallows forwarder A's goodbye", proxy.Swallowed)
	var lockers int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
		WHERE l.relation = $1::regclass AND l.granted AND a.state = 'idle in transaction'`, name+"_offsets").Scan(&lockers); err != nil {
		t.Fatal(err)
	}
	if lockers == 0 {
		t.Fatal("no transaction was left idle holding the forwarder's progress: the fault did not happen")
	}

	// Forwarder B, on the database directly, forwards the held row and a
	// new one once the server ended A's transaction.
	stopB, cancelB := context.WithCancel(ctx)
	defer cancelB()
	fwB, err := ob.Forwarder(pool, outbox.KafkaPublisher{Producer: producer, AfterPublish: afterPublish, Stop: stopB})
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = fwB.Run(stopB) }()
	third := uuid.Must(uuid.NewV7())
	write(third)
	testenv.Eventually(t, 30*time.Second, "forwarder B forwards the rows behind the vanished forwarder's transaction", forwarded(second, third))
}

// The server's idle bound is an int of milliseconds: a longer one is
// refused naming the setting, not failed at every poll.
func TestAnIdleBoundTheServerCannotTakeIsRefused(t *testing.T) {
	ob, err := outbox.New(schema.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ob.IdleInTransactionTimeout = 30 * 24 * time.Hour
	if _, err := ob.Forwarder(nil, outbox.KafkaPublisher{}); err == nil || !strings.Contains(err.Error(), "IdleInTransactionTimeout 720h0m0s") {
		t.Fatalf("a 30-day bound: %v; want it refused naming IdleInTransactionTimeout", err)
	}
}

// stallingPublisher is a Kafka slow to acknowledge: the next publish waits
// next (once), and every publish waits each (both in nanoseconds).
type stallingPublisher struct {
	outbox.KafkaPublisher
	next, each atomic.Int64
	stalled    atomic.Int64 // publishes that waited next
}

func (p *stallingPublisher) Publish(topic string, msgs ...*message.Message) error {
	if d := p.next.Swap(0); d > 0 {
		p.stalled.Add(1)
		time.Sleep(time.Duration(d))
	}
	time.Sleep(time.Duration(p.each.Load()))
	return p.KafkaPublisher.Publish(topic, msgs...)
}

// slowKafka is an outbox with a 1 s idle bound, of tables of its own,
// whose forwarder publishes through a stallingPublisher; logged is its log.
type slowKafka struct {
	pool    *pgxpool.Pool
	brokers []string
	dest    string
	ob      *outbox.Outbox
	pub     *stallingPublisher
	logged  testenv.Logs
}

func newSlowKafka(t *testing.T, prefix string, stall, each time.Duration) *slowKafka {
	t.Helper()
	k := &slowKafka{pool: testenv.Postgres(t), brokers: testenv.Brokers(t)}
	k.dest = testenv.Topic(t, k.brokers, 1)
	k.ob, _ = idleBoundOutbox(t, k.pool, prefix, slog.New(slog.NewJSONHandler(&k.logged, nil)), time.Second)
	k.pub = &stallingPublisher{KafkaPublisher: outbox.KafkaPublisher{Producer: testenv.Producer(t, k.brokers)}}
	k.pub.next.Store(int64(stall))
	k.pub.each.Store(int64(each))
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the forwarder's log:\n%s", k.logged.String())
		}
	})
	return k
}

// write commits rows with these ids to the outbox, in one transaction.
func (k *slowKafka) write(t *testing.T, ids ...string) {
	t.Helper()
	ctx := context.Background()
	tx, err := k.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	for _, id := range ids {
		if err := k.ob.Publish(ctx, tx, outbox.Message{Topic: k.dest, Key: "k", ID: id, Payload: []byte(`{}`)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}

// run starts the forwarder until the test ends.
func (k *slowKafka) run(t *testing.T) {
	t.Helper()
	runForwarder(t, k.ob, k.pool, k.pub)
}

// runForwarder runs ob's forwarder on db until the test ends.
func runForwarder(t *testing.T, ob *outbox.Outbox, db *pgxpool.Pool, pub message.Publisher) *forwarder.Forwarder {
	t.Helper()
	fw, err := ob.Forwarder(db, pub)
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- fw.Run(ctx) }()
	t.Cleanup(func() { stop(); <-done })
	return fw
}

// A forwarder whose Kafka acknowledged slower than the forwarder's idle
// bound has its transaction ended by the server. That is the bound at
// work, not the database refusing the read: the line says so and names the
// setting, and the rows go again.
func TestAForwarderHeldByKafkaPastItsIdleBoundSaysSo(t *testing.T) {
	k := newSlowKafka(t, "outbox_idle", 3*time.Second, 0)
	k.run(t)
	k.write(t, "held-by-kafka")
	testenv.Eventually(t, 30*time.Second, "a line naming the forwarder's idle bound", func() bool {
		return strings.Contains(k.logged.String(), "IdleInTransactionTimeout")
	})
	if k.pub.stalled.Load() != 1 {
		t.Fatal("the publish never stalled: the fault did not happen")
	}
	var line map[string]any
	for _, l := range k.logged.JSONLines(t, "WARN", "ERROR") {
		if msg, _ := l["msg"].(string); strings.Contains(msg, "IdleInTransactionTimeout") {
			line = l
		}
	}
	if line["level"] != "WARN" || line["error_class"] != "idle_bound" || line["idle_bound"] != float64(time.Second) || strings.Contains(line["msg"].(string), "refused") {
		t.Errorf("the bound's line: %v; want a WARN of class idle_bound naming the bound, not a refused read", line)
	}
	// The row went again, after the bound had ended its first read.
	testenv.Eventually(t, 30*time.Second, "the row on Kafka again", func() bool { return testenv.MessageCount(t, k.brokers, k.dest) >= 2 })
}

// A Kafka always slower than the idle bound for a poll's rows (each publish
// quick, but a poll's rows one after another) ends every read: the outbox
// does not move, and the rows go again at every try. The second read ended
// in a row is an ERROR that says so (review: it was a WARN for ever, which
// reads as something that passes by itself).
func TestAnOutboxEveryReadOfWhichTheIdleBoundEndsIsAnError(t *testing.T) {
	k := newSlowKafka(t, "outbox_cut", 0, 50*time.Millisecond)
	ids := make([]string, 40) // at 50 ms each, 2 s a poll against a 1 s bound
	for i := range ids {
		ids[i] = fmt.Sprintf("slow-%d", i)
	}
	k.write(t, ids...)
	k.run(t)
	testenv.Eventually(t, 30*time.Second, "an ERROR saying the idle bound ends every read", func() bool {
		return strings.Contains(k.logged.String(), "2 times in a row")
	})
	cuts := k.logged.JSONLines(t, "WARN", "ERROR")
	if len(cuts) < 2 || cuts[0]["level"] != "WARN" || cuts[0]["error_class"] != "idle_bound" || cuts[0]["cuts_in_a_row"] != float64(1) ||
		cuts[1]["level"] != "ERROR" || cuts[1]["error_class"] != "idle_bound" || cuts[1]["cuts_in_a_row"] != float64(2) {
		t.Fatalf("the lines of the first two reads ended: %v; want a WARN, then an ERROR of class idle_bound with 2 cuts in a row", cuts)
	}
	if strings.Contains(k.logged.String(), "reads the outbox again") {
		t.Fatal("a read worked between the two: the fault was not every read")
	}

	// Kafka is quick again: a read works, and the count starts over. The
	// next cut is a WARN of its own, not a third in a row.
	k.pub.each.Store(0)
	testenv.Eventually(t, 30*time.Second, "a read that works", func() bool { return strings.Contains(k.logged.String(), "reads the outbox again") })
	before := len(k.logged.JSONLines(t, "WARN", "ERROR"))
	k.pub.next.Store(int64(3 * time.Second))
	k.write(t, "after-kafka-came-back")
	testenv.Eventually(t, 30*time.Second, "the cut after Kafka came back", func() bool { return len(k.logged.JSONLines(t, "WARN", "ERROR")) > before })
	if k.pub.stalled.Load() != 1 {
		t.Fatal("the publish after Kafka came back never stalled: the fault did not happen")
	}
	if cut := k.logged.JSONLines(t, "WARN", "ERROR")[before]; cut["level"] != "WARN" || cut["cuts_in_a_row"] != float64(1) {
		t.Fatalf("the cut after a read that worked: %v; want a WARN, the first in a row", cut)
	}
}
