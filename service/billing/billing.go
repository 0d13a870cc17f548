package billing

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strconv"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/service/order"
	"github.com/once-dev/once/service/payment"
)

// Charger is the part of [payment.Client] billing needs.
type Charger interface {
	Charge(ctx context.Context, req payment.ChargeRequest, idempotencyKey string) (payment.Charge, error)
}

// lockOrderSQL serialises the events of one order, so that two different
// events for the same order (a producer bug) cannot both pass the check below
// and both charge.
const lockOrderSQL = `SELECT pg_advisory_xact_lock(hashtextextended('billing.order:' || $1::bigint::text, 0))`

const existingPaymentSQL = `SELECT event_id, status FROM billing.payments WHERE order_id = $1`

const recordPaymentSQL = `INSERT INTO billing.payments
(event_id, order_id, customer_id, amount, currency, status, provider_charge_id, failure_reason)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)`

// Handler charges an order.confirmed.v1 event's total and records the
// payment in the claim's transaction.
type Handler struct {
	Payments Charger
	// Currency of every charge: the guide's event carries none, the charging
	// service knows its own. An ISO 4217 code such as "EUR".
	Currency string
}

var currencyCode = regexp.MustCompile(`^[A-Z]{3}$`)

// Validate reports a missing Charger or a currency that is not an ISO 4217 code.
func (h Handler) Validate() error {
	var errs []error
	if h.Payments == nil {
		errs = append(errs, errors.New("billing: Handler.Payments is required"))
	}
	if !currencyCode.MatchString(h.Currency) {
		errs = append(errs, fmt.Errorf("billing: Handler.Currency %q is not an ISO 4217 code such as EUR", h.Currency))
	}
	return errors.Join(errs...)
}

// Handle is a pipeline.HandlerFunc[order.Confirmed]. A charge that may succeed later (network
// error, timeout, 5xx) returns a plain error and is retried with the same key;
// a charge the provider refused for good is recorded as failed, committed,
// and reported with [idempotency.RejectAfterCommit] so that the event is
// dead-lettered with the reason.
func (h Handler) Handle(ctx context.Context, tx pgx.Tx, ev order.Confirmed) error {
	if err := h.Validate(); err != nil {
		return err // our configuration, not the event: never a reason to record it failed
	}
	if _, err := tx.Exec(ctx, lockOrderSQL, ev.OrderID()); err != nil {
		return fmt.Errorf("billing: lock order %d: %w", ev.OrderID(), err)
	}
	var paidBy uuid.UUID
	var status string
	err := tx.QueryRow(ctx, existingPaymentSQL, ev.OrderID()).Scan(&paidBy, &status)
	switch {
	case err == nil:
		return idempotency.Permanent(fmt.Errorf("billing: order %d already has a %s payment from event %s; event %s not charged",
			ev.OrderID(), status, paidBy, ev.EventID()))
	case !errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("billing: read payment of order %d: %w", ev.OrderID(), err)
	}

	// The request is built from the immutable event only, so a retry is
	// byte-for-byte the request the provider stored under the key.
	charge, err := h.Payments.Charge(ctx, payment.ChargeRequest{
		OrderID:  strconv.FormatInt(ev.OrderID(), 10),
		Amount:   ev.TotalAmount(),
		Currency: h.Currency,
	}, ev.EventID().String())
	if err != nil {
		if !payment.IsPermanent(err) {
			return fmt.Errorf("billing: charge order %d: %w", ev.OrderID(), err)
		}
		if err := h.record(ctx, tx, ev, "failed", nil, err.Error()); err != nil {
			return err
		}
		return idempotency.RejectAfterCommit(fmt.Errorf("billing: provider refused order %d: %w", ev.OrderID(), err))
	}
	return h.record(ctx, tx, ev, "charged", &charge.ID, "")
}

func (h Handler) record(ctx context.Context, tx pgx.Tx, ev order.Confirmed, status string, chargeID *string, reason string) error {
	var failure *string
	if reason != "" {
		failure = &reason
	}
	_, err := tx.Exec(ctx, recordPaymentSQL, ev.EventID(), ev.OrderID(), ev.CustomerID(), ev.TotalAmount(), h.Currency, status, chargeID, failure)
	if err != nil {
		return fmt.Errorf("billing: record %s payment of order %d: %w", status, ev.OrderID(), err)
	}
	return nil
}
