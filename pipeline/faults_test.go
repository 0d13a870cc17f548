package pipeline_test

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/internal/pipelinetest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/pipeline"
)

// logCounter counts log lines that contain a text, on top of a quiet logger.
type logCounter struct {
	slog.Handler
	text string
	n    *atomic.Int64
}

func (c logCounter) Handle(ctx context.Context, r slog.Record) error {
	line := r.Message
	r.Attrs(func(a slog.Attr) bool {
		line += " " + a.String()
		return true
	})
	if strings.Contains(line, c.text) {
		c.n.Add(1)
	}
	return c.Handler.Handle(ctx, r)
}

func (c logCounter) Enabled(context.Context, slog.Level) bool { return true }

func countingLogger(text string) (*slog.Logger, *atomic.Int64) {
	n := new(atomic.Int64)
	return slog.New(logCounter{Handler: quietLogger().Handler(), text: text, n: n}), n
}

// A panic in a batch handler rolls its batch back and the events run on
// their own, where the same panic holds the one event that causes it: the
// others are processed and the process lives (review finding: the batcher's
// goroutine had no recover, and the panic ended the process at every start).
func TestAPanicInABatchHandlerHoldsItsEventAndNothingElse(t *testing.T) {
	e := newEnv(t, 1)
	bad := validEvent(t, "66.60")
	var panics atomic.Int64
	var healed atomic.Bool
	r := &recorder{group: uniqueGroup("batch-panic")}
	g := pipeline.Group[confirmed]{Name: r.group, Batch: pipeline.Batch{Size: 20, MaxWait: 20 * time.Millisecond},
		HandleBatch: func(ctx context.Context, tx pgx.Tx, evs []confirmed) error {
			for _, ev := range evs {
				if ev.EventID() == bad.EventID() && !healed.Load() {
					panics.Add(1)
					panic("a bug in the batch handler")
				}
			}
			return r.HandleBatch(ctx, tx, evs)
		}}
	cfg := e.config(g)
	cfg.HoldBackoff, cfg.HoldMaxBackoff = 20*time.Millisecond, 100*time.Millisecond
	p, err := pipeline.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	startPipeline(t, p)
	for i := range 10 {
		ev := validEvent(t, "1.00")
		if i == 5 {
			ev = bad
		}
		testenv.Publish(t, e.Prod, e.Topic, "k", payload(t, ev))
	}
	testenv.Eventually(t, 30*time.Second, "the event that panics held", func() bool {
		for _, s := range p.Status() {
			if s.Held > 0 {
				return true
			}
		}
		return false
	})
	if panics.Load() < 2 || effects(t, e.Pool, r.group) != 5 {
		t.Fatalf("%d panics, %d effects; want the batch's panic and the event's own, and the 5 events before it processed",
			panics.Load(), effects(t, e.Pool, r.group))
	}
	healed.Store(true)
	testenv.Eventually(t, 30*time.Second, "all ten processed once the bug is gone", func() bool { return effects(t, e.Pool, r.group) == 10 })
}

// A partition whose consumer stops inside the session (its offset out of
// range: the log was truncated under it) rejoins the group at once instead
// of stalling until an unrelated rebalance (review finding: ConsumeClaim
// waited for the acker, which waited for the session, which waited for
// ConsumeClaim).
func TestAPartitionWhoseLogWasTruncatedUnderItGoesOn(t *testing.T) {
	e := newEnv(t, 1)
	// sarama reports the broker's answer to the fetch: the fault happened.
	logger, outOfRange := countingLogger("outside the range of offsets")
	gate := make(chan struct{})
	var first sync.Once
	r := &recorder{group: uniqueGroup("truncated"), fail: func(confirmed) error {
		first.Do(func() { <-gate }) // the consumer's fetches stop while its buffer is full
		return nil
	}}
	cfg := e.config(group(r))
	cfg.Logger = logger
	run(t, cfg)
	// Events of 5 KiB: a fetch takes about 1 MiB, so the consumer's fetch
	// position stays far behind the end while the first event waits.
	pad := strings.Repeat("x", 5<<10)
	var msgs []*sarama.ProducerMessage
	for range 1500 {
		b := payload(t, validEvent(t, "1.00"))
		b = append(b[:len(b)-1], []byte(`,"pad":"`+pad+`"}`)...)
		msgs = append(msgs, &sarama.ProducerMessage{Topic: e.Topic, Key: sarama.StringEncoder("k"), Value: sarama.ByteEncoder(b)})
	}
	producer := bigProducer(t, e.Brokers)
	if err := producer.SendMessages(msgs); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "the first event at work", func() bool { return r.runs.Load() == 1 })
	time.Sleep(2 * time.Second) // the consumer fetches until its buffers are full
	admin := testenv.Admin(t, e.Brokers)
	if err := admin.DeleteRecords(e.Topic, map[int32]int64{0: 1500}); err != nil {
		t.Fatal(err)
	}
	close(gate)
	testenv.Eventually(t, 30*time.Second, "the consumer's offset out of range", func() bool { return outOfRange.Load() > 0 })
	after := validEvent(t, "2.00")
	testenv.Publish(t, e.Prod, e.Topic, "k", payload(t, after))
	testenv.Eventually(t, 30*time.Second, "an event published after the truncation processed", func() bool {
		var n int
		_ = e.Pool.QueryRow(context.Background(), `SELECT count(*) FROM pipeline_test_effect WHERE consumer_group = $1 AND event_id = $2`,
			r.group, after.EventID()).Scan(&n)
		return n == 1
	})
}

