package orders

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	watermillsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/service/order"
)

// DefaultOutboxTopic names the outbox (table watermill_orders_outbox).
const DefaultOutboxTopic = "orders_outbox"

// forwarderGroup is the outbox subscriber's consumer group.
const forwarderGroup = "kafka_forwarder"

// metaPartitionKey carries the order id from the outbox to the Kafka key.
const metaPartitionKey = "partition_key"

// insertOrderSQL takes the order id from the identity column unless the
// caller chose one ($1 not null).
const insertOrderSQL = `INSERT INTO orders.orders (order_id, customer_id, total_amount, confirmed_event_id)
OVERRIDING SYSTEM VALUE
VALUES (coalesce($1, nextval(pg_get_serial_sequence('orders.orders', 'order_id'))), $2, $3, $4)
RETURNING order_id`

// Config configures a [Service].
type Config struct {
	DB *pgxpool.Pool
	// Topic is the Kafka topic the events are forwarded to.
	Topic string
	// OutboxTopic. Default [DefaultOutboxTopic].
	OutboxTopic string
	Logger      *slog.Logger
	// Now is the clock of occurred_at. Default time.Now.
	Now func() time.Time
}

// Service confirms orders.
type Service struct {
	cfg  Config
	wlog watermill.LoggerAdapter
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
	return &Service{cfg: cfg, wlog: watermill.NewSlogLoggerWithLevelMapping(cfg.Logger, map[slog.Level]slog.Level{slog.LevelInfo: slog.LevelDebug})}, nil
}

// Init creates the outbox tables (watermill-sql's schema) if they are missing.
// The publisher cannot do it: it writes inside the caller's transaction, where
// DDL would commit implicitly.
func (s *Service) Init(ctx context.Context) error {
	sub, err := s.outboxSubscriber()
	if err != nil {
		return err
	}
	defer sub.Close()
	if err := sub.SubscribeInitialize(s.cfg.OutboxTopic); err != nil {
		return fmt.Errorf("orders: create outbox: %w", err)
	}
	return nil
}

// ConfirmRequest is an order to confirm. A zero OrderID gets the next one.
type ConfirmRequest struct {
	OrderID     int64
	CustomerID  int64
	TotalAmount decimal.Decimal
}

// Confirm confirms an order in its own transaction.
func (s *Service) Confirm(ctx context.Context, req ConfirmRequest) (order.Confirmed, error) {
	var ev order.Confirmed
	err := pgx.BeginFunc(ctx, s.cfg.DB, func(tx pgx.Tx) error {
		var err error
		ev, err = s.ConfirmInTx(ctx, tx, req)
		return err
	})
	return ev, err
}

// ConfirmInTx writes the order and its event into tx. Nothing reaches Kafka
// unless tx commits.
func (s *Service) ConfirmInTx(ctx context.Context, tx pgx.Tx, req ConfirmRequest) (order.Confirmed, error) {
	now := s.cfg.Now()
	eventID, err := uuid.NewV7()
	if err != nil {
		return order.Confirmed{}, fmt.Errorf("orders: event id: %w", err)
	}
	// Validated before the insert, with a stand-in order id.
	if _, err := order.NewConfirmed(eventID, now, max(req.OrderID, 1), req.CustomerID, req.TotalAmount); err != nil {
		return order.Confirmed{}, err
	}
	var chosen *int64
	if req.OrderID != 0 {
		chosen = &req.OrderID
	}
	var orderID int64
	if err := tx.QueryRow(ctx, insertOrderSQL, chosen, req.CustomerID, req.TotalAmount, eventID).Scan(&orderID); err != nil {
		return order.Confirmed{}, fmt.Errorf("orders: insert order: %w", err)
	}
	ev, err := order.NewConfirmed(eventID, now, orderID, req.CustomerID, req.TotalAmount)
	if err != nil {
		return order.Confirmed{}, err
	}
	payload, err := ev.MarshalJSON()
	if err != nil {
		return order.Confirmed{}, err
	}
	outbox, err := watermillsql.NewPublisher(watermillsql.TxFromPgx(tx), watermillsql.PublisherConfig{
		SchemaAdapter: watermillsql.DefaultPostgreSQLSchema{},
	}, s.wlog)
	if err != nil {
		return order.Confirmed{}, fmt.Errorf("orders: outbox publisher: %w", err)
	}
	msg := message.NewMessage(ev.EventID().String(), payload)
	msg.Metadata.Set(metaPartitionKey, strconv.FormatInt(ev.OrderID(), 10))
	pub := forwarder.NewPublisher(outbox, forwarder.PublisherConfig{ForwarderTopic: s.cfg.OutboxTopic})
	if err := pub.Publish(s.cfg.Topic, msg); err != nil {
		return order.Confirmed{}, fmt.Errorf("orders: write outbox: %w", err)
	}
	return ev, nil
}

