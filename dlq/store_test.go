package dlq_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/google/uuid"

	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/schema"
)

// Parked letters reach Kafka byte for byte (a binary header included), each
// once; a letter whose topic does not exist stays parked with its error and
// holds no other up.
func TestParkedLettersDrainOneByOne(t *testing.T) {
	ctx := context.Background()
	pool := testenv.Postgres(t)
	names := schema.Config{Schema: "dlq_test_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")}
	if _, err := schema.Migrate(ctx, pool, names); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA "+names.Schema+" CASCADE") })
	store, err := dlq.NewStore(dlq.StoreConfig{Schema: names.Schema})
	if err != nil {
		t.Fatal(err)
	}
	brokers := testenv.Brokers(t)
	topic := testenv.Topic(t, brokers, 1)
	missing := topic + ".nowhere"
	binary := "\xff\x00\xfe"
	if err := store.Park(ctx, pool,
		dlq.Letter{Topic: missing, Payload: []byte("lost?"), Headers: map[string]string{"reason_poisoned": "x"}},
		dlq.Letter{Topic: topic, Key: []byte("k1"), Payload: []byte("first"), Headers: map[string]string{"bin": binary}},
		dlq.Letter{Topic: topic, Key: []byte("k2"), Payload: []byte("second"), Headers: map[string]string{"reason_poisoned": "y"}},
	); err != nil {
		t.Fatal(err)
	}
	producer := testenv.Producer(t, brokers)
	cfg := dlq.DrainConfig{DB: pool, Producer: producer, MaxBackoff: time.Hour}
	if n, err := store.DrainOnce(ctx, cfg); err != nil || n != 3 {
		t.Fatalf("drained %d (%v), want 3 taken", n, err)
	}
	parked, err := store.List(ctx, pool, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(parked) != 1 || parked[0].Topic != missing || parked[0].Attempts != 1 || parked[0].LastError == "" {
		t.Fatalf("parked after a pass: %+v; want only the letter for the missing topic, with its error", parked)
	}
	if n, err := store.DrainOnce(ctx, cfg); err != nil || n != 0 {
		t.Fatalf("a second pass took %d (%v); the failed letter waits for its backoff", n, err)
	}
	c, err := sarama.NewConsumer(brokers, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	pc, err := c.ConsumePartition(topic, 0, sarama.OffsetOldest)
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	var got []string
	for len(got) < 2 {
		select {
		case m := <-pc.Messages():
			got = append(got, string(m.Value))
			if string(m.Value) == "first" {
				var h string
				for _, rh := range m.Headers {
					if string(rh.Key) == "bin" {
						h = string(rh.Value)
					}
				}
				if h != binary || string(m.Key) != "k1" {
					t.Errorf("header %q key %q; want the bytes %q and k1 as parked", h, m.Key, binary)
				}
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("read %v", got)
		}
	}
	if got[0] != "first" || got[1] != "second" {
		t.Fatalf("topic holds %v", got)
	}
}
