package order

import (
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"time"

	"github.com/google/uuid"
	"github.com/shopspring/decimal"
)

// TypeConfirmedV1 is the event_type of [Confirmed] on the wire.
const TypeConfirmedV1 = "order.confirmed.v1"

// MaxPayloadBytes bounds a message: an order event is a few hundred bytes, and
// a huge one is a producer bug that should not be decoded, stored or charged.
const MaxPayloadBytes = 64 << 10

// MaxFractionDigits bounds the amount's scale: charges are in minor units of
// two-decimal currencies, and a third digit would be rounded somewhere.
const MaxFractionDigits = 2

var currencyCode = regexp.MustCompile(`^[A-Z]{3}$`)

// ErrInvalid is wrapped by every validation error of [Decode], so callers can
// tell a message that can never be processed from a failure of processing it.
var ErrInvalid = errors.New("invalid order.confirmed.v1 event")

// Confirmed is an order that was confirmed and must be charged once.
// Its fields are unexported so that a value, once decoded or built by
// [NewConfirmed], is valid and cannot change.
type Confirmed struct {
	eventID    uuid.UUID
	occurredAt time.Time
	orderID    uuid.UUID
	customerID uuid.UUID
	amount     decimal.Decimal
	currency   string
}

// wire is the JSON document on the topic. Any Kafka client in any language can
// produce it; nothing depends on headers.
type wire struct {
	EventID    string `json:"event_id"`
	EventType  string `json:"event_type"`
	OccurredAt string `json:"occurred_at"`
	OrderID    string `json:"order_id"`
	CustomerID string `json:"customer_id"`
	Amount     string `json:"amount"`
	Currency   string `json:"currency"`
}

// NewConfirmed builds a valid event, as a producer would before writing it to
// its outbox. The event id must be a UUIDv7 (R-KFK-IDEM-1).
func NewConfirmed(eventID uuid.UUID, occurredAt time.Time, orderID, customerID uuid.UUID, amount decimal.Decimal, currency string) (Confirmed, error) {
	c := Confirmed{
		eventID:    eventID,
		occurredAt: occurredAt.UTC().Truncate(time.Microsecond),
		orderID:    orderID,
		customerID: customerID,
		amount:     amount,
		currency:   currency,
	}
	return c, c.validate()
}

// Decode parses and validates one message payload. Every error wraps
// [ErrInvalid] and names the offending field.
func Decode(payload []byte) (Confirmed, error) {
	if len(payload) > MaxPayloadBytes {
		return Confirmed{}, fmt.Errorf("%w: payload of %d bytes exceeds the %d-byte limit", ErrInvalid, len(payload), MaxPayloadBytes)
	}
	var w wire
	if err := json.Unmarshal(payload, &w); err != nil {
		return Confirmed{}, fmt.Errorf("%w: not a JSON object: %v", ErrInvalid, err)
	}
	if w.EventType != TypeConfirmedV1 {
		return Confirmed{}, fmt.Errorf("%w: event_type %q, want %q", ErrInvalid, w.EventType, TypeConfirmedV1)
	}
	var c Confirmed
	var err error
	if c.eventID, err = uuid.Parse(w.EventID); err != nil {
		return Confirmed{}, fmt.Errorf("%w: event_id: %v", ErrInvalid, err)
	}
	if c.occurredAt, err = time.Parse(time.RFC3339Nano, w.OccurredAt); err != nil {
		return Confirmed{}, fmt.Errorf("%w: occurred_at: %v", ErrInvalid, err)
	}
	c.occurredAt = c.occurredAt.UTC()
	if c.orderID, err = uuid.Parse(w.OrderID); err != nil {
		return Confirmed{}, fmt.Errorf("%w: order_id: %v", ErrInvalid, err)
	}
	if c.customerID, err = uuid.Parse(w.CustomerID); err != nil {
		return Confirmed{}, fmt.Errorf("%w: customer_id: %v", ErrInvalid, err)
	}
	if c.amount, err = decimal.NewFromString(w.Amount); err != nil {
		return Confirmed{}, fmt.Errorf("%w: amount %q is not a decimal string", ErrInvalid, w.Amount)
	}
	c.currency = w.Currency
	return c, c.validate()
}

func (c Confirmed) validate() error {
	switch {
	case c.eventID.Version() != 7 || c.eventID.Variant() != uuid.RFC4122:
		return fmt.Errorf("%w: event_id %s is not a UUIDv7", ErrInvalid, c.eventID)
	case c.occurredAt.IsZero():
		return fmt.Errorf("%w: occurred_at is missing", ErrInvalid)
	case c.orderID == uuid.Nil:
		return fmt.Errorf("%w: order_id is missing", ErrInvalid)
	case c.customerID == uuid.Nil:
		return fmt.Errorf("%w: customer_id is missing", ErrInvalid)
	case !c.amount.IsPositive():
		return fmt.Errorf("%w: amount %s is not positive", ErrInvalid, c.amount)
	case c.amount.Exponent() < -MaxFractionDigits && !c.amount.Equal(c.amount.Round(MaxFractionDigits)):
		return fmt.Errorf("%w: amount %s has more than %d fraction digits", ErrInvalid, c.amount, MaxFractionDigits)
	case !currencyCode.MatchString(c.currency):
		return fmt.Errorf("%w: currency %q is not an ISO 4217 code", ErrInvalid, c.currency)
	}
	return nil
}

// MarshalJSON writes the wire format. Amount is written with exactly
// [MaxFractionDigits] digits so that one event always has one byte form.
func (c Confirmed) MarshalJSON() ([]byte, error) {
	return json.Marshal(wire{
		EventID:    c.eventID.String(),
		EventType:  TypeConfirmedV1,
		OccurredAt: c.occurredAt.Format(time.RFC3339Nano),
		OrderID:    c.orderID.String(),
		CustomerID: c.customerID.String(),
		Amount:     c.amount.StringFixed(MaxFractionDigits),
		Currency:   c.currency,
	})
}

func (c Confirmed) EventID() uuid.UUID      { return c.eventID }
func (c Confirmed) OccurredAt() time.Time   { return c.occurredAt }
func (c Confirmed) OrderID() uuid.UUID      { return c.orderID }
func (c Confirmed) CustomerID() uuid.UUID   { return c.customerID }
func (c Confirmed) Amount() decimal.Decimal { return c.amount }
func (c Confirmed) Currency() string        { return c.currency }
