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
	"github.com/prometheus/client_golang/prometheus"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once"
	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/internal/progress"
	"github.com/once-dev/once/internal/reference"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/orderevents"
	"github.com/once-dev/once/orderservice"
	"github.com/once-dev/once/outbox"
	"github.com/once-dev/once/payment"
	"github.com/once-dev/once/pipeline"
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
	CancelShare    float64 // share of orders cancelled, half at once, half after the charge; default 0.04
	Timeout        time.Duration

	Progress io.Writer // a live status line; nil for none
	Logger   *slog.Logger

	// Operations, each optional: Registry holds the metrics of every
	// service the demo runs, OnService is given each once it runs (its
	// Handler answers /readyz), OnPaymentAttempt is the payment client's
	// OnAttempt.
	Registry         *prometheus.Registry
	OnService        func(*once.Service)
	OnPaymentAttempt func(payment.Attempt)
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
	if c.CancelShare == 0 {
		c.CancelShare = 0.04
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
	cfg       Config
	id        string
	suffix    string // of every topic and group
	confirmed string // topics; each has a dead-letter topic, name + ".dlq"
	cancelled string
	payments  string
	billing   string // consumer groups
	analytics string
	version   sarama.KafkaVersion
	progress  *progress.Line
	client    *payment.Client
	provider  *payment.Provider
	counts    *counters

	mu        sync.Mutex
	events    []orderevents.Confirmed
	cancels   []orderevents.Cancelled
	customers []int64
}

func dlqOf(topic string) string { return topic + ".dlq" }

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
	suffix := ".demo-" + id
	r := &run{
		cfg:       cfg,
		id:        id,
		suffix:    suffix,
		confirmed: "order.confirmed.v1" + suffix,
		cancelled: "order.cancelled.v1" + suffix,
		payments:  "payment.events.v1" + suffix,
		billing:   "billing" + suffix,
		analytics: "analytics" + suffix,
		version:   version,
		progress:  progress.New(cfg.Progress),
		counts:    newCounters(),
	}
	// Customers of this run only: analytics' totals are per customer.
	first := (1 + rand.Int64N(1<<40)) * 1000
	for i := range int64(200) {
		r.customers = append(r.customers, first+i)
	}
	defer r.progress.Done()
	return r.execute(ctx)
}

func (r *run) topics() []string { return []string{r.confirmed, r.cancelled, r.payments} }

