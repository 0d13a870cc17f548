package shipments_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/google/uuid"

	"github.com/once-dev/once/examples/shipments"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/oncetest"
	"github.com/once-dev/once/pipeline"
	"github.com/once-dev/once/schema"
)

const createParcels = `CREATE TABLE IF NOT EXISTS parcels (shipment_id bigint PRIMARY KEY, n int NOT NULL)`

// The team's topic runs in the pipeline against real Kafka and PostgreSQL:
// every event delivered twice is counted once, and an invalid one is
// dead-lettered without stopping the partition.
func TestTheTeamsTopicRunsInThePipeline(t *testing.T) {
	ctx := context.Background()
	pool := testenv.Postgres(t)
	if _, err := schema.Migrate(ctx, pool, schema.Config{}); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, createParcels); err != nil {
		t.Fatal(err)
	}
	brokers := testenv.Brokers(t)
	topic := testenv.Topic(t, brokers, 2)
	if err := testenv.Admin(t, brokers).CreateTopic(topic+".dlq", &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1}, false); err != nil {
		t.Fatal(err)
	}
	var deadLetters atomic.Int64
	p, err := pipeline.New(pipeline.Config{Brokers: brokers, DB: pool,
		Topics: []pipeline.Binding{shipments.Topic(topic)},
		Hooks:  pipeline.Hooks{OnDeadLetter: func(pipeline.DeadLetter) { deadLetters.Add(1) }}})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- p.Run(runCtx) }()
	t.Cleanup(func() { cancel(); <-done })
	<-p.Running()

	producer := testenv.Producer(t, brokers)
	shipment := 1 + rand.Int64N(1<<62)
	for i := range 3 {
		b, _ := json.Marshal(shipments.Dispatched{ID: uuid.Must(uuid.NewV7()), Shipment: shipment, Parcels: i + 1})
		testenv.Publish(t, producer, topic, fmt.Sprint(shipment), b)
		testenv.Publish(t, producer, topic, fmt.Sprint(shipment), b) // a duplicate
	}
	testenv.Publish(t, producer, topic, fmt.Sprint(shipment), []byte(`{"event_id":"`+uuid.Must(uuid.NewV7()).String()+`","shipment_id":1,"parcels":0}`))
	var n int
	testenv.Eventually(t, 60*time.Second, "6 parcels counted once and the invalid event dead-lettered", func() bool {
		_ = pool.QueryRow(ctx, `SELECT coalesce(sum(n), 0) FROM parcels WHERE shipment_id = $1`, shipment).Scan(&n)
		return n >= 6 && deadLetters.Load() == 1
	})
	time.Sleep(500 * time.Millisecond) // a second count of a duplicate would show now
	_ = pool.QueryRow(ctx, `SELECT n FROM parcels WHERE shipment_id = $1`, shipment).Scan(&n)
	if n != 6 {
		t.Fatalf("%d parcels counted, want 1+2+3 = 6", n)
	}
}

// The handler alone, with package oncetest: one effect for two deliveries.
func TestCountOnceWithTheHarness(t *testing.T) {
	ctx := context.Background()
	pool := testenv.Postgres(t)
	if _, err := pool.Exec(ctx, createParcels); err != nil {
		t.Fatal(err)
	}
	h := oncetest.NewHandler(t, oncetest.HandlerConfig[shipments.Dispatched]{DB: pool, Handle: shipments.Count})
	ev := shipments.Dispatched{ID: uuid.Must(uuid.NewV7()), Shipment: 1 + rand.Int64N(1<<62), Parcels: 4}
	h.RequireOnce(ev)
	var n int
	if err := pool.QueryRow(ctx, `SELECT n FROM parcels WHERE shipment_id = $1`, ev.Shipment).Scan(&n); err != nil || n != 4 {
		t.Fatalf("%d parcels (%v), want 4", n, err)
	}
}
