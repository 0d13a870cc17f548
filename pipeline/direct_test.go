package pipeline_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/pipeline"
)

// The direct path of a batched group, against Kafka and PostgreSQL: which
// groups take it, and that what a batch cannot decide still gets the whole
// chain. Needs KAFKA_BROKERS and DATABASE_URL.

// sequenced publishes n events on keys k0..k(keys-1), each key's order ids
// counting up from 1, and returns them in publishing order.
func sequenced(t *testing.T, e *env, n, keys int) []confirmed {
	t.Helper()
	evs := make([]confirmed, n)
	for i := range evs {
		ev, err := newConfirmed(uuid.Must(uuid.NewV7()), time.Now(), int64(i/keys+1), int64(i%keys), decimal.RequireFromString("1.00"))
		if err != nil {
			t.Fatal(err)
		}
		evs[i] = ev
		testenv.Publish(t, e.Prod, e.Topic, fmt.Sprint("k", i%keys), payload(t, ev))
	}
	return evs
}

// inOrder records, per key (the customer id of sequenced's events), the
// order ids a handler committed, and says whether any came out of order.
type inOrder struct {
	mu   sync.Mutex
	last map[int64]int64
	bad  []string
}

func (o *inOrder) saw(evs []confirmed) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.last == nil {
		o.last = map[int64]int64{}
	}
	for _, ev := range evs {
		if ev.Order <= o.last[ev.Customer] {
			o.bad = append(o.bad, fmt.Sprintf("key k%d: order %d after %d", ev.Customer, ev.Order, o.last[ev.Customer]))
		}
		o.last[ev.Customer] = ev.Order
	}
}

func (o *inOrder) check(t *testing.T) {
	t.Helper()
	o.mu.Lock()
	defer o.mu.Unlock()
	if len(o.bad) > 0 {
		t.Fatalf("a partition's events out of order: %v", o.bad[:min(len(o.bad), 5)])
	}
}

// orderedBatches is r's batch handler, recording the order it commits in:
// o sees a batch only once its transaction committed.
func orderedBatches(r *recorder, o *inOrder, handle func(ctx context.Context, tx pgx.Tx, evs []confirmed) error) pipeline.BatchHandlerFunc[confirmed] {
	if handle == nil {
		handle = r.HandleBatch
	}
	return func(ctx context.Context, tx pgx.Tx, evs []confirmed) error {
		if err := handle(ctx, tx, evs); err != nil {
			return err
		}
		// The commit comes after; a batch that then fails runs again,
		// and is seen again, out of order: none does here.
		o.saw(evs)
		return nil
	}
}

