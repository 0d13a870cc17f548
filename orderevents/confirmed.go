package orderevents

import (
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/google/uuid"
	"github.com/shopspring/decimal"
)

// TypeConfirmedV1 is the event_type of [Confirmed] on the wire.
const TypeConfirmedV1 = "order.confirmed.v1"

// Confirmed is the style guide's OrderConfirmedMessage: an order that was
// confirmed and must be charged once. Its fields are unexported so that a
// value, once decoded or built by [NewConfirmed], is valid and cannot change.
type Confirmed struct {
	eventID     uuid.UUID
	occurredAt  time.Time
	orderID     int64
	customerID  int64
	totalAmount decimal.Decimal
}

// confirmedWire is the byte form this module writes: the guide's fields in a
// fixed order, occurred_at in UTC with microseconds, the amount as a string
// with two decimals. One event has exactly one byte form.
type confirmedWire struct {
	EventID     string `json:"event_id"`
	EventType   string `json:"event_type"`
	OccurredAt  string `json:"occurred_at"`
	OrderID     int64  `json:"order_id"`
	CustomerID  int64  `json:"customer_id"`
	TotalAmount string `json:"total_amount"`
}

// occurredAtLayout is RFC 3339 with microseconds, pydantic's precision.
const occurredAtLayout = "2006-01-02T15:04:05.000000Z07:00"

// NewConfirmed builds a valid event, as a producer would before writing it to
// its outbox. The event id must be a UUIDv7 (R-KFK-IDEM-1).
func NewConfirmed(eventID uuid.UUID, occurredAt time.Time, orderID, customerID int64, totalAmount decimal.Decimal) (Confirmed, error) {
	c := Confirmed{
		eventID:     eventID,
		occurredAt:  occurredAt.UTC().Truncate(time.Microsecond),
		orderID:     orderID,
		customerID:  customerID,
		totalAmount: totalAmount,
	}
	if !totalAmount.Equal(totalAmount.Round(MaxFractionDigits)) {
		return Confirmed{}, &FieldError{EventType: TypeConfirmedV1, Field: "total_amount", Want: "at most 2 fraction digits", Got: "a decimal with more"}
	}
	if occurredAt.IsZero() {
		return Confirmed{}, &FieldError{EventType: TypeConfirmedV1, Field: "occurred_at", Want: "a time", Got: "the zero time"}
	}
	// The same checks as decoding, on the byte form this value has.
	b, err := c.MarshalJSON()
	if err != nil {
		return Confirmed{}, err
	}
	if _, err := DecodeConfirmed(b); err != nil {
		return Confirmed{}, err
	}
	return c, nil
}

// DecodeConfirmed parses and validates one message payload. Every error is a
// [*FieldError] wrapping [ErrInvalid] that names the field.
func DecodeConfirmed(payload []byte) (Confirmed, error) {
	f := readFields(TypeConfirmedV1, payload)
	c := Confirmed{
		eventID: f.uuidV7("event_id"),
	}
	f.checkType()
	c.occurredAt = f.timestamp("occurred_at")
	c.orderID = f.int64("order_id")
	c.customerID = f.int64("customer_id")
	c.totalAmount = f.amount("total_amount")
	if f.err != nil {
		return Confirmed{}, f.err
	}
	return c, nil
}

// MarshalJSON writes the byte form described at [Confirmed].
func (c Confirmed) MarshalJSON() ([]byte, error) {
	b, err := json.Marshal(confirmedWire{
		EventID:     c.eventID.String(),
		EventType:   TypeConfirmedV1,
		OccurredAt:  c.occurredAt.UTC().Format(occurredAtLayout),
		OrderID:     c.orderID,
		CustomerID:  c.customerID,
		TotalAmount: c.totalAmount.StringFixed(MaxFractionDigits),
	})
	if err != nil {
		return nil, fmt.Errorf("%s: encode: %w", TypeConfirmedV1, err)
	}
	return b, nil
}

// CanonicalJSON is the event's values in canonical form, its fingerprint
// (pipeline.CanonicalEvent): byte for byte what idempotency.CanonicalJSON
// makes of MarshalJSON's form (members by name, integers as exact decimals
// without trailing zeros, the time in UTC without trailing zeros), so that
// claims stored before it match. Written directly: it runs for every event
// consumed, and the round trip through encoding/json cost a consumer about
// a third of its CPU. It cannot fail: every value a Confirmed holds has a
// form, a time outside the years 0000-9999 included.
func (c Confirmed) CanonicalJSON() ([]byte, error) {
	b := make([]byte, 0, 192)
	b = append(b, `{"customer_id":`...)
	b = appendCanonicalInt(b, c.customerID)
	b = append(b, `,"event_id":"`...)
	b = append(b, c.eventID.String()...)
	b = append(b, `","event_type":"`+TypeConfirmedV1+`","occurred_at":"`...)
	at := c.occurredAt.UTC()
	if y := at.Year(); y < 0 || y > 9999 {
		// Not an RFC 3339 year (a valid time whose offset carried it
		// out of 0000-9999): MarshalJSON writes it with Go's signed
		// or five-digit year, a string idempotency.CanonicalJSON keeps
		// as it is.
		b = at.AppendFormat(b, occurredAtLayout)
	} else {
		at = at.Add(-time.Duration(at.Nanosecond() % 1000)) // MarshalJSON keeps microseconds
		b = at.AppendFormat(b, time.RFC3339Nano)
	}
	b = append(b, `","order_id":`...)
	b = appendCanonicalInt(b, c.orderID)
	b = append(b, `,"total_amount":"`...)
	b = append(b, c.totalAmount.StringFixed(MaxFractionDigits)...)
	return append(b, `"}`...), nil
}

// appendCanonicalInt appends n as idempotency.CanonicalJSON writes a number:
// its significant digits, and the trailing zeros as a power of ten (1200 is
// 12e2).
func appendCanonicalInt(b []byte, n int64) []byte {
	if n == 0 {
		return append(b, '0')
	}
	b = strconv.AppendInt(b, n, 10)
	zeros := 0
	for b[len(b)-1-zeros] == '0' {
		zeros++
	}
	if zeros == 0 {
		return b
	}
	b = append(b[:len(b)-zeros], 'e')
	return strconv.AppendInt(b, int64(zeros), 10)
}

func (c Confirmed) EventID() uuid.UUID           { return c.eventID }
func (c Confirmed) OccurredAt() time.Time        { return c.occurredAt }
func (c Confirmed) OrderID() int64               { return c.orderID }
func (c Confirmed) CustomerID() int64            { return c.customerID }
func (c Confirmed) TotalAmount() decimal.Decimal { return c.totalAmount }
