package oncetest

import (
	"context"
	"encoding/json"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/pgdb"
	"github.com/once-dev/once/pipeline"
	"github.com/once-dev/once/schema"
)

// HandlerConfig is one handler, as one consumer group: what a
// [HandlerHarness] runs.
type HandlerConfig[E pipeline.Event] struct {
	// DB holds the library's tables and the handler's. Required.
	DB pgdb.DB
	// Tables names the library's tables. Default: package schema's defaults.
	Tables schema.Config
	// Handle is the handler under test. Required.
	Handle pipeline.HandlerFunc[E]
	// Group is the consumer group of the claims. Default: a name unique to
	// this harness, so that tests never see each other's claims.
	Group string
	// Encode gives an event's bytes, as its producer sends them. Default:
	// json.Marshal.
	Encode func(E) ([]byte, error)
	// Decode reads them back, as the topic does. Default: json.Unmarshal.
	Decode func([]byte) (E, error)
	// Outgoing topics the handler publishes to. Default: none.
	Outgoing []pipeline.OutgoingBinding
}

// HandlerHarness delivers events to one handler, as one group, through
// the pipeline's chain; see [NewHandler].
type HandlerHarness[E pipeline.Event] struct {
	h     *Harness
	cfg   HandlerConfig[E]
	topic string
	runs  atomic.Int64
	mu    sync.Mutex
	ran   map[int64]bool // by the delivery's offset: concurrent deliveries each know
}

// Delivery is what one delivery to a handler did.
type Delivery struct {
	// Outcome of the claim: Processed, Duplicate, Rejected, Failed... (the
	// last attempt's).
	Outcome idempotency.Outcome
	// Err is what the pipeline acts on: nil (acknowledged), permanent
	// (dead-lettered; see [Delivery.DeadLettered]) or any other error (the
	// attempt rolled back, and the message would be delivered again).
	Err error
	// HandlerRan says whether the handler was called in this delivery.
	HandlerRan bool
}

// DeadLettered reports whether the pipeline dead-lettered the message.
func (d Delivery) DeadLettered() bool { return idempotency.IsPermanent(d.Err) }

// NewHandler returns a harness for one handler; it fails t on a bad
// configuration.
func NewHandler[E pipeline.Event](t TB, cfg HandlerConfig[E]) *HandlerHarness[E] {
	t.Helper()
	if cfg.Handle == nil {
		t.Fatal("oncetest: HandlerConfig.Handle is required")
	}
	if cfg.Group == "" {
		cfg.Group = "oncetest-" + uuid.NewString()[:12]
	}
	if cfg.Encode == nil {
		cfg.Encode = func(ev E) ([]byte, error) { return json.Marshal(ev) }
	}
	if cfg.Decode == nil {
		cfg.Decode = func(b []byte) (ev E, err error) { return ev, json.Unmarshal(b, &ev) }
	}
	hh := &HandlerHarness[E]{cfg: cfg, topic: "oncetest." + cfg.Group, ran: map[int64]bool{}}
	handle := func(ctx context.Context, tx pgx.Tx, ev E) error {
		hh.runs.Add(1)
		if d, ok := pipeline.DeliveryFrom(ctx); ok {
			hh.mu.Lock()
			hh.ran[d.Offset] = true
			hh.mu.Unlock()
		}
		return cfg.Handle(ctx, tx, ev)
	}
	hh.h = New(t, Config{DB: cfg.DB, Tables: cfg.Tables, Outgoing: cfg.Outgoing,
		Topics: []pipeline.Binding{pipeline.Topic[E]{Name: hh.topic, Decode: cfg.Decode, Groups: []pipeline.Group[E]{{Name: cfg.Group, Handle: handle}}}}})
	return hh
}

// Group is the consumer group the harness claims as.
func (hh *HandlerHarness[E]) Group() string { return hh.cfg.Group }

// Runs is how often the handler was called, over all deliveries.
func (hh *HandlerHarness[E]) Runs() int { return int(hh.runs.Load()) }

// Harness is the topic-level harness underneath, for PublishedMessages and
// [Published].
func (hh *HandlerHarness[E]) Harness() *Harness { return hh.h }

