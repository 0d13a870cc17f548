package analytics

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/service/order"
)

const addOrderSQL = `INSERT INTO analytics.customer_daily_revenue AS r (customer_id, day, currency, revenue, order_count)
VALUES ($1, $2, $3, $4, 1)
ON CONFLICT (customer_id, day, currency)
DO UPDATE SET revenue = r.revenue + EXCLUDED.revenue, order_count = r.order_count + 1`

// Handler adds each confirmed order to its customer's day. The day is the
// event's occurred_at in UTC, so replays land on the day they belong to.
type Handler struct{}

// Handle implements pipeline.Handler; tx is the transaction holding the claim.
func (Handler) Handle(ctx context.Context, tx pgx.Tx, ev order.Confirmed) error {
	_, err := tx.Exec(ctx, addOrderSQL, ev.CustomerID(), ev.OccurredAt().Format("2006-01-02"), ev.Currency(), ev.Amount())
	if err != nil {
		return fmt.Errorf("analytics: add order %s: %w", ev.OrderID(), err)
	}
	return nil
}
