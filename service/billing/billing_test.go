package billing_test

import (
	"context"
	"errors"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/service/billing"
	"github.com/once-dev/once/service/order"
	"github.com/once-dev/once/service/payment"
)

func setup(t *testing.T) (*pgxpool.Pool, *payment.Client) {
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
	return pool, c
}

func event(t *testing.T, orderID uuid.UUID, amount string) order.Confirmed {
	t.Helper()
	ev, err := order.NewConfirmed(uuid.Must(uuid.NewV7()), time.Now(), orderID, uuid.New(), decimal.RequireFromString(amount), "EUR")
	if err != nil {
		t.Fatal(err)
	}
	return ev
}

// handle runs the handler in a transaction and commits it, as the middleware would.
func handle(t *testing.T, pool *pgxpool.Pool, h billing.Handler, ev order.Confirmed) error {
	t.Helper()
	var handlerErr error
	err := pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) error {
		handlerErr = h.Handle(context.Background(), tx, ev)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return handlerErr
}

func storedPayment(t *testing.T, pool *pgxpool.Pool, orderID uuid.UUID) (status string, chargeID, reason *string) {
	t.Helper()
	err := pool.QueryRow(context.Background(), `SELECT status, provider_charge_id, failure_reason FROM billing.payments WHERE order_id = $1`, orderID).
		Scan(&status, &chargeID, &reason)
	if err != nil {
		t.Fatal(err)
	}
	return
}

func TestChargesAndRecordsThePayment(t *testing.T) {
	pool, client := setup(t)
	h := billing.Handler{Payments: client}
	ev := event(t, uuid.New(), "99.95")
	if err := handle(t, pool, h, ev); err != nil {
		t.Fatal(err)
	}
	status, chargeID, _ := storedPayment(t, pool, ev.OrderID())
	l, err := client.Ledger(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if status != "charged" || chargeID == nil || l.Count != 1 || l.Charges[0].ChargeID != *chargeID || l.Charges[0].IdempotencyKey != ev.EventID().String() {
		t.Fatalf("payment %s %v, ledger %+v; want one charge keyed by the event id and recorded", status, chargeID, l)
	}
}

func TestDeclineIsRecordedAsFailedAndRejected(t *testing.T) {
	pool, client := setup(t)
	ev := event(t, uuid.New(), "500.01")
	err := handle(t, pool, billing.Handler{Payments: client}, ev)
	var perr *payment.Error
	if !errors.As(err, &perr) || perr.Code != "card_declined" {
		t.Fatalf("got %v; want the provider's card_declined", err)
	}
	status, _, reason := storedPayment(t, pool, ev.OrderID())
	if status != "failed" || reason == nil {
		t.Fatalf("payment %s (%v); want failed with the reason", status, reason)
	}
}

func TestSecondEventForAChargedOrderIsRefusedWithoutCharging(t *testing.T) {
	pool, client := setup(t)
	h := billing.Handler{Payments: client}
	orderID := uuid.New()
	if err := handle(t, pool, h, event(t, orderID, "10.00")); err != nil {
		t.Fatal(err)
	}
	err := handle(t, pool, h, event(t, orderID, "10.00"))
	if !idempotency.IsPermanent(err) {
		t.Fatalf("got %v; want a permanent refusal", err)
	}
	if l, _ := client.Ledger(context.Background()); l.Count != 1 {
		t.Fatalf("ledger has %d charges, want 1", l.Count)
	}
}
