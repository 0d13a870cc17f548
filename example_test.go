package once_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/schema"
)

func TestMain(m *testing.M) { testenv.MainWithServices(m, "DATABASE_URL", "KAFKA_BROKERS") }

type parcelShipped struct {
	ID     uuid.UUID `json:"event_id"`
	Parcel int64     `json:"parcel_id"`
}

func (p parcelShipped) EventID() uuid.UUID { return p.ID }

// A whole service in one call: New checks the configuration, migrates the
// library's tables and creates the topics; Run consumes until ctx ends. The
// same event sent twice has its effect once.
func ExampleNew() {
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	suffix := "-example-" + uuid.NewString()[:8]
	brokers := strings.Split(os.Getenv("KAFKA_BROKERS"), ",")
	tables := schema.Config{Schema: "example_" + strings.ReplaceAll(suffix[9:], "-", "")}

	effects := make(chan int64, 2)
	svc, err := once.New(ctx, once.Config{
		Brokers:     brokers,
		DatabaseURL: os.Getenv("DATABASE_URL"),
		Tables:      tables,
		Logger:      slog.New(slog.DiscardHandler),
		Topics: []once.Binding{once.Topic[parcelShipped]{
			Name:   "parcel.shipped.v1" + suffix,
			Decode: func(b []byte) (p parcelShipped, err error) { return p, json.Unmarshal(b, &p) },
			Groups: []once.Group[parcelShipped]{{Name: "parcels" + suffix, Handle: func(ctx context.Context, tx pgx.Tx, p parcelShipped) error {
				effects <- p.Parcel // in a real handler: a write through tx
				return nil
			}}},
		}},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer svc.Close()
	defer svc.DB("").Exec(context.Background(), "DROP SCHEMA "+tables.Schema+" CASCADE")
	done := make(chan error, 1)
	go func() { done <- svc.Run(ctx) }()
	<-svc.Pipeline().Running()

	producer, err := sarama.NewSyncProducer(brokers, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer producer.Close()
	ev, _ := json.Marshal(parcelShipped{ID: uuid.Must(uuid.NewV7()), Parcel: 42})
	for range 2 { // Kafka delivers at least once: here, twice
		if _, _, err := producer.SendMessage(&sarama.ProducerMessage{Topic: "parcel.shipped.v1" + suffix, Value: sarama.ByteEncoder(ev)}); err != nil {
			fmt.Println(err)
			return
		}
	}
	select {
	case p := <-effects:
		fmt.Println("effect for parcel", p)
	case <-time.After(time.Minute):
		fmt.Println("no effect within a minute")
	}
	select {
	case p := <-effects:
		fmt.Println("a second effect for parcel", p)
	case <-time.After(3 * time.Second):
	}
	stop()
	fmt.Println("stopped:", <-done)
	// Output:
	// effect for parcel 42
	// stopped: <nil>
}
