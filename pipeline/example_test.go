package pipeline_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/outbox"
	"github.com/once-dev/once/pipeline"
	"github.com/once-dev/once/schema"
)

// exampleDB is a schema of the example's own on DATABASE_URL, with the
// library's tables; drop ends it.
func exampleDB() (pool *pgxpool.Pool, tables schema.Config, drop func()) {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	tables = schema.Config{Schema: "example_" + strings.ReplaceAll(uuid.NewString(), "-", "")[:12]}
	if _, err := schema.Migrate(ctx, pool, tables); err != nil {
		panic(err)
	}
	return pool, tables, func() {
		_, _ = pool.Exec(ctx, "DROP SCHEMA "+tables.Schema+" CASCADE")
		pool.Close()
	}
}

// An invoice event as its producer sends it.
type invoiceIssued struct {
	ID       uuid.UUID `json:"event_id"`
	Customer int64     `json:"customer_id"`
	Cents    int64     `json:"amount_cents"`
}

func (i invoiceIssued) EventID() uuid.UUID { return i.ID }

// A typed topic: its Decode turns bytes into the event (a failure
// dead-letters the message, naming why), and each group's handler runs in
// the transaction that claims the event for its group. Run here by a local
// pipeline (no Kafka), as package oncetest does.
func ExampleTopic() {
	pool, tables, drop := exampleDB()
	defer drop()

	invoices := pipeline.Topic[invoiceIssued]{
		Name: "invoice.issued.v1",
		Decode: func(b []byte) (i invoiceIssued, err error) {
			if err = json.Unmarshal(b, &i); err == nil && i.ID.Version() != 7 {
				err = errors.New("event_id: want a UUIDv7")
			}
			return i, err
		},
		Groups: []pipeline.Group[invoiceIssued]{{
			Name: "dunning",
			Handle: func(ctx context.Context, tx pgx.Tx, i invoiceIssued) error {
				fmt.Println("handled invoice of customer", i.Customer)
				return nil
			},
		}},
	}
	local, err := pipeline.NewLocal(pipeline.Config{DB: pool, Tables: tables, Topics: []pipeline.Binding{invoices}})
	if err != nil {
		panic(err)
	}
	defer local.Close()

	ev, _ := json.Marshal(invoiceIssued{ID: uuid.Must(uuid.NewV7()), Customer: 7, Cents: 1250})
	results, err := local.Deliver(context.Background(), "invoice.issued.v1",
		pipeline.LocalMessage{Key: "7", Payload: ev},
		pipeline.LocalMessage{Key: "7", Payload: ev}, // a redelivery
		pipeline.LocalMessage{Key: "7", Payload: []byte(`{"event_id":"` + uuid.NewString() + `"}`)},
	)
	if err != nil {
		panic(err)
	}
	for _, r := range results {
		if r.DeadLetter != nil {
			fmt.Println("dead-lettered:", r.DeadLetter.Reason)
			continue
		}
		fmt.Println(r.Claim.Outcome)
	}
	// Output:
	// handled invoice of customer 7
	// processed
	// duplicate
	// dead-lettered: event_id: want a UUIDv7
}

type customerBilled struct {
	ID       uuid.UUID `json:"event_id"`
	Customer int64     `json:"customer_id"`
}

func (c customerBilled) EventID() uuid.UUID { return c.ID }

// A handler publishes a follow-up event with Publish: into the consumer
// outbox, in the claim's transaction, so that it reaches Kafka if and only
// if the handling commits; its id derives from the handled event's, so that
// a second run publishes the same event, which downstream consumers skip.
func ExamplePublish() {
	pool, tables, drop := exampleDB()
	defer drop()

	billed := pipeline.Outgoing[customerBilled]{Name: "customer.billed.v1",
		Key: func(c customerBilled) string { return fmt.Sprint(c.Customer) }}
	handle := func(ctx context.Context, tx pgx.Tx, i invoiceIssued) error {
		id, err := pipeline.DerivedID(ctx, "customer.billed.v1", time.Unix(i.ID.Time().UnixTime()))
		if err != nil {
			return err
		}
		return pipeline.Publish(ctx, tx, customerBilled{ID: id, Customer: i.Customer})
	}
	local, err := pipeline.NewLocal(pipeline.Config{DB: pool, Tables: tables, Outgoing: []pipeline.OutgoingBinding{billed},
		Topics: []pipeline.Binding{pipeline.Topic[invoiceIssued]{Name: "invoice.issued.v1",
			Decode: func(b []byte) (i invoiceIssued, err error) { return i, json.Unmarshal(b, &i) },
			Groups: []pipeline.Group[invoiceIssued]{{Name: "billing", Handle: handle}}}}})
	if err != nil {
		panic(err)
	}
	defer local.Close()

	ev, _ := json.Marshal(invoiceIssued{ID: uuid.Must(uuid.NewV7()), Customer: 7, Cents: 1250})
	if _, err := local.Deliver(context.Background(), "invoice.issued.v1", pipeline.LocalMessage{Key: "7", Payload: ev}); err != nil {
		panic(err)
	}
	box, _ := outbox.New(tables, nil)
	written, err := box.Written(context.Background(), pool, "customer.billed.v1")
	if err != nil {
		panic(err)
	}
	for _, m := range written {
		fmt.Printf("%s key %s: %s\n", m.Topic, m.Key, strings.Replace(string(m.Payload), m.ID, "<derived id>", 1))
	}
	// Output:
	// customer.billed.v1 key 7: {"event_id":"<derived id>","customer_id":7}
}
