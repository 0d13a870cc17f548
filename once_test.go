package once_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/oncetest"
	"github.com/once-dev/once/pipeline"
	"github.com/once-dev/once/schema"
)

// ping is a test event: an id, and a number.
type ping struct {
	ID uuid.UUID `json:"event_id"`
	N  int       `json:"n"`
}

func (p ping) EventID() uuid.UUID { return p.ID }

func decodePing(b []byte) (p ping, err error) {
	if err = json.Unmarshal(b, &p); err == nil && p.ID.Version() != 7 {
		err = errors.New("event_id: want a UUIDv7")
	}
	return p, err
}

// pingAt is a ping whose id is from at.
func pingAt(t *testing.T, at time.Time, n int) ping {
	t.Helper()
	id, err := uuid.NewV7FromReader(strings.NewReader(strings.Repeat("x", 64)))
	if err != nil {
		t.Fatal(err)
	}
	ms := uint64(at.UnixMilli())
	for i := range 6 {
		id[i] = byte(ms >> (40 - 8*i))
	}
	return ping{ID: id, N: n}
}

// ownTables is a schema of the test's own: the retention it records is its
// own.
func ownTables(t *testing.T) schema.Config {
	t.Helper()
	pool := testenv.Postgres(t)
	names := schema.Config{Schema: "once_front_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+names.Schema+" CASCADE") })
	return names
}

// start runs svc until the test ends.
var start = oncetest.Run

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

// A database whose library tables were never migrated stops start-up (with
// CheckOnly, as a least-privilege role runs) naming the missing table,
// instead of holding every message for good with nothing said (review
// finding: schema.Check was called nowhere).
func TestAnUnmigratedDatabaseStopsStartUpNamingTheTable(t *testing.T) {
	tables := ownTables(t)
	_, err := once.New(context.Background(), once.Config{Brokers: testenv.Brokers(t), DatabaseURL: os.Getenv("DATABASE_URL"),
		Tables: tables, CheckOnly: true, Logger: quiet(),
		Topics: []once.Binding{once.Topic[ping]{Name: "never.consumed", Decode: decodePing,
			Groups: []once.Group[ping]{{Name: "g", Handle: func(context.Context, pgx.Tx, ping) error { return nil }}}}}})
	var se *once.SettingError
	if !errors.As(err, &se) || se.Setting != "DatabaseURL" || !errors.Is(err, schema.ErrMissingTable) ||
		!strings.Contains(err.Error(), tables.Schema+".processed_event") {
		t.Fatalf("New on an unmigrated database: %v; want DatabaseURL's missing %s.processed_event named", err, tables.Schema)
	}
}

// A dedup horizon that would outlive the claims is refused with both
// numbers; the defaults make a horizon that does not.
func TestAHorizonLongerThanTheRetentionIsRefused(t *testing.T) {
	topics := []once.Binding{once.Topic[ping]{Name: "t", Decode: decodePing,
		Groups: []once.Group[ping]{{Name: "g", Handle: func(context.Context, pgx.Tx, ping) error { return nil }}}}}
	err := once.Config{Brokers: []string{"127.0.0.1:1"}, DatabaseURL: "postgres://x@127.0.0.1:1/x", Topics: topics,
		Retention: 72 * time.Hour, MaxEventAge: 72 * time.Hour}.Validate()
	if err == nil || !strings.Contains(err.Error(), "MaxEventAge 72h0m0s") || !strings.Contains(err.Error(), "Retention 72h0m0s") {
		t.Fatalf("a horizon as long as the retention (the clock skew on top): %v; want it refused with both numbers", err)
	}
	if err := (once.Config{Brokers: []string{"127.0.0.1:1"}, DatabaseURL: "postgres://x@127.0.0.1:1/x", Topics: topics}).Validate(); err != nil {
		t.Fatalf("the defaults: %v", err)
	}
}

// With the defaults, an event older than the claims' retention is not run
// again: it follows the group's too-old policy (rejected: dead-lettered;
// process: processed), since its claim may be gone (review finding:
// MaxEventAge defaulted to 0, which turned the horizon off).
func TestWithDefaultsAnEventOlderThanTheRetentionIsNotRunAgain(t *testing.T) {
	brokers := testenv.Brokers(t)
	topic := testenv.Topic(t, brokers, 1)
	var rejecting, processing atomic.Int64
	svc, err := once.New(context.Background(), once.Config{Brokers: brokers, DatabaseURL: os.Getenv("DATABASE_URL"), Tables: ownTables(t), Logger: quiet(),
		Topics: []once.Binding{once.Topic[ping]{Name: topic, Decode: decodePing, Groups: []once.Group[ping]{
			{Name: "reject-" + uuid.NewString()[:8], Handle: func(context.Context, pgx.Tx, ping) error { rejecting.Add(1); return nil }},
			{Name: "process-" + uuid.NewString()[:8], TooOld: once.ProcessTooOld, Handle: func(context.Context, pgx.Tx, ping) error { processing.Add(1); return nil }},
		}}}})
	if err != nil {
		t.Fatal(err)
	}
	start(t, svc)
	old := pingAt(t, time.Now().Add(-once.DefaultRetention-time.Hour), 1)
	b, _ := json.Marshal(old)
	testenv.Publish(t, testenv.Producer(t, brokers), topic, "k", b)
	testenv.Eventually(t, 30*time.Second, "the old event dead-lettered by the rejecting group and processed by the other", func() bool {
		return testenv.MessageCount(t, brokers, topic+".dlq") == 1 && processing.Load() == 1
	})
	if rejecting.Load() != 0 {
		t.Fatal("the rejecting group ran its handler for an event past the horizon")
	}
}

// Behind a transaction pooler, pgx's default exec mode is refused at
// start-up with the setting named.
func TestAnExecModeAPoolerBreaksIsRefusedAtStartUp(t *testing.T) {
	url := testenv.WithoutParam(testenv.Where{Pooled: true}.URL(t), "default_query_exec_mode")
	_, err := once.New(context.Background(), once.Config{Brokers: testenv.Brokers(t), DatabaseURL: url, Logger: quiet(),
		Topics: []once.Binding{once.Topic[ping]{Name: "never.consumed", Decode: decodePing,
			Groups: []once.Group[ping]{{Name: "g", Handle: func(context.Context, pgx.Tx, ping) error { return nil }}}}}})
	if err == nil || !strings.Contains(err.Error(), "DatabaseURL") || !strings.Contains(err.Error(), "default_query_exec_mode=exec") {
		t.Fatalf("the default exec mode behind PgBouncer: %v; want it refused, naming DatabaseURL and the mode to use", err)
	}
}

// What a handler and a team's middleware have at hand: the delivery and the
// decoded event from the context; Publish through the service's outbox,
// refused for a type with no Outgoing topic or with an empty key; InTx on a
// batched group, once per batch in its transaction.
func TestAHandlersContextAndPublish(t *testing.T) {
	brokers := testenv.Brokers(t)
	topic, out := testenv.Topic(t, brokers, 1), testenv.Topic(t, brokers, 1)
	var mu sync.Mutex
	var deliveries []once.Delivery
	var unknownType, emptyKey, batchInTx error
	var inTxRuns, batchedEvents, batches, batchedSizes, runAlone atomic.Int64
	inTx := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			inTxRuns.Add(1)
			return h(msg)
		}
	}
	svc, err := once.New(context.Background(), once.Config{Brokers: brokers, DatabaseURL: os.Getenv("DATABASE_URL"), Tables: ownTables(t), Logger: quiet(),
		Hooks: once.Hooks{OnBatch: func(b pipeline.BatchDone) {
			batches.Add(1)
			batchedSizes.Add(int64(b.Size))
			runAlone.Add(int64(b.RunAlone))
		}},
		Outgoing: []once.OutgoingBinding{once.Outgoing[ping]{Name: out, Key: func(p ping) string {
			if p.N < 0 {
				return ""
			}
			return fmt.Sprint(p.N)
		}}},
		Topics: []once.Binding{once.Topic[ping]{Name: topic, Decode: decodePing, Groups: []once.Group[ping]{
			{Name: "per-event-" + uuid.NewString()[:8], Handle: func(ctx context.Context, tx pgx.Tx, p ping) error {
				d, ok := once.DeliveryFrom(ctx)
				ev, evOK := once.EventFrom[ping](ctx)
				if !ok || !evOK || ev != p {
					return once.Permanent(errors.New("no delivery or event in the context"))
				}
				mu.Lock()
				deliveries = append(deliveries, d)
				mu.Unlock()
				unknownType = once.Publish(ctx, tx, struct{ ping }{p})
				emptyKey = once.Publish(ctx, tx, ping{ID: uuid.Must(uuid.NewV7()), N: -1})
				return once.Publish(ctx, tx, ping{ID: uuid.Must(uuid.NewV7()), N: p.N})
			}},
			{Name: "batched-" + uuid.NewString()[:8], Batch: once.Batch{Size: 10, MaxWait: 50 * time.Millisecond},
				Extra: once.Extra{InTx: []message.HandlerMiddleware{inTx}},
				HandleBatch: func(ctx context.Context, tx pgx.Tx, ps []ping) error {
					if tx == nil {
						batchInTx = errors.New("no transaction")
					}
					batchedEvents.Add(int64(len(ps)))
					return nil
				}},
		}}}})
	if err != nil {
		t.Fatal(err)
	}
	start(t, svc)
	producer := testenv.Producer(t, brokers)
	for i := range 5 {
		b, _ := json.Marshal(ping{ID: uuid.Must(uuid.NewV7()), N: i})
		testenv.Publish(t, producer, topic, "key-"+fmt.Sprint(i), b)
	}
	// OnBatch is called after a batch commits, so the batches are counted
	// only once every event's batch is done, not just handled.
	testenv.Eventually(t, 30*time.Second, "the follow-ups on Kafka, and the batched group's events in batches done", func() bool {
		return testenv.MessageCount(t, brokers, out) == 5 && batchedEvents.Load() == 5 && batchedSizes.Load() >= 5
	})
	mu.Lock()
	defer mu.Unlock()
	if len(deliveries) != 5 || deliveries[0].Topic != topic || deliveries[0].Key != "key-0" || deliveries[0].Attempt != 1 {
		t.Fatalf("deliveries %+v; want the topic, key and attempt of each", deliveries)
	}
	if unknownType == nil || !strings.Contains(unknownType.Error(), "no Outgoing topic") {
		t.Fatalf("Publish of a type with no Outgoing topic: %v", unknownType)
	}
	if emptyKey == nil || !strings.Contains(emptyKey.Error(), "Key is empty") {
		t.Fatalf("Publish with an empty key: %v", emptyKey)
	}
	if n := inTxRuns.Load(); n == 0 || n != batches.Load() || runAlone.Load() != 0 || batchInTx != nil {
		t.Fatalf("InTx of the batched group ran %d times for %d batches (%d events run alone; %v); want once per batch, none alone",
			n, batches.Load(), runAlone.Load(), batchInTx)
	}
}

