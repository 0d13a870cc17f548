package metrics_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/metrics"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/pipeline"
	"github.com/once-dev/once/schema"
)

type tick struct {
	ID uuid.UUID `json:"event_id"`
}

func (e tick) EventID() uuid.UUID { return e.ID }

func decodeTick(b []byte) (tick, error) {
	var e tick
	if err := json.Unmarshal(b, &e); err != nil {
		return tick{}, fmt.Errorf("tick: %w", err)
	}
	return e, nil
}

// value is the sum of a family's series whose labels include want; for a
// histogram, its count.
func value(t *testing.T, reg *prometheus.Registry, name string, want map[string]string) (float64, bool) {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	found := false
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
	series:
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			for k, v := range want {
				if labels[k] != v {
					continue series
				}
			}
			found = true
			switch f.GetType() {
			case dto.MetricType_COUNTER:
				sum += m.GetCounter().GetValue()
			case dto.MetricType_GAUGE:
				sum += m.GetGauge().GetValue()
			case dto.MetricType_HISTOGRAM:
				sum += float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return sum, found
}

// A pipeline with a per-event group and a batched group on one topic, fed a
// duplicate, a poison message and an event whose first attempt fails:
// every outcome is counted where it happened, the claim's phases and the
// batches are timed, and the watcher reads the lag from Kafka, the groups'
// membership and the claim table.
func TestAPipelinesOutcomesReachPrometheus(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool := testenv.Postgres(t)
	names := schema.Config{Schema: "metrics_test_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")}
	if _, err := schema.Migrate(ctx, pool, names); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA "+names.Schema+" CASCADE") })
	brokers := testenv.Brokers(t)
	topic := testenv.Topic(t, brokers, 2)
	dlqTopic := testenv.Topic(t, brokers, 1)
	single, batched := "single-"+names.Schema, "batched-"+names.Schema

	flaky := uuid.Must(uuid.NewV7())
	var flakyFailures atomic.Int32
	cfg := pipeline.Config{
		Brokers: brokers, DB: pool, Tables: names, HoldBackoff: 50 * time.Millisecond, HoldMaxBackoff: 100 * time.Millisecond,
		Topics: []pipeline.Binding{pipeline.Topic[tick]{Name: topic, DLQ: dlqTopic, Decode: decodeTick, Groups: []pipeline.Group[tick]{
			{Name: single, Handle: func(ctx context.Context, _ pgx.Tx, e tick) error {
				if e.ID == flaky && flakyFailures.Add(1) == 1 {
					// The provider charged, then the record failed: the
					// next attempt runs the handler again after the effect.
					idempotency.MarkExternalEffect(ctx, "charged (staged)")
					return errors.New("the database went away (staged)")
				}
				return nil
			}},
			{Name: batched, HandleBatch: func(context.Context, pgx.Tx, []tick) error { return nil }, Batch: pipeline.Batch{Size: 10}},
		}}},
	}
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	m.Attach(&cfg)
	p, err := pipeline.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- p.Run(runCtx) }()
	defer func() { stop(); <-done }()
	go m.Watch(runCtx, p, metrics.Stores{{DB: pool, Tables: names}}, 200*time.Millisecond)

	producer := testenv.Producer(t, brokers)
	const events = 30
	for i := range events {
		id := uuid.Must(uuid.NewV7())
		if i == 7 {
			id = flaky
		}
		payload := fmt.Sprintf(`{"event_id":%q}`, id)
		testenv.Publish(t, producer, topic, fmt.Sprint(i), []byte(payload))
		if i == 3 {
			testenv.Publish(t, producer, topic, fmt.Sprint(i), []byte(payload)) // a duplicate
		}
	}
	testenv.Publish(t, producer, topic, "poison", []byte(`{"event_id":`))

	count := func(group, outcome string) float64 {
		v, _ := value(t, reg, "once_messages_total", map[string]string{"group": group, "outcome": outcome})
		return v
	}
	testenv.Eventually(t, time.Minute, "every event processed by both groups", func() bool {
		return count(single, "processed") == events && count(batched, "processed") == events &&
			count(single, "dead_lettered") == 1 && count(batched, "dead_lettered") == 1
	})
	if flakyFailures.Load() < 2 {
		t.Fatalf("the staged failure did not happen (%d calls)", flakyFailures.Load())
	}
	for _, c := range []struct {
		group, outcome string
		want           float64
	}{{single, "duplicate", 1}, {batched, "duplicate", 1}, {single, "held", 1}, {batched, "held", 0}} {
		if got := count(c.group, c.outcome); got != c.want {
			t.Errorf("%s %s: %v, want %v", c.group, c.outcome, got, c.want)
		}
	}
	if n, _ := value(t, reg, "once_attempts_after_effect_total", map[string]string{"group": single, "topic": topic}); n != 1 {
		t.Errorf("once_attempts_after_effect_total{group=%s}: %v; want the flaky event's second attempt, 1", single, n)
	}
	if n, _ := value(t, reg, "once_attempts_after_effect_total", map[string]string{"group": batched}); n != 0 {
		t.Errorf("once_attempts_after_effect_total{group=%s}: %v; want 0", batched, n)
	}
	for _, name := range []string{"once_claim_seconds", "once_handler_seconds", "once_commit_seconds"} {
		for _, g := range []string{single, batched} {
			if n, _ := value(t, reg, name, map[string]string{"group": g, "topic": topic}); n == 0 {
				t.Errorf("%s{group=%s}: no observation", name, g)
			}
		}
	}
	if n, _ := value(t, reg, "once_batch_size", map[string]string{"group": batched}); n == 0 {
		t.Error("once_batch_size: no batch observed")
	}
	if _, ok := value(t, reg, "once_batch_size", map[string]string{"group": single}); ok {
		t.Error("once_batch_size observed for a per-event group")
	}
	testenv.Eventually(t, 30*time.Second, "the watcher's gauges", func() bool {
		joined, _ := value(t, reg, "once_group_joined", map[string]string{"topic": topic})
		owned, _ := value(t, reg, "once_group_partitions", map[string]string{"topic": topic})
		_, lagSeen := value(t, reg, "once_consumer_lag", map[string]string{"group": single, "partition": "1"})
		lag, _ := value(t, reg, "once_consumer_lag", map[string]string{"topic": topic})
		parts, _ := value(t, reg, "once_claim_partitions", nil)
		age, _ := value(t, reg, "once_oldest_claim_age_seconds", nil)
		return joined == 2 && owned == 4 && lagSeen && lag == 0 && parts >= 1 && age > 0
	})
	if n, _ := value(t, reg, "once_watermill_handler_execution_time_seconds", nil); n == 0 {
		t.Error("Watermill's router metrics recorded nothing")
	}
	status := p.Status()
	if len(status) != 2 || !status[0].Joined || status[0].Held != 0 {
		t.Errorf("status %+v; want two joined groups, nothing held", status)
	}
}
