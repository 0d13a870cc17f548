package pipeline_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/pipeline"
)

// providerCalls is a handler that calls a slow provider inside the claim's
// transaction, as billing does, and counts what a revocation does to the
// calls: started, cut off in the middle (the attempt's context ended before
// the provider answered), and started per event.
type providerCalls struct {
	latency time.Duration
	started atomic.Int64
	cut     atomic.Int64
	mu      sync.Mutex
	perID   map[uuid.UUID]int
}

func (c *providerCalls) handle(r *recorder) func(ctx context.Context, tx pgx.Tx, ev confirmed) error {
	return func(ctx context.Context, tx pgx.Tx, ev confirmed) error {
		c.started.Add(1)
		c.mu.Lock()
		if c.perID == nil {
			c.perID = map[uuid.UUID]int{}
		}
		c.perID[ev.ID]++
		c.mu.Unlock()
		select {
		case <-time.After(c.latency):
		case <-ctx.Done():
			c.cut.Add(1)
			return ctx.Err()
		}
		return r.Handle(ctx, tx, ev)
	}
}

func (c *providerCalls) again() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []string
	for id, n := range c.perID {
		if n > 1 {
			out = append(out, fmt.Sprintf("%s called %d times", id, n))
		}
	}
	return out
}

// Issue 29, item 4 (and 30, item 2): when a partition moves (instances join
// and leave under load) or an instance stops, the attempts under way finish
// and commit within the revocation grace: no provider call is cut off in
// the middle, and none runs a second time on the partition's next owner.
// With no grace (the behaviour before), calls are cut off and run again.
func TestAttemptsUnderWayFinishWithinTheRevocationGrace(t *testing.T) {
	for _, c := range []struct {
		name  string
		order pipeline.Order
	}{{"partition order", pipeline.OrderPartition}, {"key order", pipeline.OrderKey}} {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t, 4)
			r := &recorder{group: uniqueGroup("grace")}
			calls := &providerCalls{latency: 400 * time.Millisecond}
			g := pipeline.Group[confirmed]{Name: r.group, Handle: calls.handle(r), Order: c.order}
			if c.order == pipeline.OrderKey {
				g.Concurrency = 4
			}
			const events = 60
			for i := range events {
				testenv.Publish(t, e.Prod, e.Topic, fmt.Sprint("k", i%12), payload(t, validEvent(t, "1.00")))
			}
			cfg := e.config(g)
			stopA := run(t, cfg)
			testenv.Eventually(t, 30*time.Second, "the first instance calling the provider", func() bool { return calls.started.Load() > 0 })
			stopB := run(t, cfg) // a rebalance under load
			testenv.Eventually(t, 30*time.Second, "some events processed after the rebalance", func() bool { return effects(t, e.Pool, r.group) >= events/3 })
			stopA() // a stop under load: the other instance takes its partitions
			testenv.Eventually(t, time.Minute, "every event processed", func() bool { return effects(t, e.Pool, r.group) == events })
			stopB()
			if n := calls.cut.Load(); n != 0 {
				t.Errorf("%d provider calls cut off in the middle; want none", n)
			}
			if again := calls.again(); len(again) > 0 {
				t.Errorf("provider calls run again on the next owner: %v", again[:min(len(again), 5)])
			}
			if n := calls.started.Load(); n != events {
				t.Fatalf("%d provider calls for %d events", n, events)
			}
		})
	}
}

// slowHandler calls a provider for latency inside the claim's transaction,
// counting the calls begun and those cut off in the middle.
type slowHandler struct {
	latency      time.Duration
	started, cut atomic.Int64
}

func (s *slowHandler) wait(ctx context.Context) error {
	s.started.Add(1)
	select {
	case <-time.After(s.latency):
		return nil
	case <-ctx.Done():
		s.cut.Add(1)
		return ctx.Err()
	}
}

// Review finding: at a stop the grace let the attempt under way commit, but
// ended before its acknowledgement reached the subscriber, so its offset
// was never committed (and its next owner found a duplicate). Now what the
// grace finishes is committed, in both commit modes and both orders.
func TestAStopCommitsTheOffsetsOfWhatTheGraceFinished(t *testing.T) {
	for _, mode := range []pipeline.CommitMode{pipeline.CommitInterval, pipeline.CommitSync} {
		for _, order := range []pipeline.Order{pipeline.OrderPartition, pipeline.OrderKey} {
			t.Run(fmt.Sprint(mode, "/", order), func(t *testing.T) {
				e := newEnv(t, 1)
				r := &recorder{group: uniqueGroup("grace-commit")}
				h := &slowHandler{latency: 800 * time.Millisecond}
				g := pipeline.Group[confirmed]{Name: r.group, Order: order, Handle: func(ctx context.Context, tx pgx.Tx, ev confirmed) error {
					if err := h.wait(ctx); err != nil {
						return err
					}
					return r.Handle(ctx, tx, ev)
				}}
				cfg := e.config(g)
				cfg.CommitMode = mode
				stop := run(t, cfg)
				testenv.Publish(t, e.Prod, e.Topic, "k1", payload(t, validEvent(t, "1.00")))
				testenv.Eventually(t, 30*time.Second, "the attempt under way", func() bool { return h.started.Load() == 1 })
				stop()
				committed := testenv.CommittedOffsets(t, testenv.Admin(t, e.Brokers), r.group, e.Topic)[0]
				if n := effects(t, e.Pool, r.group); n != 1 || h.cut.Load() != 0 || committed != 1 {
					t.Fatalf("after the stop: %d effects, %d calls cut off, committed offset %d; want the attempt finished, committed, and its offset committed (1)",
						n, h.cut.Load(), committed)
				}
			})
		}
	}
}

