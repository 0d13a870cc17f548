package analytics

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/orderevents"
)

const (
	addOrderSQL = `INSERT INTO analytics.customer_daily_revenue AS r (customer_id, day, revenue, order_count)
VALUES ($1, $2, $3, 1)
ON CONFLICT (customer_id, day)
DO UPDATE SET revenue = r.revenue + EXCLUDED.revenue, order_count = r.order_count + 1`
	// The batch form: a batch's orders summed per customer and day first,
	// rows in key order, so two batches that share rows (two instances
	// during a rebalance) lock them in the same order.
	addOrdersSQL = `INSERT INTO analytics.customer_daily_revenue AS r (customer_id, day, revenue, order_count)
SELECT c, d::date, a::numeric, n FROM unnest($1::bigint[], $2::text[], $3::text[], $4::int[]) AS u(c, d, a, n)
ORDER BY c, d
ON CONFLICT (customer_id, day)
DO UPDATE SET revenue = r.revenue + EXCLUDED.revenue, order_count = r.order_count + EXCLUDED.order_count`
	addRefundSQL = `INSERT INTO analytics.customer_daily_revenue AS r (customer_id, day, revenue, order_count, refunded, refund_count)
VALUES ($1, $2, 0, 0, $3, 1)
ON CONFLICT (customer_id, day)
DO UPDATE SET refunded = r.refunded + EXCLUDED.refunded, refund_count = r.refund_count + 1`
	addChargeSQL = `INSERT INTO analytics.customer_daily_payments AS p (customer_id, day, charged_count, charged_total)
VALUES ($1, $2, 1, $3)
ON CONFLICT (customer_id, day)
DO UPDATE SET charged_count = p.charged_count + 1, charged_total = p.charged_total + EXCLUDED.charged_total`
	addFailureSQL = `INSERT INTO analytics.customer_daily_payments AS p (customer_id, day, failed_count)
VALUES ($1, $2, 1)
ON CONFLICT (customer_id, day)
DO UPDATE SET failed_count = p.failed_count + 1`
)

// Handler keeps revenue per customer and day: confirmed orders add to it,
// refunds are subtracted on the day they happened, and charges and failures
// are counted. The day is the event's occurred_at in UTC, so replays land on
// the day they belong to. Every statement adds to a running total and is not
// idempotent by itself: only the claim in the same transaction keeps it right.
type Handler struct{}

// OnConfirmed is a pipeline.HandlerFunc[orderevents.Confirmed]; tx holds the claim.
func (Handler) OnConfirmed(ctx context.Context, tx pgx.Tx, ev orderevents.Confirmed) error {
	_, err := tx.Exec(ctx, addOrderSQL, ev.CustomerID(), day(ev.OccurredAt()), numeric(ev.TotalAmount()))
	if err != nil {
		return fmt.Errorf("analytics: add order %d: %w", ev.OrderID(), err)
	}
	return nil
}

// OnConfirmedBatch is OnConfirmed for a batch (a
// pipeline.BatchHandlerFunc[orderevents.Confirmed]): one statement for the batch.
func (Handler) OnConfirmedBatch(ctx context.Context, tx pgx.Tx, evs []orderevents.Confirmed) error {
	type customerDay struct {
		customer int64
		day      string
	}
	sums := map[customerDay]decimal.Decimal{}
	counts := map[customerDay]int32{}
	for _, ev := range evs {
		k := customerDay{ev.CustomerID(), day(ev.OccurredAt())}
		sums[k] = sums[k].Add(ev.TotalAmount())
		counts[k]++
	}
	keys := slices.SortedFunc(maps.Keys(sums), func(a, b customerDay) int {
		return cmp.Or(cmp.Compare(a.customer, b.customer), strings.Compare(a.day, b.day))
	})
	customers, days, amounts, n := make([]int64, len(keys)), make([]string, len(keys)), make([]string, len(keys)), make([]int32, len(keys))
	for i, k := range keys {
		customers[i], days[i], amounts[i], n[i] = k.customer, k.day, sums[k].String(), counts[k]
	}
	if _, err := tx.Exec(ctx, addOrdersSQL, customers, days, amounts, n); err != nil {
		return fmt.Errorf("analytics: add %d orders: %w", len(evs), err)
	}
	return nil
}

// OnPayment is a pipeline.HandlerFunc[orderevents.Payment]: billing's payment
// events, published through its outbox.
func (Handler) OnPayment(ctx context.Context, tx pgx.Tx, ev orderevents.Payment) error {
	var err error
	switch ev.Kind() {
	case orderevents.TypePaymentChargedV1:
		_, err = tx.Exec(ctx, addChargeSQL, ev.CustomerID(), day(ev.OccurredAt()), numeric(ev.Amount()))
	case orderevents.TypePaymentFailedV1:
		_, err = tx.Exec(ctx, addFailureSQL, ev.CustomerID(), day(ev.OccurredAt()))
	case orderevents.TypePaymentRefundedV1:
		_, err = tx.Exec(ctx, addRefundSQL, ev.CustomerID(), day(ev.OccurredAt()), numeric(ev.Amount()))
	}
	if err != nil {
		return fmt.Errorf("analytics: apply %s of order %d: %w", ev.Kind(), ev.OrderID(), err)
	}
	return nil
}

func day(t interface{ Format(string) string }) string { return t.Format("2006-01-02") }

// numeric is an amount as a numeric parameter: its exact decimal text, which
// pgx sends as is. A decimal.Decimal would go through its driver.Valuer,
// whose plan costs pgx a failed binary encoding and a parse per statement.
func numeric(d decimal.Decimal) string { return d.String() }