func bigProducer(t *testing.T, brokers []string) sarama.SyncProducer {
	t.Helper()
	c := sarama.NewConfig()
	c.Version = sarama.V4_3_1_0
	c.Producer.Return.Successes = true
	p, err := sarama.NewSyncProducer(brokers, c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// A group name that two topics share is one member of its Kafka group, in
// one session for both topics: two members would rebalance each other at
// every start (review finding).
func TestAGroupOnTwoTopicsIsOneMember(t *testing.T) {
	e := newEnv(t, 2)
	second := testenv.Topic(t, e.Brokers, 2)
	r := &recorder{group: uniqueGroup("two-topics")}
	cfg := e.config(group(r))
	cfg.Topics = append(cfg.Topics, pipeline.Topic[confirmed]{Name: second, DLQ: e.DLQ, Decode: decodeConfirmed,
		Groups: []pipeline.Group[confirmed]{group(r)}})
	p, err := pipeline.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	startPipeline(t, p)
	for _, topic := range []string{e.Topic, second} {
		testenv.Publish(t, e.Prod, topic, "k", payload(t, validEvent(t, "1.00")))
	}
	testenv.Eventually(t, 30*time.Second, "an event of each topic processed", func() bool { return effects(t, e.Pool, r.group) == 2 })
	admin := testenv.Admin(t, e.Brokers)
	groups, err := admin.DescribeConsumerGroups([]string{r.group})
	if err != nil || len(groups) != 1 {
		t.Fatalf("describe %s: %v", r.group, err)
	}
	if n := len(groups[0].Members); n != 1 {
		t.Fatalf("consumer group %s has %d members in this one process; want 1", r.group, n)
	}
	for _, s := range p.Status() {
		if len(s.Partitions) != 2 {
			t.Errorf("%s/%s owns partitions %v; want both of its topic's", s.Topic, s.Group, s.Partitions)
		}
	}
}

// After an offset reset a group reads its poison again: each was
// dead-lettered once, and is not dead-lettered twice (review finding: the
// dead-letter topic doubled after a reset to the earliest offsets).
func TestAnOffsetResetDoesNotDeadLetterTwice(t *testing.T) {
	eachMode(t, testResetDoesNotDeadLetterTwice)
}

func testResetDoesNotDeadLetterTwice(t *testing.T, m handlerMode) {
	e := newEnv(t, 1)
	r := &recorder{group: uniqueGroup("reset")}
	reused := validEvent(t, "3.00")
	other, err := newConfirmed(reused.EventID(), reused.OccurredAt(), reused.OrderID(), reused.CustomerID(), decimal.RequireFromString("4.00"))
	if err != nil {
		t.Fatal(err)
	}
	var deadLetters atomic.Int64
	cfg := e.config(m.group(r))
	cfg.Hooks.OnDeadLetter = func(pipeline.DeadLetter) { deadLetters.Add(1) }
	stop := run(t, cfg)
	testenv.Publish(t, e.Prod, e.Topic, "k", []byte(`{"not": "an event"}`))
	testenv.Publish(t, e.Prod, e.Topic, "k", payload(t, reused))
	testenv.Publish(t, e.Prod, e.Topic, "k", payload(t, other)) // the id reused with other values
	testenv.Publish(t, e.Prod, e.Topic, "k", payload(t, validEvent(t, "5.00")))
	testenv.Eventually(t, 30*time.Second, "two dead letters and two events", func() bool {
		return deadLetters.Load() == 2 && effects(t, e.Pool, r.group) == 2
	})
	testenv.Eventually(t, 30*time.Second, "both letters on the dead-letter topic", func() bool { return testenv.MessageCount(t, e.Brokers, e.DLQ) == 2 })
	stop()

	admin := testenv.Admin(t, e.Brokers)
	if err := admin.DeleteConsumerGroupOffset(r.group, e.Topic, 0); err != nil {
		t.Fatal(err)
	}
	var seen pipelinetest.Outcomes
	cfg.Hooks.OnResult = seen.Record
	run(t, cfg)
	testenv.Eventually(t, 30*time.Second, "the partition read again from its start", func() bool {
		return seen.Get(r.group, idempotency.Duplicate) == 2 && seen.Get(r.group, idempotency.PayloadMismatch) == 1
	})
	time.Sleep(time.Second) // a second letter would be on its way
	if n := testenv.MessageCount(t, e.Brokers, e.DLQ); n != 2 || deadLetters.Load() != 2 {
		t.Fatalf("after the reset: %d letters on the topic, %d dead-lettered; want 2 and 2", n, deadLetters.Load())
	}
}

// A re-published event in another byte form is a duplicate: members in
// another order, the time in another zone, the amount as a number or a
// string of another scale. Only other values under the id are a mismatch.
func TestARepublishedEventInAnotherByteFormIsADuplicate(t *testing.T) {
	eachMode(t, testRepublishedInAnotherForm)
}

// shipment is an event type of a team's own, decoded by encoding/json: its
// time keeps the offset it came with, and its amount is a decimal.
type shipment struct {
	ID      uuid.UUID       `json:"event_id"`
	At      time.Time       `json:"occurred_at"`
	Weight  decimal.Decimal `json:"weight_kg"`
	Parcels []int           `json:"parcels"`
}

func (s shipment) EventID() uuid.UUID { return s.ID }

func decodeShipment(b []byte) (shipment, error) {
	var s shipment
	if err := jsonUnmarshalStrict(b, &s); err != nil {
		return s, err
	}
	if s.ID.Version() != 7 {
		return s, errors.New("event_id: want a UUIDv7")
	}
	return s, nil
}

func testRepublishedInAnotherForm(t *testing.T, m handlerMode) {
	e := newEnv(t, 1)
	var runs atomic.Int64
	group := uniqueGroup("republished")
	handle := func(ctx context.Context, tx pgx.Tx, evs []shipment) error {
		for _, ev := range evs {
			runs.Add(1)
			if _, err := tx.Exec(ctx, `INSERT INTO pipeline_test_effect (event_id, consumer_group) VALUES ($1, $2)`, ev.ID, group); err != nil {
				return err
			}
		}
		return nil
	}
	g := pipeline.Group[shipment]{Name: group, Handle: func(ctx context.Context, tx pgx.Tx, ev shipment) error { return handle(ctx, tx, []shipment{ev}) }}
	if m.batched {
		g = pipeline.Group[shipment]{Name: group, HandleBatch: handle, Batch: pipeline.Batch{Size: 10}}
	}
	var seen pipelinetest.Outcomes
	cfg := e.config()
	cfg.Topics = []pipeline.Binding{pipeline.Topic[shipment]{Name: e.Topic, DLQ: e.DLQ, Decode: decodeShipment, Groups: []pipeline.Group[shipment]{g}}}
	cfg.Hooks.OnResult = seen.Record
	run(t, cfg)
	id := uuid.Must(uuid.NewV7())
	for _, form := range []string{
		`{"event_id":"%s","occurred_at":"2026-12-02T15:08:21.123456Z","weight_kg":"12.50","parcels":[1,2]}`,
		`{"parcels":[1,2],"weight_kg":12.5,"occurred_at":"2026-12-02T15:08:21.123456+00:00","event_id":"%s"}`,
		`{"occurred_at":"2026-12-02T17:08:21.123456+02:00","event_id":"%s","weight_kg":1.25e1,"parcels":[1,2],"extra":"ignored"}`,
		`{"event_id":"%s","occurred_at":"2026-12-02T15:08:21.123456Z","weight_kg":"12.51","parcels":[1,2]}`,
	} {
		testenv.Publish(t, e.Prod, e.Topic, "k", []byte(fmt.Sprintf(form, id)))
	}
	testenv.Eventually(t, 30*time.Second, "four deliveries decided", func() bool {
		return seen.Get(group, idempotency.Processed)+seen.Get(group, idempotency.Duplicate)+seen.Get(group, idempotency.PayloadMismatch) == 4
	})
	if seen.Get(group, idempotency.Processed) != 1 || seen.Get(group, idempotency.Duplicate) != 2 || seen.Get(group, idempotency.PayloadMismatch) != 1 || runs.Load() != 1 {
		t.Fatalf("processed %d, duplicates %d, mismatches %d, runs %d; want 1, 2, 1, 1", seen.Get(group, idempotency.Processed),
			seen.Get(group, idempotency.Duplicate), seen.Get(group, idempotency.PayloadMismatch), runs.Load())
	}
}

// jsonUnmarshalStrict is encoding/json as the guide's models read: unknown
// fields ignored, the value one object.
func jsonUnmarshalStrict(b []byte, v any) error { return json.Unmarshal(b, v) }

// opaque keeps its values in unexported fields behind getters, as a team's
// event type may: encoding/json sees none of them.
type opaque struct {
	id     uuid.UUID
	amount string
}

func (o opaque) EventID() uuid.UUID { return o.id }

func decodeOpaque(b []byte) (opaque, error) {
	var w struct {
		ID     uuid.UUID `json:"event_id"`
		Amount string    `json:"amount"`
	}
	err := json.Unmarshal(b, &w)
	return opaque{id: w.ID, amount: w.Amount}, err
}

// A reused id with other values is a mismatch for an event type whose values
// encoding/json cannot see (review finding: every such event fingerprinted
// as {}, and a reused id passed for a duplicate); and a claim stored before
// fingerprints (the payload's bytes hashed, no values) still makes the same
// bytes a duplicate.
func TestAReusedIDIsAMismatchWhateverTheEventType(t *testing.T) {
	e := newEnv(t, 1)
	group := uniqueGroup("opaque")
	var runs atomic.Int64
	var seen pipelinetest.Outcomes
	cfg := e.config()
	cfg.Hooks.OnResult = seen.Record
	cfg.Topics = []pipeline.Binding{pipeline.Topic[opaque]{Name: e.Topic, DLQ: e.DLQ, Decode: decodeOpaque, Groups: []pipeline.Group[opaque]{
		{Name: group, Handle: func(context.Context, pgx.Tx, opaque) error { runs.Add(1); return nil }}}}}
	legacy := uuid.Must(uuid.NewV7())
	legacyBytes := []byte(`{"event_id":"` + legacy.String() + `","amount":"1.00"}`)
	raw := sha256.Sum256(legacyBytes)
	if _, err := e.Pool.Exec(context.Background(), `INSERT INTO processed_event (event_id, consumer_group, payload_sha256) VALUES ($1, $2, $3)`,
		legacy, group, raw[:]); err != nil {
		t.Fatal(err)
	}
	run(t, cfg)
	id := uuid.Must(uuid.NewV7())
	testenv.Publish(t, e.Prod, e.Topic, "k", []byte(`{"event_id":"`+id.String()+`","amount":"10.00"}`))
	testenv.Publish(t, e.Prod, e.Topic, "k", []byte(`{"amount":"10.00", "event_id":"`+id.String()+`"}`))
	testenv.Publish(t, e.Prod, e.Topic, "k", []byte(`{"event_id":"`+id.String()+`","amount":"99.00"}`))
	testenv.Publish(t, e.Prod, e.Topic, "k", legacyBytes)
	testenv.Eventually(t, 30*time.Second, "four deliveries decided", func() bool {
		return seen.Get(group, idempotency.Processed)+seen.Get(group, idempotency.Duplicate)+seen.Get(group, idempotency.PayloadMismatch) == 4
	})
	if seen.Get(group, idempotency.Processed) != 1 || seen.Get(group, idempotency.Duplicate) != 2 || seen.Get(group, idempotency.PayloadMismatch) != 1 {
		t.Fatalf("processed %d, duplicates %d, mismatches %d; want 1, 2 (the other member order, the legacy claim's bytes), 1",
			seen.Get(group, idempotency.Processed), seen.Get(group, idempotency.Duplicate), seen.Get(group, idempotency.PayloadMismatch))
	}
}

// A stop while the broker neither answers nor fails (paused: a hung broker,
// a partition) and a dead letter is on its way to it ends the pipeline
// within a bound, instead of waiting out every retry of the letter's send
// (review finding: minutes). The letter stays parked.
func TestAStopWhileTheBrokerIsSilentIsBounded(t *testing.T) {
	testenv.RequireDevService(t, "kafka")
	e := newEnv(t, 1)
	r := &recorder{group: uniqueGroup("silent-broker")}
	cfg := e.config(group(r))
	cfg.CloseTimeout = 5 * time.Second
	p, err := pipeline.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	testenv.Publish(t, e.Prod, e.Topic, "k", payload(t, validEvent(t, "1.00")))
	testenv.Eventually(t, 30*time.Second, "the group at work", func() bool { return effects(t, e.Pool, r.group) == 1 })

	testenv.DevService(t, "kafka", "pause")
	resumed := false
	resume := func() {
		if !resumed {
			resumed = true
			testenv.DevService(t, "kafka", "resume")
			testenv.WaitForKafka(t, e.Brokers, time.Minute)
		}
	}
	t.Cleanup(resume)
	var id int64
	if err := e.Pool.QueryRow(context.Background(), `INSERT INTO once_dead_letter (topic, payload, headers) VALUES ($1, 'x', '[]') RETURNING id`, e.DLQ).Scan(&id); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = e.Pool.Exec(context.Background(), `DELETE FROM once_dead_letter WHERE id = $1`, id) })
	testenv.Eventually(t, 30*time.Second, "the drainer sending the letter to the silent broker", func() bool {
		var attempts int
		_ = e.Pool.QueryRow(context.Background(), `SELECT attempts FROM once_dead_letter WHERE id = $1`, id).Scan(&attempts)
		return attempts > 0
	})
	stopped := time.Now()
	cancel()
	select {
	case <-done:
	case <-time.After(45 * time.Second):
		resume()
		t.Fatal("the pipeline did not stop within 45s of its stop while the broker was silent")
	}
	took := time.Since(stopped)
	t.Logf("stopped %s after the stop, the broker silent", took.Round(time.Millisecond))
	resume()
	var parked int
	if err := e.Pool.QueryRow(context.Background(), `SELECT count(*) FROM once_dead_letter WHERE id = $1`, id).Scan(&parked); err != nil || parked != 1 {
		t.Fatalf("the letter is gone (%v): a send abandoned at the stop must leave it parked", err)
	}
}