// Review finding: a batch under way at a stop was cut off at once (its
// attempt ran on the pipeline's context, which the stop ends): now it gets
// the grace, on the direct path and through the router.
func TestABatchUnderWayAtAStopGetsTheGrace(t *testing.T) {
	for _, through := range []bool{false, true} {
		t.Run(map[bool]string{false: "direct", true: "through the router"}[through], func(t *testing.T) {
			e := newEnv(t, 1)
			r := &recorder{group: uniqueGroup("grace-batch")}
			h := &slowHandler{latency: 800 * time.Millisecond}
			g := pipeline.Group[confirmed]{Name: r.group, Batch: pipeline.Batch{Size: 10, ThroughRouter: through},
				HandleBatch: func(ctx context.Context, tx pgx.Tx, evs []confirmed) error {
					if err := h.wait(ctx); err != nil {
						return err
					}
					return r.HandleBatch(ctx, tx, evs)
				}}
			stop := run(t, e.config(g))
			testenv.Publish(t, e.Prod, e.Topic, "k1", payload(t, validEvent(t, "1.00")))
			testenv.Eventually(t, 30*time.Second, "the batch under way", func() bool { return h.started.Load() == 1 })
			stop()
			committed := testenv.CommittedOffsets(t, testenv.Admin(t, e.Brokers), r.group, e.Topic)[0]
			if n := effects(t, e.Pool, r.group); n != 1 || h.cut.Load() != 0 || committed != 1 {
				t.Fatalf("after the stop: %d effects, %d batches cut off, committed offset %d; want the batch finished, committed, and its offset committed (1)",
					n, h.cut.Load(), committed)
			}
		})
	}
}

// poisonCatcher is a team's poison topic: what its router-level PoisonQueue
// publishes instead of letting an error through.
type poisonCatcher struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (c *poisonCatcher) Publish(_ string, msgs ...*message.Message) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.msgs = append(c.msgs, msgs...)
	return nil
}
func (c *poisonCatcher) Close() error { return nil }
func (c *poisonCatcher) caught() int  { c.mu.Lock(); defer c.mu.Unlock(); return len(c.msgs) }

// Review finding: a message given up at a revocation is given back, but a
// team's router-level middleware that swallows errors (Watermill's
// PoisonQueue) acknowledged it, and the subscriber, which goes on marking
// during the grace, marked it: the group never processed it. Only what the
// pipeline decided is marked, whatever acknowledges it.
func TestAMessageGivenBackIsNeverMarkedWhateverAcknowledgesIt(t *testing.T) {
	e := newEnv(t, 1)
	r := &recorder{group: uniqueGroup("given-back")}
	held, slow := validEvent(t, "1.00"), validEvent(t, "2.00")
	var slowStarted atomic.Int64
	instance := func(first bool) pipeline.Config {
		g := pipeline.Group[confirmed]{Name: r.group, Order: pipeline.OrderKey, Concurrency: 4,
			Handle: func(ctx context.Context, tx pgx.Tx, ev confirmed) error {
				switch {
				case first && ev.ID == held.ID:
					return errors.New("the provider answers 503 (staged, on the first instance)")
				case first && ev.ID == slow.ID:
					slowStarted.Add(1)
					time.Sleep(3 * time.Second) // under way at the revocation: the grace waits for it
				}
				return r.Handle(ctx, tx, ev)
			}}
		cfg := e.config(g)
		cfg.CommitMode = pipeline.CommitSync
		cfg.HoldBackoff, cfg.HoldMaxBackoff = 20*time.Millisecond, 50*time.Millisecond
		return cfg
	}
	poison := &poisonCatcher{}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	pq, err := middleware.PoisonQueue(poison, "the-teams-poison-topic")
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(pq)
	cfg := instance(true)
	cfg.Router = router
	first, err := pipeline.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stopFirst := startPipeline(t, first)
	testenv.Publish(t, e.Prod, e.Topic, "A", payload(t, held))
	testenv.Publish(t, e.Prod, e.Topic, "B", payload(t, slow))
	testenv.Eventually(t, 30*time.Second, "A held and B under way", func() bool {
		return first.Status()[0].Held == 1 && slowStarted.Load() == 1
	})
	run(t, instance(false)) // a second instance: the partition moves or stays, a revocation either way
	testenv.Eventually(t, 30*time.Second, "the team's middleware swallowed the given-back message", func() bool { return poison.caught() >= 1 })
	stopFirst()
	testenv.Eventually(t, time.Minute, "both events processed, each once", func() bool { return effects(t, e.Pool, r.group) == 2 })
	var n int
	if err := e.Pool.QueryRow(context.Background(), `SELECT count(*) FROM pipeline_test_effect WHERE consumer_group = $1 AND event_id = $2`, r.group, held.ID).Scan(&n); err != nil || n != 1 {
		t.Fatalf("the held event processed %d times (%v); want once, by the partition's next owner", n, err)
	}
}
