package pipeline_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/internal/pipelinetest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/pipeline"
)

// BenchmarkCommitModes compares the two offset commit modes end to end, side
// by side in one run: b.N events (use -benchtime=3000x) on 6 partitions are
// published first, then consumed through the whole middleware chain with a
// handler that only claims. The clock runs from the first processed event to
// the last, so the consumer group's join is not counted.
//
//	go test -run '^$' -bench CommitModes -benchtime 3000x ./pipeline
func BenchmarkCommitModes(b *testing.B) {
	for _, mode := range []pipeline.CommitMode{pipeline.CommitInterval, pipeline.CommitSync} {
		b.Run(string(mode), func(b *testing.B) {
			e := newBenchEnv(b)
			msgs := make([]*sarama.ProducerMessage, b.N)
			for i := range msgs {
				ev := validEvent(b, "1.00")
				p, _ := ev.MarshalJSON()
				msgs[i] = &sarama.ProducerMessage{Topic: e.Topic, Key: sarama.StringEncoder(fmt.Sprint(ev.OrderID())), Value: sarama.ByteEncoder(p)}
			}
			for i := 0; i < len(msgs); i += 500 {
				if err := e.Prod.SendMessages(msgs[i:min(i+500, len(msgs))]); err != nil {
					b.Fatal(err)
				}
			}
			var mu sync.Mutex
			var first, last time.Time
			processed := 0
			all := make(chan struct{})
			cfg := e.config(pipeline.Group[confirmed]{Name: uniqueGroup("bench"), Handle: func(context.Context, pgx.Tx, confirmed) error { return nil }})
			cfg.CommitMode = mode
			cfg.Hooks.OnResult = func(r idempotency.Result) {
				mu.Lock()
				defer mu.Unlock()
				now := time.Now()
				if processed == 0 {
					first = now
				}
				processed++
				last = now
				if processed == b.N {
					close(all)
				}
			}
			b.ResetTimer()
			stop := run(b, cfg)
			select {
			case <-all:
			case <-time.After(10 * time.Minute):
				b.Fatalf("processed %d of %d", processed, b.N)
			}
			b.StopTimer()
			stop()
			elapsed := last.Sub(first)
			b.ReportMetric(float64(b.N-1)/elapsed.Seconds(), "events/s")
			b.ReportMetric(float64(elapsed.Nanoseconds())/float64(b.N), "ns/event")
		})
	}
}

func newBenchEnv(b *testing.B) *env {
	b.Helper()
	return &env{pipelinetest.NewEnv(b, testenv.Postgres(b), 6)}
}
