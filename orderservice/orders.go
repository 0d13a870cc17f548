package orderservice

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/shopspring/decimal"
	"go.opentelemetry.io/otel"

	"github.com/once-dev/once/orderevents"
	"github.com/once-dev/once/outbox"
	"github.com/once-dev/once/pgdb"
	"github.com/once-dev/once/schema"
)

// DefaultOutboxTopic names the outbox (table watermill_orders_outbox, as
// watermill-sql first created it).
const DefaultOutboxTopic = "orders_outbox"

// insertOrderSQL takes the order id from the identity column unless the
// caller chose one ($1 not null).
const insertOrderSQL = `INSERT INTO orders.orders (order_id, customer_id, total_amount, confirmed_event_id)
OVERRIDING SYSTEM VALUE
VALUES (coalesce($1, nextval(pg_get_serial_sequence('orders.orders', 'order_id'))), $2, $3, $4)
RETURNING order_id`

// cancelOrderSQL cancels an order once: a second cancellation changes no row.
const cancelOrderSQL = `UPDATE orders.orders SET cancelled_at = now(), cancelled_event_id = $2
WHERE order_id = $1 AND cancelled_at IS NULL`

const orderStateSQL = `SELECT cancelled_event_id FROM orders.orders WHERE order_id = $1`

// Config configures a [Service].
type Config struct {
	DB *pgxpool.Pool
	// Topic receives order.confirmed.v1 events. Required.
	Topic string
	// CancelledTopic receives order.cancelled.v1 events. Default: none,
	// and Cancel refuses.
	CancelledTopic string
	// OutboxTopic names the outbox table: watermill_<OutboxTopic>. Default
	// [DefaultOutboxTopic].
	OutboxTopic string
	Logger      *slog.Logger
	// Now is the clock of occurred_at. Default time.Now.
	Now func() time.Time
}

// Service confirms and cancels orders.
type Service struct {
	cfg    Config
	outbox *outbox.Outbox
}

