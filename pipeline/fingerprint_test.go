package pipeline_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/internal/pipelinetest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/pipeline"
)

// dated is a team's event type whose decoder puts its time in UTC, as
// orderevents does: "0000-01-01T00:30:00+01:00" is a valid time, and in UTC
// it is in the year -1, which time.Time's MarshalJSON refuses to write.
type dated struct {
	ID uuid.UUID `json:"event_id"`
	At time.Time `json:"occurred_at"`
}

func (d dated) EventID() uuid.UUID { return d.ID }

func decodeDated(b []byte) (dated, error) {
	var d dated
	if err := json.Unmarshal(b, &d); err != nil {
		return d, err
	}
	if d.ID.Version() != 7 {
		return d, errors.New("event_id: want a UUIDv7")
	}
	d.At = d.At.UTC()
	return d, nil
}

// A valid event whose values cannot be fingerprinted is the message's
// fault: it is dead-lettered with the reason, and the message behind it in
// its partition is processed (issue 28, item 2b: the claim held it, and
// its partition, for ever).
func TestAnEventThatCannotBeFingerprintedIsDeadLettered(t *testing.T) {
	eachMode(t, testUnfingerprintable)
}

func testUnfingerprintable(t *testing.T, m handlerMode) {
	e := newEnv(t, 1)
	group := uniqueGroup("unfingerprintable")
	var mu sync.Mutex
	var handled []uuid.UUID
	handle := func(ctx context.Context, tx pgx.Tx, evs []dated) error {
		for _, ev := range evs {
			if _, err := tx.Exec(ctx, `INSERT INTO pipeline_test_effect (event_id, consumer_group) VALUES ($1, $2)`, ev.ID, group); err != nil {
				return err
			}
		}
		mu.Lock()
		defer mu.Unlock()
		for _, ev := range evs {
			handled = append(handled, ev.ID)
		}
		return nil
	}
	g := pipeline.Group[dated]{Name: group, Handle: func(ctx context.Context, tx pgx.Tx, ev dated) error { return handle(ctx, tx, []dated{ev}) }}
	if m.batched {
		g = pipeline.Group[dated]{Name: group, HandleBatch: handle, Batch: pipeline.Batch{Size: 10}}
	}
	var letters []pipeline.DeadLetter
	var held atomic.Int64
	cfg := e.config()
	cfg.HoldBackoff = 10 * time.Millisecond
	cfg.Topics = []pipeline.Binding{pipeline.Topic[dated]{Name: e.Topic, DLQ: e.DLQ, Decode: decodeDated, Groups: []pipeline.Group[dated]{g}}}
	cfg.Hooks.OnDeadLetter = func(d pipeline.DeadLetter) {
		mu.Lock()
		defer mu.Unlock()
		letters = append(letters, d)
	}
	cfg.Hooks.OnHeld = func(pipeline.Held) { held.Add(1) }
	run(t, cfg)

	bad := fmt.Sprintf(`{"event_id":%q,"occurred_at":"0000-01-01T00:30:00+01:00"}`, uuid.Must(uuid.NewV7()))
	if _, err := decodeDated([]byte(bad)); err != nil {
		t.Fatalf("the event must be valid: %v", err)
	}
	next := uuid.Must(uuid.NewV7())
	testenv.Publish(t, e.Prod, e.Topic, "k", []byte(bad))
	testenv.Publish(t, e.Prod, e.Topic, "k", []byte(fmt.Sprintf(`{"event_id":%q,"occurred_at":"2026-12-02T15:08:21Z"}`, next)))

	testenv.Eventually(t, 60*time.Second, "the event behind it processed", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(handled) == 1
	})
	mu.Lock()
	defer mu.Unlock()
	if handled[0] != next {
		t.Fatalf("handled %v; want only %s", handled, next)
	}
	if len(letters) != 1 || !strings.Contains(letters[0].Reason, "cannot be fingerprinted") || !strings.Contains(letters[0].Reason, "year outside of range") {
		t.Fatalf("dead letters %+v; want one, its reason that the values cannot be fingerprinted (the year)", letters)
	}
	if reasons := readDLQ(t, e.Brokers, e.DLQ, 1); !strings.Contains(reasons[bad], "cannot be fingerprinted") {
		t.Fatalf("the dead-letter topic holds %v; want the event with its reason", reasons)
	}
	if held.Load() != 0 {
		t.Fatalf("held %d times; a message's own fault is not held", held.Load())
	}
}

// hidden keeps its amount unexported beside an exported id: encoding/json
// sees the id alone.
type hidden struct {
	ID     uuid.UUID `json:"event_id"`
	amount string
}

