package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/internal/pipelinetest"
	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/pipeline"
)

// reservation is an event of a team's own topic, from a producer whose ids
// are UUIDv4s: its claim's id is derived from that id and its time.
type reservation struct {
	ID        string    `json:"reservation_id"`
	CreatedAt time.Time `json:"created_at"`
	Quantity  int       `json:"quantity"`
}

func (r reservation) EventID() uuid.UUID {
	return idempotency.DeriveEventID("inventory", r.ID, r.CreatedAt)
}

func decodeReservation(b []byte) (r reservation, err error) {
	if err = json.Unmarshal(b, &r); err == nil && (r.ID == "" || r.CreatedAt.IsZero()) {
		err = errors.New("reservation_id and created_at are required")
	}
	return r, err
}

// The admin commands serve topics and groups the reference service does
// not know, run by a pipeline of a team's own against Kafka and
// PostgreSQL: dlq list reads a topic's dead-letter topic (topic + .dlq, or
// --dlq-topic) and filters by any group; dlq replay sends a topic's letters
// back to it; inbox status and forget find an event by its producer's own
// id (--id-namespace).
func TestTheAdminCommandsServeATopicTheReferenceServiceDoesNotKnow(t *testing.T) {
	brokers := testenv.Brokers(t)
	pool := reftest.Postgres(t)
	sfx := uuid.NewString()[:8]
	reservations, returns, returnsDLQ := "inventory.reservations."+sfx, "inventory.returns."+sfx, "inventory.dead."+sfx
	admin := testenv.Admin(t, brokers)
	for _, topic := range []string{reservations, reservations + ".dlq", returns, returnsDLQ} {
		if err := admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1}, false); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = admin.DeleteTopic(topic) })
	}
	group := "stock-" + sfx
	var handled, decided atomic.Int64
	handle := func(context.Context, pgx.Tx, reservation) error { handled.Add(1); return nil }
	var letters testenv.Logs // letters' topics, as the hook saw them
	pipelinetest.Run(t, pipeline.Config{Brokers: brokers, DB: pool, Logger: slog.New(slog.DiscardHandler), Topics: []pipeline.Binding{
		pipeline.Topic[reservation]{Name: reservations, Decode: decodeReservation, IDNamespace: "inventory",
			Groups: []pipeline.Group[reservation]{{Name: group, Handle: handle}}},
		pipeline.Topic[reservation]{Name: returns, DLQ: returnsDLQ, Decode: decodeReservation, IDNamespace: "inventory",
			Groups: []pipeline.Group[reservation]{{Name: group, Handle: handle}}},
	}, Hooks: pipeline.Hooks{
		OnResult: func(r idempotency.Result) {
			if r.Outcome == idempotency.Processed || r.Outcome == idempotency.Duplicate {
				decided.Add(1)
			}
		},
		OnDeadLetter: func(d pipeline.DeadLetter) { fmt.Fprintln(&letters, d.Topic) },
	}})

	foreign := uuid.NewString()
	created := time.Now().UTC().Truncate(time.Millisecond)
	first := fmt.Sprintf(`{"reservation_id":%q,"created_at":%q,"quantity":2}`, foreign, created.Format(time.RFC3339Nano))
	changed := strings.Replace(first, `"quantity":2`, `"quantity":5`, 1)
	prod := testenv.Producer(t, brokers)
	for _, p := range []string{first, first, changed} {
		testenv.Publish(t, prod, reservations, "k", []byte(p))
	}
	testenv.Publish(t, prod, returns, "k", []byte(`{"quantity":1}`))
	testenv.Eventually(t, 60*time.Second, "a letter on each dead-letter topic", func() bool {
		return testenv.MessageCount(t, brokers, reservations+".dlq") == 1 && testenv.MessageCount(t, brokers, returnsDLQ) == 1
	})
	if handled.Load() != 1 || decided.Load() != 2 {
		t.Fatalf("handled %d times, %d deliveries processed or duplicate; want 1 and 2", handled.Load(), decided.Load())
	}
	id := reservation{ID: foreign, CreatedAt: created}.EventID()
	kafka := []string{"--kafka-brokers", strings.Join(brokers, ",")}
	db := []string{"--database-url", pool.Config().ConnString()}

	out, err := runApp(t, append([]string{"dlq", "list", "--source-topic", reservations, "--source-group", group}, kafka...)...)
	if err != nil || !strings.Contains(out, "different payload") || !strings.Contains(out, reservations+".dlq/0@0") || !strings.Contains(out, "1 dead letters on the topics") {
		t.Fatalf("dlq list of %s: %v\n%s", reservations, err, out)
	}
	out, err = runApp(t, append([]string{"dlq", "list", "--source-topic", returns, "--dlq-topic", returnsDLQ, "--reason", "required"}, kafka...)...)
	if err != nil || !strings.Contains(out, returnsDLQ+"/0@0") || !strings.Contains(out, "1 dead letters on the topics") {
		t.Fatalf("dlq list of %s on --dlq-topic %s: %v\n%s", returns, returnsDLQ, err, out)
	}
	out, err = runApp(t, append([]string{"dlq", "replay", "--source-topic", reservations, "--source-group", group, "--group", "replay-" + sfx}, kafka...)...)
	if err != nil || !strings.Contains(out, "replayed 1 dead letters") || !strings.Contains(out, reservations) {
		t.Fatalf("dlq replay of %s: %v\n%s", reservations, err, out)
	}
	// Back on its topic, the changed payload is a mismatch again: a second letter.
	testenv.Eventually(t, 60*time.Second, "the replayed letter on its topic, and dead-lettered again", func() bool {
		return testenv.MessageCount(t, brokers, reservations) == 4 && testenv.MessageCount(t, brokers, reservations+".dlq") == 2
	})

	out, err = runApp(t, append([]string{"inbox", "status", foreign, "--id-namespace", "inventory"}, db...)...)
	if err != nil || !strings.Contains(out, id.String()) || !strings.Contains(out, group) {
		t.Fatalf("inbox status of the producer's id: %v\n%s", err, out)
	}
	if out, err := runApp(t, append([]string{"inbox", "status", foreign}, db...)...); err == nil || !strings.Contains(out+err.Error(), "--id-namespace") {
		t.Fatalf("inbox status of a UUIDv4 without --id-namespace: %v\n%s; want it refused, naming --id-namespace", err, out)
	}
	out, err = runApp(t, append([]string{"inbox", "forget", foreign, "--id-namespace", "inventory", "--group", group}, db...)...)
	if err != nil || !strings.Contains(out, "forgot the claim of "+id.String()) {
		t.Fatalf("inbox forget by the producer's id: %v\n%s", err, out)
	}
	out, err = runApp(t, append([]string{"inbox", "status", id.String()}, db...)...)
	if err != nil || !strings.Contains(out, "not processed") {
		t.Fatalf("inbox status after forgetting: %v\n%s", err, out)
	}
	if letters.String() != reservations+"\n"+returns+"\n"+reservations+"\n" && letters.String() != returns+"\n"+reservations+"\n"+reservations+"\n" {
		t.Fatalf("dead letters of %q; want the mismatch and the undecodable event, then the replayed mismatch", letters.String())
	}
}

