package pipeline_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
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

// checked is a team's event type whose MarshalJSON validates what it
// writes, as a careful producer's does: no event without an id, no
// negative amount.
type checked struct {
	ID     uuid.UUID `json:"event_id"`
	Amount int64     `json:"amount"`
}

func (c checked) EventID() uuid.UUID { return c.ID }

func (c checked) MarshalJSON() ([]byte, error) {
	if err := validate(c.ID, c.Amount); err != nil {
		return nil, err
	}
	type plain checked
	return json.Marshal(plain(c))
}

// checkedCanonical is the same as a CanonicalEvent.
type checkedCanonical struct {
	ID     uuid.UUID `json:"event_id"`
	Amount int64     `json:"amount"`
}

func (c checkedCanonical) EventID() uuid.UUID { return c.ID }

func (c checkedCanonical) CanonicalJSON() ([]byte, error) {
	if err := validate(c.ID, c.Amount); err != nil {
		return nil, err
	}
	return fmt.Appendf(nil, `{"amount":%d,"event_id":%q}`, c.Amount, c.ID), nil
}

func validate(id uuid.UUID, amount int64) error {
	if id == uuid.Nil {
		return errors.New("no event_id")
	}
	if amount < 0 {
		return errors.New("a negative amount")
	}
	return nil
}

// Review finding of issue 28: the pipeline fingerprinted the zero value
// of each event type at start-up and refused the type when that failed,
// so a type whose MarshalJSON (or CanonicalJSON) refuses a zero id, which
// worked before, stopped pipeline.New after an upgrade, though every real
// event fingerprints. Such a type is accepted; its events are duplicates
// and mismatches by their values, and one whose values it refuses is
// dead-lettered with the reason.
func TestAnEventTypeThatRefusesItsZeroValueIsAccepted(t *testing.T) {
	t.Run("MarshalJSON", func(t *testing.T) { testRefusesZero[checked](t) })
	t.Run("CanonicalJSON", func(t *testing.T) { testRefusesZero[checkedCanonical](t) })
}

func testRefusesZero[E pipeline.Event](t *testing.T) {
	var zero E
	if _, err := json.Marshal(zero); err == nil {
		if c, ok := any(zero).(pipeline.CanonicalEvent); !ok {
			t.Fatal("the zero value marshals: the type does not stage the finding")
		} else if _, err := c.CanonicalJSON(); err == nil {
			t.Fatal("the zero value has a canonical form: the type does not stage the finding")
		}
	}
	e := newEnv(t, 1)
	group := uniqueGroup("refuses-zero")
	var runs atomic.Int64
	var seen pipelinetest.Outcomes
	var mu sync.Mutex
	var reasons []string
	cfg := e.config()
	cfg.Hooks.OnResult = seen.Record
	cfg.Hooks.OnDeadLetter = func(d pipeline.DeadLetter) {
		mu.Lock()
		defer mu.Unlock()
		reasons = append(reasons, d.Reason)
	}
	cfg.Topics = []pipeline.Binding{pipeline.Topic[E]{Name: e.Topic, DLQ: e.DLQ,
		Decode: func(b []byte) (ev E, err error) { return ev, json.Unmarshal(b, &ev) },
		Groups: []pipeline.Group[E]{{Name: group, Handle: func(context.Context, pgx.Tx, E) error { runs.Add(1); return nil }}}}}
	run(t, cfg)

	id := uuid.Must(uuid.NewV7()).String()
	for _, payload := range []string{
		`{"event_id":"` + id + `","amount":10}`,
		`{"amount":10, "event_id":"` + id + `"}`,                              // the same values: a duplicate
		`{"event_id":"` + id + `","amount":99}`,                               // other values: a mismatch
		`{"event_id":"` + uuid.Must(uuid.NewV7()).String() + `","amount":-1}`, // values its type refuses
		`{"event_id":"` + uuid.Must(uuid.NewV7()).String() + `","amount":5}`,
	} {
		testenv.Publish(t, e.Prod, e.Topic, "k", []byte(payload))
	}
	testenv.Eventually(t, 60*time.Second, "five messages decided", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return seen.Get(group, idempotency.Processed)+seen.Get(group, idempotency.Duplicate) == 3 && len(reasons) == 2
	})
	mu.Lock()
	defer mu.Unlock()
	if seen.Get(group, idempotency.Processed) != 2 || seen.Get(group, idempotency.Duplicate) != 1 || seen.Get(group, idempotency.PayloadMismatch) != 1 || runs.Load() != 2 {
		t.Fatalf("processed %d, duplicates %d, mismatches %d, runs %d; want 2, 1, 1 and 2", seen.Get(group, idempotency.Processed),
			seen.Get(group, idempotency.Duplicate), seen.Get(group, idempotency.PayloadMismatch), runs.Load())
	}
	if !slices.ContainsFunc(reasons, func(r string) bool {
		return strings.Contains(r, "cannot be fingerprinted") && strings.Contains(r, "a negative amount")
	}) {
		t.Fatalf("dead letters' reasons %q; want one saying the negative amount cannot be fingerprinted", reasons)
	}
}