// A batched group without Observe or BeforeClaim takes the direct path:
// every message acknowledged by its batch, in its partition's order, and
// the hooks see each one, its topic named. A group with Observe or
// BeforeClaim keeps the chain for every message, which they see, and so
// does a group in a team's router, whose middleware sees every message.
func TestABatchedGroupTakesTheDirectPathUnlessATeamsMiddlewareMustSeeEachMessage(t *testing.T) {
	const events = 300
	pass := func(seen *atomic.Int64) message.HandlerMiddleware {
		return func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				seen.Add(1)
				return h(msg)
			}
		}
	}
	for _, c := range []struct {
		name        string
		observe     bool
		beforeClaim bool
		teamsRouter bool // with router-level middleware of the team's
		through     bool // router-level middleware by SetupRouter, and Batch.ThroughRouter
	}{{"direct", false, false, false, false}, {"with Observe", true, false, false, false}, {"with BeforeClaim", false, true, false, false},
		{"in the team router", false, false, true, false}, {"through the router", false, false, false, true}} {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t, 3)
			r := &recorder{group: uniqueGroup("direct")}
			var o inOrder
			var seen atomic.Int64
			g := pipeline.Group[confirmed]{Name: r.group, HandleBatch: orderedBatches(r, &o, nil), Batch: pipeline.Batch{Size: 50}}
			if c.observe {
				g.Extra.Observe = []message.HandlerMiddleware{pass(&seen)}
			}
			if c.beforeClaim {
				g.Extra.BeforeClaim = []message.HandlerMiddleware{pass(&seen)}
			}
			g.Batch.ThroughRouter = c.through
			var delivered, processed, untopical atomic.Int64
			cfg := e.config(g)
			cfg.Hooks = pipeline.Hooks{
				OnDelivered: func(pipeline.Delivery) { delivered.Add(1) },
				OnResult: func(res idempotency.Result) {
					if res.Outcome == idempotency.Processed {
						processed.Add(1)
					}
					if res.Topic != e.Topic {
						untopical.Add(1)
					}
				},
			}
			if c.through {
				cfg.SetupRouter = func(r *message.Router) error { r.AddMiddleware(pass(&seen)); return nil }
			}
			if c.teamsRouter {
				router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
				if err != nil {
					t.Fatal(err)
				}
				router.AddMiddleware(pass(&seen))
				cfg.Router = router
			}
			p, err := pipeline.New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			startPipeline(t, p)
			sequenced(t, e, events, 9)
			testenv.Eventually(t, time.Minute, "every event processed", func() bool { return effects(t, e.Pool, r.group) == events })
			o.check(t)
			direct := pipeline.DecidedDirectly(p)
			if c.observe || c.beforeClaim || c.teamsRouter || c.through {
				if direct != 0 || seen.Load() != events {
					t.Fatalf("%d messages decided on the direct path, the team's middleware saw %d; want none, and all %d", direct, seen.Load(), events)
				}
			} else if direct != events {
				t.Fatalf("%d of %d messages decided on the direct path", direct, events)
			}
			testenv.Eventually(t, 10*time.Second, "the hooks told of every message", func() bool {
				return delivered.Load() == events && processed.Load() == events
			})
			if untopical.Load() != 0 {
				t.Fatalf("%d results without their topic", untopical.Load())
			}
		})
	}
}

// A batch on the direct path that fails gives its messages to the chain,
// one by one, in order: the one at fault is dead-lettered, the others are
// processed once, and a reused id that a batch proves is dead-lettered too.
func TestAFailingBatchOnTheDirectPathFallsBackEventByEvent(t *testing.T) {
	e := newEnv(t, 2)
	r := &recorder{group: uniqueGroup("direct-fallback")}
	var o inOrder
	var bad atomic.Value // the event whose handler refuses it for good
	var refused atomic.Int64
	// WaitToFill: the events published together share a batch.
	g := pipeline.Group[confirmed]{Name: r.group, Batch: pipeline.Batch{Size: 50, MaxWait: time.Second, WaitToFill: true},
		HandleBatch: orderedBatches(r, &o, func(ctx context.Context, tx pgx.Tx, evs []confirmed) error {
			for _, ev := range evs {
				if b, _ := bad.Load().(uuid.UUID); ev.ID == b {
					refused.Add(1)
					return idempotency.Permanent(errors.New("a refused order (staged)"))
				}
			}
			return r.HandleBatch(ctx, tx, evs)
		})}
	var deadLettered, fellBack atomic.Int64
	cfg := e.config(g)
	cfg.Hooks.OnDeadLetter = func(pipeline.DeadLetter) { deadLettered.Add(1) }
	cfg.Hooks.OnBatch = func(b pipeline.BatchDone) { fellBack.Add(int64(b.RunAlone)) }
	p, err := pipeline.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	startPipeline(t, p)

	first := sequenced(t, e, 40, 4)
	testenv.Eventually(t, time.Minute, "the first events processed", func() bool { return effects(t, e.Pool, r.group) == 40 })
	// Each key's order continues; a reused id (an event processed
	// already, with another amount) and an event the handler refuses
	// come among them.
	reused := first[3]
	reused.Amount = decimal.RequireFromString("99.00")
	var msgs []*sarama.ProducerMessage
	for i := range 40 {
		ev, err := newConfirmed(uuid.Must(uuid.NewV7()), time.Now(), int64(10+i/4+1), int64(i%4), decimal.RequireFromString("2.00"))
		if err != nil {
			t.Fatal(err)
		}
		if i == 21 {
			bad.Store(ev.ID)
		}
		if i == 30 {
			msgs = append(msgs, &sarama.ProducerMessage{Topic: e.Topic, Key: sarama.StringEncoder(fmt.Sprint("k", reused.Customer)), Value: sarama.ByteEncoder(payload(t, reused))})
		}
		msgs = append(msgs, &sarama.ProducerMessage{Topic: e.Topic, Key: sarama.StringEncoder(fmt.Sprint("k", ev.Customer)), Value: sarama.ByteEncoder(payload(t, ev))})
	}
	if err := e.Prod.SendMessages(msgs); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, time.Minute, "the good events processed and two dead-lettered", func() bool {
		return effects(t, e.Pool, r.group) == 40+39 && deadLettered.Load() == 2
	})
	o.check(t)
	if refused.Load() < 2 || fellBack.Load() < 2 {
		t.Fatalf("the bad event refused %d times, %d messages of failed batches run on their own; want its batch's refusal and its own, and the others of its batch on their own",
			refused.Load(), fellBack.Load())
	}
	if n := pipeline.DecidedDirectly(p); n < 40 || n > 40+41-fellBack.Load() {
		t.Fatalf("%d messages decided on the direct path; want the first 40, and none of those run on their own", n)
	}
	testenv.Eventually(t, 30*time.Second, "both letters on the dead-letter topic", func() bool { return testenv.MessageCount(t, e.Brokers, e.DLQ) == 2 })
}

