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

	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/internal/pipelinetest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/pipeline"
)

// reservation is an event of a producer the team does not own: its id is
// a UUIDv4, and the claim's UUIDv7 is derived from it and the time the
// producer wrote in the event.
type reservation struct {
	ID        string    `json:"reservation_id"`
	CreatedAt time.Time `json:"created_at"`
	SKU       string    `json:"sku"`
	Quantity  int       `json:"quantity"`
}

const inventoryNamespace = "inventory"

func (r reservation) EventID() uuid.UUID {
	return idempotency.DeriveEventID(inventoryNamespace, r.ID, r.CreatedAt)
}

func decodeReservation(b []byte) (r reservation, err error) {
	if err = json.Unmarshal(b, &r); err == nil && (r.ID == "" || r.CreatedAt.IsZero()) {
		err = errors.New("reservation_id and created_at are required")
	}
	return r, err
}

// rawReservation is the same event with the producer's UUIDv4 as its id,
// as a team would first write it.
type rawReservation struct {
	ID uuid.UUID `json:"reservation_id"`
}

func (r rawReservation) EventID() uuid.UUID { return r.ID }

// A topic whose producer sends UUIDv4s, its events' ids derived with
// DeriveEventID: an event is processed once; its re-publish, in the same
// bytes or another byte form of the same values, is a duplicate; another
// payload under the same producer id and time is a payload mismatch and
// dead-lettered. A topic whose events return the UUIDv4 itself is refused
// with an error that names EventID() and the helper, not a payload field.
func TestForeignIDsDerivedWithDeriveEventID(t *testing.T) {
	eachMode(t, testForeignIDs)
}

