package pipeline_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/internal/testenv"
)

// Review finding: a message held for longer than AttemptTimeout holds its
// partition in both modes. Batched, the message behind it used to time out
// waiting for its batch and take the per-event claim ahead of the held one.
func TestAMessageHeldLongerThanAnAttemptKeepsItsFollowersBehind(t *testing.T) {
	eachMode(t, testHeldLongerThanAnAttempt)
}

func testHeldLongerThanAnAttempt(t *testing.T, m handlerMode) {
	e := newEnv(t, 1)
	a, b := validEvent(t, "1.00"), validEvent(t, "2.00")
	var mu sync.Mutex
	var passed []uuid.UUID
	var failUntil time.Time
	var failures int
	r := &recorder{group: uniqueGroup("billing"), fail: func(ev confirmed) error {
		mu.Lock()
		defer mu.Unlock()
		if ev.EventID() == a.EventID() {
			if failUntil.IsZero() {
				failUntil = time.Now().Add(4 * time.Second)
			}
			if time.Now().Before(failUntil) {
				failures++
				return errors.New("provider answered 503 (staged)")
			}
		}
		passed = append(passed, ev.EventID())
		return nil
	}}
	cfg := e.config(m.group(r))
	cfg.HoldBackoff, cfg.HoldMaxBackoff = 100*time.Millisecond, 200*time.Millisecond
	cfg.AttemptTimeout = time.Second
	run(t, cfg)
	testenv.Publish(t, e.Prod, e.Topic, "k", payload(t, a))
	testenv.Publish(t, e.Prod, e.Topic, "k", payload(t, b))
	testenv.Eventually(t, time.Minute, "both processed", func() bool { return effects(t, e.Pool, r.group) == 2 })
	mu.Lock()
	defer mu.Unlock()
	if failures < 5 {
		t.Fatalf("the held event failed %d times; the hold did not outlast several attempts", failures)
	}
	if len(passed) < 2 || passed[0] != a.EventID() {
		t.Fatalf("handler passes %v; want the held %s before %s", passed, a.EventID(), b.EventID())
	}
}

// Review finding: stopping while a handler works stops it, in both modes:
// a batch's attempt used to run on past shutdown for up to AttemptTimeout.
// It gets the revocation grace to finish first, no more.
func TestStopEndsAHandlerAtWork(t *testing.T) { eachMode(t, testStopEndsAHandler) }

func testStopEndsAHandler(t *testing.T, m handlerMode) {
	e := newEnv(t, 1)
	entered := make(chan struct{}, 10)
	r := &recorder{group: uniqueGroup("billing")}
	g := m.group(r)
	// The handler writes its effect, then works until its attempt ends: a
	// stop that committed the attempt would leave the effect behind.
	work := func(ctx context.Context, tx pgx.Tx, ev confirmed) error {
		if _, err := tx.Exec(ctx, `INSERT INTO pipeline_test_effect (event_id, consumer_group) VALUES ($1, $2)`, ev.EventID(), r.group); err != nil {
			return err
		}
		entered <- struct{}{}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(30 * time.Second):
			return nil
		}
	}
	if m.batched {
		g.HandleBatch = func(ctx context.Context, tx pgx.Tx, evs []confirmed) error { return work(ctx, tx, evs[0]) }
	} else {
		g.Handle = work
	}
	cfg := e.config(g)
	cfg.RevocationGrace = 2 * time.Second
	stop := run(t, cfg)
	testenv.Publish(t, e.Prod, e.Topic, "k", payload(t, validEvent(t, "1.00")))
	select {
	case <-entered:
	case <-time.After(30 * time.Second):
		t.Fatal("the handler never ran")
	}
	start := time.Now()
	stop()
	if took := time.Since(start); took > cfg.RevocationGrace+8*time.Second {
		t.Fatalf("stop took %s: it waited for the handler beyond the grace (%s) instead of ending its attempt", took.Round(time.Millisecond), cfg.RevocationGrace)
	}
	if n := effects(t, e.Pool, r.group); n != 0 {
		t.Fatalf("%d effects of a handler stopped mid-work: its attempt committed", n)
	}
}
