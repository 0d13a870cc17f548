package reference_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/handlers/analytics"
	"github.com/once-dev/once/handlers/billing"
	"github.com/once-dev/once/internal/pipelinetest"
	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/orderevents"
	"github.com/once-dev/once/payment"
	"github.com/once-dev/once/pipeline"
)

// providerFor runs the payment provider simulator over real loopback HTTP and
// returns a client for a fresh account, and the number of charge requests.
func providerFor(t *testing.T, e *env, faults payment.Faults, client payment.ClientConfig) (*payment.Client, *atomic.Int64) {
	t.Helper()
	// A pool of its own: in production the provider is another company's
	// service, and sharing the consumers' pool could starve it.
	p, err := payment.NewProvider(payment.ProviderConfig{DB: reftest.Postgres(t), Faults: faults})
	if err != nil {
		t.Fatal(err)
	}
	var requests atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			requests.Add(1)
		}
		p.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	client.BaseURL, client.APIKey = srv.URL, "acct_"+uuid.NewString()[:8]
	c, err := payment.NewClient(client)
	if err != nil {
		t.Fatal(err)
	}
	return c, &requests
}

// The provider charges and then drops the connection. The client is allowed
// one attempt, so the handler fails, the consumer's transaction (with the
// claim) rolls back, and the event is delivered to the handler again: the
// provider sees the same key a second time and replays the stored charge.
func TestReplyThenResetChargesOnce(t *testing.T) {
	e := newEnv(t, 1)
	client, requests := providerFor(t, e, payment.Faults{ResetAfterChargeRate: 1}, payment.ClientConfig{MaxAttempts: 1})
	group := pipelinetest.UniqueGroup("billing")
	var seen pipelinetest.Outcomes
	cfg := e.config(pipeline.Group[orderevents.Confirmed]{Name: group, Handle: billing.Handler{Payments: client, Currency: "EUR", DB: e.Pool}.OnConfirmed})
	cfg.HoldBackoff = 10 * time.Millisecond
	cfg.Hooks.OnResult = seen.Record
	pipelinetest.Run(t, cfg)

	ev := validEvent(t, "49.90")
	testenv.Publish(t, e.Prod, e.Topic, fmt.Sprint(ev.OrderID()), payload(t, ev))
	testenv.Eventually(t, 60*time.Second, "the event processed", func() bool { return seen.Get(group, idempotency.Processed) == 1 })

	if f := seen.Get(group, idempotency.Failed); f != 1 {
		t.Fatalf("%d failed attempts, want 1 (the reset)", f)
	}
	if n := requests.Load(); n != 2 {
		t.Fatalf("provider saw %d requests, want 2 with the same key", n)
	}
	l, err := client.Ledger(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if l.Count != 1 || l.Charges[0].IdempotencyKey != ev.EventID().String() {
		t.Fatalf("ledger %+v; want exactly one charge keyed by the event id", l)
	}
	var status string
	if err := e.Pool.QueryRow(context.Background(), `SELECT status FROM billing.payments WHERE event_id = $1`, ev.EventID()).Scan(&status); err != nil || status != "charged" {
		t.Fatalf("billing payment %q, %v; want charged", status, err)
	}
}

// 1,000 events, each published twice, through billing and analytics: one
// charge per event summing to the orders' total, analytics revenue equal to
// the same total, and one claim per event and group.
// Batched, analytics sums each batch's orders per customer and day in one
// statement (analytics.Handler.OnConfirmedBatch).
func TestThousandEventsPublishedTwiceThroughBothGroups(t *testing.T) { eachMode(t, testThousandEvents) }

func testThousandEvents(t *testing.T, batched bool) {
	const events = 1000
	e := newEnv(t, 6)
	client, _ := providerFor(t, e, payment.Faults{}, payment.ClientConfig{})
	billingGroup, analyticsGroup := pipelinetest.UniqueGroup("billing"), pipelinetest.UniqueGroup("analytics")
	var seen pipelinetest.Outcomes
	analyticsOf := pipeline.Group[orderevents.Confirmed]{Name: analyticsGroup, Handle: analytics.Handler{}.OnConfirmed}
	if batched {
		analyticsOf = pipeline.Group[orderevents.Confirmed]{Name: analyticsGroup, HandleBatch: analytics.Handler{}.OnConfirmedBatch}
	}
	cfg := e.config(
		pipeline.Group[orderevents.Confirmed]{Name: billingGroup, Handle: billing.Handler{Payments: client, Currency: "EUR", DB: e.Pool}.OnConfirmed},
		analyticsOf,
	)
	cfg.Hooks.OnResult = seen.Record
	// The group commit must really have batched: a batcher bypassed (every
	// event on its own) passes every other check here.
	var batches, largest atomic.Int64
	cfg.Hooks.OnBatch = func(b pipeline.BatchDone) {
		batches.Add(1)
		for l := largest.Load(); int64(b.Size) > l && !largest.CompareAndSwap(l, int64(b.Size)); l = largest.Load() {
		}
	}

	customers := make([]int64, 37)
	first := 1 + rand.Int64N(1<<50)
	for i := range customers {
		customers[i] = first + int64(i)
	}
	total := decimal.Zero
	batch := make([]orderevents.Confirmed, events)
	for i := range batch {
		amount := decimal.New(int64(100+i*7%9000), -2) // 1.00 .. 90.99
		ev, err := orderevents.NewConfirmed(uuid.Must(uuid.NewV7()), time.Now(), 1+rand.Int64N(1<<62), customers[i%len(customers)], amount)
		if err != nil {
			t.Fatal(err)
		}
		batch[i] = ev
		total = total.Add(amount)
	}
	start := time.Now()
	pipelinetest.Run(t, cfg)
	for round := range 2 {
		for _, ev := range batch {
			testenv.Publish(t, e.Prod, e.Topic, fmt.Sprintf("%d-%d", ev.OrderID(), round), payload(t, ev))
		}
	}
	for _, g := range []string{billingGroup, analyticsGroup} {
		testenv.Eventually(t, 5*time.Minute, g+" saw 2,000 deliveries", func() bool {
			return seen.Get(g, idempotency.Processed)+seen.Get(g, idempotency.Duplicate) == 2*events
		})
		if p, d := seen.Get(g, idempotency.Processed), seen.Get(g, idempotency.Duplicate); p != events || d != events {
			t.Fatalf("%s: %d processed, %d duplicates; want %d each", g, p, d, events)
		}
	}
	t.Logf("2 x %d events through 2 groups in %s", events, time.Since(start).Round(time.Millisecond))
	if batched {
		// 2,000 deliveries on 6 partitions: batches of more than the 6
		// messages one per partition would allow.
		if batches.Load() == 0 || batches.Load() >= 2*events || largest.Load() <= 6 {
			t.Fatalf("analytics ran %d batches, the largest of %d; want batches larger than one message per partition", batches.Load(), largest.Load())
		}
		t.Logf("analytics: %d batches, the largest of %d", batches.Load(), largest.Load())
	} else if batches.Load() != 0 {
		t.Fatalf("%d batches in per-event mode", batches.Load())
	}

	l, err := client.Ledger(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if l.Count != events || l.Totals["EUR"] != total.StringFixed(2) {
		t.Fatalf("ledger: %d charges totalling %s; want %d totalling %s", l.Count, l.Totals["EUR"], events, total.StringFixed(2))
	}
	var revenue decimal.Decimal
	var orders int
	if err := e.Pool.QueryRow(context.Background(), `SELECT coalesce(sum(revenue), 0), coalesce(sum(order_count), 0)
		FROM analytics.customer_daily_revenue WHERE customer_id = ANY($1)`, customers).Scan(&revenue, &orders); err != nil {
		t.Fatal(err)
	}
	if !revenue.Equal(total) || orders != events {
		t.Fatalf("analytics: %s over %d orders; want %s over %d", revenue, orders, total, events)
	}
	for _, g := range []string{billingGroup, analyticsGroup} {
		var claims int
		if err := e.Pool.QueryRow(context.Background(), `SELECT count(*) FROM processed_event WHERE consumer_group = $1`, g).Scan(&claims); err != nil {
			t.Fatal(err)
		}
		if claims != events {
			t.Fatalf("%s: %d rows in processed_event, want %d", g, claims, events)
		}
	}
}
