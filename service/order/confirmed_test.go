package order_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/service/order"
)

func doc(fields map[string]string) []byte {
	base := map[string]string{
		"event_id":    uuid.Must(uuid.NewV7()).String(),
		"event_type":  order.TypeConfirmedV1,
		"occurred_at": "2026-12-02T10:00:00.123Z",
		"order_id":    uuid.NewString(),
		"customer_id": uuid.NewString(),
		"amount":      "19.90",
		"currency":    "EUR",
	}
	for k, v := range fields {
		if v == "<absent>" {
			delete(base, k)
		} else {
			base[k] = v
		}
	}
	var parts []string
	for k, v := range base {
		parts = append(parts, fmt.Sprintf("%q:%q", k, v))
	}
	return []byte("{" + strings.Join(parts, ",") + "}")
}

func TestDecodeRejectsWithTheFieldNamed(t *testing.T) {
	for _, tc := range []struct {
		name   string
		fields map[string]string
		want   string
	}{
		{"uuid v4 id", map[string]string{"event_id": uuid.NewString()}, "not a UUIDv7"},
		{"missing id", map[string]string{"event_id": "<absent>"}, "event_id"},
		{"other version", map[string]string{"event_type": "order.confirmed.v2"}, "event_type"},
		{"float amount", map[string]string{"amount": "1e400x"}, "amount"},
		{"negative amount", map[string]string{"amount": "-1.00"}, "not positive"},
		{"zero amount", map[string]string{"amount": "0"}, "not positive"},
		{"sub-cent amount", map[string]string{"amount": "1.001"}, "fraction digits"},
		{"bad currency", map[string]string{"currency": "euro"}, "currency"},
		{"bad time", map[string]string{"occurred_at": "yesterday"}, "occurred_at"},
		{"bad order id", map[string]string{"order_id": "17"}, "order_id"},
	} {
		_, err := order.Decode(doc(tc.fields))
		if !errors.Is(err, order.ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: got %v; want ErrInvalid mentioning %q", tc.name, err, tc.want)
		}
	}
	huge := doc(map[string]string{"padding": strings.Repeat("x", order.MaxPayloadBytes)})
	if _, err := order.Decode(huge); !errors.Is(err, order.ErrInvalid) || !strings.Contains(err.Error(), "limit") {
		t.Errorf("huge payload: got %v", err)
	}
	if _, err := order.Decode([]byte("not json")); !errors.Is(err, order.ErrInvalid) {
		t.Errorf("not json: got %v", err)
	}
}

func TestAmountIsExactDecimal(t *testing.T) {
	ev, err := order.Decode(doc(map[string]string{"amount": "0.10"}))
	if err != nil {
		t.Fatal(err)
	}
	sum := decimal.Zero
	for range 3 {
		sum = sum.Add(ev.Amount())
	}
	if !sum.Equal(decimal.RequireFromString("0.30")) {
		t.Fatalf("0.10 * 3 = %s; a float would not be exact, a decimal must be", sum)
	}
	if _, err := order.Decode(doc(map[string]string{"amount": "12.50"})); err != nil {
		t.Fatalf("trailing zero: %v", err)
	}
	if _, err := order.Decode(doc(map[string]string{"amount": "12.5000"})); err != nil {
		t.Fatalf("an exact amount with extra zeros must be accepted: %v", err)
	}
}

func TestRoundTripIsByteStable(t *testing.T) {
	ev, err := order.NewConfirmed(uuid.Must(uuid.NewV7()), time.Date(2026, 12, 2, 10, 0, 0, 123456789, time.UTC),
		uuid.New(), uuid.New(), decimal.RequireFromString("7.5"), "EUR")
	if err != nil {
		t.Fatal(err)
	}
	first, _ := ev.MarshalJSON()
	back, err := order.Decode(first)
	if err != nil {
		t.Fatal(err)
	}
	second, _ := back.MarshalJSON()
	if string(first) != string(second) {
		t.Fatalf("re-encoding changed the bytes:\n%s\n%s", first, second)
	}
	if !strings.Contains(string(first), `"amount":"7.50"`) {
		t.Fatalf("amount not written with two decimals: %s", first)
	}
}

func TestNewConfirmedRejectsV4(t *testing.T) {
	_, err := order.NewConfirmed(uuid.New(), time.Now(), uuid.New(), uuid.New(), decimal.NewFromInt(1), "EUR")
	if !errors.Is(err, order.ErrInvalid) {
		t.Fatalf("got %v", err)
	}
}
