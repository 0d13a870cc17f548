package billing

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/internal/durable"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/orderevents"
	"github.com/once-dev/once/outbox"
	"github.com/once-dev/once/payment"
)

// Provider is the part of [payment.Client] billing needs.
type Provider interface {
	Charge(ctx context.Context, req payment.ChargeRequest, idempotencyKey string) (payment.Charge, error)
	Refund(ctx context.Context, req payment.RefundRequest, idempotencyKey string) (payment.Refund, error)
}

// DB is where billing commits its charge intents, outside the claim's
// transaction: a pool of its own (a few connections), never the pool of the
// claims, whose connection the attempt already holds while it asks for this
// one. *pgxpool.Pool implements it.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Handler charges confirmed orders and refunds cancelled ones, each once,
// recording what happened in the claim's transaction and announcing it with a
// payment event written to the outbox in that same transaction.
type Handler struct {
	Payments Provider
	// Currency of every charge: the guide's event carries none, the charging
	// service knows its own. An ISO 4217 code such as "EUR".
	Currency string
	// DB is the database of the claims, for charge intents; see [DB].
	DB DB
	// Horizon is the dedup horizon of the confirmations (the claim
	// retention minus the clock skew): a confirmation older than it is
	// never processed again. A cancellation that finds a charge intent
	// without a payment waits for its confirmation to settle it; once that
	// confirmation is past the horizon it never will, and the cancellation
	// is dead-lettered for a person to reconcile. 0: wait without end.
	Horizon time.Duration
	// Publish writes a payment event in the claim's transaction, to reach
	// Kafka when it commits (once.PublishTo of the payments topic). Without
	// it, none are published.
	Publish func(ctx context.Context, tx pgx.Tx, ev orderevents.Payment) error
	// Now is the clock of the events' occurred_at. Default time.Now.
	Now func() time.Time
}

// Validate reports every missing or impossible setting.
func (h Handler) Validate() error {
	var errs []error
	if h.Payments == nil {
		errs = append(errs, errors.New("billing: Handler.Payments is required"))
	}
	if h.DB == nil {
		errs = append(errs, errors.New("billing: Handler.DB is required (charge intents)"))
	}
	if !orderevents.IsCurrencyCode(h.Currency) {
		errs = append(errs, fmt.Errorf("billing: Handler.Currency %q is not an ISO 4217 code such as EUR", h.Currency))
	}
	return errors.Join(errs...)
}

// lockOrderSQL serialises billing's work on one order across its topics: a
// confirmation and a cancellation, or two events for one order (a producer
// bug), never interleave.
const lockOrderSQL = `SELECT pg_advisory_xact_lock(hashtextextended('billing.order:' || $1::bigint::text, 0))`

const (
	paymentOfOrderSQL = `SELECT event_id, customer_id, status, provider_charge_id, amount, currency FROM billing.payments WHERE order_id = $1`
	recordPaymentSQL  = `INSERT INTO billing.payments
(event_id, order_id, customer_id, amount, currency, status, provider_charge_id, failure_reason, payment_event_id)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)`
	cancellationOfOrderSQL = `SELECT event_id FROM billing.cancellations WHERE order_id = $1`
	recordCancellationSQL  = `INSERT INTO billing.cancellations (order_id, event_id, reason) VALUES ($1, $2, $3)
ON CONFLICT (order_id) DO NOTHING`
	// A charge intent is written and committed on its own before the
	// provider is called; the first event of an order owns it.
	// Durable before the provider is called, whatever the server's
	// synchronous_commit: a crash must not forget a charge that happened.
	claimIntentSQL = `INSERT INTO billing.charge_intents (order_id, event_id, idempotency_key)
SELECT $1, $2, $3 FROM (SELECT ` + durable.RaiseSynchronousCommit + `) AS durable
ON CONFLICT (order_id) DO NOTHING`
	intentOfOrderSQL   = `SELECT event_id, idempotency_key, created_at, unsettled_reason FROM billing.charge_intents WHERE order_id = $1`
	unsettledIntentSQL = `UPDATE billing.charge_intents SET unsettled_reason = $2 WHERE order_id = $1`
	refundOfOrderSQL   = `SELECT event_id FROM billing.refunds WHERE order_id = $1`
	recordRefundSQL    = `INSERT INTO billing.refunds (event_id, order_id, provider_charge_id, provider_refund_id, amount, currency, payment_event_id)
VALUES ($1, $2, $3, $4, $5, $6, $7)`
	// Intents whose payment is recorded serve no more purpose: the payment
	// row refuses a later event for the order by itself.
	pruneIntentsSQL = `DELETE FROM billing.charge_intents i USING billing.payments p
WHERE p.order_id = i.order_id AND i.created_at < now() - make_interval(secs => $1)`
)

