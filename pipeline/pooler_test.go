package pipeline_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/outbox"
	"github.com/once-dev/once/pipeline"
	"github.com/once-dev/once/retention"
	"github.com/once-dev/once/schema"
)

// Every statement of the library works in each of pgx's query exec modes,
// directly and behind PgBouncer in transaction pooling: migrations, claims
// and batch claims, duplicates and mismatches, the consumer outbox and its
// forwarder, dead letters parked and drained, a retention pass and the
// recorded retention (review finding: behind the pooler, the outbox's
// insert failed with 22P02 after the provider had charged, and retention's
// session lock was stranded).
func TestEveryStatementInEveryWay(t *testing.T) {
	for _, w := range testenv.EveryWay {
		t.Run(w.String(), func(t *testing.T) { testEveryStatement(t, w) })
	}
}

func testEveryStatement(t *testing.T, w testenv.Where) {
	ctx := context.Background()
	e := newEnv(t, 2)
	pool := w.Pool(t)
	names := schema.Config{Schema: "pooler_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")}
	t.Cleanup(func() { _, _ = e.Pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+names.Schema+" CASCADE") })
	if _, err := schema.Migrate(ctx, pool, names); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	if _, err := schema.Migrate(ctx, pool, names); err != nil {
		t.Fatalf("migrate again: %v", err)
	}
	effects := names.Schema + ".effect"
	if _, err := e.Pool.Exec(ctx, `CREATE TABLE `+effects+` (event_id uuid, grp text, weight numeric, at timestamptz)`); err != nil {
		t.Fatal(err)
	}
	box, err := outbox.New(names, nil)
	if err != nil {
		t.Fatal(err)
	}
	followUps := testenv.Topic(t, e.Brokers, 1)
	write := func(ctx context.Context, tx pgx.Tx, grp string, s shipment) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+effects+` (event_id, grp, weight, at) VALUES ($1, $2, $3, $4)`, s.ID, grp, s.Weight, s.At)
		return err
	}
	perEvent, batched := uniqueGroup("per-event"), uniqueGroup("batched")
	var deadLetters atomic.Int64
	cfg := pipeline.Config{Brokers: e.Brokers, DB: pool, Tables: names, Logger: quietLogger(), StatementTimeout: 10 * time.Second,
		Hooks: pipeline.Hooks{OnDeadLetter: func(pipeline.DeadLetter) { deadLetters.Add(1) }},
		Topics: []pipeline.Binding{pipeline.Topic[shipment]{Name: e.Topic, DLQ: e.DLQ, Decode: decodeShipment, Groups: []pipeline.Group[shipment]{
			{Name: perEvent, Handle: func(ctx context.Context, tx pgx.Tx, s shipment) error {
				if err := write(ctx, tx, perEvent, s); err != nil {
					return err
				}
				return box.Publish(ctx, tx, outbox.Message{Topic: followUps, Key: s.ID.String(), ID: s.ID.String(), Payload: []byte(`{"follows":"` + s.ID.String() + `"}`)})
			}},
			{Name: batched, Batch: pipeline.Batch{Size: 8}, HandleBatch: func(ctx context.Context, tx pgx.Tx, ss []shipment) error {
				for _, s := range ss {
					if err := write(ctx, tx, batched, s); err != nil {
						return err
					}
				}
				return nil
			}},
		}}}}
	run(t, cfg)
	const events = 20
	var first []byte
	for i := range events {
		b := []byte(fmt.Sprintf(`{"event_id":"%s","occurred_at":"%s","weight_kg":"%d.25","parcels":[%d]}`,
			uuid.Must(uuid.NewV7()), time.Now().UTC().Format(time.RFC3339Nano), i, i))
		if i == 0 {
			first = b
		}
		testenv.Publish(t, e.Prod, e.Topic, fmt.Sprint(i), b)
	}
	testenv.Publish(t, e.Prod, e.Topic, "0", first) // a duplicate
	testenv.Publish(t, e.Prod, e.Topic, "0", []byte(strings.Replace(string(first), `.25"`, `.75"`, 1)))
	testenv.Publish(t, e.Prod, e.Topic, "p", []byte(`{"event_id": 17}`))
	count := func(q string, args ...any) int {
		var n int
		if err := e.Pool.QueryRow(ctx, q, args...).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	testenv.Eventually(t, 60*time.Second, "every event once in both groups, and 4 dead letters", func() bool {
		return count(`SELECT count(*) FROM `+effects+` WHERE grp = $1`, perEvent) == events &&
			count(`SELECT count(*) FROM `+effects+` WHERE grp = $1`, batched) == events && deadLetters.Load() == 4
	})
	testenv.Eventually(t, 60*time.Second, "the follow-ups forwarded and the dead letters drained", func() bool {
		return testenv.MessageCount(t, e.Brokers, followUps) == events && testenv.MessageCount(t, e.Brokers, e.DLQ) == 4
	})
	if n := count(`SELECT count(DISTINCT (event_id, grp)) FROM ` + effects); n != 2*events {
		t.Fatalf("%d distinct effects, want %d", n, 2*events)
	}
	rcfg := retention.Config{DB: pool, Tables: names, Logger: quietLogger()}
	if err := retention.Agree(ctx, rcfg); err != nil {
		t.Fatalf("agree on the retention: %v", err)
	}
	for range 2 {
		rep, err := retention.Run(ctx, rcfg)
		if err != nil || rep.Busy {
			t.Fatalf("retention pass: %+v, %v; want it done (its lease released)", rep, err)
		}
	}
	if n, err := box.Prune(ctx, pool, 0, 100); err != nil || n != events {
		t.Fatalf("outbox prune: %d (%v), want %d", n, err, events)
	}
}
