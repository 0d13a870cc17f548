package orderevents

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/google/uuid"
)

// TypeCancelledV1 is the event_type of [Cancelled] on the wire.
const TypeCancelledV1 = "order.cancelled.v1"

// Cancelled is an order that was cancelled: if it was charged, it must be
// refunded once; if not, it must never be charged.
type Cancelled struct {
	eventID    uuid.UUID
	occurredAt time.Time
	orderID    int64
	reason     string
}

type cancelledWire struct {
	EventID    string `json:"event_id"`
	EventType  string `json:"event_type"`
	OccurredAt string `json:"occurred_at"`
	OrderID    int64  `json:"order_id"`
	Reason     string `json:"reason"`
}

// NewCancelled builds a valid event. The reason may be empty.
func NewCancelled(eventID uuid.UUID, occurredAt time.Time, orderID int64, reason string) (Cancelled, error) {
	c := Cancelled{eventID: eventID, occurredAt: occurredAt.UTC().Truncate(time.Microsecond), orderID: orderID, reason: reason}
	if occurredAt.IsZero() {
		return Cancelled{}, &FieldError{EventType: TypeCancelledV1, Field: "occurred_at", Want: "a time", Got: "the zero time"}
	}
	b, err := c.MarshalJSON()
	if err != nil {
		return Cancelled{}, err
	}
	if _, err := DecodeCancelled(b); err != nil {
		return Cancelled{}, err
	}
	return c, nil
}

// DecodeCancelled parses and validates one message payload; see [DecodeConfirmed].
func DecodeCancelled(payload []byte) (Cancelled, error) {
	f := readFields(TypeCancelledV1, payload)
	c := Cancelled{eventID: f.uuidV7("event_id")}
	f.checkType()
	c.occurredAt = f.timestamp("occurred_at")
	c.orderID = f.int64("order_id")
	c.reason, _ = f.str("reason", "a string")
	if f.err != nil {
		return Cancelled{}, f.err
	}
	return c, nil
}

// MarshalJSON writes the event's one byte form.
func (c Cancelled) MarshalJSON() ([]byte, error) {
	b, err := json.Marshal(cancelledWire{
		EventID:    c.eventID.String(),
		EventType:  TypeCancelledV1,
		OccurredAt: c.occurredAt.UTC().Format(occurredAtLayout),
		OrderID:    c.orderID,
		Reason:     c.reason,
	})
	if err != nil {
		return nil, fmt.Errorf("%s: encode: %w", TypeCancelledV1, err)
	}
	return b, nil
}

func (c Cancelled) EventID() uuid.UUID    { return c.eventID }
func (c Cancelled) OccurredAt() time.Time { return c.occurredAt }
func (c Cancelled) OrderID() int64        { return c.orderID }
func (c Cancelled) Reason() string        { return c.reason }