// OnConfirmed charges an order.confirmed.v1 event's total: a
// pipeline.HandlerFunc[orderevents.Confirmed].
//
// An order whose cancellation arrived first is never charged. A charge that
// may succeed later (network error, timeout, 5xx, a rotated key) returns a
// plain error: rolled back, held and tried again with the same key. A charge
// the provider refused for good is recorded as failed, committed, and
// reported with [idempotency.RejectAfterCommit], so the event is
// dead-lettered with the reason.
func (h Handler) OnConfirmed(ctx context.Context, tx pgx.Tx, ev orderevents.Confirmed) error {
	if err := h.Validate(); err != nil {
		return err // our configuration, not the event: never a reason to record it failed
	}
	if _, err := tx.Exec(ctx, lockOrderSQL, ev.OrderID()); err != nil {
		return fmt.Errorf("billing: lock order %d: %w", ev.OrderID(), err)
	}
	var paidBy uuid.UUID
	var status string
	var recorded *string
	err := tx.QueryRow(ctx, `SELECT event_id, status, failure_reason FROM billing.payments WHERE order_id = $1`, ev.OrderID()).Scan(&paidBy, &status, &recorded)
	switch {
	case err == nil && paidBy == ev.EventID():
		// This event's own record: its claim was forgotten and the event
		// replayed. The record is the verdict it had, and it stands: the
		// same outcome again, with the claim (a declined charge is again a
		// recorded rejection, whose letter says a replay cannot change it).
		if status != "failed" {
			return nil
		}
		why := "declined"
		if recorded != nil {
			why = *recorded
		}
		return idempotency.RejectAfterCommit(fmt.Errorf("billing: order %d: event %s's charge failed before and its record stands: %s",
			ev.OrderID(), ev.EventID(), why))
	case err == nil:
		// Another event's payment: this event is refused, not recorded.
		// A replay refuses it again.
		return idempotency.Permanent(fmt.Errorf("billing: order %d already has a %s payment from event %s; event %s not charged",
			ev.OrderID(), status, paidBy, ev.EventID()))
	case !errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("billing: read payment of order %d: %w", ev.OrderID(), err)
	}
	var cancelledBy uuid.UUID
	err = tx.QueryRow(ctx, cancellationOfOrderSQL, ev.OrderID()).Scan(&cancelledBy)
	switch {
	case err == nil:
		// Cancelled before it was charged: never charge it. Not an error.
		return h.record(ctx, tx, ev, "cancelled", nil, "cancelled by event "+cancelledBy.String()+" before it was charged", nil)
	case !errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("billing: read cancellation of order %d: %w", ev.OrderID(), err)
	}

	key, intendedAt, err := h.intend(ctx, ev)
	if err != nil {
		return err
	}
	// The request is built from the immutable event only, so a retry is
	// byte-for-byte the request the provider stored under the key.
	charge, err := h.Payments.Charge(ctx, payment.ChargeRequest{
		OrderID:  strconv.FormatInt(ev.OrderID(), 10),
		Amount:   ev.TotalAmount(),
		Currency: h.Currency,
	}, key)
	switch {
	case errors.Is(err, payment.ErrKeyReused):
		// The key is this order's intent's: an earlier request under it
		// had another body (the currency setting changed, or a producer
		// reused the event id with another amount) and may have charged.
		// Nothing is known to be failed: no record, no event; a person
		// reconciles from the dead letter. The intent says so, durably and
		// before the verdict: the order's cancellation must not wait for a
		// confirmation that comes back only when a person replays it.
		reason := fmt.Errorf("billing: order %d: the provider holds another request under key %s; the charge's outcome is unknown, reconcile: %w",
			ev.OrderID(), key, err)
		if _, uerr := h.DB.Exec(ctx, unsettledIntentSQL, ev.OrderID(), reason.Error()); uerr != nil {
			return fmt.Errorf("billing: mark the charge intent of order %d unsettled: %w", ev.OrderID(), uerr)
		}
		return idempotency.Permanent(reason)
	case err != nil && !payment.IsPermanent(err):
		return fmt.Errorf("billing: charge order %d: %w", ev.OrderID(), err)
	case err != nil:
		// The provider's own final refusal (a decline): the payment failed.
		// occurred_at and the event's id take the intent's time, which
		// every attempt reads the same.
		failed, ferr := orderevents.NewPaymentFailed(outbox.EventID(ev.EventID(), orderevents.TypePaymentFailedV1, intendedAt), intendedAt,
			ev.OrderID(), ev.CustomerID(), ev.TotalAmount(), h.Currency, err.Error())
		if ferr != nil {
			return ferr
		}
		if err := h.record(ctx, tx, ev, "failed", nil, err.Error(), h.eventID(failed)); err != nil {
			return err
		}
		if err := h.publish(ctx, tx, failed); err != nil {
			return err
		}
		return idempotency.RejectAfterCommit(fmt.Errorf("billing: provider refused order %d: %w", ev.OrderID(), err))
	}
	// The money moved: from here nothing in this attempt dead-letters the
	// event; it is held until the payment's record commits.
	idempotency.MarkExternalEffect(ctx, fmt.Sprintf("charged order %d (charge %s)", ev.OrderID(), charge.ID))
	// occurred_at and the event's id take the intent's time, on the
	// database's clock, which every attempt reads the same: the event has
	// one id and one byte form however often it is built. Not the
	// provider's time of the charge: a provider clock running ahead would
	// make analytics refuse the event as from the future.
	at := intendedAt
	charged, err := orderevents.NewPaymentCharged(outbox.EventID(ev.EventID(), orderevents.TypePaymentChargedV1, at), at,
		ev.OrderID(), ev.CustomerID(), ev.TotalAmount(), h.Currency, charge.ID)
	if err != nil {
		return err
	}
	if err := h.record(ctx, tx, ev, "charged", &charge.ID, "", h.eventID(charged)); err != nil {
		return err
	}
	return h.publish(ctx, tx, charged)
}

