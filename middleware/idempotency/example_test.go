package idempotency_test

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/middleware/idempotency"
)

// A handler whose database writes happen once per event for the "billing"
// consumer group, however often Kafka delivers the event. (Compiled, not run:
// it needs a broker and a database; the package's tests run the same against
// real ones.)
func Example() {
	ctx := context.Background()
	pool, _ := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	logger := watermill.NewSlogLogger(nil)
	sub, _ := kafka.NewSubscriber(kafka.SubscriberConfig{
		Brokers:       []string{os.Getenv("KAFKA_BROKERS")},
		Unmarshaler:   kafka.DefaultMarshaler{},
		ConsumerGroup: "billing",
	}, logger)

	idem, _ := idempotency.New(idempotency.Config{DB: pool, ConsumerGroup: "billing"})
	router, _ := message.NewRouter(message.RouterConfig{}, logger)
	router.AddConsumerHandler("billing", "order.confirmed.v1", sub, func(msg *message.Message) error {
		tx, err := idempotency.TxFromContext(msg.Context())
		if err != nil {
			return err
		}
		eventID, err := idempotency.PayloadEventID(msg)
		if err != nil {
			return err
		}
		// Same transaction as the claim: commits with it, or not at all.
		_, err = tx.Exec(msg.Context(), `INSERT INTO billing.ledger (event_id) VALUES ($1)`, eventID)
		return err
	}).AddMiddleware(idem.Middleware)
	_ = router.Run(ctx)
}

// An event from a producer that sends UUIDv4s gets its claim key from that
// id and the time the producer wrote in the event, the same on every
// delivery. The namespace is the producer's (or the topic's) name.
func ExampleDeriveEventID() {
	// {"reservation_id":"3f1c2a54-0b7e-4e3a-9c51-7d2f8e6a1b90","created_at":"2026-03-14T09:26:53.589Z",...}
	createdAt := time.Date(2026, 3, 14, 9, 26, 53, 589_000_000, time.UTC)
	id := idempotency.DeriveEventID("inventory", "3f1c2a54-0b7e-4e3a-9c51-7d2f8e6a1b90", createdAt)
	fmt.Println(id, id.Version())
	fmt.Println(idempotency.IDTime(id).UTC().Format(time.RFC3339Nano))
	// Output:
	// 019cebab-8995-7b1b-bb5d-65e23ab14d67 VERSION_7
	// 2026-03-14T09:26:53.589Z
}
