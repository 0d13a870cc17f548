package pipeline_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/internal/pipelinetest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/pipeline"
)

const createEffects = `CREATE TABLE IF NOT EXISTS pipeline_test_effect (
	event_id uuid NOT NULL, consumer_group text NOT NULL)`

// recorder is a handler that writes one row per run through the claim's
// transaction and counts its runs, per consumer group.
type recorder struct {
	group string
	runs  atomic.Int64
	fail  func(confirmed) error
}

func (r *recorder) Handle(ctx context.Context, tx pgx.Tx, ev confirmed) error {
	return r.handle(ctx, tx, ev)
}

func (r *recorder) handle(ctx context.Context, tx pgx.Tx, ev pipeline.Event) error {
	r.runs.Add(1)
	if r.fail != nil {
		if err := r.fail(ev.(confirmed)); err != nil {
			return err
		}
	}
	_, err := tx.Exec(ctx, `INSERT INTO pipeline_test_effect (event_id, consumer_group) VALUES ($1, $2)`, ev.EventID(), r.group)
	return err
}

type env struct{ *pipelinetest.Env }

func newEnv(t *testing.T, partitions int32) *env {
	t.Helper()
	pool := testenv.Postgres(t)
	if _, err := pool.Exec(context.Background(), createEffects); err != nil {
		t.Fatal(err)
	}
	return &env{pipelinetest.NewEnv(t, pool, partitions)}
}

// group is a consumer group of the order-confirmed test topic run by r.
func group(r *recorder) pipeline.Group[confirmed] {
	return pipeline.Group[confirmed]{Name: r.group, Handle: r.Handle}
}

// HandleBatch handles a batch as Handle handles one event, event by event,
// in the batch's transaction: the first error fails the batch.
func (r *recorder) HandleBatch(ctx context.Context, tx pgx.Tx, evs []confirmed) error {
	for _, ev := range evs {
		if err := r.handle(ctx, tx, ev); err != nil {
			return err
		}
	}
	return nil
}

// handlerMode is how a group's handler runs: one event per transaction, or
// the group commit. The guarantees are the same; the tests of them run in
// both modes.
type handlerMode struct {
	name    string
	batched bool
}

var handlerModes = []handlerMode{{"per-event", false}, {"batched", true}}

func eachMode(t *testing.T, test func(t *testing.T, m handlerMode)) {
	for _, m := range handlerModes {
		t.Run(m.name, func(t *testing.T) { test(t, m) })
	}
}

// group is r's consumer group in this mode. A batched group has no Handle:
// the events of a failed batch run one by one through HandleBatch.
func (m handlerMode) group(r *recorder) pipeline.Group[confirmed] {
	if !m.batched {
		return group(r)
	}
	return pipeline.Group[confirmed]{Name: r.group, HandleBatch: r.HandleBatch, Batch: pipeline.Batch{Size: 50}}
}

func (e *env) topicOf(groups ...pipeline.Group[confirmed]) pipeline.Topic[confirmed] {
	return pipeline.Topic[confirmed]{Name: e.Topic, DLQ: e.DLQ, Decode: decodeConfirmed, Groups: groups}
}

func (e *env) config(groups ...pipeline.Group[confirmed]) pipeline.Config {
	return pipeline.Config{
		Brokers: e.Brokers,
		Topics:  []pipeline.Binding{e.topicOf(groups...)},
		DB:      e.Pool,
		Logger:  quietLogger(),
	}
}

func quietLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// run starts the pipeline until the test ends; stop stops it sooner.
var run = pipelinetest.Run

var uniqueGroup = pipelinetest.UniqueGroup

func validEvent(t testing.TB, amount string) confirmed {
	t.Helper()
	ev, err := newConfirmed(uuid.Must(uuid.NewV7()), time.Now(), 1+rand.Int64N(1<<62), 1+rand.Int64N(1000), decimal.RequireFromString(amount))
	if err != nil {
		t.Fatal(err)
	}
	return ev
}

