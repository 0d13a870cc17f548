// Package demo runs the whole system in one process against real Kafka and
// PostgreSQL and proves, at the end, that every order was charged once and
// counted once although duplicates arrived from every real source: a producer
// re-publishing events, a dead-letter replay, a consumer group reset to the
// earliest offset and restarted, and a payment provider that drops
// connections after charging.
package demo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/internal/progress"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/pipeline"
	"github.com/once-dev/once/service/analytics"
	"github.com/once-dev/once/service/billing"
	"github.com/once-dev/once/service/order"
	"github.com/once-dev/once/service/orders"
	"github.com/once-dev/once/service/payment"
)

// Config configures a demo run. Zero values of optional fields work.
type Config struct {
	DB *pgxpool.Pool
	// ProviderDB is the payment provider simulator's pool: in production it
	// is another company's database, and sharing a pool with consumers that
	// hold transactions across the HTTP call could starve it.
	ProviderDB   *pgxpool.Pool
	Brokers      []string
	KafkaVersion string
	Partitions   int32

	Orders         int     // default 10,000
	Workers        int     // concurrent order confirmations, default 8
	RepublishShare float64 // share of events a producer re-publishes, default 0.05
	DeclineShare   float64 // share of orders above the provider's decline limit, default 0.005
	PoisonMessages int     // malformed messages injected, default 24
	ResetRate      float64 // provider drops the connection after charging, default 0.02
	Timeout        time.Duration

	Progress io.Writer // a live status line; nil for none
	Logger   *slog.Logger
}

