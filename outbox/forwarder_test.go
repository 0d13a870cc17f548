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

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

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
	name := fmt.Sprintf("outbox_vanished_%d", time.Now().UnixNano()%1e9)
	ob, err := outbox.New(schema.Config{Outbox: name, OutboxOffsets: name + "_offsets"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ob.IdleInTransactionTimeout = 2 * time.Second
	if err := ob.Init(ctx, pool); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), `DROP TABLE IF EXISTS `+pgx.Identifier{name}.Sanitize()+`, `+pgx.Identifier{name + "_offsets"}.Sanitize())
	})
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
