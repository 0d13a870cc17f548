package pipeline_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

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
