package idempotency_test

import (
	"context"
	"os"

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