// A message on the direct path whose batch fails for a reason of the
// environment is held in the chain, its followers behind it, until it
// passes; then they follow, each once.
func TestAMessageOnTheDirectPathIsHeldOnAnEnvironmentError(t *testing.T) {
	e := newEnv(t, 1)
	r := &recorder{group: uniqueGroup("direct-hold")}
	var o inOrder
	var held atomic.Value // the event the provider refuses for a while
	var until atomic.Int64
	var failures atomic.Int64
	g := pipeline.Group[confirmed]{Name: r.group, Batch: pipeline.Batch{Size: 50},
		HandleBatch: orderedBatches(r, &o, func(ctx context.Context, tx pgx.Tx, evs []confirmed) error {
			for _, ev := range evs {
				if h, _ := held.Load().(uuid.UUID); ev.ID == h {
					until.CompareAndSwap(0, time.Now().Add(2*time.Second).UnixNano())
					if time.Now().UnixNano() < until.Load() {
						failures.Add(1)
						return errors.New("provider answered 503 (staged)")
					}
				}
			}
			return r.HandleBatch(ctx, tx, evs)
		})}
	var heldHook atomic.Int64
	cfg := e.config(g)
	cfg.HoldBackoff, cfg.HoldMaxBackoff = 50*time.Millisecond, 200*time.Millisecond
	cfg.Hooks.OnHeld = func(pipeline.Held) { heldHook.Add(1) }
	p, err := pipeline.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	startPipeline(t, p)
	evs := make([]confirmed, 20)
	for i := range evs {
		ev, err := newConfirmed(uuid.Must(uuid.NewV7()), time.Now(), int64(i+1), 0, decimal.RequireFromString("3.00"))
		if err != nil {
			t.Fatal(err)
		}
		evs[i] = ev
	}
	held.Store(evs[5].ID)
	for _, ev := range evs {
		testenv.Publish(t, e.Prod, e.Topic, "k0", payload(t, ev))
	}
	testenv.Eventually(t, 30*time.Second, "the refused event held", func() bool {
		for _, s := range p.Status() {
			if s.Held > 0 {
				return true
			}
		}
		return false
	})
	if n := effects(t, e.Pool, r.group); n > 5 {
		t.Fatalf("%d events processed while the sixth was held; want its followers behind it", n)
	}
	testenv.Eventually(t, time.Minute, "all processed once it passes", func() bool { return effects(t, e.Pool, r.group) == 20 })
	o.check(t)
	if failures.Load() < 3 || heldHook.Load() < 2 {
		t.Fatalf("%d failures, %d holds reported; want the batch's and several of its own", failures.Load(), heldHook.Load())
	}
}

