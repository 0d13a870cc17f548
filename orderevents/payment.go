package orderevents

import (
	"encoding/json"
	"fmt"
	"regexp"
	"time"

	"github.com/google/uuid"
	"github.com/shopspring/decimal"
)

// The payment events billing publishes about an order, through its outbox,
// all on one topic keyed by the order id: a refund never overtakes its charge.
const (
	TypePaymentChargedV1  = "payment.charged.v1"
	TypePaymentFailedV1   = "payment.failed.v1"
	TypePaymentRefundedV1 = "payment.refunded.v1"
)

// Payment is one of billing's payment events. Kind says which; ProviderID
// is the provider's charge id (charged) or refund id (refunded), Reason is
// set for failed.
type Payment struct {
	eventID    uuid.UUID
	kind       string
	occurredAt time.Time
	orderID    int64
	customerID int64
	amount     decimal.Decimal
	currency   string
	providerID string
	reason     string
}

type paymentWire struct {
	EventID          string `json:"event_id"`
	EventType        string `json:"event_type"`
	OccurredAt       string `json:"occurred_at"`
	OrderID          int64  `json:"order_id"`
	CustomerID       int64  `json:"customer_id"`
	Amount           string `json:"amount"`
	Currency         string `json:"currency"`
	ProviderChargeID string `json:"provider_charge_id,omitempty"`
	ProviderRefundID string `json:"provider_refund_id,omitempty"`
	Reason           string `json:"reason,omitempty"`
}

// NewPaymentCharged, NewPaymentFailed and NewPaymentRefunded build valid events.
func NewPaymentCharged(eventID uuid.UUID, at time.Time, orderID, customerID int64, amount decimal.Decimal, currency, chargeID string) (Payment, error) {
	return newPayment(Payment{eventID: eventID, kind: TypePaymentChargedV1, occurredAt: at, orderID: orderID, customerID: customerID, amount: amount, currency: currency, providerID: chargeID})
}

func NewPaymentFailed(eventID uuid.UUID, at time.Time, orderID, customerID int64, amount decimal.Decimal, currency, reason string) (Payment, error) {
	return newPayment(Payment{eventID: eventID, kind: TypePaymentFailedV1, occurredAt: at, orderID: orderID, customerID: customerID, amount: amount, currency: currency, reason: reason})
}

func NewPaymentRefunded(eventID uuid.UUID, at time.Time, orderID, customerID int64, amount decimal.Decimal, currency, refundID string) (Payment, error) {
	return newPayment(Payment{eventID: eventID, kind: TypePaymentRefundedV1, occurredAt: at, orderID: orderID, customerID: customerID, amount: amount, currency: currency, providerID: refundID})
}

func newPayment(p Payment) (Payment, error) {
	p.occurredAt = p.occurredAt.UTC().Truncate(time.Microsecond)
	if p.occurredAt.IsZero() {
		return Payment{}, &FieldError{EventType: p.kind, Field: "occurred_at", Want: "a time", Got: "the zero time"}
	}
	b, err := p.MarshalJSON()
	if err != nil {
		return Payment{}, err
	}
	if _, err := DecodePayment(b); err != nil {
		return Payment{}, err
	}
	return p, nil
}

var currencyCode = regexp.MustCompile(`^[A-Z]{3}$`)

// IsCurrencyCode reports whether s has the form of an ISO 4217 code (EUR),
// as the payment events carry it.
func IsCurrencyCode(s string) bool { return currencyCode.MatchString(s) }

// DecodePayment parses and validates any of the three payment events.
func DecodePayment(payload []byte) (Payment, error) {
	f := readFields("payment event", payload)
	const kinds = `"payment.charged.v1", "payment.failed.v1" or "payment.refunded.v1"`
	kind, ok := f.str("event_type", kinds)
	if ok {
		switch kind {
		case TypePaymentChargedV1, TypePaymentFailedV1, TypePaymentRefundedV1:
			f.eventType = kind
		default:
			f.failAs("event_type", kinds, "another string")
		}
	}
	p := Payment{kind: kind, eventID: f.uuidV7("event_id")}
	p.occurredAt = f.timestamp("occurred_at")
	p.orderID = f.int64("order_id")
	p.customerID = f.int64("customer_id")
	p.amount = f.amount("amount")
	if c, ok := f.str("currency", "an ISO 4217 code such as EUR"); ok && !currencyCode.MatchString(c) {
		f.failAs("currency", "an ISO 4217 code such as EUR", "a string that is not one")
	} else {
		p.currency = c
	}
	switch kind {
	case TypePaymentChargedV1:
		p.providerID = f.nonEmpty("provider_charge_id")
	case TypePaymentRefundedV1:
		p.providerID = f.nonEmpty("provider_refund_id")
	case TypePaymentFailedV1:
		p.reason = f.nonEmpty("reason")
	}
	if f.err != nil {
		return Payment{}, f.err
	}
	return p, nil
}

// MarshalJSON writes the event's one byte form.
func (p Payment) MarshalJSON() ([]byte, error) {
	w := paymentWire{
		EventID:    p.eventID.String(),
		EventType:  p.kind,
		OccurredAt: p.occurredAt.UTC().Format(occurredAtLayout),
		OrderID:    p.orderID,
		CustomerID: p.customerID,
		Amount:     p.amount.StringFixed(MaxFractionDigits),
		Currency:   p.currency,
		Reason:     p.reason,
	}
	switch p.kind {
	case TypePaymentChargedV1:
		w.ProviderChargeID = p.providerID
	case TypePaymentRefundedV1:
		w.ProviderRefundID = p.providerID
	}
	b, err := json.Marshal(w)
	if err != nil {
		return nil, fmt.Errorf("%s: encode: %w", p.kind, err)
	}
	return b, nil
}

func (p Payment) EventID() uuid.UUID      { return p.eventID }
func (p Payment) Kind() string            { return p.kind }
func (p Payment) OccurredAt() time.Time   { return p.occurredAt }
func (p Payment) OrderID() int64          { return p.orderID }
func (p Payment) CustomerID() int64       { return p.customerID }
func (p Payment) Amount() decimal.Decimal { return p.amount }
func (p Payment) Currency() string        { return p.currency }
func (p Payment) ProviderID() string      { return p.providerID }
func (p Payment) Reason() string          { return p.reason }
