package pipeline_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/internal/pipelinetest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/pipeline"
	"github.com/once-dev/once/schema"
)

// ping is a second team's event type, on a topic of its own.
type ping struct {
	ID uuid.UUID `json:"event_id"`
	N  int       `json:"n"`
}

func (p ping) EventID() uuid.UUID { return p.ID }

func decodePing(b []byte) (ping, error) {
	var p ping
	if err := json.Unmarshal(b, &p); err != nil {
		return ping{}, fmt.Errorf("ping: %w", err)
	}
	if p.N <= 0 {
		return ping{}, fmt.Errorf("ping: field n: want a positive integer, got %d", p.N)
	}
	return p, nil
}

// counter is a Watermill middleware that counts the messages it sees, per topic.
type counter struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *counter) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		c.mu.Lock()
		if c.n == nil {
			c.n = map[string]int{}
		}
		c.n[message.SubscribeTopicFromCtx(msg.Context())]++
		c.mu.Unlock()
		return h(msg)
	}
}

func (c *counter) get(topic string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[topic]
}

const createPingEffects = `CREATE TABLE IF NOT EXISTS pipeline_test_ping (event_id uuid NOT NULL, consumer_group text NOT NULL, n int NOT NULL)`

func claimsIn(t *testing.T, db *pgxpool.Pool, table, group string) int {
	t.Helper()
	var n int
	if err := db.QueryRow(context.Background(), `SELECT count(*) FROM `+table+` WHERE consumer_group = $1`, group).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// Two topics with two event types in one router: the team's own router with
// its router-level middleware, middleware per topic in its slots, a group
// whose claims and tables live in a database of its own, and the library's
// claim table under names the team chose. Every event is handled once per
// group, and each middleware saw exactly its own topic.
func TestTwoTopicsInOneRouterWithPerTopicMiddleware(t *testing.T) {
	e := newEnv(t, 3)
	ctx := context.Background()
	other := testenv.OtherPostgres(t, "once_test_other")
	names := schema.Config{Schema: "once_lib", ClaimTable: "claims"}
	for _, db := range []*pgxpool.Pool{e.Pool, other} {
		if _, err := schema.Migrate(ctx, db, names); err != nil {
			t.Fatal(err)
		}
		if _, err := db.Exec(ctx, createEffects+"; "+createPingEffects); err != nil {
			t.Fatal(err)
		}
	}
	pingTopic := testenv.Topic(t, e.Brokers, 2)
	pingDLQ := testenv.Topic(t, e.Brokers, 1)

	orders := &recorder{group: uniqueGroup("orders")}
	var pingRuns atomic.Int64
	pingGroup := uniqueGroup("pings")
	handlePing := func(ctx context.Context, tx pgx.Tx, p ping) error {
		pingRuns.Add(1)
		_, err := tx.Exec(ctx, `INSERT INTO pipeline_test_ping (event_id, consumer_group, n) VALUES ($1, $2, $3)`, p.ID, pingGroup, p.N)
		return err
	}
	var routerLevel, ordersBeforeClaim, pingsObserve, pingsInTx counter
	inTxSawTx := atomic.Bool{}
	pingsInTxCheck := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			_, err := idempotency.TxFromContext(msg.Context())
			inTxSawTx.Store(err == nil)
			return h(msg)
		}
	}

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(routerLevel.middleware)
	var seen pipelinetest.Outcomes
	p, err := pipeline.New(pipeline.Config{
		Brokers: e.Brokers,
		DB:      e.Pool,
		Router:  router,
		Tables:  names,
		Logger:  quietLogger(),
		Hooks:   pipeline.Hooks{OnResult: seen.Record},
		Topics: []pipeline.Binding{
			pipeline.Topic[confirmed]{Name: e.Topic, DLQ: e.DLQ, Decode: decodeConfirmed,
				Groups: []pipeline.Group[confirmed]{group(orders)},
				Extra:  pipeline.Extra{BeforeClaim: []message.HandlerMiddleware{ordersBeforeClaim.middleware}}},
			pipeline.Topic[ping]{Name: pingTopic, DLQ: pingDLQ, Decode: decodePing,
				Groups: []pipeline.Group[ping]{{Name: pingGroup, Handle: handlePing, DB: other,
					Extra: pipeline.Extra{InTx: []message.HandlerMiddleware{pingsInTx.middleware, pingsInTxCheck}}}},
				Extra: pipeline.Extra{Observe: []message.HandlerMiddleware{pingsObserve.middleware}}},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- p.Run(runCtx) }()
	t.Cleanup(func() { cancel(); <-done })
	<-p.Running()

	for i := range 4 {
		ev := validEvent(t, "3.00")
		for range 2 { // each delivered twice
			testenv.Publish(t, e.Prod, e.Topic, fmt.Sprint(i), payload(t, ev))
		}
	}
	for i := range 3 {
		b, _ := json.Marshal(ping{ID: uuid.Must(uuid.NewV7()), N: i + 1})
		for range 2 {
			testenv.Publish(t, e.Prod, pingTopic, fmt.Sprint(i), b)
		}
	}
	testenv.Eventually(t, 60*time.Second, "every delivery of both topics handled", func() bool {
		return seen.Get(orders.group, idempotency.Processed)+seen.Get(orders.group, idempotency.Duplicate) == 8 &&
			seen.Get(pingGroup, idempotency.Processed)+seen.Get(pingGroup, idempotency.Duplicate) == 6
	})
	if orders.runs.Load() != 4 || pingRuns.Load() != 3 {
		t.Fatalf("handlers ran %d and %d times; want 4 and 3", orders.runs.Load(), pingRuns.Load())
	}
	if claimsIn(t, e.Pool, "once_lib.claims", orders.group) != 4 || claimsIn(t, other, "once_lib.claims", pingGroup) != 3 ||
		claimsIn(t, e.Pool, "once_lib.claims", pingGroup) != 0 {
		t.Fatal("claims are not in the claim table of each group's own database")
	}
	var pings int
	if err := other.QueryRow(ctx, `SELECT count(*) FROM pipeline_test_ping WHERE consumer_group = $1`, pingGroup).Scan(&pings); err != nil || pings != 3 {
		t.Fatalf("%d ping effects in the group's database (%v), want 3", pings, err)
	}
	for _, c := range []struct {
		name         string
		c            *counter
		orders, ping int
	}{
		{"router level", &routerLevel, 8, 6},
		{"orders BeforeClaim", &ordersBeforeClaim, 8, 0},
		{"pings Observe", &pingsObserve, 0, 6},
		{"pings InTx (first deliveries only)", &pingsInTx, 0, 3},
	} {
		if c.c.get(e.Topic) != c.orders || c.c.get(pingTopic) != c.ping {
			t.Errorf("%s middleware saw %d orders and %d pings; want %d and %d", c.name, c.c.get(e.Topic), c.c.get(pingTopic), c.orders, c.ping)
		}
	}
	if !inTxSawTx.Load() {
		t.Error("InTx middleware did not find the claim's transaction in the message context")
	}
}

// A message returned by a handler chain would be published by the router
// after the commit, where a crash loses it: the pipeline refuses it and rolls
// the claim back. It is a fault of the code, not of the message: the message
// is held (with the reason logged), never dead-lettered.
func TestReturnedMessagesAreRefused(t *testing.T) {
	e := newEnv(t, 1)
	r := &recorder{group: uniqueGroup("returns")}
	returns := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			if _, err := h(msg); err != nil {
				return nil, err
			}
			return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("{}"))}, nil
		}
	}
	g := group(r)
	g.Extra.InTx = []message.HandlerMiddleware{returns}
	cfg := e.config(g)
	cfg.HoldBackoff = 10 * time.Millisecond
	var refused, deadLetters atomic.Int64
	cfg.Hooks.OnHeld = func(h pipeline.Held) {
		if errors.Is(h.Err, pipeline.ErrReturnedMessages) {
			refused.Add(1)
		}
	}
	cfg.Hooks.OnDeadLetter = func(pipeline.DeadLetter) { deadLetters.Add(1) }
	run(t, cfg)
	ev := validEvent(t, "1.00")
	testenv.Publish(t, e.Prod, e.Topic, "k", payload(t, ev))
	testenv.Eventually(t, 60*time.Second, "the returned message refused three times", func() bool { return refused.Load() >= 3 })
	if effects(t, e.Pool, r.group) != 0 || deadLetters.Load() != 0 || r.runs.Load() < 3 {
		t.Fatalf("%d effects, %d dead letters, %d runs; want nothing committed, nothing dead-lettered, the handler run each time",
			effects(t, e.Pool, r.group), deadLetters.Load(), r.runs.Load())
	}
}
