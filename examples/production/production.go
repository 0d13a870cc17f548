// Package production is a complete consumer service on the library's front
// door: two topics, three consumer groups (one batched), a team middleware,
// and a handler that publishes a follow-up event. Run it with
// once.New(ctx, production.Config(...)), Tables(ctx, svc.DB("")), svc.Run.
package production

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once"
	"github.com/once-dev/once/pgdb"
)

// The events: two consumed, one published. Any type with EventID() is one.
type Dispatched struct {
	ID       uuid.UUID `json:"event_id"`
	Shipment int64     `json:"shipment_id"`
	Customer int64     `json:"customer_id"`
	Parcels  int       `json:"parcels"`
}
type Delivered struct {
	ID       uuid.UUID `json:"event_id"`
	Shipment int64     `json:"shipment_id"`
}
type Notified struct {
	ID       uuid.UUID `json:"event_id"`
	Customer int64     `json:"customer_id"`
	Shipment int64     `json:"shipment_id"`
}

func (e Dispatched) EventID() uuid.UUID { return e.ID }
func (e Delivered) EventID() uuid.UUID  { return e.ID }
func (e Notified) EventID() uuid.UUID   { return e.ID }

// decode validates a payload at the edge: its error dead-letters the message.
func decode[E once.Event](b []byte) (ev E, err error) {
	if err = json.Unmarshal(b, &ev); err == nil && ev.EventID().Version() != 7 {
		err = errors.New("event_id: want a UUIDv7")
	}
	return ev, err
}

// Tables makes the service's own tables (its migrations, in a real one).
func Tables(ctx context.Context, db pgdb.DB) error {
	_, err := db.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS shipping;
CREATE TABLE IF NOT EXISTS shipping.parcels (customer_id bigint PRIMARY KEY, parcels bigint NOT NULL);
CREATE TABLE IF NOT EXISTS shipping.notified (shipment_id bigint PRIMARY KEY, event_id uuid NOT NULL);
CREATE TABLE IF NOT EXISTS shipping.delivered (shipment_id bigint PRIMARY KEY, event_id uuid NOT NULL)`)
	return err
}

// countParcels is the batched group: one statement for a batch, rows in key
// order (two batches at once never deadlock).
func countParcels(ctx context.Context, tx pgx.Tx, evs []Dispatched) error {
	customers, parcels := make([]int64, len(evs)), make([]int32, len(evs))
	for i, ev := range evs {
		customers[i], parcels[i] = ev.Customer, int32(ev.Parcels)
	}
	_, err := tx.Exec(ctx, `INSERT INTO shipping.parcels AS p SELECT c, sum(n) FROM unnest($1::bigint[], $2::int[]) AS u(c, n)
GROUP BY c ORDER BY c ON CONFLICT (customer_id) DO UPDATE SET parcels = p.parcels + EXCLUDED.parcels`, customers, parcels)
	return err
}

// notify records the notice and publishes it in the claim's transaction: it
// reaches Kafka once, when the transaction commits.
func notify(ctx context.Context, tx pgx.Tx, ev Dispatched) error {
	sec, nsec := ev.ID.Time().UnixTime() // when the dispatch happened: every attempt derives one id
	id, err := once.DerivedID(ctx, "customer.notified.v1", time.Unix(sec, nsec))
	if err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `INSERT INTO shipping.notified VALUES ($1, $2)`, ev.Shipment, id); err != nil {
		return err
	}
	return once.Publish(ctx, tx, Notified{ID: id, Customer: ev.Customer, Shipment: ev.Shipment})
}

func track(ctx context.Context, tx pgx.Tx, ev Delivered) (err error) {
	_, err = tx.Exec(ctx, `INSERT INTO shipping.delivered VALUES ($1, $2)`, ev.Shipment, ev.ID)
	return err
}

// logged is a team's middleware: every delivery of its topic, and its origin.
func logged(log *slog.Logger) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			d, _ := once.DeliveryFrom(msg.Context())
			log.Debug("delivery", "topic", d.Topic, "partition", d.Partition, "offset", d.Offset, "group", d.Group, "err", err)
			return out, err
		}
	}
}

// Config is the service; suffix isolates a copy (topics and groups).
func Config(brokers []string, databaseURL, suffix string, log *slog.Logger) once.Config {
	return once.Config{Brokers: brokers, DatabaseURL: databaseURL, Logger: log,
		Topics: []once.Binding{
			once.Topic[Dispatched]{Name: "shipment.dispatched.v1" + suffix, Decode: decode[Dispatched],
				Extra: once.Extra{Observe: []message.HandlerMiddleware{logged(log)}},
				Groups: []once.Group[Dispatched]{
					{Name: "parcel-counter" + suffix, HandleBatch: countParcels, Batch: once.Batch{Size: 50}},
					{Name: "notifier" + suffix, Handle: notify}}},
			once.Topic[Delivered]{Name: "shipment.delivered.v1" + suffix, Decode: decode[Delivered],
				Groups: []once.Group[Delivered]{{Name: "delivery-tracker" + suffix, Handle: track}}}},
		Outgoing: []once.OutgoingBinding{once.Outgoing[Notified]{Name: "customer.notified.v1" + suffix,
			Key: func(n Notified) string { return strconv.FormatInt(n.Customer, 10) }}},
	}
}
