package pipeline_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/shopspring/decimal"
)

// confirmed is the tests' event, in the shape of the guide's
// order.confirmed.v1: the library's tests bring their own events rather
// than the reference service's.
type confirmed struct {
	ID       uuid.UUID       `json:"event_id"`
	Type     string          `json:"event_type"`
	At       time.Time       `json:"occurred_at"`
	Order    int64           `json:"order_id"`
	Customer int64           `json:"customer_id"`
	Amount   decimal.Decimal `json:"total_amount"`
}

const confirmedType = "order.confirmed.v1"

func (c confirmed) EventID() uuid.UUID    { return c.ID }
func (c confirmed) OccurredAt() time.Time { return c.At }
func (c confirmed) OrderID() int64        { return c.Order }
func (c confirmed) CustomerID() int64     { return c.Customer }

func newConfirmed(id uuid.UUID, at time.Time, order, customer int64, amount decimal.Decimal) (confirmed, error) {
	c := confirmed{ID: id, Type: confirmedType, At: at.UTC().Truncate(time.Microsecond), Order: order, Customer: customer, Amount: amount}
	return c, c.validate()
}

func (c confirmed) MarshalJSON() ([]byte, error) {
	type wire confirmed
	w := wire(c)
	w.Type = confirmedType
	return json.Marshal(w)
}

// decodeConfirmed is strict as a team's decoder is: each fault is named,
// so that its dead letter says which.
func decodeConfirmed(b []byte) (confirmed, error) {
	var c confirmed
	if !json.Valid(b) || !bytes.HasPrefix(bytes.TrimSpace(b), []byte("{")) {
		return c, errors.New("payload: want a JSON object, got malformed JSON")
	}
	var fields struct {
		ID string `json:"event_id"`
	}
	if err := json.Unmarshal(b, &fields); err != nil {
		return c, fmt.Errorf("field event_id: %w", err)
	}
	if id, err := uuid.Parse(fields.ID); err != nil || id.Version() != 7 {
		return c, fmt.Errorf("field event_id: want a UUID version 7 string, got %q", fields.ID)
	}
	if err := json.Unmarshal(b, &c); err != nil {
		return confirmed{}, fmt.Errorf("payload: %w", err)
	}
	return c, c.validate()
}

func (c confirmed) validate() error {
	switch {
	// Named, never quoted: the text is the dead letter's reason.
	case c.ID.Version() != 7:
		return fmt.Errorf("field event_id: want a UUID version 7 string, got a UUID version %d", c.ID.Version())
	case c.Type != confirmedType:
		return fmt.Errorf("field event_type: want the string %q, got another string", confirmedType)
	case !c.Amount.IsPositive():
		return errors.New("field total_amount: want a positive decimal, got a decimal that is not")
	}
	return nil
}
