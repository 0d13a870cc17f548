package billing_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/oncetest"
	"github.com/once-dev/once/service/billing"
	"github.com/once-dev/once/service/order"
	"github.com/once-dev/once/service/payment"
)

// fixture is billing behind the real idempotency middleware (package
// oncetest): each delivery commits or rolls back as in production.
type fixture struct {
	pool    *pgxpool.Pool
	client  *payment.Client
	harness *oncetest.Harness[order.Confirmed]
}

func setup(t *testing.T) *fixture {
	t.Helper()
	pool := testenv.Postgres(t)
	p, err := payment.NewProvider(payment.ProviderConfig{DB: pool, DeclineAbove: decimal.NewFromInt(500)})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(p)
	t.Cleanup(srv.Close)
	c, err := payment.NewClient(payment.ClientConfig{BaseURL: srv.URL, APIKey: "acct_" + uuid.NewString()[:8]})
	if err != nil {
		t.Fatal(err)
	}
	h := billing.Handler{Payments: c, Currency: "EUR"}
	return &fixture{pool: pool, client: c, harness: oncetest.New(t, oncetest.Config[order.Confirmed]{DB: pool, Handle: h.Handle})}
}

// newOrderID is unique across test runs on one database: billing keeps one
// payment per order.
func newOrderID() int64 { return 1 + rand.Int64N(1<<62) }

func event(t *testing.T, orderID int64, amount string) order.Confirmed {
	t.Helper()
	ev, err := order.NewConfirmed(uuid.Must(uuid.NewV7()), time.Now(), orderID, 7, decimal.RequireFromString(amount))
	if err != nil {
		t.Fatal(err)
	}
	return ev
}

func storedPayment(t *testing.T, pool *pgxpool.Pool, orderID int64) (status string, chargeID, reason *string, currency string) {
	t.Helper()
	err := pool.QueryRow(context.Background(), `SELECT status, provider_charge_id, failure_reason, currency FROM billing.payments WHERE order_id = $1`, orderID).
		Scan(&status, &chargeID, &reason, &currency)
	if err != nil {
		t.Fatal(err)
	}
	return
}

func payments(t *testing.T, pool *pgxpool.Pool, orderID int64) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM billing.payments WHERE order_id = $1`, orderID).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestChargesOnceAndRecordsThePayment(t *testing.T) {
	f := setup(t)
	ev := event(t, newOrderID(), "99.95")
	f.harness.DeliverTwice(ev)
	status, chargeID, _, currency := storedPayment(t, f.pool, ev.OrderID())
	l, err := f.client.Ledger(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if status != "charged" || chargeID == nil || currency != "EUR" || l.Count != 1 || l.Charges[0].ChargeID != *chargeID ||
		l.Charges[0].IdempotencyKey != ev.EventID().String() || l.Charges[0].Currency != "EUR" || l.Charges[0].Amount != "99.95" {
		t.Fatalf("payment %s %v %s, ledger %+v; want one EUR charge keyed by the event id and recorded", status, chargeID, currency, l)
	}
}

// A decline is committed as a failed payment with the claim, and the
// delivery is dead-lettered with the provider's reason; a redelivery changes
// nothing.
func TestDeclineIsRecordedAsFailedAndDeadLettered(t *testing.T) {
	f := setup(t)
	ev := event(t, newOrderID(), "500.01")
	first, _ := f.harness.DeliverTwice(ev)
	var perr *payment.Error
	var rejected *idempotency.RejectedError
	if !first.DeadLettered() || !errors.As(first.Err, &rejected) || !errors.As(first.Err, &perr) || perr.Code != "card_declined" {
		t.Fatalf("got %v; want a rejection carrying the provider's card_declined", first.Err)
	}
	status, _, reason, _ := storedPayment(t, f.pool, ev.OrderID())
	if status != "failed" || reason == nil || !f.harness.Claimed(ev) {
		t.Fatalf("payment %s (%v); want failed with the reason, committed with the claim", status, reason)
	}
}

func TestSecondEventForAChargedOrderIsRefusedWithoutCharging(t *testing.T) {
	f := setup(t)
	orderID := newOrderID()
	f.harness.DeliverTwice(event(t, orderID, "10.00"))
	second := event(t, orderID, "10.00")
	d := f.harness.Deliver(second)
	if !d.DeadLettered() || f.harness.Claimed(second) {
		t.Fatalf("got %v; want a permanent refusal that leaves no claim", d.Err)
	}
	if l, _ := f.client.Ledger(context.Background()); l.Count != 1 || payments(t, f.pool, orderID) != 1 {
		t.Fatalf("ledger has %d charges, want 1", l.Count)
	}
}

// A provider that cannot be reached is no reason to record anything: the
// delivery rolls back (claim included) and the next one charges.
func TestUnreachableProviderRollsBackAndTheNextDeliveryCharges(t *testing.T) {
	pool := testenv.Postgres(t)
	p, err := payment.NewProvider(payment.ProviderConfig{DB: pool})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(p)
	url := srv.URL
	srv.Close() // nothing listens there now
	down, err := payment.NewClient(payment.ClientConfig{BaseURL: url, MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	group := "billing-" + uuid.NewString()[:8]
	ev := event(t, newOrderID(), "12.00")
	h := oncetest.New(t, oncetest.Config[order.Confirmed]{DB: pool, Group: group, Handle: billing.Handler{Payments: down, Currency: "EUR"}.Handle})
	d := h.Deliver(ev)
	if d.Err == nil || d.DeadLettered() || h.Claimed(ev) || payments(t, pool, ev.OrderID()) != 0 {
		t.Fatalf("got %v (dead-lettered %v); want a retryable error with nothing committed", d.Err, d.DeadLettered())
	}

	srv = httptest.NewServer(p)
	t.Cleanup(srv.Close)
	up, err := payment.NewClient(payment.ClientConfig{BaseURL: srv.URL})
	if err != nil {
		t.Fatal(err)
	}
	h = oncetest.New(t, oncetest.Config[order.Confirmed]{DB: pool, Group: group, Handle: billing.Handler{Payments: up, Currency: "EUR"}.Handle})
	h.DeliverTwice(ev)
	if status, _, _, _ := storedPayment(t, pool, ev.OrderID()); status != "charged" {
		t.Fatalf("payment %s after the provider came back, want charged", status)
	}
}

func TestCurrencyIsValidated(t *testing.T) {
	for _, c := range []string{"", "eur", "EURO"} {
		if err := (billing.Handler{Payments: &payment.Client{}, Currency: c}).Validate(); err == nil {
			t.Errorf("currency %q accepted", c)
		}
	}
}
