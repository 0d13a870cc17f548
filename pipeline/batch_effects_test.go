package pipeline_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/pipeline"
)

// Issue 28, item 1, against Kafka and PostgreSQL, on the direct path and
// through the router: a batch that charged for one event and then failed
// on another event's own verdict holds the charged event only. The declined
// event is dead-lettered, the charged one is processed once its record
// commits, and the partition goes on behind them in order. On main the
// batch's mark was copied onto every event, and the declined one was held
// for ever with its partition behind it.
func TestABatchsEffectHoldsOnlyTheEventThatCausedIt(t *testing.T) {
	for _, through := range []bool{false, true} {
		t.Run(map[bool]string{false: "direct", true: "through the router"}[through], func(t *testing.T) {
			e := newEnv(t, 1)
			r := &recorder{group: uniqueGroup("batch-effect")}
			var o inOrder
			var charged, declined atomic.Value
			var charges, refusals atomic.Int64
			g := pipeline.Group[confirmed]{Name: r.group, Batch: pipeline.Batch{Size: 50, MaxWait: time.Second, WaitToFill: true, ThroughRouter: through},
				HandleBatch: orderedBatches(r, &o, func(ctx context.Context, tx pgx.Tx, evs []confirmed) error {
					for _, ev := range evs {
						if c, _ := charged.Load().(uuid.UUID); ev.ID == c {
							charges.Add(1) // the provider took the money (its Idempotency-Key dedups)
							idempotency.MarkExternalEffectOf(ctx, ev.ID, "charged")
						}
						if d, _ := declined.Load().(uuid.UUID); ev.ID == d {
							refusals.Add(1)
							return idempotency.Permanent(errors.New("card declined (staged)"))
						}
					}
					return r.HandleBatch(ctx, tx, evs)
				})}
			var deadLettered, ranAlone atomic.Int64
			cfg := e.config(g)
			cfg.Hooks.OnDeadLetter = func(pipeline.DeadLetter) { deadLettered.Add(1) }
			cfg.Hooks.OnBatch = func(b pipeline.BatchDone) { ranAlone.Add(int64(b.RunAlone)) }
			p, err := pipeline.New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			startPipeline(t, p)

			const events = 30
			var msgs []*sarama.ProducerMessage
			for i := range events {
				ev, err := newConfirmed(uuid.Must(uuid.NewV7()), time.Now(), int64(i/3+1), int64(i%3), decimal.RequireFromString("3.00"))
				if err != nil {
					t.Fatal(err)
				}
				switch i {
				case 10:
					charged.Store(ev.ID)
				case 11:
					declined.Store(ev.ID)
				}
				msgs = append(msgs, &sarama.ProducerMessage{Topic: e.Topic, Key: sarama.StringEncoder(fmt.Sprint("k", ev.Customer)), Value: sarama.ByteEncoder(payload(t, ev))})
			}
			if err := e.Prod.SendMessages(msgs); err != nil {
				t.Fatal(err)
			}
			testenv.Eventually(t, time.Minute, "the declined event dead-lettered and every other processed", func() bool {
				return deadLettered.Load() == 1 && effects(t, e.Pool, r.group) == events-1
			})
			o.check(t)
			// The staged fault happened: the batch charged, failed on the
			// declined event, and ran its events on their own.
			if charges.Load() < 2 || refusals.Load() < 2 || ranAlone.Load() < 2 {
				t.Fatalf("charged %d times, declined %d times, %d ran on their own; want the batch's and each event's own run",
					charges.Load(), refusals.Load(), ranAlone.Load())
			}
			testenv.Eventually(t, 30*time.Second, "the letter on the dead-letter topic", func() bool { return testenv.MessageCount(t, e.Brokers, e.DLQ) == 1 })
		})
	}
}