func testForeignIDs(t *testing.T, m handlerMode) {
	e := newEnv(t, 1)
	rawTopic, rawDLQ := testenv.Topic(t, e.Brokers, 1), testenv.Topic(t, e.Brokers, 1)
	group := uniqueGroup("inventory")
	var runs atomic.Int64
	handle := func(ctx context.Context, tx pgx.Tx, r reservation) error {
		runs.Add(1)
		_, err := tx.Exec(ctx, `INSERT INTO pipeline_test_effect (event_id, consumer_group) VALUES ($1, $2)`, r.EventID(), group)
		return err
	}
	g := pipeline.Group[reservation]{Name: group, Handle: handle}
	if m.batched {
		g = pipeline.Group[reservation]{Name: group, Batch: pipeline.Batch{Size: 50}, HandleBatch: func(ctx context.Context, tx pgx.Tx, rs []reservation) error {
			for _, r := range rs {
				if err := handle(ctx, tx, r); err != nil {
					return err
				}
			}
			return nil
		}}
	}
	rawGroup := uniqueGroup("inventory-raw")
	var rawRuns atomic.Int64
	var seen pipelinetest.Outcomes
	var mu sync.Mutex
	letters := map[string]string{} // payload -> reason
	cfg := pipeline.Config{Brokers: e.Brokers, DB: e.Pool, Logger: quietLogger(), Topics: []pipeline.Binding{
		pipeline.Topic[reservation]{Name: e.Topic, DLQ: e.DLQ, Decode: decodeReservation, IDNamespace: inventoryNamespace,
			Groups: []pipeline.Group[reservation]{g}},
		pipeline.Topic[rawReservation]{Name: rawTopic, DLQ: rawDLQ,
			Decode: func(b []byte) (r rawReservation, err error) { return r, json.Unmarshal(b, &r) },
			Groups: []pipeline.Group[rawReservation]{{Name: rawGroup, Handle: func(context.Context, pgx.Tx, rawReservation) error {
				rawRuns.Add(1)
				return nil
			}}}},
	}}
	cfg.Hooks.OnResult = seen.Record
	cfg.Hooks.OnDeadLetter = func(d pipeline.DeadLetter) {
		mu.Lock()
		defer mu.Unlock()
		letters[d.Topic] = d.Reason
	}
	run(t, cfg)

	foreign := uuid.New() // the producer's id, a UUIDv4
	// Two hours old: within the dedup horizon, beyond a replay window of one.
	created := time.Now().Add(-2 * time.Hour).UTC().Truncate(time.Microsecond)
	first := fmt.Sprintf(`{"reservation_id":%q,"created_at":%q,"sku":"A-1","quantity":2}`, foreign, created.Format(time.RFC3339Nano))
	otherForm := fmt.Sprintf(`{"quantity":2,"sku":"A-1","created_at":%q,"reservation_id":%q}`,
		created.In(time.FixedZone("", 2*3600)).Format(time.RFC3339Nano), foreign)
	changed := fmt.Sprintf(`{"reservation_id":%q,"created_at":%q,"sku":"A-1","quantity":5}`, foreign, created.Format(time.RFC3339Nano))
	for _, p := range []string{first, first, otherForm, changed} {
		testenv.Publish(t, e.Prod, e.Topic, "k", []byte(p))
	}
	testenv.Publish(t, e.Prod, rawTopic, "k", []byte(fmt.Sprintf(`{"reservation_id":%q}`, foreign)))

	testenv.Eventually(t, 60*time.Second, "4 deliveries decided and the raw topic's event dead-lettered", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return seen.Get(group, idempotency.Processed)+seen.Get(group, idempotency.Duplicate)+seen.Get(group, idempotency.PayloadMismatch) == 4 && letters[rawTopic] != ""
	})
	id := idempotency.DeriveEventID(inventoryNamespace, foreign.String(), created)
	if runs.Load() != 1 || effects(t, e.Pool, group) != 1 || seen.Get(group, idempotency.Duplicate) != 2 || seen.Get(group, idempotency.PayloadMismatch) != 1 {
		t.Fatalf("%d runs, %d effects, %d duplicates, %d mismatches; want 1, 1, 2, 1",
			runs.Load(), effects(t, e.Pool, group), seen.Get(group, idempotency.Duplicate), seen.Get(group, idempotency.PayloadMismatch))
	}
	var claimed int
	if err := e.Pool.QueryRow(context.Background(), `SELECT count(*) FROM processed_event WHERE event_id = $1 AND consumer_group = $2`, id, group).Scan(&claimed); err != nil || claimed != 1 {
		t.Fatalf("%d claims of the derived id %s (%v); want 1", claimed, id, err)
	}
	mu.Lock()
	mismatch, reason := letters[e.Topic], letters[rawTopic]
	mu.Unlock()
	if !strings.Contains(mismatch, "different payload") {
		t.Errorf("the changed payload's dead letter says %q; want a payload mismatch", mismatch)
	}
	for _, want := range []string{"rawReservation.EventID() returned " + foreign.String(), "UUID version 4", "DeriveEventID"} {
		if !strings.Contains(reason, want) {
			t.Errorf("the UUIDv4 event's dead letter says %q; want it to say %q", reason, want)
		}
	}
	if strings.Contains(reason, "event_id") || rawRuns.Load() != 0 {
		t.Errorf("the UUIDv4 event's dead letter names a payload field it does not have (%q), or its handler ran (%d)", reason, rawRuns.Load())
	}

	// The letter says the derived id, which no payload field holds, and the
	// replay window judges it by the event's time, not by the letter's.
	testenv.Eventually(t, 30*time.Second, "the mismatch's letter on its topic", func() bool { return testenv.MessageCount(t, e.Brokers, e.DLQ) == 1 })
	entries, err := dlq.List(context.Background(), dlq.ListConfig{Brokers: e.Brokers, Sarama: pipelinetest.SaramaConfig(t), DLQTopics: []string{e.DLQ}})
	if err != nil || len(entries) != 1 || entries[0].EventID != id.String() || !entries[0].EventTime.Equal(created.Truncate(time.Millisecond)) {
		t.Fatalf("the letter: %+v, %v; want event id %s from %s", entries, err, id, created.Truncate(time.Millisecond))
	}
	rep, err := dlq.Replay(context.Background(), dlq.Config{Brokers: e.Brokers, Sarama: pipelinetest.SaramaConfig(t), Topic: e.Topic, DLQTopic: e.DLQ,
		Group: uniqueGroup("replay"), MaxAge: time.Hour, DryRun: true})
	if err != nil || rep.SkippedStale != 1 || rep.Replayed != 0 {
		t.Fatalf("a replay within an hour of a two-hour-old event: %+v, %v; want it skipped as stale", rep, err)
	}
}
