package analytics_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/service/analytics"
	"github.com/once-dev/once/service/order"
)

// Two orders of one customer on one day add up; the handler itself is not
// idempotent (that is the middleware's job), so two calls count twice.
func TestAddsOrdersToTheCustomersDay(t *testing.T) {
	pool := testenv.Postgres(t)
	ctx := context.Background()
	customer := uuid.New()
	day := time.Date(2026, 12, 2, 23, 59, 0, 0, time.UTC)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	for _, amount := range []string{"10.10", "0.20"} {
		ev, err := order.NewConfirmed(uuid.Must(uuid.NewV7()), day, uuid.New(), customer, decimal.RequireFromString(amount), "EUR")
		if err != nil {
			t.Fatal(err)
		}
		if err := (analytics.Handler{}).Handle(ctx, tx, ev); err != nil {
			t.Fatal(err)
		}
	}
	var revenue decimal.Decimal
	var count int
	err = tx.QueryRow(ctx, `SELECT revenue, order_count FROM analytics.customer_daily_revenue
		WHERE customer_id = $1 AND day = '2026-12-02' AND currency = 'EUR'`, customer).Scan(&revenue, &count)
	if err != nil {
		t.Fatal(err)
	}
	if !revenue.Equal(decimal.RequireFromString("10.30")) || count != 2 {
		t.Fatalf("revenue %s over %d orders; want 10.30 over 2", revenue, count)
	}
}
