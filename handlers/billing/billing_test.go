package billing_test

import (
	"context"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/handlers/billing"
	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/oncetest"
	"github.com/once-dev/once/orderevents"
	"github.com/once-dev/once/outbox"
	"github.com/once-dev/once/payment"
	"github.com/once-dev/once/schema"
)

// fixture is billing behind the real idempotency middleware (package
// oncetest), against the provider simulator over real HTTP: each delivery
// commits or rolls back as in production.
type fixture struct {
	pool      *pgxpool.Pool
	provider  *payment.Provider
	client    *payment.Client
	handler   billing.Handler
	confirmed *oncetest.HandlerHarness[orderevents.Confirmed]
	cancelled *oncetest.HandlerHarness[orderevents.Cancelled]
}

const paymentTopic = "payment.events.v1.billing-test"

func setup(t *testing.T) *fixture {
	t.Helper()
	pool := reftest.Postgres(t)
	p, err := payment.NewProvider(payment.ProviderConfig{DB: pool, DeclineAbove: decimal.NewFromInt(500)})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(p)
	t.Cleanup(srv.Close)
	c, err := payment.NewClient(payment.ClientConfig{BaseURL: srv.URL, APIKey: "acct_" + uuid.NewString()[:8], InitialBackoff: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	// An outbox table of the tests' own: nothing forwards it, and a
	// forwarder elsewhere must never meet rows for a topic that does not exist.
	box, err := outbox.New(schema.Config{Outbox: "billing_test_outbox"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := box.Init(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	h := billing.Handler{Payments: c, Currency: "EUR", DB: pool, Publish: func(ctx context.Context, tx pgx.Tx, ev orderevents.Payment) error {
		b, err := ev.MarshalJSON()
		if err != nil {
			return err
		}
		return box.Publish(ctx, tx, outbox.Message{Topic: paymentTopic, Key: strconv.FormatInt(ev.OrderID(), 10), ID: ev.EventID().String(), Payload: b})
	}}
	group := "billing-" + uuid.NewString()[:8]
	return &fixture{pool: pool, provider: p, client: c, handler: h,
		confirmed: oncetest.NewHandler(t, oncetest.HandlerConfig[orderevents.Confirmed]{Decode: orderevents.DecodeConfirmed, DB: pool, Group: group, Handle: h.OnConfirmed}),
		cancelled: oncetest.NewHandler(t, oncetest.HandlerConfig[orderevents.Cancelled]{Decode: orderevents.DecodeCancelled, DB: pool, Group: group, Handle: h.OnCancelled}),
	}
}

// newOrderID is unique across test runs on one database: billing keeps one
// payment per order.
func newOrderID() int64 { return 1 + rand.Int64N(1<<62) }

func confirmed(t *testing.T, orderID int64, amount string) orderevents.Confirmed {
	t.Helper()
	ev, err := orderevents.NewConfirmed(uuid.Must(uuid.NewV7()), time.Now(), orderID, 7, decimal.RequireFromString(amount))
	if err != nil {
		t.Fatal(err)
	}
	return ev
}

func cancelled(t *testing.T, orderID int64) orderevents.Cancelled {
	t.Helper()
	ev, err := orderevents.NewCancelled(uuid.Must(uuid.NewV7()), time.Now(), orderID, "customer asked")
	if err != nil {
		t.Fatal(err)
	}
	return ev
}

func (f *fixture) payment(t *testing.T, orderID int64) (status string, chargeID, reason *string, currency string) {
	t.Helper()
	err := f.pool.QueryRow(context.Background(), `SELECT status, provider_charge_id, failure_reason, currency FROM billing.payments WHERE order_id = $1`, orderID).
		Scan(&status, &chargeID, &reason, &currency)
	if err != nil {
		t.Fatal(err)
	}
	return
}

func (f *fixture) count(t *testing.T, query string, args ...any) int {
	t.Helper()
	var n int
	if err := f.pool.QueryRow(context.Background(), query, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// published counts the committed outbox rows of one outgoing event.
func (f *fixture) published(t *testing.T, id uuid.UUID) int {
	return f.count(t, `SELECT count(*) FROM public.billing_test_outbox WHERE payload->>'uuid' = $1`, id.String())
}

// paymentEventOf reads the id of the payment event billing recorded.
func (f *fixture) paymentEventOf(t *testing.T, query string, orderID int64) uuid.UUID {
	t.Helper()
	var id *uuid.UUID
	if err := f.pool.QueryRow(context.Background(), query, orderID).Scan(&id); err != nil || id == nil {
		t.Fatalf("no payment event recorded for order %d (%v)", orderID, err)
	}
	return *id
}

func (f *fixture) ledger(t *testing.T) payment.Ledger {
	t.Helper()
	l, err := f.client.Ledger(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// One charge, one payment row, one payment.charged.v1 in the outbox, across
// an attempt that rolled back after charging and a redelivery.
func TestChargesOnceRecordsAndAnnouncesThePayment(t *testing.T) {
	f := setup(t)
	ev := confirmed(t, newOrderID(), "99.95")
	f.confirmed.RequireOnce(ev)
	status, chargeID, _, currency := f.payment(t, ev.OrderID())
	l := f.ledger(t)
	if status != "charged" || chargeID == nil || currency != "EUR" || l.Count != 1 || l.Charges[0].ChargeID != *chargeID ||
		l.Charges[0].IdempotencyKey != ev.EventID().String() || l.Charges[0].Currency != "EUR" || l.Charges[0].Amount != "99.95" {
		t.Fatalf("payment %s %v %s, ledger %+v; want one EUR charge keyed by the event id and recorded", status, chargeID, currency, l)
	}
	derived := f.paymentEventOf(t, `SELECT payment_event_id FROM billing.payments WHERE order_id = $1`, ev.OrderID())
	if n := f.published(t, derived); n != 1 {
		t.Fatalf("payment.charged.v1 %s is %d times in the outbox, want once", derived, n)
	}
	if derived.Version() != 7 {
		t.Fatalf("payment event id %s is not a UUIDv7", derived)
	}
}

// A provider whose clock runs an hour ahead must not date billing's payment
// events: consumers judge an event's id time against their database's clock,
// and would refuse one from the future. The events take the database's time.
func TestPaymentEventsAreNotDatedByTheProvidersClock(t *testing.T) {
	f := setup(t)
	ahead := 0
	skewed := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := httptest.NewRecorder()
		f.provider.ServeHTTP(rec, r)
		body := rec.Body.Bytes()
		var answer map[string]any
		if json.Unmarshal(body, &answer) == nil {
			if created, ok := answer["created_at"].(string); ok {
				at, _ := time.Parse(time.RFC3339Nano, created)
				answer["created_at"] = at.Add(time.Hour).Format(time.RFC3339Nano)
				body, _ = json.Marshal(answer)
				ahead++
			}
		}
		for k, v := range rec.Header() {
			w.Header()[k] = v
		}
		w.Header().Del("Content-Length")
		w.WriteHeader(rec.Code)
		_, _ = w.Write(body)
	}))
	defer skewed.Close()
	c, err := payment.NewClient(payment.ClientConfig{BaseURL: skewed.URL, APIKey: "acct_" + uuid.NewString()[:8], InitialBackoff: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	h := f.handler
	h.Payments = c
	group := "billing-" + uuid.NewString()[:8]
	confirmedH := oncetest.NewHandler(t, oncetest.HandlerConfig[orderevents.Confirmed]{Decode: orderevents.DecodeConfirmed, DB: f.pool, Group: group, Handle: h.OnConfirmed})
	cancelledH := oncetest.NewHandler(t, oncetest.HandlerConfig[orderevents.Cancelled]{Decode: orderevents.DecodeCancelled, DB: f.pool, Group: group, Handle: h.OnCancelled})
	ev := confirmed(t, newOrderID(), "12.00")
	if d := confirmedH.Deliver(ev); d.Err != nil {
		t.Fatal(d.Err)
	}
	if d := cancelledH.Deliver(cancelled(t, ev.OrderID())); d.Err != nil {
		t.Fatal(d.Err)
	}
	if ahead < 2 {
		t.Fatalf("the provider's answers were moved ahead %d times; want the charge and the refund: the fault did not happen", ahead)
	}
	var dbNow time.Time
	if err := f.pool.QueryRow(context.Background(), `SELECT now()`).Scan(&dbNow); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{`SELECT payment_event_id FROM billing.payments WHERE order_id = $1`, `SELECT payment_event_id FROM billing.refunds WHERE order_id = $1`} {
		id := f.paymentEventOf(t, q, ev.OrderID())
		sec, nsec := id.Time().UnixTime()
		if at := time.Unix(sec, nsec); at.After(dbNow.Add(time.Minute)) {
			t.Errorf("payment event %s is dated %s, the provider's clock; the database's is %s", id, at.UTC(), dbNow.UTC())
		}
	}
}

// A decline is committed as a failed payment with the claim, announced as
// payment.failed.v1, and the delivery is dead-lettered with the provider's
// reason; a redelivery changes nothing.
func TestDeclineIsRecordedAnnouncedAndDeadLettered(t *testing.T) {
	f := setup(t)
	ev := confirmed(t, newOrderID(), "500.01")
	first, _ := f.confirmed.RequireOnce(ev)
	var perr *payment.Error
	var rejected *idempotency.RejectedError
	if !first.DeadLettered() || !errors.As(first.Err, &rejected) || !errors.As(first.Err, &perr) || perr.Code != payment.CodeCardDeclined {
		t.Fatalf("got %v; want a rejection carrying the provider's card_declined", first.Err)
	}
	status, _, reason, _ := f.payment(t, ev.OrderID())
	if status != "failed" || reason == nil || !f.confirmed.Claimed(ev) {
		t.Fatalf("payment %s (%v); want failed with the reason, committed with the claim", status, reason)
	}
	if n := f.published(t, f.paymentEventOf(t, `SELECT payment_event_id FROM billing.payments WHERE order_id = $1`, ev.OrderID())); n != 1 {
		t.Fatalf("payment.failed.v1 is %d times in the outbox, want once", n)
	}
}

// An operator forgets a declined charge's claim and replays it: billing
// meets its own failed payment, and that is the verdict it had: a recorded
// rejection again (its claim committed, its letter a verdict's), not a
// refusal that would dead-letter it as a fault a replay might cure. A
// charged order's own event, replayed so, is processed: its record stands.
func TestAnEventMeetingItsOwnRecordGetsTheSameVerdict(t *testing.T) {
	f := setup(t)
	forget := func(ev orderevents.Confirmed) {
		t.Helper()
		tag, err := f.pool.Exec(context.Background(), "DELETE FROM "+schema.Config{}.Claims().Qualified+" WHERE event_id = $1", ev.EventID())
		if err != nil || tag.RowsAffected() != 1 {
			t.Fatalf("forget the claim of %s: %v, %d rows", ev.EventID(), err, tag.RowsAffected())
		}
	}
	declined := confirmed(t, newOrderID(), "500.01")
	if d := f.confirmed.Deliver(declined); !d.DeadLettered() {
		t.Fatalf("first delivery: %v; want the decline dead-lettered", d.Err)
	}
	forget(declined)
	d := f.confirmed.Deliver(declined)
	var rejected *idempotency.RejectedError
	if !errors.As(d.Err, &rejected) || !f.confirmed.Claimed(declined) || !strings.Contains(d.Err.Error(), "failed before") {
		t.Fatalf("replay of the decline: %v, claimed %v; want a recorded rejection again, claimed", d.Err, f.confirmed.Claimed(declined))
	}
	charged := confirmed(t, newOrderID(), "10.00")
	f.confirmed.Deliver(charged)
	forget(charged)
	if d := f.confirmed.Deliver(charged); d.Err != nil || !f.confirmed.Claimed(charged) {
		t.Fatalf("replay of a charged order's event: %v; want processed, its payment's record standing", d.Err)
	}
	if l := f.ledger(t); l.Count != 1 {
		t.Fatalf("ledger has %d charges, want 1", l.Count)
	}
}

func TestSecondEventForAChargedOrderIsRefusedWithoutCharging(t *testing.T) {
	f := setup(t)
	orderID := newOrderID()
	f.confirmed.RequireOnce(confirmed(t, orderID, "10.00"))
	second := confirmed(t, orderID, "10.00")
	d := f.confirmed.Deliver(second)
	if !d.DeadLettered() || f.confirmed.Claimed(second) {
		t.Fatalf("got %v; want a permanent refusal that leaves no claim", d.Err)
	}
	if l := f.ledger(t); l.Count != 1 || f.count(t, `SELECT count(*) FROM billing.payments WHERE order_id = $1`, orderID) != 1 {
		t.Fatalf("ledger has %d charges, want 1", l.Count)
	}
}

// Event 1 is charged, but its answer is lost and its transaction rolls back;
// event 2 for the same order must not charge under a key of its own. The
// charge intent, committed before the call, refuses it; event 1, delivered
// again, is answered from the provider's record and recorded once.
func TestAChargeWhoseAnswerWasLostBlocksAnotherEventForTheOrder(t *testing.T) {
	f := setup(t)
	orderID := newOrderID()
	first, second := confirmed(t, orderID, "42.00"), confirmed(t, orderID, "42.00")
	if d := f.confirmed.DeliverRolledBack(first); !d.HandlerRan || f.ledger(t).Count != 1 {
		t.Fatalf("the first attempt did not charge: %v", d.Err)
	}
	d := f.confirmed.Deliver(second)
	if !d.DeadLettered() || f.ledger(t).Count != 1 {
		t.Fatalf("second event: %v, %d charges; want a permanent refusal and still one charge", d.Err, f.ledger(t).Count)
	}
	if d := f.confirmed.Deliver(first); d.Err != nil {
		t.Fatalf("first event again: %v", d.Err)
	}
	if l := f.ledger(t); l.Count != 1 {
		t.Fatalf("%d charges, want 1", l.Count)
	}
	if status, _, _, _ := f.payment(t, orderID); status != "charged" {
		t.Fatalf("payment %s, want charged", status)
	}
}

// A provider that cannot be reached is no reason to record anything: the
// delivery rolls back (claim included) and the next one charges.
func TestUnreachableProviderRollsBackAndTheNextDeliveryCharges(t *testing.T) {
	pool := reftest.Postgres(t)
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
	ev := confirmed(t, newOrderID(), "12.00")
	h := oncetest.NewHandler(t, oncetest.HandlerConfig[orderevents.Confirmed]{Decode: orderevents.DecodeConfirmed, DB: pool, Group: group, Handle: billing.Handler{Payments: down, Currency: "EUR", DB: pool}.OnConfirmed})
	d := h.Deliver(ev)
	var n int
	_ = pool.QueryRow(context.Background(), `SELECT count(*) FROM billing.payments WHERE order_id = $1`, ev.OrderID()).Scan(&n)
	if d.Err == nil || d.DeadLettered() || h.Claimed(ev) || n != 0 {
		t.Fatalf("got %v (dead-lettered %v); want a retryable error with nothing committed", d.Err, d.DeadLettered())
	}

	srv = httptest.NewServer(p)
	t.Cleanup(srv.Close)
	up, err := payment.NewClient(payment.ClientConfig{BaseURL: srv.URL})
	if err != nil {
		t.Fatal(err)
	}
	h = oncetest.NewHandler(t, oncetest.HandlerConfig[orderevents.Confirmed]{Decode: orderevents.DecodeConfirmed, DB: pool, Group: group, Handle: billing.Handler{Payments: up, Currency: "EUR", DB: pool}.OnConfirmed})
	h.RequireOnce(ev)
	var status string
	if err := pool.QueryRow(context.Background(), `SELECT status FROM billing.payments WHERE order_id = $1`, ev.OrderID()).Scan(&status); err != nil || status != "charged" {
		t.Fatalf("payment %s (%v) after the provider came back, want charged", status, err)
	}
}

// A cancellation after the charge refunds it once, with the cancellation's
// event id as the key, and announces payment.refunded.v1 once.
func TestCancellationAfterTheChargeRefundsOnce(t *testing.T) {
	f := setup(t)
	orderID := newOrderID()
	f.confirmed.RequireOnce(confirmed(t, orderID, "30.10"))
	cancel := cancelled(t, orderID)
	f.cancelled.RequireOnce(cancel)
	l := f.ledger(t)
	if l.RefundCount != 1 || l.Refunds[0].Amount != "30.10" || l.Refunds[0].IdempotencyKey != cancel.EventID().String() || l.RefundTotals["EUR"] != "30.10" {
		t.Fatalf("ledger refunds %+v; want one full refund keyed by the cancellation", l.Refunds)
	}
	if f.count(t, `SELECT count(*) FROM billing.refunds WHERE order_id = $1`, orderID) != 1 {
		t.Fatal("billing did not record the refund once")
	}
	if n := f.published(t, f.paymentEventOf(t, `SELECT payment_event_id FROM billing.refunds WHERE order_id = $1`, orderID)); n != 1 {
		t.Fatalf("payment.refunded.v1 is %d times in the outbox, want once", n)
	}
	// Another cancellation of the same order (a producer re-publishing under
	// a new id) refunds nothing more.
	f.cancelled.RequireOnce(cancelled(t, orderID))
	if l := f.ledger(t); l.RefundCount != 1 {
		t.Fatalf("%d refunds after a second cancellation, want 1", l.RefundCount)
	}
}

// A cancellation that arrives before its confirmation blocks the charge:
// the confirmation is recorded as cancelled and the provider never called.
func TestCancellationBeforeTheChargeBlocksIt(t *testing.T) {
	f := setup(t)
	orderID := newOrderID()
	f.cancelled.RequireOnce(cancelled(t, orderID))
	f.confirmed.RequireOnce(confirmed(t, orderID, "15.00"))
	if status, _, _, _ := f.payment(t, orderID); status != "cancelled" {
		t.Fatalf("payment %s, want cancelled", status)
	}
	if l := f.ledger(t); l.Count != 0 || l.RefundCount != 0 {
		t.Fatalf("ledger %d charges, %d refunds; want none", l.Count, l.RefundCount)
	}
}

// A cancellation that arrives while the charge is in flight (its intent
// committed, its outcome not yet recorded) is held, not recorded, until the
// confirmation settles the charge; then it refunds it.
func TestCancellationDuringTheChargeWaitsAndThenRefunds(t *testing.T) {
	f := setup(t)
	orderID := newOrderID()
	charge := confirmed(t, orderID, "60.00")
	f.confirmed.DeliverRolledBack(charge) // charged at the provider, not recorded
	cancel := cancelled(t, orderID)
	d := f.cancelled.Deliver(cancel)
	if d.Err == nil || d.DeadLettered() || f.cancelled.Claimed(cancel) {
		t.Fatalf("cancellation during the charge: %v; want it held (not permanent, nothing committed)", d.Err)
	}
	if f.count(t, `SELECT count(*) FROM billing.cancellations WHERE order_id = $1`, orderID) != 0 {
		t.Fatal("the cancellation was recorded while the charge was in flight: it would have blocked nothing")
	}
	f.confirmed.RequireOnce(charge)
	f.cancelled.RequireOnce(cancel)
	l := f.ledger(t)
	if l.Count != 1 || l.RefundCount != 1 || l.Refunds[0].Amount != "60.00" {
		t.Fatalf("ledger %d charges, %d refunds; want the charge refunded once", l.Count, l.RefundCount)
	}
}

// A declined order has nothing to refund.
func TestCancellationOfADeclinedOrderRefundsNothing(t *testing.T) {
	f := setup(t)
	orderID := newOrderID()
	f.confirmed.RequireOnce(confirmed(t, orderID, "900.00"))
	f.cancelled.RequireOnce(cancelled(t, orderID))
	if l := f.ledger(t); l.Count != 0 || l.RefundCount != 0 {
		t.Fatalf("ledger %d charges, %d refunds; want none", l.Count, l.RefundCount)
	}
}

func TestSettingsAreValidated(t *testing.T) {
	for _, c := range []string{"", "eur", "EURO"} {
		if err := (billing.Handler{Payments: &payment.Client{}, Currency: c, DB: &pgxpool.Pool{}}).Validate(); err == nil {
			t.Errorf("currency %q accepted", c)
		}
	}
	err := billing.Handler{}.Validate()
	for _, want := range []string{"Payments", "DB", "Currency"} {
		if err == nil || !contains(err.Error(), want) {
			t.Errorf("missing settings: %v; want %s named", err, want)
		}
	}
}

func contains(s, sub string) bool { return sub != "" && strings.Contains(s, sub) }

// The provider holds another request under the order's key (the currency
// setting changed, or a producer reused the event id with another amount
// after an attempt rolled back): the outcome of the earlier request is
// unknown, so nothing is recorded failed and nothing announced; the event is
// dead-lettered for a person to reconcile.
func TestKeyReusedIsNotRecordedAsFailed(t *testing.T) {
	f := setup(t)
	ev := confirmed(t, newOrderID(), "20.00")
	f.confirmed.DeliverRolledBack(ev) // charged at the provider in EUR, not recorded
	usd := f.handler
	usd.Currency = "USD"
	h := oncetest.NewHandler(t, oncetest.HandlerConfig[orderevents.Confirmed]{Decode: orderevents.DecodeConfirmed, DB: f.pool, Group: f.confirmed.Group(), Handle: usd.OnConfirmed})
	d := h.Deliver(ev)
	if !d.DeadLettered() || !errors.Is(d.Err, payment.ErrKeyReused) || !strings.Contains(d.Err.Error(), "reconcile") {
		t.Fatalf("got %v; want a permanent refusal naming the reused key", d.Err)
	}
	var n int
	_ = f.pool.QueryRow(context.Background(), `SELECT count(*) FROM billing.payments WHERE order_id = $1`, ev.OrderID()).Scan(&n)
	if n != 0 || f.ledger(t).Count != 1 {
		t.Fatalf("%d payment rows, %d charges; want none recorded and the one charge untouched", n, f.ledger(t).Count)
	}
	// The confirmation is in the dead-letter topic now and comes back only
	// when a person replays it: the order's cancellation must go to a person
	// too, at once, not wait a dedup horizon for it.
	if d := f.cancelled.Deliver(cancelled(t, ev.OrderID())); !d.DeadLettered() || !strings.Contains(d.Err.Error(), "unsettled") {
		t.Fatalf("the cancellation of an order whose charge is unsettled: %v; want it dead-lettered for reconciliation", d.Err)
	}
}

// A cancellation that finds a charge intent without a payment waits for the
// confirmation, unless that confirmation is past the dedup horizon and can
// never be recorded: then it is dead-lettered for a person to reconcile,
// rather than held forever.
func TestCancellationOfAChargeThatWillNeverBeRecorded(t *testing.T) {
	f := setup(t)
	orderID := newOrderID()
	charge := confirmed(t, orderID, "33.00")
	f.confirmed.DeliverRolledBack(charge) // the intent and the charge, never recorded
	later := f.handler
	later.Horizon = time.Hour
	later.Now = func() time.Time { return time.Now().Add(2 * time.Hour) } // the confirmation is now too old
	h := oncetest.NewHandler(t, oncetest.HandlerConfig[orderevents.Cancelled]{Decode: orderevents.DecodeCancelled, DB: f.pool, Group: f.cancelled.Group(), Handle: later.OnCancelled})
	cancel := cancelled(t, orderID)
	if d := f.cancelled.Deliver(cancel); d.Err == nil || d.DeadLettered() {
		t.Fatalf("within the horizon: %v; want the cancellation held", d.Err)
	}
	if d := h.Deliver(cancel); !d.DeadLettered() || !strings.Contains(d.Err.Error(), "reconcile") {
		t.Fatalf("past the horizon: %v; want it dead-lettered for reconciliation", d.Err)
	}
}

// The order's lock orders a confirmation behind a cancellation that is being
// committed: the confirmation sees the cancellation and does not charge.
// Without the lock it would find neither a payment nor a cancellation, and
// charge an order whose cancellation was then recorded.
func TestConfirmationWaitsForACancellationInFlight(t *testing.T) {
	f := setup(t)
	orderID := newOrderID()
	inTx, release := make(chan struct{}), make(chan struct{})
	slowCancel := func(ctx context.Context, tx pgx.Tx, ev orderevents.Cancelled) error {
		if err := f.handler.OnCancelled(ctx, tx, ev); err != nil {
			return err
		}
		close(inTx)
		<-release // the cancellation is recorded, not yet committed
		return nil
	}
	h := oncetest.NewHandler(t, oncetest.HandlerConfig[orderevents.Cancelled]{Decode: orderevents.DecodeCancelled, DB: f.pool, Group: f.cancelled.Group(), Handle: slowCancel})
	done := make(chan oncetest.Delivery, 1)
	go func() { done <- h.Deliver(cancelled(t, orderID)) }()
	<-inTx
	charged := make(chan oncetest.Delivery, 1)
	go func() { charged <- f.confirmed.Deliver(confirmed(t, orderID, "15.00")) }()
	select {
	case d := <-charged:
		close(release)
		<-done
		t.Fatalf("the confirmation finished (%v) while the cancellation was not committed: it did not wait for the order's lock", d.Err)
	case <-time.After(500 * time.Millisecond):
	}
	close(release)
	if d := <-done; d.Err != nil {
		t.Fatal(d.Err)
	}
	if d := <-charged; d.Err != nil {
		t.Fatal(d.Err)
	}
	if status, _, _, _ := f.payment(t, orderID); status != "cancelled" || f.ledger(t).Count != 0 {
		t.Fatalf("payment %s, %d charges; want cancelled and never charged", status, f.ledger(t).Count)
	}
}

// The provider charged and the payment's record is then refused by the
// database (22P02, as a pooler or a driver mode can cause): nothing in that
// attempt is permanent after the charge. The order is held, not
// dead-lettered, and once the write passes it is recorded once, under the
// one charge the provider made.
func TestAChargeWhoseRecordFailsIsHeldAndRecordedOnce(t *testing.T) {
	f := setup(t)
	ctx := context.Background()
	orderID := newOrderID()
	fn := "billing_test_refuse_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	if _, err := f.pool.Exec(ctx, `CREATE SEQUENCE `+fn+`_tries;
CREATE FUNCTION `+fn+`() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.order_id = `+strconv.FormatInt(orderID, 10)+` THEN
    PERFORM nextval('`+fn+`_tries');
    RAISE EXCEPTION 'staged: invalid input syntax for type json' USING ERRCODE = '22P02';
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER `+fn+` BEFORE INSERT ON billing.payments FOR EACH ROW EXECUTE FUNCTION `+fn+`()`); err != nil {
		t.Fatal(err)
	}
	drop := func() { _, _ = f.pool.Exec(context.Background(), `DROP TRIGGER IF EXISTS `+fn+` ON billing.payments`) }
	t.Cleanup(func() {
		drop()
		_, _ = f.pool.Exec(context.Background(), `DROP FUNCTION IF EXISTS `+fn+`(); DROP SEQUENCE IF EXISTS `+fn+`_tries`)
	})
	ev := confirmed(t, orderID, "42.00")
	for range 2 {
		d := f.confirmed.Deliver(ev)
		if d.DeadLettered() || !errors.Is(d.Err, idempotency.ErrAfterExternalEffect) {
			t.Fatalf("the charge's record refused: %v (dead-lettered %t); want it held after the charge", d.Err, d.DeadLettered())
		}
	}
	if n := f.count(t, `SELECT last_value FROM `+fn+`_tries`); n != 2 {
		t.Fatalf("the record was refused %d times; want 2 (the fault did not happen)", n)
	}
	drop()
	f.confirmed.RequireOnce(ev)
	if status, chargeID, _, _ := f.payment(t, orderID); status != "charged" || chargeID == nil {
		t.Fatalf("payment %s; want charged", status)
	}
	charges := 0
	for _, c := range f.ledger(t).Charges {
		if c.OrderID == strconv.FormatInt(orderID, 10) {
			charges++
		}
	}
	if charges != 1 {
		t.Fatalf("the provider holds %d charges of the order; want 1", charges)
	}
}
