// Package pipelinetest runs a pipeline for the length of a test and counts
// what its hooks report: what the library's tests and the reference
// service's share.
package pipelinetest

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/pipeline"
)

// SaramaConfig is the pipeline's own producer configuration at its default
// Kafka version: what the library's dead letters and outbox are sent with.
func SaramaConfig(t testing.TB) *sarama.Config {
	t.Helper()
	v, err := pipeline.ParseKafkaVersion(pipeline.DefaultKafkaVersion)
	if err != nil {
		t.Fatal(err)
	}
	return pipeline.PublisherSaramaConfig(v)
}

// Run starts a pipeline of cfg and returns a function that stops it and
// waits (the test's end stops it too); Run's error fails the test. A
// pipeline that does not start within 30s fails the test.
func Run(t testing.TB, cfg pipeline.Config) (stop func()) {
	t.Helper()
	p, err := pipeline.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stopped := Start(t, p)
	var once sync.Once
	stop = func() {
		once.Do(func() {
			if err := stopped(); err != nil {
				t.Errorf("pipeline: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// Start runs p until the test ends or stop is called, which returns Run's
// error (the same on every call).
func Start(t testing.TB, p *pipeline.Pipeline) (stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	select {
	case <-p.Running():
	case err := <-done:
		cancel()
		t.Fatalf("pipeline stopped at start: %v", err)
	case <-time.After(30 * time.Second):
		cancel()
		t.Fatal("pipeline did not start in 30s")
	}
	var once sync.Once
	var runErr error
	stop = func() error {
		once.Do(func() { cancel(); runErr = <-done })
		return runErr
	}
	t.Cleanup(func() { _ = stop() })
	return stop
}

// UniqueGroup is a consumer group name no other test uses.
func UniqueGroup(name string) string { return name + "-" + uuid.NewString()[:8] }

// Outcomes counts the claims' results per group and outcome; Record is a
// [pipeline.Hooks] OnResult.
type Outcomes struct {
	mu sync.Mutex
	n  map[string]map[idempotency.Outcome]int
}

func (o *Outcomes) Record(r idempotency.Result) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.n == nil {
		o.n = map[string]map[idempotency.Outcome]int{}
	}
	if o.n[r.ConsumerGroup] == nil {
		o.n[r.ConsumerGroup] = map[idempotency.Outcome]int{}
	}
	o.n[r.ConsumerGroup][r.Outcome]++
}

// Get is how many results of group had outcome.
func (o *Outcomes) Get(group string, outcome idempotency.Outcome) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.n[group][outcome]
}

// Env is what a pipeline test runs on: a database pool, the brokers, a
// topic of its own and a dead-letter topic, and a producer.
type Env struct {
	Pool    *pgxpool.Pool
	Brokers []string
	Topic   string
	DLQ     string
	Prod    sarama.SyncProducer
}

// NewEnv makes the topics (the first with partitions) and the producer,
// on pool.
func NewEnv(t testing.TB, pool *pgxpool.Pool, partitions int32) *Env {
	t.Helper()
	brokers := testenv.Brokers(t)
	return &Env{Pool: pool, Brokers: brokers, Topic: testenv.Topic(t, brokers, partitions), DLQ: testenv.Topic(t, brokers, 1), Prod: testenv.Producer(t, brokers)}
}