// Issue 31, item 5g: a stop while the broker was silent waited the whole
// drain saying nothing. It now says, within a second, what it waits for on
// Kafka and the drain timeout that bounds it.
func TestAStopWaitingOnASilentBrokerSaysSo(t *testing.T) {
	testenv.RequireDevService(t, "kafka")
	e := newEnv(t, 1)
	r := &recorder{group: uniqueGroup("silent-stop")}
	cfg := e.config(group(r))
	cfg.CloseTimeout = 5 * time.Second
	var logged testenv.Logs
	cfg.Logger = slog.New(slog.NewJSONHandler(&logged, nil))
	p, err := pipeline.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	testenv.Publish(t, e.Prod, e.Topic, "k", payload(t, validEvent(t, "1.00")))
	testenv.Eventually(t, 30*time.Second, "the group at work", func() bool { return effects(t, e.Pool, r.group) == 1 })

	testenv.DevService(t, "kafka", "pause")
	resumed := false
	resume := func() {
		if !resumed {
			resumed = true
			testenv.DevService(t, "kafka", "resume")
			testenv.WaitForKafka(t, e.Brokers, time.Minute)
		}
	}
	t.Cleanup(resume)
	stopped := time.Now()
	cancel()
	testenv.Eventually(t, 4*time.Second, "a line saying the stop waits on Kafka", func() bool {
		return strings.Contains(logged.String(), "waiting up to 5s for Kafka")
	})
	said := time.Since(stopped)
	select {
	case <-done:
	case <-time.After(45 * time.Second):
		resume()
		t.Fatal("the pipeline did not stop within 45s of its stop while the broker was silent")
	}
	resume()
	if said > 3*time.Second {
		t.Errorf("the stop said it waits on Kafka %s after it began; want within a second or two", said)
	}
	var line map[string]any
	for _, l := range strings.Split(logged.String(), "\n") {
		if strings.Contains(l, "waiting up to") {
			_ = json.Unmarshal([]byte(l), &line)
		}
	}
	if line["consumer_group"] != r.group || line["drain_timeout"] == nil || !strings.Contains(fmt.Sprint(line["msg"]), "--drain-timeout") {
		t.Errorf("the line names no group, drain timeout or setting: %v", line)
	}
}