// eventID is the id of a payment event billing publishes, or nil when it
// publishes none.
func (h Handler) eventID(p orderevents.Payment) *uuid.UUID {
	if h.Publish == nil {
		return nil
	}
	id := p.EventID()
	return &id
}

// intend commits the charge intent of ev's order, in a transaction of its
// own, and returns the idempotency key to charge with and when the intent
// was first made. The first event of an order owns its intent, and with it
// the key: a later event for the same order is refused, whether or not the
// first one's charge was recorded, so that a charge whose answer was lost is
// never repeated under another key.
func (h Handler) intend(ctx context.Context, ev orderevents.Confirmed) (string, time.Time, error) {
	key := ev.EventID().String()
	if _, err := h.DB.Exec(ctx, claimIntentSQL, ev.OrderID(), ev.EventID(), key); err != nil {
		return "", time.Time{}, fmt.Errorf("billing: record charge intent of order %d: %w", ev.OrderID(), err)
	}
	var owner uuid.UUID
	var ownerKey string
	var at time.Time
	var unsettled *string
	if err := h.DB.QueryRow(ctx, intentOfOrderSQL, ev.OrderID()).Scan(&owner, &ownerKey, &at, &unsettled); err != nil {
		return "", time.Time{}, fmt.Errorf("billing: read charge intent of order %d: %w", ev.OrderID(), err)
	}
	if owner != ev.EventID() {
		return "", time.Time{}, idempotency.Permanent(fmt.Errorf("billing: order %d may already be charged by event %s (idempotency key %s); event %s not charged",
			ev.OrderID(), owner, ownerKey, ev.EventID()))
	}
	return ownerKey, at.UTC(), nil
}