// Two events derived from one producer id (re-sent with another time) in
// one group: forget by the producer's id names both and forgets neither.
func TestForgetByAProducersIDThatNamesTwoEventsIsRefused(t *testing.T) {
	pool := reftest.Postgres(t)
	foreign, group := uuid.NewString(), "stock-"+uuid.NewString()[:8]
	t0 := time.Now().Add(-time.Hour)
	ids := []uuid.UUID{idempotency.DeriveEventID("inventory", foreign, t0), idempotency.DeriveEventID("inventory", foreign, t0.Add(time.Minute))}
	for _, id := range ids {
		if _, err := pool.Exec(context.Background(), `INSERT INTO processed_event (event_id, consumer_group, payload_sha256) VALUES ($1, $2, '\xabcd')`, id, group); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), `DELETE FROM processed_event WHERE consumer_group = $1`, group)
	})
	out, err := runApp(t, "inbox", "forget", foreign, "--id-namespace", "inventory", "--group", group, "--database-url", pool.Config().ConnString())
	if err == nil || !strings.Contains(err.Error(), ids[0].String()) || !strings.Contains(err.Error(), ids[1].String()) {
		t.Fatalf("forget by a producer's id of two events: %v\n%s; want it refused, naming both", err, out)
	}
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM processed_event WHERE consumer_group = $1`, group).Scan(&n); err != nil || n != 2 {
		t.Fatalf("%d claims left (%v); want both", n, err)
	}
}
