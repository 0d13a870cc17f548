package analytics

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/service/order"
)

const (
	addOrderSQL = `INSERT INTO analytics.customer_daily_revenue AS r (customer_id, day, revenue, order_count)
VALUES ($1, $2, $3, 1)
ON CONFLICT (customer_id, day)
DO UPDATE SET revenue = r.revenue + EXCLUDED.revenue, order_count = r.order_count + 1`
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

// OnConfirmed is a pipeline.HandlerFunc[order.Confirmed]; tx holds the claim.
func (Handler) OnConfirmed(ctx context.Context, tx pgx.Tx, ev order.Confirmed) error {
	_, err := tx.Exec(ctx, addOrderSQL, ev.CustomerID(), day(ev.OccurredAt()), ev.TotalAmount())
	if err != nil {
		return fmt.Errorf("analytics: add order %d: %w", ev.OrderID(), err)
	}
	return nil
}

// OnPayment is a pipeline.HandlerFunc[order.Payment]: billing's payment
// events, published through its outbox.
func (Handler) OnPayment(ctx context.Context, tx pgx.Tx, ev order.Payment) error {
	var err error
	switch ev.Kind() {
	case order.TypePaymentChargedV1:
		_, err = tx.Exec(ctx, addChargeSQL, ev.CustomerID(), day(ev.OccurredAt()), ev.Amount())
	case order.TypePaymentFailedV1:
		_, err = tx.Exec(ctx, addFailureSQL, ev.CustomerID(), day(ev.OccurredAt()))
	case order.TypePaymentRefundedV1:
		_, err = tx.Exec(ctx, addRefundSQL, ev.CustomerID(), day(ev.OccurredAt()), ev.Amount())
	}
	if err != nil {
		return fmt.Errorf("analytics: apply %s of order %d: %w", ev.Kind(), ev.OrderID(), err)
	}
	return nil
}

func day(t interface{ Format(string) string }) string { return t.Format("2006-01-02") }