// PruneIntents deletes charge intents older than olderThan whose payment is
// recorded, and returns how many. A database without billing's tables has
// none: 0, no error.
func PruneIntents(ctx context.Context, db DB, olderThan time.Duration) (int64, error) {
	var present bool
	if err := db.QueryRow(ctx, `SELECT to_regclass('billing.charge_intents') IS NOT NULL`).Scan(&present); err != nil || !present {
		return 0, err
	}
	tag, err := db.Exec(ctx, pruneIntentsSQL, olderThan.Seconds())
	if err != nil {
		return 0, fmt.Errorf("billing: prune charge intents: %w", err)
	}
	return tag.RowsAffected(), nil
}

func (h Handler) record(ctx context.Context, tx pgx.Tx, ev orderevents.Confirmed, status string, chargeID *string, reason string, paymentEvent *uuid.UUID) error {
	var failure *string
	if reason != "" {
		failure = &reason
	}
	_, err := tx.Exec(ctx, recordPaymentSQL, ev.EventID(), ev.OrderID(), ev.CustomerID(), ev.TotalAmount(), h.Currency, status, chargeID, failure, paymentEvent)
	if err != nil {
		return fmt.Errorf("billing: record %s payment of order %d: %w", status, ev.OrderID(), err)
	}
	return nil
}

// errChargeInFlight holds a cancellation while its order's charge may have
// happened but is not recorded yet: the confirmation will be delivered again
// and settle it, and then the cancellation refunds it.
var errChargeInFlight = errors.New("billing: the order's charge is in flight; its cancellation waits until it is recorded")

