package analytics_test

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/handlers/analytics"
	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/oncetest"
	"github.com/once-dev/once/orderevents"
)

func revenue(t *testing.T, pool *pgxpool.Pool, customer int64, day string) (decimal.Decimal, int) {
	t.Helper()
	var r decimal.Decimal
	var n int
	err := pool.QueryRow(context.Background(), `SELECT coalesce(sum(revenue), 0), coalesce(sum(order_count), 0)
		FROM analytics.customer_daily_revenue WHERE customer_id = $1 AND day = $2`, customer, day).Scan(&r, &n)
	if err != nil {
		t.Fatal(err)
	}
	return r, n
}

// Two orders of one customer on one day add up, each once however often it
// is delivered; the day is the event's occurred_at in UTC.
func TestAddsEachOrderToTheCustomersDayOnce(t *testing.T) {
	pool := reftest.Postgres(t)
	h := oncetest.NewHandler(t, oncetest.HandlerConfig[orderevents.Confirmed]{Decode: orderevents.DecodeConfirmed, DB: pool, Handle: analytics.Handler{}.OnConfirmed})
	customer := 1 + rand.Int64N(1<<62)
	day := time.Date(2026, 12, 2, 23, 59, 0, 0, time.UTC)
	for i, amount := range []string{"10.10", "0.20"} {
		ev, err := orderevents.NewConfirmed(uuid.Must(uuid.NewV7()), day, int64(i+1), customer, decimal.RequireFromString(amount))
		if err != nil {
			t.Fatal(err)
		}
		h.RequireOnce(ev)
	}
	if r, n := revenue(t, pool, customer, "2026-12-02"); !r.Equal(decimal.RequireFromString("10.30")) || n != 2 {
		t.Fatalf("revenue %s over %d orders; want 10.30 over 2", r, n)
	}
}