// Deliver delivers ev once, as a Kafka delivery reaches the handler. It may
// be called from several goroutines: deliveries from several partitions.
func (hh *HandlerHarness[E]) Deliver(ev E) Delivery {
	hh.h.t.Helper()
	return hh.deliver(ev, false)
}

// DeliverRolledBack delivers ev, and rolls the claim's transaction back
// after the handler returned, whatever it returned: what a crash before the
// commit leaves behind. Only the handler's effects outside the transaction
// remain.
func (hh *HandlerHarness[E]) DeliverRolledBack(ev E) Delivery {
	hh.h.t.Helper()
	return hh.deliver(ev, true)
}

func (hh *HandlerHarness[E]) deliver(ev E, rollBack bool) Delivery {
	hh.h.t.Helper()
	payload, err := hh.cfg.Encode(ev)
	if err != nil {
		hh.h.t.Fatalf("oncetest: encode event %s: %v", ev.EventID(), err)
	}
	lm := pipeline.LocalMessage{Key: ev.EventID().String(), Payload: payload}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	deliver := hh.h.local.Deliver
	if rollBack {
		deliver = hh.h.local.DeliverRolledBack
	}
	rs, err := deliver(ctx, hh.topic, lm)
	if err != nil || len(rs) != 1 {
		hh.h.t.Fatalf("oncetest: deliver %s: %v", ev.EventID(), err)
	}
	r := rs[0]
	hh.mu.Lock()
	ran := hh.ran[r.Offset]
	delete(hh.ran, r.Offset)
	hh.mu.Unlock()
	d := Delivery{Outcome: r.Claim.Outcome, HandlerRan: ran}
	switch {
	case r.DeadLetter != nil:
		d.Err = r.DeadLetter.Err
	case r.Held != nil:
		d.Err = r.Held.Err
	default:
		d.Err = r.Err
	}
	return d
}

// DeliverTwice delivers ev twice, as Kafka's at-least-once delivery may:
// it fails the test unless the first delivery ran the handler (processed,
// or rejected and dead-lettered) and the second was a duplicate that did
// not. Assert afterwards that the handler's effect happened once. (A crash
// before the commit is [HandlerHarness.DeliverRolledBack].)
func (hh *HandlerHarness[E]) DeliverTwice(ev E) (first, second Delivery) {
	hh.h.t.Helper()
	first = hh.Deliver(ev)
	if !first.HandlerRan || (first.Outcome != idempotency.Processed && first.Outcome != idempotency.Rejected) {
		hh.h.t.Fatalf("oncetest: first delivery of %s: outcome %s, error %v; want processed or rejected", ev.EventID(), first.Outcome, first.Err)
	}
	second = hh.Deliver(ev)
	if second.HandlerRan || second.Outcome != idempotency.Duplicate {
		hh.h.t.Fatalf("oncetest: second delivery of %s: outcome %s, handler ran %v, error %v; want a skipped duplicate",
			ev.EventID(), second.Outcome, second.HandlerRan, second.Err)
	}
	return first, second
}

// Claimed reports whether the group's claim of ev is committed.
func (hh *HandlerHarness[E]) Claimed(ev E) bool {
	hh.h.t.Helper()
	return hh.h.Claimed(hh.cfg.Group, ev.EventID())
}

// RequireOnce checks the guarantee for ev: a delivery whose transaction
// rolls back after the handler ran leaves no claim, then [DeliverTwice]'s
// checks hold. It returns DeliverTwice's deliveries. Assert afterwards
// that the handler's effect happened once.
func (hh *HandlerHarness[E]) RequireOnce(ev E) (first, second Delivery) {
	hh.h.t.Helper()
	if d := hh.DeliverRolledBack(ev); !d.HandlerRan || hh.Claimed(ev) {
		hh.h.t.Fatalf("oncetest: rolled-back delivery of %s: handler ran %v, error %v, claimed %v; want a run that left no claim",
			ev.EventID(), d.HandlerRan, d.Err, hh.Claimed(ev))
	}
	return hh.DeliverTwice(ev)
}
