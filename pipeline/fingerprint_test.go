package pipeline_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
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
