package pipeline_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/pipeline"
)

// A key-ordered group against Kafka and PostgreSQL. Needs KAFKA_BROKERS and
// DATABASE_URL.

// keyRuns records a handler's runs from its own clock: when each event of
// each key started and ended, and what ran at once. A key's runs must never
// overlap and must come in its order; a keyless event's run must overlap
// nothing of its partition.
type keyRuns struct {
	mu       sync.Mutex
	running  map[string]bool // by key; "" for a keyless event
	now      int             // runs at once
	most     int             // the most at once
	last     map[string]int64
	bad      []string
	finished int
}

func (k *keyRuns) start(key string, order int64) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.running == nil {
		k.running, k.last = map[string]bool{}, map[string]int64{}
	}
	switch {
	case k.running[key]:
		k.bad = append(k.bad, fmt.Sprintf("key %q: two runs at once", key))
	case key == "" && k.now > 0:
		k.bad = append(k.bad, fmt.Sprintf("a keyless event ran beside %d others", k.now))
	case key != "" && k.running[""]:
		k.bad = append(k.bad, fmt.Sprintf("key %q ran beside a keyless event", key))
	}
	if order <= k.last[key] {
		k.bad = append(k.bad, fmt.Sprintf("key %q: order %d after %d", key, order, k.last[key]))
	}
	k.last[key] = order
	k.running[key] = true
	k.now++
	k.most = max(k.most, k.now)
}

func (k *keyRuns) end(key string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.running[key] = false
	k.now--
	k.finished++
}

func (k *keyRuns) check(t *testing.T) {
	t.Helper()
	k.mu.Lock()
	defer k.mu.Unlock()
	if len(k.bad) > 0 {
		t.Fatalf("%d violations of the key order, e.g. %v", len(k.bad), k.bad[:min(len(k.bad), 5)])
	}
}

// keyOf is the key sequenced and keyed publish under; "" for the keyless.
func keyOf(ev confirmed) string {
	if ev.Customer < 0 {
		return ""
	}
	return fmt.Sprint("k", ev.Customer)
}

// A key-ordered group runs a partition's messages at once, never two of one
// key, each key's in order, and a message without a key alone: everything
// before it done first, everything after it waiting for it.
func TestAKeyOrderedGroupRunsKeysAtOnceInOrder(t *testing.T) {
	e := newEnv(t, 1)
	r := &recorder{group: uniqueGroup("key-order")}
	var runs keyRuns
	g := pipeline.Group[confirmed]{Name: r.group, Order: pipeline.OrderKey, Concurrency: 8,
		Handle: func(ctx context.Context, tx pgx.Tx, ev confirmed) error {
			runs.start(keyOf(ev), ev.Order)
			defer runs.end(keyOf(ev))
			time.Sleep(20 * time.Millisecond) // a provider's call
			return r.Handle(ctx, tx, ev)
		}}
	p, err := pipeline.New(e.config(g))
	if err != nil {
		t.Fatal(err)
	}
	startPipeline(t, p)

	const keys, perKey = 8, 10
	var msgs []*sarama.ProducerMessage
	for i := range keys * perKey {
		ev, err := newConfirmed(uuid.Must(uuid.NewV7()), time.Now(), int64(i/keys+1), int64(i%keys), decimal.RequireFromString("1.00"))
		if err != nil {
			t.Fatal(err)
		}
		msgs = append(msgs, &sarama.ProducerMessage{Topic: e.Topic, Key: sarama.StringEncoder(keyOf(ev)), Value: sarama.ByteEncoder(payload(t, ev))})
		if i == keys*perKey/2 {
			// A message without a key, in the middle.
			keyless, err := newConfirmed(uuid.Must(uuid.NewV7()), time.Now(), 1, -1, decimal.RequireFromString("1.00"))
			if err != nil {
				t.Fatal(err)
			}
			msgs = append(msgs, &sarama.ProducerMessage{Topic: e.Topic, Value: sarama.ByteEncoder(payload(t, keyless))})
		}
	}
	if err := e.Prod.SendMessages(msgs); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, time.Minute, "every event processed", func() bool { return effects(t, e.Pool, r.group) == keys*perKey+1 })
	runs.check(t)
	runs.mu.Lock()
	defer runs.mu.Unlock()
	t.Logf("at most %d at once", runs.most)
	if runs.most < 2 || runs.most > 8 {
		t.Fatalf("at most %d runs at once; want several, and no more than Concurrency (8)", runs.most)
	}
}