func (h hidden) EventID() uuid.UUID { return h.ID }

func decodeHidden(b []byte) (hidden, error) {
	var w struct {
		ID     uuid.UUID `json:"event_id"`
		Amount string    `json:"amount"`
	}
	err := json.Unmarshal(b, &w)
	return hidden{ID: w.ID, amount: w.Amount}, err
}

// A reused id with another amount is a mismatch for an event type whose
// fields are partly unexported (issue 28: its exported fields alone were
// fingerprinted, and the event passed for a duplicate: its effect was
// skipped). The same values in another member order are a duplicate.
func TestAReusedIDIsAMismatchWhenPartOfTheTypeIsHidden(t *testing.T) {
	e := newEnv(t, 1)
	group := uniqueGroup("hidden")
	var runs atomic.Int64
	var seen pipelinetest.Outcomes
	cfg := e.config()
	cfg.Hooks.OnResult = seen.Record
	cfg.Topics = []pipeline.Binding{pipeline.Topic[hidden]{Name: e.Topic, DLQ: e.DLQ, Decode: decodeHidden, Groups: []pipeline.Group[hidden]{
		{Name: group, Handle: func(context.Context, pgx.Tx, hidden) error { runs.Add(1); return nil }}}}}
	run(t, cfg)
	id := uuid.Must(uuid.NewV7()).String()
	testenv.Publish(t, e.Prod, e.Topic, "k", []byte(`{"event_id":"`+id+`","amount":"10.00"}`))
	testenv.Publish(t, e.Prod, e.Topic, "k", []byte(`{"event_id":"`+id+`","amount":"99.00"}`))
	testenv.Publish(t, e.Prod, e.Topic, "k", []byte(`{"amount":"10.00", "event_id":"`+id+`"}`))
	testenv.Eventually(t, 30*time.Second, "three deliveries decided", func() bool {
		return seen.Get(group, idempotency.Processed)+seen.Get(group, idempotency.Duplicate)+seen.Get(group, idempotency.PayloadMismatch) == 3
	})
	if seen.Get(group, idempotency.Processed) != 1 || seen.Get(group, idempotency.PayloadMismatch) != 1 || seen.Get(group, idempotency.Duplicate) != 1 || runs.Load() != 1 {
		t.Fatalf("processed %d, mismatches %d, duplicates %d, runs %d; want 1 each", seen.Get(group, idempotency.Processed),
			seen.Get(group, idempotency.PayloadMismatch), seen.Get(group, idempotency.Duplicate), runs.Load())
	}
}

// refusing is a CanonicalEvent that cannot write even its zero value.
type refusing struct{ ID uuid.UUID }

func (r refusing) EventID() uuid.UUID             { return r.ID }
func (r refusing) CanonicalJSON() ([]byte, error) { return nil, errors.New("no canonical form") }

// unmarshalable is seen whole by encoding/json, but its MarshalJSON fails.
type unmarshalable struct {
	ID uuid.UUID `json:"event_id"`
}

func (u unmarshalable) EventID() uuid.UUID           { return u.ID }
func (u unmarshalable) MarshalJSON() ([]byte, error) { return nil, errors.New("cannot marshal") }

// An event type whose fingerprint fails for its zero value would fail for
// every event: the pipeline refuses it at start-up, naming the type.
func TestAnEventTypeThatCannotBeFingerprintedIsRefused(t *testing.T) {
	noop := func(context.Context, pgx.Tx, refusing) error { return nil }
	noop2 := func(context.Context, pgx.Tx, unmarshalable) error { return nil }
	_, err := pipeline.New(pipeline.Config{
		Brokers: []string{"127.0.0.1:1"},
		Topics: []pipeline.Binding{
			pipeline.Topic[refusing]{Name: "r", Decode: func([]byte) (refusing, error) { return refusing{}, nil }, Groups: []pipeline.Group[refusing]{{Name: "g", Handle: noop}}},
			pipeline.Topic[unmarshalable]{Name: "u", Decode: func([]byte) (unmarshalable, error) { return unmarshalable{}, nil }, Groups: []pipeline.Group[unmarshalable]{{Name: "g", Handle: noop2}}},
		},
	})
	if err == nil {
		t.Fatal("accepted")
	}
	for _, want := range []string{
		"topic r: event type pipeline_test.refusing cannot be fingerprinted, not even its zero value: the canonical form of pipeline_test.refusing: no canonical form",
		"topic u: event type pipeline_test.unmarshalable cannot be fingerprinted, not even its zero value",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not mention %q:\n%v", want, err)
		}
	}
}