// NewService validates cfg.
func NewService(cfg Config) (*Service, error) {
	if cfg.OutboxTopic == "" {
		cfg.OutboxTopic = DefaultOutboxTopic
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.DB == nil || cfg.Topic == "" {
		return nil, errors.New("orders: Config.DB and Config.Topic are required")
	}
	// The names watermill-sql gave the tables when it created them.
	box, err := outbox.New(schema.Config{Outbox: "watermill_" + cfg.OutboxTopic, OutboxOffsets: "watermill_offsets_" + cfg.OutboxTopic}, cfg.Logger)
	if err != nil {
		return nil, fmt.Errorf("orders: %w", err)
	}
	return &Service{cfg: cfg, outbox: box}, nil
}

// Init creates the outbox tables if they are missing. The publisher cannot:
// it writes inside the caller's transaction, where DDL would commit it.
func (s *Service) Init(ctx context.Context) error {
	return s.outbox.Init(ctx, s.cfg.DB)
}

// ConfirmRequest is an order to confirm. A zero OrderID gets the next one.
type ConfirmRequest struct {
	OrderID     int64
	CustomerID  int64
	TotalAmount decimal.Decimal
}

// Confirm confirms an order in its own transaction.
func (s *Service) Confirm(ctx context.Context, req ConfirmRequest) (orderevents.Confirmed, error) {
	var ev orderevents.Confirmed
	err := pgdb.InTxBounded(ctx, s.cfg.DB, idleBound, func(tx pgx.Tx) error {
		var err error
		ev, err = s.ConfirmInTx(ctx, tx, req)
		return err
	})
	return ev, err
}

// ConfirmInTx writes the order and its event into tx. Nothing reaches Kafka
// unless tx commits.
func (s *Service) ConfirmInTx(ctx context.Context, tx pgx.Tx, req ConfirmRequest) (orderevents.Confirmed, error) {
	// The order's trace starts here (or continues a caller's): the event
	// carries it to every consumer, and billing to the provider.
	ctx, span := otel.Tracer("github.com/once-dev/once/orderservice").Start(ctx, "orders.confirm")
	defer span.End()
	now := s.cfg.Now()
	eventID, err := uuid.NewV7()
	if err != nil {
		return orderevents.Confirmed{}, fmt.Errorf("orders: event id: %w", err)
	}
	// Validated before the insert, with a stand-in order id.
	if _, err := orderevents.NewConfirmed(eventID, now, max(req.OrderID, 1), req.CustomerID, req.TotalAmount); err != nil {
		return orderevents.Confirmed{}, err
	}
	var chosen *int64
	if req.OrderID != 0 {
		chosen = &req.OrderID
	}
	var orderID int64
	if err := tx.QueryRow(ctx, insertOrderSQL, chosen, req.CustomerID, req.TotalAmount, eventID).Scan(&orderID); err != nil {
		return orderevents.Confirmed{}, fmt.Errorf("orders: insert order: %w", err)
	}
	ev, err := orderevents.NewConfirmed(eventID, now, orderID, req.CustomerID, req.TotalAmount)
	if err != nil {
		return orderevents.Confirmed{}, err
	}
	payload, err := ev.MarshalJSON()
	if err != nil {
		return orderevents.Confirmed{}, err
	}
	return ev, s.outbox.Publish(ctx, tx, outbox.Message{Topic: s.cfg.Topic, Key: strconv.FormatInt(orderID, 10), ID: eventID.String(), Payload: payload})
}

// ErrNotFound and ErrAlreadyCancelled are Cancel's refusals.
var (
	ErrNotFound         = errors.New("orders: no such order")
	ErrAlreadyCancelled = errors.New("orders: order already cancelled")
)

// Cancel cancels a confirmed order once, in its own transaction, and writes
// its order.cancelled.v1 event into the outbox in the same transaction. A
// second cancellation is refused with [ErrAlreadyCancelled] and publishes
// nothing.
func (s *Service) Cancel(ctx context.Context, orderID int64, reason string) (orderevents.Cancelled, error) {
	if s.cfg.CancelledTopic == "" {
		return orderevents.Cancelled{}, errors.New("orders: Config.CancelledTopic is not set: cancellations are off")
	}
	var ev orderevents.Cancelled
	err := pgdb.InTxBounded(ctx, s.cfg.DB, idleBound, func(tx pgx.Tx) error {
		eventID, err := uuid.NewV7()
		if err != nil {
			return fmt.Errorf("orders: event id: %w", err)
		}
		if ev, err = orderevents.NewCancelled(eventID, s.cfg.Now(), orderID, reason); err != nil {
			return err
		}
		tag, err := tx.Exec(ctx, cancelOrderSQL, orderID, eventID)
		if err != nil {
			return fmt.Errorf("orders: cancel order %d: %w", orderID, err)
		}
		if tag.RowsAffected() == 0 {
			var by *uuid.UUID
			if err := tx.QueryRow(ctx, orderStateSQL, orderID).Scan(&by); errors.Is(err, pgx.ErrNoRows) {
				return fmt.Errorf("%w: %d", ErrNotFound, orderID)
			} else if err != nil {
				return fmt.Errorf("orders: read order %d: %w", orderID, err)
			}
			return fmt.Errorf("%w: order %d, by event %s", ErrAlreadyCancelled, orderID, by)
		}
		payload, err := ev.MarshalJSON()
		if err != nil {
			return err
		}
		return s.outbox.Publish(ctx, tx, outbox.Message{Topic: s.cfg.CancelledTopic, Key: strconv.FormatInt(orderID, 10), ID: eventID.String(), Payload: payload})
	})
	return ev, err
}

// PruneOutbox deletes forwarded outbox rows older than olderThan, batch rows
// per statement, and returns how many it deleted.
func (s *Service) PruneOutbox(ctx context.Context, olderThan time.Duration, batch int) (int64, error) {
	return s.outbox.Prune(ctx, s.cfg.DB, olderThan, batch)
}

// NewForwarder moves outbox rows to Kafka through kafkaPublisher (see
// outbox.NewKafkaPublisher). A row is acknowledged only after Kafka
// acknowledged the publish, so a crash in between publishes it again, with
// the same event id.
func (s *Service) NewForwarder(kafkaPublisher message.Publisher) (*forwarder.Forwarder, error) {
	return s.outbox.Forwarder(s.cfg.DB, kafkaPublisher)
}

// idleBound is how long the server lets a request's transaction sit idle:
// it runs its statements back to back, and one whose client vanished
// behind a network black hole must not keep its locks, or its transaction
// id (which holds back every outbox forwarder of the cluster), for long.
const idleBound = 30 * time.Second