// A batch under way on the direct path when its partitions are revoked
// ends with its session, rolls back, and leaves its messages to their new
// owner, which processes each once; the batch does not wait for its
// attempt's timeout.
func TestARebalanceEndsABatchUnderWayOnTheDirectPath(t *testing.T) {
	e := newEnv(t, 4)
	name := uniqueGroup("direct-rebalance")
	r := &recorder{group: name}
	entered := make(chan struct{}, 100)
	var endedAt sync.Map // when each of A's batches ended, and why
	stuck := pipeline.Group[confirmed]{Name: name, Batch: pipeline.Batch{Size: 50},
		// A's batches never commit: each waits until its attempt ends.
		HandleBatch: func(ctx context.Context, tx pgx.Tx, evs []confirmed) error {
			entered <- struct{}{}
			<-ctx.Done()
			endedAt.Store(time.Now(), ctx.Err())
			return ctx.Err()
		}}
	cfgA := e.config(stuck)
	cfgA.AttemptTimeout = 5 * time.Minute
	stopA := run(t, cfgA)
	sequenced(t, e, 24, 8)
	select {
	case <-entered:
	case <-time.After(30 * time.Second):
		t.Fatal("A's batch never began")
	}

	var o inOrder
	b := pipeline.Group[confirmed]{Name: name, Batch: pipeline.Batch{Size: 50}, HandleBatch: orderedBatches(r, &o, nil)}
	joined := time.Now()
	run(t, e.config(b))
	testenv.Eventually(t, 30*time.Second, "B processing its share", func() bool { return effects(t, e.Pool, name) > 0 })
	var endedEarly bool
	endedAt.Range(func(k, _ any) bool {
		endedEarly = endedEarly || k.(time.Time).After(joined)
		return true
	})
	if !endedEarly {
		t.Fatal("no batch of A ended at the rebalance; it waits for its attempt's timeout")
	}
	stopA()
	testenv.Eventually(t, time.Minute, "all 24 processed by B", func() bool { return effects(t, e.Pool, name) == 24 })
	var distinct int
	if err := e.Pool.QueryRow(context.Background(), `SELECT count(DISTINCT event_id) FROM pipeline_test_effect WHERE consumer_group = $1`, name).Scan(&distinct); err != nil || distinct != 24 {
		t.Fatalf("%d distinct events among the effects (%v); want 24, each once", distinct, err)
	}
	o.check(t)
}

// Review finding: on the direct path the delivery hook runs on sarama's
// consumer goroutine, where a panic (a hook's bug) ended the process, and
// again after every restart. Such a message now goes through the chain,
// whose recoverer holds it: it comes again and is processed.
func TestAPanickingDeliveryHookOnTheDirectPathHoldsTheMessage(t *testing.T) {
	e := newEnv(t, 1)
	r := &recorder{group: uniqueGroup("hook-panic")}
	cfg := e.config(pipeline.Group[confirmed]{Name: r.group, HandleBatch: r.HandleBatch, Batch: pipeline.Batch{Size: 50}})
	var calls, panicked atomic.Int64
	cfg.Hooks.OnDelivered = func(pipeline.Delivery) {
		if calls.Add(1) == 1 {
			panicked.Add(1)
			panic("a metrics hook's bug (staged)")
		}
	}
	p, err := pipeline.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	startPipeline(t, p)
	sequenced(t, e, 5, 1)
	testenv.Eventually(t, 30*time.Second, "all 5 processed", func() bool { return effects(t, e.Pool, r.group) == 5 })
	if panicked.Load() != 1 {
		t.Fatalf("the hook panicked %d times; want the staged once", panicked.Load())
	}
	if d := pipeline.DecidedDirectly(p); d < 1 || d > 4 {
		t.Fatalf("%d decided on the direct path; want the others than the one whose hook panicked", d)
	}
}