// OnCancelled refunds a cancelled order once, or makes sure it is never
// charged: a pipeline.HandlerFunc[orderevents.Cancelled].
//
// Kafka orders nothing across topics, so the cancellation may arrive
// before, during or after the charge of its order:
//   - charged: refunded in full with Idempotency-Key = the cancellation's
//     event id, recorded, and payment.refunded.v1 published;
//   - not charged and no charge started: the cancellation is recorded, and
//     the confirmation, whenever it comes, is not charged;
//   - a charge started (its intent committed) but not recorded: the charge
//     may have happened at the provider; the cancellation is held until the
//     confirmation settles it, then refunds;
//   - declined, or already cancelled or refunded: nothing to do.
func (h Handler) OnCancelled(ctx context.Context, tx pgx.Tx, ev orderevents.Cancelled) error {
	if err := h.Validate(); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, lockOrderSQL, ev.OrderID()); err != nil {
		return fmt.Errorf("billing: lock order %d: %w", ev.OrderID(), err)
	}
	var p struct {
		eventID    uuid.UUID
		customerID int64
		status     string
		chargeID   *string
		amount     decimal.Decimal
		currency   string
	}
	err := tx.QueryRow(ctx, paymentOfOrderSQL, ev.OrderID()).Scan(&p.eventID, &p.customerID, &p.status, &p.chargeID, &p.amount, &p.currency)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		var owner uuid.UUID
		var key string
		var at time.Time
		var unsettled *string
		// Through the claim's transaction: a committed intent is visible to
		// it, and it asks the pool for no second connection.
		err := tx.QueryRow(ctx, intentOfOrderSQL, ev.OrderID()).Scan(&owner, &key, &at, &unsettled)
		switch {
		case err == nil && unsettled != nil:
			return idempotency.Permanent(fmt.Errorf("billing: order %d: its confirmation %s was dead-lettered with its charge unsettled (%s); "+
				"the refund's amount is unknown here; reconcile with the provider", ev.OrderID(), owner, *unsettled))
		case err == nil && h.Horizon > 0 && idempotency.IDTime(owner).Before(h.now().Add(-h.Horizon)):
			return idempotency.Permanent(fmt.Errorf("billing: order %d was charged or not under key %s by event %s, which is past the dedup horizon and will never be recorded: "+
				"the refund's amount is unknown here; reconcile with the provider", ev.OrderID(), key, owner))
		case err == nil:
			return fmt.Errorf("%w (order %d, charge by event %s under key %s)", errChargeInFlight, ev.OrderID(), owner, key)
		case !errors.Is(err, pgx.ErrNoRows):
			return fmt.Errorf("billing: read charge intent of order %d: %w", ev.OrderID(), err)
		}
		if _, err := tx.Exec(ctx, recordCancellationSQL, ev.OrderID(), ev.EventID(), ev.Reason()); err != nil {
			return fmt.Errorf("billing: record cancellation of order %d: %w", ev.OrderID(), err)
		}
		return nil
	case err != nil:
		return fmt.Errorf("billing: read payment of order %d: %w", ev.OrderID(), err)
	case p.status != "charged" || p.chargeID == nil:
		return nil // declined or cancelled: nothing was taken
	}
	var refundedBy uuid.UUID
	err = tx.QueryRow(ctx, refundOfOrderSQL, ev.OrderID()).Scan(&refundedBy)
	switch {
	case err == nil:
		return nil // refunded by an earlier cancellation of the same order
	case !errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("billing: read refund of order %d: %w", ev.OrderID(), err)
	}

	refund, err := h.Payments.Refund(ctx, payment.RefundRequest{ChargeID: *p.chargeID, Amount: p.amount}, ev.EventID().String())
	if err != nil {
		if payment.IsPermanent(err) {
			// Our record says charged; the provider disagrees. A person must look.
			return idempotency.Permanent(fmt.Errorf("billing: provider refused the refund of order %d (charge %s): %w", ev.OrderID(), *p.chargeID, err))
		}
		return fmt.Errorf("billing: refund order %d: %w", ev.OrderID(), err)
	}
	idempotency.MarkExternalEffect(ctx, fmt.Sprintf("refunded order %d (refund %s)", ev.OrderID(), refund.ID))
	// The cancellation's id time: stable across attempts, and already
	// judged against the database's clock when the cancellation was
	// claimed, unlike the provider's clock.
	at := idempotency.IDTime(ev.EventID())
	refunded, err := orderevents.NewPaymentRefunded(outbox.EventID(ev.EventID(), orderevents.TypePaymentRefundedV1, at), at,
		ev.OrderID(), p.customerID, p.amount, p.currency, refund.ID)
	if err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, recordRefundSQL, ev.EventID(), ev.OrderID(), *p.chargeID, refund.ID, p.amount, p.currency, h.eventID(refunded)); err != nil {
		return fmt.Errorf("billing: record refund of order %d: %w", ev.OrderID(), err)
	}
	return h.publish(ctx, tx, refunded)
}

// publish writes a payment event into the claim's transaction: it reaches
// Kafka if and only if the transaction commits.
func (h Handler) publish(ctx context.Context, tx pgx.Tx, ev orderevents.Payment) error {
	if h.Publish == nil {
		return nil
	}
	return h.Publish(ctx, tx, ev)
}

func (h Handler) now() time.Time {
	if h.Now != nil {
		return h.Now()
	}
	return time.Now()
}