func (r *run) execute(ctx context.Context) (Summary, error) {
	start := time.Now()
	var all []string
	for _, t := range r.topics() {
		all = append(all, t, dlqOf(t))
	}
	if err := pipeline.EnsureTopics(ctx, r.cfg.Brokers, r.version, pipeline.KafkaSecurity{}, r.cfg.Partitions, 1, all...); err != nil {
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
	stopBilling, err := r.startBilling(ctx)
	if err != nil {
		return Summary{}, err
	}
	defer stopBilling()
	stopAnalytics, err := r.startAnalytics(ctx)
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

	// Orders, some cancelled at once (most of them before billing charged
	// them: the cancellation must block the charge, or, when it lost the
	// race, refund it).
	if err := r.confirmOrders(ctx, svc, raw); err != nil {
		return Summary{}, err
	}
	if err := r.waitProcessed(ctx, "consuming"); err != nil {
		return Summary{}, err
	}
	// More cancellations, now certainly after the charge: refunds.
	if err := r.cancelOrders(ctx, svc, r.cfg.CancelShare/2, "cancelling charged orders"); err != nil {
		return Summary{}, err
	}

	// Source 1: a producer re-publishes a share of the events.
	republished, err := r.republish(ctx, raw)
	if err != nil {
		return Summary{}, err
	}
	if err := r.waitLagZero(ctx, "draining"); err != nil {
		return Summary{}, err
	}
	// Source 2: the dead-letter topics are replayed (declined charges, poison).
	r.progress.Set("replaying the dead-letter topics")
	replay := dlq.Report{ByTopic: map[string]int64{}}
	for _, t := range r.topics() {
		rep, err := dlq.Replay(ctx, dlq.Config{Brokers: r.cfg.Brokers, Sarama: pipeline.PublisherSaramaConfig(r.version),
			DLQTopic: dlqOf(t), Topic: t, Group: "dlq-replay.demo-" + r.id})
		if err != nil {
			return Summary{}, err
		}
		replay.Replayed += rep.Replayed
	}
	// Source 3: analytics' offsets are reset to the earliest and it restarts.
	r.progress.Set("stopping %s", r.analytics)
	stopAnalytics()
	r.progress.Set("resetting %s to the earliest offsets", r.analytics)
	for _, t := range []string{r.confirmed, r.payments} {
		if err := r.resetToEarliest(r.analytics, t); err != nil {
			return Summary{}, err
		}
	}
	r.progress.Set("restarting %s", r.analytics)
	if stopAnalytics, err = r.startAnalytics(ctx); err != nil {
		return Summary{}, err
	}
	if err := r.waitLagZero(ctx, "draining (analytics re-reads from the earliest offset)"); err != nil {
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
	r.client, err = payment.NewClient(payment.ClientConfig{BaseURL: "http://" + ln.Addr().String(), APIKey: "acct_demo_" + r.id, OnAttempt: r.cfg.OnPaymentAttempt})
	if err != nil {
		return nil, err
	}
	return func() { _ = srv.Shutdown(context.WithoutCancel(ctx)) }, nil
}

func (r *run) startBilling(ctx context.Context) (stop func(), err error) {
	return r.startService(ctx, reference.Billing)
}

func (r *run) startAnalytics(ctx context.Context) (stop func(), err error) {
	return r.startService(ctx, reference.Analytics)
}

// startService runs one group of the reference service, as app serve
// would: billing, or analytics, which counts orders with the group commit
// (a hundred events per transaction) so that the demo's duplicates, poison
// and replays go through the batched mode's guarantees too.
func (r *run) startService(ctx context.Context, group string) (stop func(), err error) {
	svc, err := reference.New(ctx, reference.Config{
		Service: once.Config{
			Brokers: r.cfg.Brokers, KafkaVersion: r.cfg.KafkaVersion, DB: r.cfg.DB, Registry: r.cfg.Registry, Logger: r.cfg.Logger,
			MaintenanceInterval: -1,
			Hooks: once.Hooks{
				OnResult:     r.counts.result,
				OnDeadLetter: func(d pipeline.DeadLetter) { r.counts.add(d.Group, d.Topic, "dead_lettered") },
				OnDelivered:  func(d pipeline.Delivery) { r.counts.add(d.Group, d.Topic, "delivered") },
				OnForwarded:  func(f pipeline.Forwarded) { r.counts.add("", f.Topic, "forwarded") },
			},
		},
		Groups: []string{group}, GroupSuffix: r.suffix,
		ConfirmedTopic: r.confirmed, CancelledTopic: r.cancelled, PaymentTopic: r.payments,
		Currency: Currency, Payments: r.client, Concurrency: 6, AnalyticsBatch: 100,
	})
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		if err := svc.Run(ctx); err != nil {
			r.cfg.Logger.Error("service stopped", "group", group, "err", err)
		}
		close(done)
	}()
	select {
	case <-svc.Pipeline().Running():
	case <-done:
		cancel()
		svc.Close()
		return nil, fmt.Errorf("demo: %s stopped at start-up", group)
	}
	if r.cfg.OnService != nil {
		r.cfg.OnService(svc.Service)
	}
	var once sync.Once
	return func() { once.Do(func() { cancel(); <-done; svc.Close() }) }, nil
}

func (r *run) startOrders(ctx context.Context) (*orderservice.Service, func(), error) {
	svc, err := orderservice.NewService(orderservice.Config{DB: r.cfg.DB, Topic: r.confirmed, CancelledTopic: r.cancelled, Logger: r.cfg.Logger})
	if err != nil {
		return nil, nil, err
	}
	if err := svc.Init(ctx); err != nil {
		return nil, nil, err
	}
	producer, err := sarama.NewSyncProducer(r.cfg.Brokers, pipeline.PublisherSaramaConfig(r.version))
	if err != nil {
		return nil, nil, err
	}
	fw, err := svc.NewForwarder(outbox.KafkaPublisher{Producer: producer})
	if err != nil {
		producer.Close()
		return nil, nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { _ = fw.Run(ctx); close(done) }()
	<-fw.Running()
	return svc, func() { cancel(); <-done; producer.Close() }, nil
}

// confirmOrders confirms the orders with several workers, cancels a share
// of them right after their confirmation, and injects the poison messages
// along the way, so they sit in the middle of partitions.
func (r *run) confirmOrders(ctx context.Context, svc *orderservice.Service, raw sarama.SyncProducer) error {
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
				ev, err := svc.Confirm(ctx, orderservice.ConfirmRequest{
					CustomerID: r.customers[rand.IntN(len(r.customers))], TotalAmount: amount})
				if err != nil {
					errc <- err
					return
				}
				r.mu.Lock()
				r.events = append(r.events, ev)
				r.mu.Unlock()
				if rand.Float64() < r.cfg.CancelShare/2 {
					if err := r.cancel(ctx, svc, ev.OrderID(), "changed my mind"); err != nil {
						errc <- err
						return
					}
				}
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

func (r *run) cancel(ctx context.Context, svc *orderservice.Service, orderID int64, reason string) error {
	ev, err := svc.Cancel(ctx, orderID, reason)
	if err != nil {
		return err
	}
	r.mu.Lock()
	r.cancels = append(r.cancels, ev)
	r.mu.Unlock()
	return nil
}

// cancelOrders cancels a share of the orders not cancelled yet.
func (r *run) cancelOrders(ctx context.Context, svc *orderservice.Service, share float64, what string) error {
	r.mu.Lock()
	done := map[int64]bool{}
	for _, c := range r.cancels {
		done[c.OrderID()] = true
	}
	var pick []int64
	for _, ev := range r.events {
		if !done[ev.OrderID()] && rand.Float64() < share {
			pick = append(pick, ev.OrderID())
		}
	}
	r.mu.Unlock()
	for i, id := range pick {
		if err := r.cancel(ctx, svc, id, "returned"); err != nil {
			return err
		}
		r.progress.Set("%s: %d/%d", what, i+1, len(pick))
	}
	return nil
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
	_, _, err := raw.SendMessage(&sarama.ProducerMessage{Topic: r.confirmed, Key: sarama.StringEncoder(fmt.Sprintf("poison-%d", n)), Value: sarama.ByteEncoder(poison(n))})
	if err != nil {
		return fmt.Errorf("demo: send poison message: %w", err)
	}
	r.counts.add("", "", "poison_sent")
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
		if _, _, err := raw.SendMessage(&sarama.ProducerMessage{Topic: r.confirmed, Key: sarama.StringEncoder(strconv.FormatInt(ev.OrderID(), 10)), Value: sarama.ByteEncoder(payload)}); err != nil {
			return i, fmt.Errorf("demo: republish: %w", err)
		}
		r.progress.Set("re-publishing events: %d/%d", i+1, n)
	}
	return n, nil
}

// resetToEarliest commits the oldest offset of every partition of topic for
// group, as kafka-consumer-groups.sh --reset-offsets --to-earliest does. The
// group must have no members.
func (r *run) resetToEarliest(group, topic string) error {
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
	partitions, err := client.Partitions(topic)
	if err != nil {
		return err
	}
	for _, p := range partitions {
		oldest, err := client.GetOffset(topic, p, sarama.OffsetOldest)
		if err != nil {
			return err
		}
		pom, err := om.ManagePartition(topic, p)
		if err != nil {
			return err
		}
		pom.ResetOffset(oldest, "reset to earliest by the demo")
	}
	om.Commit() // synchronous; closing each partition manager would wait for a tick
	return nil
}

// waitProcessed waits until both groups claimed every valid confirmation.
func (r *run) waitProcessed(ctx context.Context, what string) error {
	want := len(r.events)
	for {
		b := r.counts.get(r.billing, r.confirmed, idempotency.Processed.String()) + r.counts.get(r.billing, r.confirmed, idempotency.Rejected.String())
		a := r.counts.get(r.analytics, r.confirmed, idempotency.Processed.String())
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

// waitLagZero waits until every group committed offsets at the end of every
// partition of every topic it reads, and no dead letter waits in the
// database: everything delivered was handled, and nothing is left.
func (r *run) waitLagZero(ctx context.Context, what string) error {
	client, err := sarama.NewClient(r.cfg.Brokers, pipeline.PublisherSaramaConfig(r.version))
	if err != nil {
		return err
	}
	defer client.Close()
	admin, err := sarama.NewClusterAdminFromClient(client)
	if err != nil {
		return err
	}
	pairs := [][2]string{{r.billing, r.confirmed}, {r.billing, r.cancelled}, {r.analytics, r.confirmed}, {r.analytics, r.payments}}
	for {
		total := int64(0)
		_ = client.RefreshMetadata(r.topics()...)
		for _, p := range pairs {
			lag, err := pipeline.GroupLag(client, admin, p[0], p[1])
			if err != nil {
				return err
			}
			total += lag
		}
		var parked int64
		if err := r.cfg.DB.QueryRow(ctx, `SELECT count(*) FROM once_dead_letter WHERE topic = ANY($1)`,
			[]string{dlqOf(r.confirmed), dlqOf(r.cancelled), dlqOf(r.payments)}).Scan(&parked); err != nil {
			return err
		}
		r.progress.Set("%s: consumer lag %d, dead letters waiting %d", what, total, parked)
		if total == 0 && parked == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("demo: consumer lag still %d, %d dead letters waiting, when time ran out: %w", total, parked, ctx.Err())
		case <-time.After(250 * time.Millisecond):
		}
	}
}