func payload(t testing.TB, ev confirmed) []byte {
	t.Helper()
	b, err := ev.MarshalJSON()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func effects(t *testing.T, pool *pgxpool.Pool, group string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM pipeline_test_effect WHERE consumer_group = $1`, group).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// The same event arrives five times, on different partitions (a producer
// re-publishing it with another key): each group runs its handler once.
func TestSameEventFiveTimesRunsOncePerGroup(t *testing.T) { eachMode(t, testSameEventFiveTimes) }

func testSameEventFiveTimes(t *testing.T, m handlerMode) {
	e := newEnv(t, 3)
	billing := &recorder{group: uniqueGroup("billing")}
	analytics := &recorder{group: uniqueGroup("analytics")}
	var seen pipelinetest.Outcomes
	cfg := e.config(m.group(billing), m.group(analytics))
	cfg.Hooks.OnResult = seen.Record
	run(t, cfg)

	ev := validEvent(t, "12.34")
	for i := range 5 {
		testenv.Publish(t, e.Prod, e.Topic, fmt.Sprintf("key-%d", i), payload(t, ev))
	}
	for _, r := range []*recorder{billing, analytics} {
		testenv.Eventually(t, 60*time.Second, r.group+" saw all 5 deliveries", func() bool {
			return seen.Get(r.group, idempotency.Processed)+seen.Get(r.group, idempotency.Duplicate) == 5
		})
		if r.runs.Load() != 1 || effects(t, e.Pool, r.group) != 1 || seen.Get(r.group, idempotency.Duplicate) != 4 {
			t.Fatalf("%s: %d runs, %d effects, %d duplicates; want 1, 1, 4",
				r.group, r.runs.Load(), effects(t, e.Pool, r.group), seen.Get(r.group, idempotency.Duplicate))
		}
	}
}

// A crash after the database commit but before the offset commit: the
// consumer stops without acknowledging a message it committed. On restart the
// message is redelivered, found claimed, skipped, and its offset committed.
func TestCrashBetweenDatabaseCommitAndOffsetCommit(t *testing.T) {
	eachMode(t, func(t *testing.T, m handlerMode) {
		for _, mode := range []pipeline.CommitMode{pipeline.CommitSync, pipeline.CommitInterval} {
			t.Run(string(mode), func(t *testing.T) { testCrashBetweenCommits(t, m, mode) })
		}
	})
}

func testCrashBetweenCommits(t *testing.T, m handlerMode, mode pipeline.CommitMode) {
	e := newEnv(t, 1)
	r := &recorder{group: uniqueGroup("billing")}
	committed := make(chan struct{})
	crashed := make(chan struct{})
	var first sync.Once
	g := m.group(r)
	// Outside the chain, after the commit: the first delivery is never
	// acknowledged while this consumer lives.
	g.Extra.Observe = []message.HandlerMiddleware{func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				first.Do(func() {
					close(committed)
					<-crashed
				})
			}
			return out, err
		}
	}}
	cfg := e.config(g)
	cfg.CommitMode = mode
	cfg.CloseTimeout = time.Second
	stop := run(t, cfg)
	testenv.Publish(t, e.Prod, e.Topic, "k", payload(t, validEvent(t, "5.00")))
	select {
	case <-committed:
	case <-time.After(60 * time.Second):
		t.Fatal("the event was not processed")
	}
	if effects(t, e.Pool, r.group) != 1 {
		t.Fatal("the effect is not committed: the crash is not staged between the two commits")
	}
	stop()
	close(crashed)
	admin := testenv.Admin(t, e.Brokers)
	if off := testenv.CommittedOffsets(t, admin, r.group, e.Topic)[0]; off > 0 {
		t.Fatalf("offset %d was committed although the message was never acknowledged", off)
	}

	var seen pipelinetest.Outcomes
	cfg.Hooks.OnResult = seen.Record
	stop = run(t, cfg)
	testenv.Eventually(t, 60*time.Second, "redelivery skipped as duplicate", func() bool {
		return seen.Get(r.group, idempotency.Duplicate) == 1
	})
	stop() // a clean stop commits what was acknowledged in either mode
	if r.runs.Load() != 1 || effects(t, e.Pool, r.group) != 1 {
		t.Fatalf("%d runs, %d effects; want 1 each", r.runs.Load(), effects(t, e.Pool, r.group))
	}
	if off := testenv.CommittedOffsets(t, admin, r.group, e.Topic)[0]; off != 1 {
		t.Fatalf("committed offset %d after restart, want 1", off)
	}
}

// Poison messages in the middle of a partition are dead-lettered with their
// reason, and every valid message after them is processed. A message whose
// attempts fail for a reason that is not its own (a provider answering 503)
// is held, never dead-lettered, and the partition waits for it: the message
// behind it is processed after it, in order.
func TestPoisonIsDeadLetteredAndAFailingMessageIsHeld(t *testing.T) { eachMode(t, testPoisonAndHeld) }

func testPoisonAndHeld(t *testing.T, m handlerMode) {
	e := newEnv(t, 1)
	broken := validEvent(t, "7.00")
	var processedOrder []uuid.UUID
	var mu sync.Mutex
	var brokenAttempts atomic.Int64
	r := &recorder{group: uniqueGroup("billing"), fail: func(ev confirmed) error {
		if ev.EventID() == broken.EventID() && brokenAttempts.Add(1) <= 3 {
			return errors.New("provider answered 503")
		}
		mu.Lock()
		processedOrder = append(processedOrder, ev.EventID())
		mu.Unlock()
		return nil
	}}
	var deadLetters, held atomic.Int64
	cfg := e.config(m.group(r))
	cfg.HoldBackoff = 10 * time.Millisecond
	cfg.Hooks.OnDeadLetter = func(pipeline.DeadLetter) { deadLetters.Add(1) }
	cfg.Hooks.OnHeld = func(h pipeline.Held) {
		if h.Err != nil && strings.Contains(h.Err.Error(), "provider answered 503") {
			held.Add(1)
		}
	}
	run(t, cfg)

	first := validEvent(t, "1.00")
	testenv.Publish(t, e.Prod, e.Topic, "k", payload(t, first))
	for range 2 {
		testenv.Publish(t, e.Prod, e.Topic, "k", payload(t, validEvent(t, "1.00")))
	}
	reused, err := newConfirmed(first.EventID(), first.OccurredAt(), first.OrderID(), first.CustomerID(), decimal.RequireFromString("100.00"))
	if err != nil {
		t.Fatal(err)
	}
	poison := map[string]string{
		string(payload(t, reused)): "already processed with a different payload",
		`{"event_id": "broken`:     "payload: want a JSON object, got malformed JSON",
		fmt.Sprintf(`{"event_id":%q,"event_type":"order.confirmed.v1","occurred_at":"2026-12-02T10:00:00Z","order_id":1,"customer_id":2,"total_amount":"1.00"}`,
			uuid.New()): "field event_id: want a UUID version 7 string",
		fmt.Sprintf(`{"event_id":%q,"event_type":"order.confirmed.v1","occurred_at":"2026-12-02T10:00:00Z","order_id":1,"customer_id":2,"total_amount":"-3.00"}`,
			uuid.Must(uuid.NewV7())): "field total_amount: want a positive decimal",
		fmt.Sprintf(`{"event_id":%q,"event_type":"order.confirmed.v2"}`, uuid.Must(uuid.NewV7())): `field event_type: want the string "order.confirmed.v1", got another string`,
	}
	for p := range poison {
		testenv.Publish(t, e.Prod, e.Topic, "k", []byte(p))
	}
	testenv.Publish(t, e.Prod, e.Topic, "k", payload(t, broken))
	after := validEvent(t, "1.00")
	testenv.Publish(t, e.Prod, e.Topic, "k", payload(t, after))
	for range 2 {
		testenv.Publish(t, e.Prod, e.Topic, "k", payload(t, validEvent(t, "1.00")))
	}

	testenv.Eventually(t, 60*time.Second, "7 valid events processed", func() bool { return effects(t, e.Pool, r.group) == 7 })
	testenv.Eventually(t, 30*time.Second, "5 dead letters", func() bool { return deadLetters.Load() == 5 })

	reasons := readDLQ(t, e.Brokers, e.DLQ, 5)
	for p, want := range poison {
		if got, ok := reasons[p]; !ok || !contains(got, want) {
			t.Errorf("DLQ reason for %q = %q; want it to mention %q", p, got, want)
		}
	}
	if _, ok := reasons[string(payload(t, broken))]; ok {
		t.Error("the held message was dead-lettered")
	}
	// Batched, its first failure fails its batch, which is not a hold: the
	// message then runs on its own, and is held from there.
	wantHeld := int64(3)
	if m.batched {
		wantHeld = 2
	}
	if held.Load() != wantHeld || brokenAttempts.Load() != 4 {
		t.Errorf("held %d times over %d attempts; want %d failed attempts held, the 4th passing", held.Load(), brokenAttempts.Load(), wantHeld)
	}
	mu.Lock()
	defer mu.Unlock()
	for i, id := range processedOrder {
		if id == broken.EventID() && (i+1 >= len(processedOrder) || processedOrder[i+1] != after.EventID()) {
			t.Errorf("the event behind the held one did not wait for it: %v", processedOrder)
		}
	}
}

func contains(s, sub string) bool { return sub != "" && strings.Contains(s, sub) }

// readDLQ reads n messages from the dead-letter topic: payload to reason header.
func readDLQ(t *testing.T, brokers []string, topic string, n int) map[string]string {
	t.Helper()
	c, err := sarama.NewConsumer(brokers, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	pc, err := c.ConsumePartition(topic, 0, sarama.OffsetOldest)
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	out := map[string]string{}
	for len(out) < n {
		select {
		case m := <-pc.Messages():
			for _, h := range m.Headers {
				if string(h.Key) == middleware.ReasonForPoisonedKey {
					out[string(m.Value)] = string(h.Value)
				}
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("read %d of %d dead letters", len(out), n)
		}
	}
	return out
}

// A consumer group created after events were published still processes them:
// offsets start at the oldest message, not the newest.
func TestNewGroupSeesEarlierEvents(t *testing.T) { eachMode(t, testNewGroupSeesEarlierEvents) }

func testNewGroupSeesEarlierEvents(t *testing.T, m handlerMode) {
	e := newEnv(t, 3)
	for i := range 4 {
		testenv.Publish(t, e.Prod, e.Topic, fmt.Sprint(i), payload(t, validEvent(t, "2.50")))
	}
	r := &recorder{group: uniqueGroup("late")}
	run(t, e.config(m.group(r)))
	testenv.Eventually(t, 60*time.Second, "4 earlier events processed", func() bool { return effects(t, e.Pool, r.group) == 4 })
}

// Validate reports every bad setting at once, each named.
func TestInvalidConfigReportsEveryProblem(t *testing.T) {
	noop := func(context.Context, pgx.Tx, confirmed) error { return nil }
	_, err := pipeline.New(pipeline.Config{
		KafkaVersion: "0.11.0",
		CommitMode:   "sometimes",
		Topics: []pipeline.Binding{
			pipeline.Topic[confirmed]{Name: "t", DLQ: "t", Groups: []pipeline.Group[confirmed]{{Name: "g", Handle: noop}, {Name: "g", Handle: noop}}},
			pipeline.Topic[confirmed]{Name: "u", Decode: decodeConfirmed, IDNamespace: "inventory\x00v2"},
		},
	})
	if err == nil {
		t.Fatal("accepted")
	}
	for _, want := range []string{"KafkaVersion", "Brokers is empty", "CommitMode", "DLQ must differ", "Decode is required",
		"group g listed twice", "topic u: no consumer groups", "no DB, and Config.DB is nil", "topic u: IDNamespace must not contain a NUL byte"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not mention %q:\n%v", want, err)
		}
	}
	// A newcomer's finding: an unset KAFKA_BROKERS split on commas is one
	// empty address, which went through to a dial error far from the cause.
	err = pipeline.Config{Brokers: strings.Split("", ","), Topics: []pipeline.Binding{pipeline.Topic[confirmed]{Name: "t", Decode: decodeConfirmed,
		Groups: []pipeline.Group[confirmed]{{Name: "g", Handle: noop, Order: pipeline.OrderKey, HandleBatch: func(context.Context, pgx.Tx, []confirmed) error { return nil }}}}},
		InstanceID: "pod 0", HeartbeatInterval: 5 * time.Second, SessionTimeout: 10 * time.Second, RevocationGrace: 2 * time.Second, CloseTimeout: time.Second}.Validate()
	for _, want := range []string{"Brokers [\"\"] holds an empty address", "Order \"key\" is for a per-event group", "InstanceID \"pod 0\"", "HeartbeatInterval 5s",
		"RevocationGrace 2s must be shorter than CloseTimeout 1s"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error does not mention %q:\n%v", want, err)
		}
	}
	// Review findings: a heartbeat longer than a third of sarama's default
	// session timeout, and static membership on a Kafka older than 2.3,
	// passed Validate and failed in Run with sarama's words.
	err = pipeline.Config{Brokers: []string{"k:9092"}, KafkaVersion: "2.1.0", InstanceID: "pod-0", HeartbeatInterval: 12 * time.Second,
		Topics: []pipeline.Binding{pipeline.Topic[confirmed]{Name: "t", Decode: decodeConfirmed, Groups: []pipeline.Group[confirmed]{{Name: "g", Handle: noop}}}}}.Validate()
	for _, want := range []string{"HeartbeatInterval 12s: want at most a third of SessionTimeout 10s", "InstanceID needs KafkaVersion 2.3 or later"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error does not mention %q:\n%v", want, err)
		}
	}
}

