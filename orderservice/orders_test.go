package orderservice_test

import (
	"context"
	"encoding/json"
	"errors"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/internal/pipelinetest"
	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/orderevents"
	"github.com/once-dev/once/orderservice"
	"github.com/once-dev/once/outbox"
)

type fixture struct {
	svc     *orderservice.Service
	brokers []string
	topic   string
}

func setup(t *testing.T) *fixture {
	t.Helper()
	pool := reftest.Postgres(t)
	brokers := testenv.Brokers(t)
	topic := testenv.Topic(t, brokers, 3)
	// An outbox of its own per test, so forwarders of other tests never see its rows.
	svc, err := orderservice.NewService(orderservice.Config{DB: pool, Topic: topic, CancelledTopic: topic, OutboxTopic: "outbox_" + uuid.NewString()[:8]})
	if err != nil {
		t.Fatal(err)
	}
	if err := svc.Init(context.Background()); err != nil {
		t.Fatal(err)
	}
	return &fixture{svc: svc, brokers: brokers, topic: topic}
}

func (f *fixture) kafkaPublisher(t *testing.T) message.Publisher {
	t.Helper()
	producer, err := sarama.NewSyncProducer(f.brokers, pipelinetest.SaramaConfig(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { producer.Close() })
	return outbox.KafkaPublisher{Producer: producer}
}

// runForwarder runs a forwarder until the returned stop is called.
func (f *fixture) runForwarder(t *testing.T, pub message.Publisher) (stop func()) {
	t.Helper()
	fw, err := f.svc.NewForwarder(pub)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = fw.Run(ctx); close(done) }()
	<-fw.Running()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	return stop
}

type record struct {
	key     string
	eventID string
	payload string
}

