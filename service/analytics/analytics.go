package analytics

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/service/order"
)

const addOrderSQL = `INSERT INTO analytics.customer_daily_revenue AS r (customer_id, day, revenue, order_count)
VALUES ($1, $2, $3, 1)
ON CONFLICT (customer_id, day)
DO UPDATE SET revenue = r.revenue + EXCLUDED.revenue, order_count = r.order_count + 1`

// Handler adds each confirmed order to its customer's day. The day is the
// event's occurred_at in UTC, so replays land on the day they belong to.
type Handler struct{}

// Handle is a pipeline.HandlerFunc[order.Confirmed]; tx holds the claim. The
// upsert adds, so only the claim in the same transaction keeps it right.
func (Handler) Handle(ctx context.Context, tx pgx.Tx, ev order.Confirmed) error {
	_, err := tx.Exec(ctx, addOrderSQL, ev.CustomerID(), ev.OccurredAt().Format("2006-01-02"), ev.TotalAmount())
	if err != nil {
		return fmt.Errorf("analytics: add order %d: %w", ev.OrderID(), err)
	}
	return nil
}