// While its database is unreachable, a consumer holds its messages; but when
// another instance joins, it gives its partitions up at once instead of
// blocking the rebalance until sarama's 60s rebalance timeout, and when it is
// stopped it stops at once. The other instance processes everything, once.
func TestOutageDoesNotBlockRebalanceOrShutdown(t *testing.T) { eachMode(t, testOutage) }

func testOutage(t *testing.T, m handlerMode) {
	e := newEnv(t, 4)
	name := uniqueGroup("analytics")
	r := &recorder{group: name}
	stuckPool, proxy := testenv.ProxiedPostgres(t, e.Pool)
	proxy.Down(true)
	cfgA := e.config(m.group(r))
	cfgA.DB = stuckPool
	stopA := run(t, cfgA)
	for i := range 24 {
		testenv.Publish(t, e.Prod, e.Topic, fmt.Sprint(i), payload(t, validEvent(t, "3.00")))
	}
	time.Sleep(2 * time.Second) // A now holds messages it cannot process

	run(t, e.config(m.group(r)))
	joined := time.Now()
	testenv.Eventually(t, 20*time.Second, "the new instance processing its share", func() bool { return effects(t, e.Pool, name) > 0 })
	t.Logf("rebalance with a consumer stuck in an outage: first event processed %s after the second instance joined", time.Since(joined).Round(time.Millisecond))

	stopping := time.Now()
	done := make(chan struct{})
	go func() { stopA(); close(done) }()
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		t.Fatal("a consumer waiting for its database did not stop within 15s")
	}
	t.Logf("stopped a consumer waiting for its database in %s", time.Since(stopping).Round(time.Millisecond))
	testenv.Eventually(t, 60*time.Second, "all 24 events processed", func() bool { return effects(t, e.Pool, name) == 24 })
	if n := r.runs.Load(); n != 24 {
		t.Fatalf("handler ran %d times, want 24", n)
	}
}

// The examples need PostgreSQL only; the tests say for themselves.
func TestMain(m *testing.M) { testenv.MainWithServices(m, "DATABASE_URL") }