// readTopic reads the topic from the start until want messages arrived and
// then for quiet more, so that extra messages would be seen too.
func (f *fixture) readTopic(t *testing.T, want int, quiet time.Duration) []record {
	t.Helper()
	c, err := sarama.NewConsumer(f.brokers, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	partitions, err := c.Partitions(f.topic)
	if err != nil {
		t.Fatal(err)
	}
	msgs := make(chan *sarama.ConsumerMessage)
	for _, p := range partitions {
		pc, err := c.ConsumePartition(f.topic, p, sarama.OffsetOldest)
		if err != nil {
			t.Fatal(err)
		}
		defer pc.Close()
		go func() {
			for m := range pc.Messages() {
				msgs <- m
			}
		}()
	}
	var out []record
	deadline := time.After(60 * time.Second)
	for {
		wait := quiet
		if len(out) < want {
			wait = time.Minute
		}
		select {
		case m := <-msgs:
			var doc struct {
				EventID string `json:"event_id"`
			}
			_ = json.Unmarshal(m.Value, &doc)
			out = append(out, record{key: string(m.Key), eventID: doc.EventID, payload: string(m.Value)})
		case <-time.After(wait):
			return out
		case <-deadline:
			t.Fatalf("read %d of %d messages", len(out), want)
		}
	}
}

func req() orderservice.ConfirmRequest {
	return orderservice.ConfirmRequest{CustomerID: 42, TotalAmount: decimal.RequireFromString("12.30")}
}

func TestRolledBackOrderPublishesNothingCommittedOnePublishesOnce(t *testing.T) {
	f := setup(t)
	ctx := context.Background()
	pool := reftest.Postgres(t)

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.svc.ConfirmInTx(ctx, tx, req()); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	committed, err := f.svc.Confirm(ctx, req())
	if err != nil {
		t.Fatal(err)
	}
	f.runForwarder(t, f.kafkaPublisher(t))

	got := f.readTopic(t, 1, 2*time.Second)
	if len(got) != 1 || got[0].eventID != committed.EventID().String() || got[0].key != strconv.FormatInt(committed.OrderID(), 10) {
		t.Fatalf("topic holds %+v; want only the committed event, keyed by its order id", got)
	}
}

// publishThenHang publishes to Kafka and then never returns, as a forwarder
// that crashed after Kafka acknowledged but before it acknowledged the row.
type publishThenHang struct {
	message.Publisher
	published chan struct{}
	release   chan struct{}
}

func (p publishThenHang) Publish(topic string, msgs ...*message.Message) error {
	if err := p.Publisher.Publish(topic, msgs...); err != nil {
		return err
	}
	close(p.published)
	<-p.release
	return context.Canceled
}

func TestForwarderRestartedBetweenPublishAndAckRepublishesTheSameEventID(t *testing.T) {
	f := setup(t)
	ev, err := f.svc.Confirm(context.Background(), req())
	if err != nil {
		t.Fatal(err)
	}
	hang := publishThenHang{Publisher: f.kafkaPublisher(t), published: make(chan struct{}), release: make(chan struct{})}
	stop := f.runForwarder(t, hang)
	select {
	case <-hang.published:
	case <-time.After(60 * time.Second):
		t.Fatal("the first forwarder did not publish")
	}
	go stop() // the router waits for the hanging handler until released
	time.Sleep(200 * time.Millisecond)
	close(hang.release)
	stop()

	f.runForwarder(t, f.kafkaPublisher(t))
	got := f.readTopic(t, 2, 3*time.Second)
	if len(got) != 2 {
		t.Fatalf("topic holds %d messages, want 2 (the publish before the crash and its repeat)", len(got))
	}
	for _, r := range got {
		if r.eventID != ev.EventID().String() || r.payload != got[0].payload || r.key != strconv.FormatInt(ev.OrderID(), 10) {
			t.Fatalf("messages %+v; want the same event id, bytes and key twice", got)
		}
	}
}

func TestOrderRowAndEventShareTheTransaction(t *testing.T) {
	f := setup(t)
	ctx := context.Background()
	pool := reftest.Postgres(t)
	var ev interface{ EventID() uuid.UUID }
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		e, err := f.svc.ConfirmInTx(ctx, tx, req())
		ev = e
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	var stored uuid.UUID
	if err := pool.QueryRow(ctx, `SELECT confirmed_event_id FROM orders.orders WHERE confirmed_event_id = $1`, ev.EventID()).Scan(&stored); err != nil {
		t.Fatalf("order row: %v", err)
	}
}

// Forwarded rows are pruned; a row the forwarder has not acknowledged stays
// whatever its age.
func TestPruneOutboxDeletesOnlyForwardedRows(t *testing.T) {
	f := setup(t)
	ctx := context.Background()
	for range 3 {
		if _, err := f.svc.Confirm(ctx, req()); err != nil {
			t.Fatal(err)
		}
	}
	stop := f.runForwarder(t, f.kafkaPublisher(t))
	f.readTopic(t, 3, time.Second)
	stop()
	if _, err := f.svc.Confirm(ctx, req()); err != nil { // not forwarded
		t.Fatal(err)
	}
	time.Sleep(10 * time.Millisecond)
	n, err := f.svc.PruneOutbox(ctx, 0, 2)
	if err != nil {
		t.Fatal(err)
	}
	if n != 3 {
		t.Fatalf("pruned %d rows, want the 3 forwarded ones", n)
	}
	f.runForwarder(t, f.kafkaPublisher(t))
	if got := f.readTopic(t, 4, 2*time.Second); len(got) != 4 {
		t.Fatalf("topic holds %d events, want 4: the unforwarded row must survive pruning", len(got))
	}
}

// A cancellation writes its event through the outbox with the order's key,
// once: a second cancellation is refused and publishes nothing, and an order
// that does not exist cannot be cancelled.
func TestCancelPublishesOnceAfterTheConfirmation(t *testing.T) {
	f := setup(t)
	ctx := context.Background()
	ev, err := f.svc.Confirm(ctx, req())
	if err != nil {
		t.Fatal(err)
	}
	c, err := f.svc.Cancel(ctx, ev.OrderID(), "changed my mind")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.svc.Cancel(ctx, ev.OrderID(), "again"); !errors.Is(err, orderservice.ErrAlreadyCancelled) {
		t.Fatalf("second cancellation: %v, want ErrAlreadyCancelled", err)
	}
	if _, err := f.svc.Cancel(ctx, -1, ""); !errors.Is(err, orderservice.ErrNotFound) {
		t.Fatalf("unknown order: %v, want ErrNotFound", err)
	}
	f.runForwarder(t, f.kafkaPublisher(t))
	got := f.readTopic(t, 2, 2*time.Second)
	key := strconv.FormatInt(ev.OrderID(), 10)
	if len(got) != 2 || got[0].eventID != ev.EventID().String() || got[1].eventID != c.EventID().String() || got[0].key != key || got[1].key != key {
		t.Fatalf("topic holds %+v; want the confirmation, then the one cancellation, keyed by the order", got)
	}
	if _, err := orderevents.DecodeCancelled([]byte(got[1].payload)); err != nil {
		t.Fatalf("the cancellation on the wire: %v", err)
	}
}