// A database host that swallows every byte does not hold start-up for the
// kernel's TCP timeout: each connection's opening is bounded by
// ConnectTimeout (review finding: the front door dropped serve's
// --db-connect-timeout).
func TestADatabaseThatSwallowsEverythingFailsWithinTheConnectTimeout(t *testing.T) {
	_, proxy := testenv.ProxiedPostgres(t, testenv.Postgres(t))
	proxy.BlackHole(true)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err := once.New(ctx, once.Config{Brokers: testenv.Brokers(t), DatabaseURL: proxy.URL(os.Getenv("DATABASE_URL")),
		ConnectTimeout: 300 * time.Millisecond, Logger: quiet(),
		Topics: []once.Binding{once.Topic[ping]{Name: "never.consumed", Decode: decodePing,
			Groups: []once.Group[ping]{{Name: "g", Handle: func(context.Context, pgx.Tx, ping) error { return nil }}}}}})
	if !proxy.Swallowed() {
		t.Fatal("the proxy swallowed nothing: the fault did not happen")
	}
	if err == nil || ctx.Err() != nil || !strings.Contains(err.Error(), "DatabaseURL") {
		t.Fatalf("New behind a black hole: %v (the test's minute: %v); want DatabaseURL's connection refused within its timeout", err, ctx.Err())
	}
}

// An empty URL for a group's database is refused: pgx would connect to
// whatever the PG* variables say, and the group's claims would live
// elsewhere on each host (review finding).
func TestAnEmptyGroupDatabaseURLIsRefused(t *testing.T) {
	err := once.Config{Brokers: []string{"127.0.0.1:1"}, DatabaseURL: "postgres://x@127.0.0.1:1/x", GroupDatabases: map[string]string{"g": ""},
		Topics: []once.Binding{once.Topic[ping]{Name: "t", Decode: decodePing,
			Groups: []once.Group[ping]{{Name: "g", Handle: func(context.Context, pgx.Tx, ping) error { return nil }}}}}}.Validate()
	if err == nil || !strings.Contains(err.Error(), "GroupDatabases[g] is empty") {
		t.Fatalf("an empty group database URL: %v; want it refused by name", err)
	}
}
