package pipeline_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/outbox"
	"github.com/once-dev/once/pipeline"
	"github.com/once-dev/once/schema"
)

// localBatch runs one batched group of decodeConfirmed events in a local
// pipeline, in a schema of the test's own, with the topic's InTx and
// Outgoing given, and delivers evs at once.
func localBatch(t *testing.T, handle pipeline.BatchHandlerFunc[confirmed], inTx message.HandlerMiddleware, outgoing []pipeline.OutgoingBinding,
	onBatch func(pipeline.BatchDone), evs []confirmed) ([]pipeline.LocalResult, *outbox.Outbox, schema.Config) {
	t.Helper()
	pool := testenv.Postgres(t)
	tables := schema.Config{Schema: "batch_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")}
	if _, err := schema.Migrate(context.Background(), pool, tables); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA "+tables.Schema+" CASCADE") })
	var extra pipeline.Extra
	if inTx != nil {
		extra.InTx = []message.HandlerMiddleware{inTx}
	}
	local, err := pipeline.NewLocal(pipeline.Config{DB: pool, Tables: tables, Outgoing: outgoing, Logger: quietLogger(),
		Hooks: pipeline.Hooks{OnBatch: onBatch},
		Topics: []pipeline.Binding{pipeline.Topic[confirmed]{Name: "orders", Decode: decodeConfirmed, Extra: extra,
			Groups: []pipeline.Group[confirmed]{{Name: "batched", HandleBatch: handle, Batch: pipeline.Batch{Size: 50, MaxWait: 50 * time.Millisecond}}}}}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(local.Close)
	msgs := make([]pipeline.LocalMessage, len(evs))
	for i, ev := range evs {
		msgs[i] = pipeline.LocalMessage{Key: "k", Payload: payload(t, ev)}
	}
	rs, err := local.Deliver(context.Background(), "orders", msgs...)
	if err != nil {
		t.Fatal(err)
	}
	box, _ := outbox.New(tables, nil)
	return rs, box, tables
}

// A topic's InTx written for one event, a filter that skips some, on a
// batched group: it sees the batch's first event only, so it must not
// decide for the batch. The batch's events run on their own, through it,
// and every event it does not skip reaches the handler (review finding: a
// filter skipping the first event committed the whole batch unhandled).
func TestAnInTxFilterOnABatchDecidesEventByEvent(t *testing.T) {
	var mu sync.Mutex
	handled := map[uuid.UUID]bool{}
	var skip uuid.UUID
	filter := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			if ev, ok := pipeline.EventFrom[confirmed](msg.Context()); ok && ev.ID == skip {
				return nil, nil // not for us
			} else if !ok {
				// In a batch there is no one event: a filter cannot tell.
				return nil, nil
			}
			return h(msg)
		}
	}
	evs := make([]confirmed, 10)
	for i := range evs {
		evs[i] = validEvent(t, "1.00")
	}
	skip = evs[0].ID
	var batches []pipeline.BatchDone
	rs, _, _ := localBatch(t, func(ctx context.Context, tx pgx.Tx, got []confirmed) error {
		mu.Lock()
		defer mu.Unlock()
		for _, ev := range got {
			handled[ev.ID] = true
		}
		return nil
	}, filter, nil, func(b pipeline.BatchDone) { batches = append(batches, b) }, evs)
	for _, r := range rs {
		if r.Err != nil || r.Held != nil || r.DeadLetter != nil {
			t.Fatalf("result %+v; want every event acknowledged", r)
		}
	}
	if len(batches) == 0 || batches[0].RunAlone == 0 {
		t.Fatalf("batches %+v; want the filtered batch to run its events alone", batches)
	}
	if len(handled) != 9 || handled[skip] {
		t.Fatalf("%d events handled (the skipped one: %v); want the 9 the filter let through", len(handled), handled[skip])
	}
}

// followed is the follow-up a batch handler publishes.
type followed struct {
	ID    uuid.UUID `json:"event_id"`
	Order int64     `json:"order_id"`
}

func (f followed) EventID() uuid.UUID { return f.ID }

// Publish works in a batch's handler as in an event's (review finding: it
// failed, and every batch ran its events alone); DerivedID refuses, since a
// batch has no one event, and outbox.EventID derives each one's id.
func TestPublishFromABatchHandler(t *testing.T) {
	evs := make([]confirmed, 10)
	for i := range evs {
		evs[i] = validEvent(t, "1.00")
	}
	var derivedErr error
	var batches []pipeline.BatchDone
	rs, box, _ := localBatch(t, func(ctx context.Context, tx pgx.Tx, got []confirmed) error {
		_, derivedErr = pipeline.DerivedID(ctx, "order.followed.v1", time.Now())
		for _, ev := range got {
			if err := pipeline.Publish(ctx, tx, followed{ID: outbox.EventID(ev.ID, "order.followed.v1", ev.At), Order: ev.Order}); err != nil {
				return err
			}
		}
		return nil
	}, nil, []pipeline.OutgoingBinding{pipeline.Outgoing[followed]{Name: "order.followed.v1", Key: func(f followed) string { return fmt.Sprint(f.Order) }}},
		func(b pipeline.BatchDone) { batches = append(batches, b) }, evs)
	for _, r := range rs {
		if r.Err != nil || r.Held != nil || r.Claim.Outcome != idempotency.Processed {
			t.Fatalf("result %+v; want every event processed", r)
		}
	}
	if len(batches) == 0 {
		t.Fatal("no batch ran")
	}
	for _, b := range batches {
		if b.RunAlone != 0 {
			t.Fatalf("batches %+v; want none failed", batches)
		}
	}
	written, err := box.Written(context.Background(), testenv.Postgres(t), "order.followed.v1")
	if err != nil {
		t.Fatal(err)
	}
	ids := map[string]bool{}
	for _, m := range written {
		var f followed
		if err := json.Unmarshal(m.Payload, &f); err != nil || m.ID != f.ID.String() {
			t.Fatalf("outbox message %+v (%v)", m, err)
		}
		ids[m.ID] = true
	}
	if len(written) != len(evs) || len(ids) != len(evs) {
		t.Fatalf("%d follow-ups with %d ids in the outbox; want %d, one per event", len(written), len(ids), len(evs))
	}
	if derivedErr == nil || !strings.Contains(derivedErr.Error(), "outbox.EventID") {
		t.Fatalf("DerivedID in a batch: %v; want a refusal naming outbox.EventID", derivedErr)
	}
}