func (c *Config) setDefaults() {
	if c.Orders == 0 {
		c.Orders = 10000
	}
	if c.Workers == 0 {
		c.Workers = 8
	}
	if c.RepublishShare == 0 {
		c.RepublishShare = 0.05
	}
	if c.DeclineShare == 0 {
		c.DeclineShare = 0.005
	}
	if c.PoisonMessages == 0 {
		c.PoisonMessages = 24
	}
	if c.ResetRate == 0 {
		c.ResetRate = 0.02
	}
	if c.Partitions == 0 {
		c.Partitions = 6
	}
	if c.KafkaVersion == "" {
		c.KafkaVersion = pipeline.DefaultKafkaVersion
	}
	if c.Timeout == 0 {
		c.Timeout = 15 * time.Minute
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Currency billing charges in: the guide's events carry none.
const Currency = "EUR"

// declineAbove is the simulator's limit; declined orders are priced above it.
var declineAbove = decimal.NewFromInt(10000)

// run holds one demo run's state.
type run struct {
	cfg      Config
	id       string
	topic    string
	dlqTopic string
	groups   [2]string // billing, analytics
	version  sarama.KafkaVersion
	progress *progress.Line
	client   *payment.Client
	provider *payment.Provider
	counts   *counters

	mu        sync.Mutex
	events    []order.Confirmed
	customers []int64
}

// Run executes the demo and returns its summary. An error means the demo
// could not run; a run that ran but found a double or a loss returns a
// Summary whose Pass is false.
func Run(ctx context.Context, cfg Config) (Summary, error) {
	cfg.setDefaults()
	if cfg.DB == nil || cfg.ProviderDB == nil || len(cfg.Brokers) == 0 {
		return Summary{}, errors.New("demo: DB, ProviderDB and Brokers are required")
	}
	version, err := pipeline.ParseKafkaVersion(cfg.KafkaVersion)
	if err != nil {
		return Summary{}, err
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()

	id := uuid.NewString()[:8]
	r := &run{
		cfg:      cfg,
		id:       id,
		topic:    "order.confirmed.v1.demo-" + id,
		dlqTopic: "order.confirmed.v1.demo-" + id + ".dlq",
		groups:   [2]string{"billing.demo-" + id, "analytics.demo-" + id},
		version:  version,
		progress: progress.New(cfg.Progress),
		counts:   newCounters(),
	}
	// Customers of this run only: analytics' totals are per customer.
	first := (1 + rand.Int64N(1<<40)) * 1000
	for i := range int64(200) {
		r.customers = append(r.customers, first+i)
	}
	defer r.progress.Done()
	return r.execute(ctx)
}

func (r *run) execute(ctx context.Context) (Summary, error) {
	start := time.Now()
	if err := pipeline.EnsureTopics(ctx, r.cfg.Brokers, r.version, r.cfg.Partitions, 1, r.topic, r.dlqTopic); err != nil {
		return Summary{}, err
	}

	// The payment provider simulator, over real loopback HTTP.
	stopProvider, err := r.startProvider(ctx)
	if err != nil {
		return Summary{}, err
	}
	defer stopProvider()

	// Both consumer groups, each in a pipeline of its own so that one can be
	// stopped and reset while the other keeps running.
	stopBilling, err := r.startGroup(ctx, r.groups[0], billing.Handler{Payments: r.client, Currency: Currency}.Handle)
	if err != nil {
		return Summary{}, err
	}
	defer stopBilling()
	stopAnalytics, err := r.startGroup(ctx, r.groups[1], analytics.Handler{}.Handle)
	if err != nil {
		return Summary{}, err
	}
	defer func() { stopAnalytics() }()

	// The order service and its outbox forwarder.
	svc, stopForwarder, err := r.startOrders(ctx)
	if err != nil {
		return Summary{}, err
	}
	defer stopForwarder()

	raw, err := sarama.NewSyncProducer(r.cfg.Brokers, pipeline.PublisherSaramaConfig(r.version))
	if err != nil {
		return Summary{}, fmt.Errorf("demo: producer: %w", err)
	}
	defer raw.Close()

	if err := r.confirmOrders(ctx, svc, raw); err != nil {
		return Summary{}, err
	}
	if err := r.waitProcessed(ctx, "consuming"); err != nil {
		return Summary{}, err
	}

	// Source 1: a producer re-publishes a share of the events.
	republished, err := r.republish(ctx, raw)
	if err != nil {
		return Summary{}, err
	}
	// Source 2: the dead-letter topic is replayed (declined charges, poison).
	r.progress.Set("replaying the dead-letter topic")
	replay, err := dlq.Replay(ctx, dlq.Config{Brokers: r.cfg.Brokers, Sarama: pipeline.PublisherSaramaConfig(r.version),
		DLQTopic: r.dlqTopic, Topic: r.topic, Group: "dlq-replay.demo-" + r.id})
	if err != nil {
		return Summary{}, err
	}
	// Source 3: analytics' offsets are reset to the earliest and it restarts.
	r.progress.Set("stopping %s", r.groups[1])
	stopAnalytics()
	r.progress.Set("resetting %s to the earliest offsets", r.groups[1])
	if err := r.resetToEarliest(r.groups[1]); err != nil {
		return Summary{}, err
	}
	r.progress.Set("restarting %s", r.groups[1])
	if stopAnalytics, err = r.startGroup(ctx, r.groups[1], analytics.Handler{}.Handle); err != nil {
		return Summary{}, err
	}
	if err := r.waitLagZero(ctx); err != nil {
		return Summary{}, err
	}
	r.progress.Done()
	return r.summarize(ctx, republished, replay, time.Since(start))
}

func (r *run) startProvider(ctx context.Context) (stop func(), err error) {
	provider, err := payment.NewProvider(payment.ProviderConfig{DB: r.cfg.ProviderDB, DeclineAbove: declineAbove,
		Faults: payment.Faults{ResetAfterChargeRate: r.cfg.ResetRate}, Logger: r.cfg.Logger})
	if err != nil {
		return nil, err
	}
	r.provider = provider
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	srv := &http.Server{Handler: provider, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	r.client, err = payment.NewClient(payment.ClientConfig{BaseURL: "http://" + ln.Addr().String(), APIKey: "acct_demo_" + r.id})
	if err != nil {
		return nil, err
	}
	return func() { _ = srv.Shutdown(context.WithoutCancel(ctx)) }, nil
}

func (r *run) startGroup(ctx context.Context, group string, handle pipeline.HandlerFunc[order.Confirmed]) (stop func(), err error) {
	p, err := pipeline.New(pipeline.Config{
		Brokers:      r.cfg.Brokers,
		KafkaVersion: r.cfg.KafkaVersion,
		DB:           r.cfg.DB,
		Topics: []pipeline.Binding{pipeline.Topic[order.Confirmed]{
			Name: r.topic, DLQ: r.dlqTopic, Decode: order.DecodeConfirmed,
			Groups: []pipeline.Group[order.Confirmed]{{Name: group, Handle: handle}},
		}},
		Logger:       r.cfg.Logger,
		OnResult:     r.counts.result,
		OnDeadLetter: func(d pipeline.DeadLetter) { r.counts.add(d.Group, "dead_lettered") },
		OnDelivered:  func(d pipeline.Delivery) { r.counts.add(d.Group, "delivered") },
	})
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		if err := p.Run(ctx); err != nil {
			r.cfg.Logger.Error("pipeline stopped", "group", group, "err", err)
		}
		close(done)
	}()
	select {
	case <-p.Running():
	case <-done:
		cancel()
		return nil, fmt.Errorf("demo: group %s stopped at start-up", group)
	}
	var once sync.Once
	return func() { once.Do(func() { cancel(); <-done }) }, nil
}

func (r *run) startOrders(ctx context.Context) (*orders.Service, func(), error) {
	svc, err := orders.NewService(orders.Config{DB: r.cfg.DB, Topic: r.topic, Logger: r.cfg.Logger})
	if err != nil {
		return nil, nil, err
	}
	if err := svc.Init(ctx); err != nil {
		return nil, nil, err
	}
	pub, err := orders.NewKafkaPublisher(r.cfg.Brokers, pipeline.PublisherSaramaConfig(r.version), nil)
	if err != nil {
		return nil, nil, err
	}
	fw, err := svc.NewForwarder(pub)
	if err != nil {
		pub.Close()
		return nil, nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { _ = fw.Run(ctx); close(done) }()
	<-fw.Running()
	return svc, func() { cancel(); <-done; pub.Close() }, nil
}

// confirmOrders confirms the orders with several workers and injects the
// poison messages along the way, so they sit in the middle of partitions.
func (r *run) confirmOrders(ctx context.Context, svc *orders.Service, raw sarama.SyncProducer) error {
	var next atomic.Int64
	poisonEvery := int64(r.cfg.Orders / (r.cfg.PoisonMessages + 1))
	errc := make(chan error, r.cfg.Workers)
	var wg sync.WaitGroup
	for range r.cfg.Workers {
		wg.Go(func() {
			for {
				i := next.Add(1)
				if i > int64(r.cfg.Orders) || ctx.Err() != nil {
					return
				}
				amount := decimal.New(100+rand.Int64N(50000), -2) // 1.00 .. 500.99
				if rand.Float64() < r.cfg.DeclineShare {
					amount = declineAbove.Add(decimal.New(1+rand.Int64N(1000000), -2))
				}
				ev, err := svc.Confirm(ctx, orders.ConfirmRequest{
					CustomerID: r.customers[rand.IntN(len(r.customers))], TotalAmount: amount})
				if err != nil {
					errc <- err
					return
				}
				r.mu.Lock()
				r.events = append(r.events, ev)
				r.mu.Unlock()
				if poisonEvery > 0 && i%poisonEvery == 0 && i/poisonEvery <= int64(r.cfg.PoisonMessages) {
					if err := r.sendPoison(raw, int(i/poisonEvery)); err != nil {
						errc <- err
						return
					}
				}
				r.progress.Set("confirming orders: %d/%d", i, r.cfg.Orders)
			}
		})
	}
	wg.Wait()
	close(errc)
	return <-errc
}

// poison returns the n-th kind of message that can never be processed.
func poison(n int) []byte {
	switch n % 4 {
	case 0:
		return []byte(`{"event_id": "truncated`)
	case 1:
		return fmt.Appendf(nil, `{"event_id":%q,"event_type":"order.confirmed.v1","occurred_at":"2026-12-02T10:00:00Z","order_id":1,"customer_id":2,"total_amount":"5.00"}`,
			uuid.New()) // a UUIDv4 id
	case 2:
		return fmt.Appendf(nil, `{"event_id":%q,"event_type":"order.confirmed.v1","occurred_at":"2026-12-02T10:00:00Z","order_id":1,"customer_id":2,"total_amount":"-5.00"}`,
			uuid.Must(uuid.NewV7()))
	default:
		return fmt.Appendf(nil, `{"event_id":%q,"event_type":"order.confirmed.v1","occurred_at":"2026-12-02T10:00:00Z","order_id":"1","customer_id":2,"total_amount":"5.00"}`,
			uuid.Must(uuid.NewV7())) // order_id as a string
	}
}

func (r *run) sendPoison(raw sarama.SyncProducer, n int) error {
	_, _, err := raw.SendMessage(&sarama.ProducerMessage{Topic: r.topic, Key: sarama.StringEncoder(fmt.Sprintf("poison-%d", n)), Value: sarama.ByteEncoder(poison(n))})
	if err != nil {
		return fmt.Errorf("demo: send poison message: %w", err)
	}
	r.counts.add("", "poison_sent")
	return nil
}

// republish sends a share of the events again, as a producer retrying without
// idempotence would: same bytes, same key.
func (r *run) republish(ctx context.Context, raw sarama.SyncProducer) (int, error) {
	n := int(float64(len(r.events)) * r.cfg.RepublishShare)
	for i, ev := range r.events[:n] {
		if ctx.Err() != nil {
			return i, ctx.Err()
		}
		payload, err := ev.MarshalJSON()
		if err != nil {
			return i, err
		}
		if _, _, err := raw.SendMessage(&sarama.ProducerMessage{Topic: r.topic, Key: sarama.StringEncoder(strconv.FormatInt(ev.OrderID(), 10)), Value: sarama.ByteEncoder(payload)}); err != nil {
			return i, fmt.Errorf("demo: republish: %w", err)
		}
		r.progress.Set("re-publishing events: %d/%d", i+1, n)
	}
	return n, nil
}

// resetToEarliest commits the oldest offset of every partition for group, as
// kafka-consumer-groups.sh --reset-offsets --to-earliest does. The group must
// have no members.
func (r *run) resetToEarliest(group string) error {
	c := pipeline.PublisherSaramaConfig(r.version)
	client, err := sarama.NewClient(r.cfg.Brokers, c)
	if err != nil {
		return err
	}
	defer client.Close()
	om, err := sarama.NewOffsetManagerFromClient(group, client)
	if err != nil {
		return err
	}
	defer om.Close()
	partitions, err := client.Partitions(r.topic)
	if err != nil {
		return err
	}
	for _, p := range partitions {
		oldest, err := client.GetOffset(r.topic, p, sarama.OffsetOldest)
		if err != nil {
			return err
		}
		pom, err := om.ManagePartition(r.topic, p)
		if err != nil {
			return err
		}
		pom.ResetOffset(oldest, "reset to earliest by the demo")
	}
	om.Commit() // synchronous; closing each partition manager would wait for a tick
	return nil
}

// waitProcessed waits until both groups claimed every valid event.
func (r *run) waitProcessed(ctx context.Context, what string) error {
	want := len(r.events)
	for {
		b := r.counts.get(r.groups[0], idempotency.Processed.String()) + r.counts.get(r.groups[0], idempotency.Rejected.String())
		a := r.counts.get(r.groups[1], idempotency.Processed.String())
		r.progress.Set("%s: billing %d/%d, analytics %d/%d", what, b, want, a, want)
		if a >= want && b >= want {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("demo: %s: billing %d/%d, analytics %d/%d when time ran out: %w", what, b, want, a, want, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// waitLagZero waits until both groups committed offsets at the end of every
// partition: everything delivered was handled, and nothing is left.
func (r *run) waitLagZero(ctx context.Context) error {
	client, err := sarama.NewClient(r.cfg.Brokers, pipeline.PublisherSaramaConfig(r.version))
	if err != nil {
		return err
	}
	defer client.Close()
	admin, err := sarama.NewClusterAdminFromClient(client)
	if err != nil {
		return err
	}
	for {
		total := int64(0)
		for _, g := range r.groups {
			lag, err := pipeline.GroupLag(client, admin, g, r.topic)
			if err != nil {
				return err
			}
			total += lag
		}
		r.progress.Set("draining: consumer lag %d (analytics re-reads from the earliest offset)", total)
		if total == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("demo: consumer lag still %d when time ran out: %w", total, ctx.Err())
		case <-time.After(250 * time.Millisecond):
		}
	}
}