func (s *Service) outboxSubscriber() (*watermillsql.Subscriber, error) {
	return watermillsql.NewSubscriber(watermillsql.BeginnerFromPgx(s.cfg.DB), watermillsql.SubscriberConfig{
		ConsumerGroup:    forwarderGroup,
		PollInterval:     50 * time.Millisecond,
		SchemaAdapter:    watermillsql.DefaultPostgreSQLSchema{},
		OffsetsAdapter:   watermillsql.DefaultPostgreSQLOffsetsAdapter{},
		InitializeSchema: true,
	}, s.wlog)
}

// pruneOutboxSQL deletes, in one bounded batch, outbox rows the forwarder has
// acknowledged (watermill-sql orders rows by transaction id, then offset) and
// that are older than the given age. Unforwarded rows are never touched.
// The table names are watermill-sql's, computed from the outbox topic;
// created_at is a timestamp without time zone written by CURRENT_TIMESTAMP,
// hence LOCALTIMESTAMP.
const pruneOutboxSQL = `DELETE FROM %[1]s WHERE ctid IN (
  SELECT m.ctid FROM %[1]s m JOIN %[2]s o ON o.consumer_group = $1
  WHERE (m.transaction_id < o.last_processed_transaction_id
     OR (m.transaction_id = o.last_processed_transaction_id AND m."offset" <= o.offset_acked))
    AND m.created_at < LOCALTIMESTAMP - make_interval(secs => $2)
  LIMIT $3)`

// PruneOutbox deletes forwarded outbox rows older than olderThan, batch rows
// per statement, and returns how many it deleted. watermill-sql keeps every
// row forever; without this the outbox grows with every order.
func (s *Service) PruneOutbox(ctx context.Context, olderThan time.Duration, batch int) (int64, error) {
	q := fmt.Sprintf(pruneOutboxSQL,
		watermillsql.DefaultPostgreSQLSchema{}.MessagesTable(s.cfg.OutboxTopic),
		watermillsql.DefaultPostgreSQLOffsetsAdapter{}.MessagesOffsetsTable(s.cfg.OutboxTopic))
	var total int64
	for {
		tag, err := s.cfg.DB.Exec(ctx, q, forwarderGroup, olderThan.Seconds(), batch)
		if err != nil {
			return total, fmt.Errorf("orders: prune outbox: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(batch) {
			return total, nil
		}
	}
}

// KafkaMarshaler keys each Kafka message by its order id, so one order's
// events stay in one partition and in order. The value is the event's JSON
// as written to the outbox.
func KafkaMarshaler() kafka.MarshalerUnmarshaler {
	return kafka.NewWithPartitioningMarshaler(func(_ string, msg *message.Message) (string, error) {
		key := msg.Metadata.Get(metaPartitionKey)
		if key == "" {
			return "", fmt.Errorf("orders: message %s has no %s", msg.UUID, metaPartitionKey)
		}
		return key, nil
	})
}

// NewKafkaPublisher returns the forwarder's Kafka publisher: keyed by order
// id ([KafkaMarshaler]) and configured by cfg, which should be an idempotent
// producer's (acks from all in-sync replicas, one request in flight).
func NewKafkaPublisher(brokers []string, cfg *sarama.Config, logger watermill.LoggerAdapter) (*kafka.Publisher, error) {
	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: brokers, Marshaler: KafkaMarshaler(), OverwriteSaramaConfig: cfg}, logger)
	if err != nil {
		return nil, fmt.Errorf("orders: kafka publisher: %w", err)
	}
	return pub, nil
}

// NewForwarder moves outbox rows to Kafka through kafkaPublisher (see
// [KafkaMarshaler]). A row is acknowledged only after Kafka acknowledged the
// publish, so a crash in between publishes it again, with the same event id.
func (s *Service) NewForwarder(kafkaPublisher message.Publisher) (*forwarder.Forwarder, error) {
	sub, err := s.outboxSubscriber()
	if err != nil {
		return nil, err
	}
	f, err := forwarder.NewForwarder(sub, kafkaPublisher, s.wlog, forwarder.Config{ForwarderTopic: s.cfg.OutboxTopic})
	if err != nil {
		return nil, fmt.Errorf("orders: forwarder: %w", err)
	}
	return f, nil
}
