// Package oncetest runs a consumer group's handler the way the pipeline does,
// against a real PostgreSQL and without Kafka, so a team can test its own
// handlers: each delivery claims the event in the real claim table through
// the real idempotency middleware, runs the handler in the claim's
// transaction, and commits or rolls back exactly as in production. Deliver
// an event twice and assert that its effect happened once.
//
//	h := oncetest.New(t, oncetest.Config[order.Confirmed]{DB: pool, Handle: analytics.Handler{}.OnConfirmed})
//	h.DeliverTwice(ev) // fails the test unless the second delivery was a skipped duplicate
//	// then count the handler's rows: one effect.
package oncetest

import (
	"context"
	"encoding/json"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/pipeline"
	"github.com/once-dev/once/schema"
)

// Config configures a [Harness].
type Config[E pipeline.Event] struct {
	// DB holds the claim table (package schema) and the handler's tables. Required.
	DB pipeline.DB
	// Handle is the handler under test. Required.
	Handle pipeline.HandlerFunc[E]
	// Group is the consumer group of the claims. Default: a name unique to
	// this harness, so that tests never see each other's claims.
	Group string
	// Encode gives an event's payload bytes, whose hash tells a redelivery
	// from a reused id. Default: json.Marshal.
	Encode func(E) ([]byte, error)
	// Tables names the claim table. Default: schema's defaults.
	Tables schema.Config
}

// Harness delivers events to one handler as one consumer group.
type Harness[E pipeline.Event] struct {
	t    testing.TB
	cfg  Config[E]
	idem *idempotency.Middleware
	runs int
	last idempotency.Result
}

// Delivery is what one delivery did.
type Delivery struct {
	// Outcome of the claim: Processed, Duplicate, Rejected, Failed...
	Outcome idempotency.Outcome
	// Err is what the pipeline would act on: nil (acknowledged), permanent
	// (dead-lettered, see [Delivery.DeadLettered]) or anything else (rolled
	// back and delivered again).
	Err error
	// HandlerRan says whether the handler was called in this delivery.
	HandlerRan bool
}

// DeadLettered reports whether the pipeline would dead-letter the message.
func (d Delivery) DeadLettered() bool { return idempotency.IsPermanent(d.Err) }

// New returns a harness; it fails t on a bad configuration.
func New[E pipeline.Event](t testing.TB, cfg Config[E]) *Harness[E] {
	t.Helper()
	if cfg.Group == "" {
		cfg.Group = "oncetest-" + uuid.NewString()[:12]
	}
	if cfg.Encode == nil {
		cfg.Encode = func(ev E) ([]byte, error) { return json.Marshal(ev) }
	}
	if cfg.Handle == nil {
		t.Fatal("oncetest: Config.Handle is required")
	}
	h := &Harness[E]{t: t, cfg: cfg}
	idem, err := idempotency.New(idempotency.Config{
		DB:            cfg.DB,
		ConsumerGroup: cfg.Group,
		Schema:        cfg.Tables.WithDefaults().Schema,
		Table:         cfg.Tables.WithDefaults().ClaimTable,
		Key:           eventKey[E],
		OnResult:      func(r idempotency.Result) { h.last = r },
	})
	if err != nil {
		t.Fatalf("oncetest: %v", err)
	}
	h.idem = idem
	return h
}

type eventCtxKey struct{}

func eventKey[E pipeline.Event](msg *message.Message) (uuid.UUID, error) {
	return msg.Context().Value(eventCtxKey{}).(E).EventID(), nil
}

// Group is the consumer group the harness claims as.
func (h *Harness[E]) Group() string { return h.cfg.Group }

// Runs is how often the handler was called, over all deliveries.
func (h *Harness[E]) Runs() int { return h.runs }

// errRolledBack is what the harness makes an attempt fail with after the
// handler ran, to roll it back as a crash or a failed commit would.
var errRolledBack = errors.New("oncetest: attempt rolled back after the handler ran")

// Deliver delivers ev once, as a Kafka delivery would reach the handler.
func (h *Harness[E]) Deliver(ev E) Delivery {
	h.t.Helper()
	return h.deliver(ev, false)
}

// DeliverRolledBack delivers ev and rolls the claim's transaction back after
// the handler returned, whatever it returned: what a crash before the commit
// leaves behind. Only the handler's effects outside the transaction remain.
func (h *Harness[E]) DeliverRolledBack(ev E) Delivery {
	h.t.Helper()
	return h.deliver(ev, true)
}

func (h *Harness[E]) deliver(ev E, rollBack bool) Delivery {
	h.t.Helper()
	payload, err := h.cfg.Encode(ev)
	if err != nil {
		h.t.Fatalf("oncetest: encode event %s: %v", ev.EventID(), err)
	}
	msg := message.NewMessage(uuid.NewString(), payload)
	msg.SetContext(context.WithValue(context.Background(), eventCtxKey{}, ev))
	before := h.runs
	_, err = h.idem.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		h.runs++
		tx, err := idempotency.TxFromContext(msg.Context())
		if err != nil {
			return nil, err
		}
		err = h.cfg.Handle(msg.Context(), tx, msg.Context().Value(eventCtxKey{}).(E))
		if rollBack {
			return nil, errRolledBack
		}
		return nil, err
	})(msg)
	return Delivery{Outcome: h.last.Outcome, Err: err, HandlerRan: h.runs > before}
}

// DeliverTwice delivers ev three times: an attempt that rolls back after the
// handler ran ([Harness.DeliverRolledBack]), a delivery that commits, and a
// redelivery. It fails the test unless the committed delivery ran the
// handler and the redelivery was a duplicate that did not, and returns
// those two. Assert afterwards that the handler's effect happened once.
func (h *Harness[E]) DeliverTwice(ev E) (first, second Delivery) {
	h.t.Helper()
	if d := h.DeliverRolledBack(ev); !d.HandlerRan || !errors.Is(d.Err, errRolledBack) || h.Claimed(ev) {
		h.t.Fatalf("oncetest: rolled-back delivery of %s: handler ran %v, error %v, claimed %v; want a run that left no claim",
			ev.EventID(), d.HandlerRan, d.Err, h.Claimed(ev))
	}
	first = h.Deliver(ev)
	if !first.HandlerRan || (first.Outcome != idempotency.Processed && first.Outcome != idempotency.Rejected) {
		h.t.Fatalf("oncetest: first delivery of %s: outcome %s, error %v; want processed or rejected", ev.EventID(), first.Outcome, first.Err)
	}
	second = h.Deliver(ev)
	if second.HandlerRan || second.Outcome != idempotency.Duplicate {
		h.t.Fatalf("oncetest: second delivery of %s: outcome %s, handler ran %v, error %v; want a skipped duplicate",
			ev.EventID(), second.Outcome, second.HandlerRan, second.Err)
	}
	return first, second
}

// Claimed reports whether the group's claim of ev is committed.
func (h *Harness[E]) Claimed(ev E) bool {
	h.t.Helper()
	ctx := context.Background()
	tx, err := h.cfg.DB.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
	if err != nil {
		h.t.Fatalf("oncetest: %v", err)
	}
	defer tx.Rollback(ctx)
	var n int
	q := "SELECT count(*) FROM " + h.cfg.Tables.Claims().Qualified + " WHERE event_id = $1 AND consumer_group = $2"
	if err := tx.QueryRow(ctx, q, ev.EventID(), h.cfg.Group).Scan(&n); err != nil {
		h.t.Fatalf("oncetest: read claim: %v", err)
	}
	return n == 1
}