// A held message holds its key, not its partition: the other keys go on
// while the window has room, the held message pins the partition's
// committed offset, the status shows the held key, the pinned commit point
// and the full window, and once it passes its key's events follow in order.
func TestAHeldMessageHoldsItsKeyNotItsPartition(t *testing.T) {
	e := newEnv(t, 1)
	r := &recorder{group: uniqueGroup("held-key")}
	var runs keyRuns
	var holding atomic.Bool
	holding.Store(true)
	var failures atomic.Int64
	const keys, perKey, window = 6, 10, 20
	var heldID atomic.Value
	g := pipeline.Group[confirmed]{Name: r.group, Order: pipeline.OrderKey, Concurrency: 4, Window: window,
		Handle: func(ctx context.Context, tx pgx.Tx, ev confirmed) error {
			if id, _ := heldID.Load().(uuid.UUID); ev.ID == id && holding.Load() {
				failures.Add(1)
				return errors.New("the provider answers 503 (staged)")
			}
			runs.start(keyOf(ev), ev.Order)
			defer runs.end(keyOf(ev))
			return r.Handle(ctx, tx, ev)
		}}
	cfg := e.config(g)
	cfg.HoldBackoff, cfg.HoldMaxBackoff = 10*time.Millisecond, 50*time.Millisecond
	cfg.CommitMode = pipeline.CommitSync
	p, err := pipeline.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	startPipeline(t, p)

	var msgs []*sarama.ProducerMessage
	const heldAt = 2*keys + 0 // key k0's third event
	for i := range keys * perKey {
		ev, err := newConfirmed(uuid.Must(uuid.NewV7()), time.Now(), int64(i/keys+1), int64(i%keys), decimal.RequireFromString("1.00"))
		if err != nil {
			t.Fatal(err)
		}
		if i == heldAt {
			heldID.Store(ev.ID)
		}
		msgs = append(msgs, &sarama.ProducerMessage{Topic: e.Topic, Key: sarama.StringEncoder(keyOf(ev)), Value: sarama.ByteEncoder(payload(t, ev))})
	}
	if err := e.Prod.SendMessages(msgs); err != nil {
		t.Fatal(err)
	}
	// Offsets 0..heldAt+window-1 may be in flight; of those, every message
	// of another key runs, and k0's after the held one wait.
	inWindow := heldAt + window
	wantPassed := heldAt // the messages before the held one
	for off := heldAt + 1; off < inWindow; off++ {
		if off%keys != 0 {
			wantPassed++
		}
	}
	testenv.Eventually(t, time.Minute, "the other keys processed up to the window", func() bool {
		return effects(t, e.Pool, r.group) == wantPassed
	})
	var status pipeline.GroupStatus
	testenv.Eventually(t, 10*time.Second, "the status shows the held key and the full window", func() bool {
		status = p.Status()[0]
		return status.Held == 1 && status.HeldKeys == 1 && status.WindowFull == 1 && status.Pinned > 0
	})
	time.Sleep(300 * time.Millisecond) // nothing more runs while the window is full
	if n := effects(t, e.Pool, r.group); n != wantPassed || failures.Load() < 2 {
		t.Fatalf("%d processed while the key is held (want %d), the held message failed %d times (want it held)", n, wantPassed, failures.Load())
	}
	admin := testenv.Admin(t, e.Brokers)
	if committed := testenv.CommittedOffsets(t, admin, r.group, e.Topic)[0]; committed > heldAt {
		t.Fatalf("committed offset %d is past the held message's %d", committed, heldAt)
	}

	holding.Store(false)
	testenv.Eventually(t, time.Minute, "every event processed", func() bool { return effects(t, e.Pool, r.group) == keys*perKey })
	runs.check(t)
	testenv.Eventually(t, 10*time.Second, "the commit point moved to the end", func() bool {
		return testenv.CommittedOffsets(t, admin, r.group, e.Topic)[0] == keys*perKey
	})
	if s := p.Status()[0]; s.Held != 0 || s.HeldKeys != 0 || s.WindowFull != 0 {
		t.Fatalf("status after the hold %+v; want nothing held, no window full", s)
	}
}

// Start-up refuses a key-ordered group whose pool cannot serve its
// Concurrency: every attempt holds a connection for its whole run.
func TestAConcurrencyThePoolCannotServeIsRefused(t *testing.T) {
	e := newEnv(t, 1)
	cfg := e.Pool.Config()
	cfg.MaxConns = 4
	small, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(small.Close)
	r := &recorder{group: uniqueGroup("too-few-conns")}
	pc := e.config(pipeline.Group[confirmed]{Name: r.group, Handle: r.Handle, Order: pipeline.OrderKey, Concurrency: 3},
		pipeline.Group[confirmed]{Name: r.group + "-batched", HandleBatch: r.HandleBatch, Batch: pipeline.Batch{Concurrency: 2}})
	pc.DB = small
	err = pc.Validate()
	for _, want := range []string{"MaxConns 4", "up to 5 attempts", "Concurrency 3", "Batch.Concurrency 2"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("Validate: %v; want a refusal naming %q", err, want)
		}
	}
	pc.Topics = []pipeline.Binding{e.topicOf(pipeline.Group[confirmed]{Name: r.group, Handle: r.Handle, Order: pipeline.OrderKey, Concurrency: 4})}
	if err := pc.Validate(); err != nil {
		t.Fatalf("a pool that serves the concurrency: %v", err)
	}
}
