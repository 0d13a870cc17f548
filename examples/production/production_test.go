package production_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/google/uuid"

	"github.com/once-dev/once"
	"github.com/once-dev/once/examples/production"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/oncetest"
)

// The production example against the real services: every dispatch and
// delivery delivered twice (and a dispatch re-published in another byte
// form), and a poison message. Each effect happens once, each follow-up
// event is on Kafka once, and the poison is dead-lettered by both groups of
// its topic.
func TestTheProductionExample(t *testing.T) {
	ctx := context.Background()
	pool := testenv.Postgres(t)
	brokers := testenv.Brokers(t)
	suffix := ".example-" + uuid.NewString()[:8]
	cfg := production.Config(brokers, os.Getenv("DATABASE_URL"), suffix, slog.New(slog.DiscardHandler))
	cfg.TopicPartitions = 3
	svc, err := once.New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(svc.Close)
	if err := production.Tables(ctx, svc.DB("")); err != nil {
		t.Fatal(err)
	}
	oncetest.Run(t, svc)

	producer := testenv.Producer(t, brokers)
	send := func(topic string, key int64, v any) {
		b, _ := json.Marshal(v)
		testenv.Publish(t, producer, topic+suffix, fmt.Sprint(key), b)
	}
	customer := 1 + rand.Int64N(1<<50)
	shipments := make([]int64, 20)
	parcels := 0
	for i := range shipments {
		shipments[i] = 1 + rand.Int64N(1<<60)
		ev := production.Dispatched{ID: uuid.Must(uuid.NewV7()), Shipment: shipments[i], Customer: customer, Parcels: 1 + i%3}
		parcels += ev.Parcels
		send("shipment.dispatched.v1", ev.Shipment, ev)
		send("shipment.dispatched.v1", ev.Shipment, ev) // a duplicate
		if i == 0 {                                     // the same event in another byte form
			testenv.Publish(t, producer, "shipment.dispatched.v1"+suffix, "x", []byte(fmt.Sprintf(
				`{"parcels": %d, "customer_id": %d, "shipment_id": %d, "event_id": "%s"}`, ev.Parcels, ev.Customer, ev.Shipment, ev.ID)))
		}
		delivered := production.Delivered{ID: uuid.Must(uuid.NewV7()), Shipment: shipments[i]}
		send("shipment.delivered.v1", delivered.Shipment, delivered)
		send("shipment.delivered.v1", delivered.Shipment, delivered)
	}
	testenv.Publish(t, producer, "shipment.dispatched.v1"+suffix, "poison", []byte(`{"event_id": 17}`))

	count := func(q string, args ...any) int {
		var n int
		if err := pool.QueryRow(ctx, q, args...).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	testenv.Eventually(t, 60*time.Second, "every effect of the three groups", func() bool {
		return count(`SELECT coalesce(sum(parcels), 0) FROM shipping.parcels WHERE customer_id = $1`, customer) == parcels &&
			count(`SELECT count(*) FROM shipping.notified WHERE shipment_id = ANY($1)`, shipments) == len(shipments) &&
			count(`SELECT count(*) FROM shipping.delivered WHERE shipment_id = ANY($1)`, shipments) == len(shipments)
	})
	readAll := func(topic string, atLeast int) []*sarama.ConsumerMessage {
		testenv.Eventually(t, 60*time.Second, fmt.Sprintf("%d messages on %s", atLeast, topic), func() bool {
			return testenv.MessageCount(t, brokers, topic) >= int64(atLeast)
		})
		return testenv.ReadTopic(t, brokers, topic)
	}
	notices := readAll("customer.notified.v1"+suffix, len(shipments))
	ids := map[string]int{}
	for _, m := range notices {
		var n production.Notified
		if err := json.Unmarshal(m.Value, &n); err != nil || n.Customer != customer {
			t.Fatalf("a notice that is not ours: %s (%v)", m.Value, err)
		}
		ids[n.ID.String()]++
	}
	if len(ids) != len(shipments) {
		t.Fatalf("%d notices with %d ids on Kafka; want each of the %d once", len(notices), len(ids), len(shipments))
	}
	// Both groups of shipment.dispatched.v1 dead-letter the poison.
	letters := readAll("shipment.dispatched.v1"+suffix+".dlq", 2)
	if len(letters) != 2 {
		t.Fatalf("%d dead letters, want the poison once per group", len(letters))
	}
	for _, l := range letters {
		if string(l.Value) != `{"event_id": 17}` {
			t.Fatalf("dead letter %q; want the poison", l.Value)
		}
	}
	time.Sleep(2 * time.Second) // a second effect or notice would arrive meanwhile
	if got := count(`SELECT coalesce(sum(parcels), 0) FROM shipping.parcels WHERE customer_id = $1`, customer); got != parcels {
		t.Fatalf("%d parcels counted, want %d", got, parcels)
	}
	if n := len(testenv.ReadTopic(t, brokers, "customer.notified.v1"+suffix)); n != len(shipments) {
		t.Fatalf("%d notices on Kafka, want %d", n, len(shipments))
	}
}
