package idempotency_test

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/middleware/idempotency"
)

// A claim without a fingerprint (adopted from the style guide's table, or
// made by the guide's consumer beside us: payload_sha256 and values_sha256
// NULL) matches by its id: a redelivery is a duplicate, alone and in a
// batch, and the handler does not run. Before, it was taken for the id
// reused with other values and dead-lettered: every redelivery of an event
// the guide's consumer had processed. In every exec mode, behind PgBouncer
// too: each must read the NULL as no fingerprint.
func TestAClaimWithoutAFingerprintMatchesByItsID(t *testing.T) {
	setup(t)
	for _, where := range testenv.EveryWay {
		t.Run(where.String(), func(t *testing.T) {
			pool := where.Pool(t)
			group := uniqueGroup(t, "g")
			alone, aloneMsg := newEvent(t)
			batched, batchedMsg := newEvent(t)
			for _, id := range []any{alone, batched} {
				if _, err := pool.Exec(context.Background(), `INSERT INTO processed_event (event_id, consumer_group) VALUES ($1, $2)`, id, group); err != nil {
					t.Fatal(err)
				}
			}
			var outcomes []idempotency.Outcome
			m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group, OnResult: func(r idempotency.Result) { outcomes = append(outcomes, r.Outcome) }})
			var runs atomic.Int64
			if _, err := m.Middleware(recordEffect(group, &runs))(aloneMsg); err != nil {
				t.Fatalf("a redelivery of an event claimed without a fingerprint: %v; want a duplicate", err)
			}
			if err := m.ProcessBatch(context.Background(), []*message.Message{batchedMsg}, recordBatch(group, &runs))[0]; err != nil {
				t.Fatalf("the same in a batch: %v; want a duplicate", err)
			}
			if len(outcomes) != 2 || outcomes[0] != idempotency.Duplicate || outcomes[1] != idempotency.Duplicate || runs.Load() != 0 {
				t.Fatalf("outcomes %v, handler ran %d times; want two duplicates and no run", outcomes, runs.Load())
			}
		})
	}
}
