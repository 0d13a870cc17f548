package orderevents_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/orderevents"
)

// Payloads written by the style guide's own pydantic OrderConfirmedMessage
// (model_dump_json, and json.dumps of it), recorded from the model in
// dev/seedpeer/produce.py. Each must decode.
var fromPydantic = []string{
	`{"event_id":"01a23a2f-4097-72fb-89dd-6b846b37ea60","event_type":"order.confirmed.v1","occurred_at":"2026-12-03T04:35:04.983939Z","order_id":9007199254740993,"customer_id":2,"total_amount":"123.45"}`,
	`{"event_id":"01a23a2f-4098-75d6-a202-77816c432a36","event_type":"order.confirmed.v1","occurred_at":"2026-12-03T04:35:04.984123Z","order_id":9007199254740993,"customer_id":2,"total_amount":"10"}`,
	`{"event_id":"01a23a2f-4098-75d6-a202-778331d6e5c4","event_type":"order.confirmed.v1","occurred_at":"2026-12-03T04:35:04.984186Z","order_id":9007199254740993,"customer_id":2,"total_amount":"1E+2"}`,
	`{"event_id": "01a23a2f-4098-75d6-a202-7784185faffe", "event_type": "order.confirmed.v1", "occurred_at": "2026-12-02T15:08:21Z", "order_id": 1, "customer_id": 2, "total_amount": "5"}`,
	// --format seed-number: the amount as a JSON number; and an offset instead of Z.
	`{"event_id": "01a23a2f-4098-75d6-a202-7784185faffe", "event_type": "order.confirmed.v1", "occurred_at": "2026-12-02T15:08:21.5+00:00", "order_id": 1, "customer_id": 2, "total_amount": 5.10}`,
	// Unknown extra fields are ignored, as pydantic's default model does.
	`{"event_id":"01a23a2f-4097-72fb-89dd-6b846b37ea60","event_type":"order.confirmed.v1","occurred_at":"2026-12-03T04:35:04.983939Z","order_id":7,"customer_id":2,"total_amount":"1.00","currency":"EUR","schema_version":3}`,
}

func TestDecodesWhatThePydanticModelWrites(t *testing.T) {
	for _, p := range fromPydantic {
		if _, err := orderevents.DecodeConfirmed([]byte(p)); err != nil {
			t.Errorf("%s\n  refused: %v", p, err)
		}
	}
	ev, err := orderevents.DecodeConfirmed([]byte(fromPydantic[0]))
	if err != nil {
		t.Fatal(err)
	}
	if ev.OrderID() != 9007199254740993 || ev.CustomerID() != 2 || !ev.TotalAmount().Equal(decimal.RequireFromString("123.45")) {
		t.Fatalf("decoded %d, %d, %s", ev.OrderID(), ev.CustomerID(), ev.TotalAmount())
	}
	if want := time.Date(2026, 12, 3, 4, 35, 4, 983939000, time.UTC); !ev.OccurredAt().Equal(want) {
		t.Fatalf("occurred_at %s, want %s", ev.OccurredAt(), want)
	}
}

// valid is a payload with every field right; overrides replace raw JSON values.
func valid(overrides map[string]string) []byte {
	fields := []struct{ k, v string }{
		{"event_id", fmt.Sprintf("%q", uuid.Must(uuid.NewV7()))},
		{"event_type", `"order.confirmed.v1"`},
		{"occurred_at", `"2026-12-02T10:00:00.123456Z"`},
		{"order_id", `17`},
		{"customer_id", `42`},
		{"total_amount", `"19.90"`},
	}
	var parts []string
	for _, f := range fields {
		v, ok := overrides[f.k]
		if !ok {
			v = f.v
		}
		if v == "<absent>" {
			continue
		}
		parts = append(parts, fmt.Sprintf("%q:%s", f.k, v))
	}
	return []byte("{" + strings.Join(parts, ",") + "}")
}

func TestRejectionsNameTheFieldAndWhatWasExpected(t *testing.T) {
	for _, tc := range []struct {
		name  string
		field string
		value string
		want  string // in the error text
	}{
		{"uuid v4 id", "event_id", fmt.Sprintf("%q", uuid.New()), "field event_id: want a UUID version 7 string, got a UUID version 4"},
		{"missing id", "event_id", "<absent>", "field event_id: want a UUID version 7 string, got nothing (the field is missing)"},
		{"other version", "event_type", `"order.confirmed.v2"`, `field event_type: want the string "order.confirmed.v1", got another string`},
		{"order id as string", "order_id", `"17"`, `field order_id: want a JSON integer (64-bit), got a string`},
		{"order id as UUID", "order_id", fmt.Sprintf("%q", uuid.New()), "field order_id: want a JSON integer (64-bit), got a string"},
		{"order id fraction", "order_id", `17.5`, "field order_id: want a JSON integer (64-bit), got a number with a fraction or an exponent"},
		{"order id overflow", "order_id", `9223372036854775808`, "field order_id: want a JSON integer (64-bit), got an integer beyond 64 bits"},
		{"customer id null", "customer_id", `null`, "field customer_id: want a JSON integer (64-bit), got null"},
		{"amount float text", "total_amount", `"1e400x"`, "field total_amount: want a positive decimal"},
		{"negative amount", "total_amount", `"-1.00"`, "got a string holding a number that is not positive"},
		{"zero amount", "total_amount", `0`, "field total_amount: want a positive decimal"},
		{"sub-cent amount", "total_amount", `"1.001"`, "got a string holding a number with more than 2 fraction digits"},
		{"amount NaN", "total_amount", `"NaN"`, "field total_amount"},
		{"amount beyond numeric(20,2)", "total_amount", `"1e18"`, "got a string holding a number of 10^18 or more"},
		{"amount huge exponent", "total_amount", `1e10000`, "below 10^18"},
		{"amount bool", "total_amount", `true`, "got a boolean"},
		{"no offset", "occurred_at", `"2026-12-02T10:00:00"`, "field occurred_at: want an ISO 8601 date-time with an offset"},
		{"bad time", "occurred_at", `"yesterday"`, "field occurred_at"},
	} {
		_, err := orderevents.DecodeConfirmed(valid(map[string]string{tc.field: tc.value}))
		var fe *orderevents.FieldError
		if !errors.Is(err, orderevents.ErrInvalid) || !errors.As(err, &fe) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: got %v; want a FieldError mentioning %q", tc.name, err, tc.want)
			continue
		}
		if fe.Field != tc.field {
			t.Errorf("%s: FieldError.Field %q, want %q", tc.name, fe.Field, tc.field)
		}
	}
	for name, p := range map[string]string{
		"not json":  "not json",
		"array":     `[1,2]`,
		"truncated": `{"event_id": "truncated`,
		"empty":     ``,
		"huge":      string(valid(map[string]string{"order_id": "1, \"padding\": \"" + strings.Repeat("x", orderevents.MaxPayloadBytes) + "\""})),
	} {
		_, err := orderevents.DecodeConfirmed([]byte(p))
		if !errors.Is(err, orderevents.ErrInvalid) || !strings.Contains(err.Error(), "payload: want") {
			t.Errorf("%s: got %v; want a payload-level FieldError", name, err)
		}
	}
}

// Review finding of issue 28: a rejection quoted up to 60 bytes of the
// value (or of a payload that is not JSON), and the pipeline made it the
// dead letter's reason, which the console showed to anyone: a customer's
// e-mail in customer_id was on every page. A rejection names the field,
// the JSON type that arrived and what was wanted, never the value.
func TestRejectionsNeverQuoteTheValue(t *testing.T) {
	const pii = "jane.doe@example.com"
	payloads := map[string][]byte{"not JSON": []byte(pii), "a string": []byte(`"` + pii + `"`),
		"an array": []byte(`["` + pii + `"]`), "truncated": []byte(`{"customer_id":"` + pii)}
	for _, field := range []string{"event_id", "event_type", "occurred_at", "order_id", "customer_id", "total_amount"} {
		for _, value := range []string{`"` + pii + `"`, `{"email":"` + pii + `"}`, `["` + pii + `"]`, `"` + pii + `0.5"`} {
			payloads[field+" = "+value] = valid(map[string]string{field: value})
		}
	}
	// Numbers that are values too: an amount, an id.
	for field, value := range map[string]string{"order_id": "8765432109.25", "customer_id": "98765432109876543210",
		"total_amount": "-8765432109.25", "event_id": "8765432109"} {
		payloads[field+" = "+value] = valid(map[string]string{field: value})
	}
	payloads["total_amount = 8765432109.125"] = valid(map[string]string{"total_amount": `"8765432109.125"`})
	for name, p := range payloads {
		for decoder, decode := range map[string]func([]byte) error{
			"DecodeConfirmed": func(b []byte) error { _, err := orderevents.DecodeConfirmed(b); return err },
			"DecodePayment":   func(b []byte) error { _, err := orderevents.DecodePayment(b); return err },
			"DecodeCancelled": func(b []byte) error { _, err := orderevents.DecodeCancelled(b); return err },
		} {
			err := decode(p)
			if err == nil {
				if decoder == "DecodeConfirmed" {
					t.Errorf("%s: %s accepted %s", name, decoder, p)
				}
				continue
			}
			for _, quoted := range []string{"jane", "example", "8765432109", "98765432109876543210"} {
				if strings.Contains(err.Error(), quoted) {
					t.Errorf("%s: %s's error quotes the value (%q): %v", name, decoder, quoted, err)
				}
			}
		}
	}
}

func TestAmountIsExactDecimal(t *testing.T) {
	ev, err := orderevents.DecodeConfirmed(valid(map[string]string{"total_amount": `0.10`}))
	if err != nil {
		t.Fatal(err)
	}
	sum := decimal.Zero
	for range 3 {
		sum = sum.Add(ev.TotalAmount())
	}
	if !sum.Equal(decimal.RequireFromString("0.30")) {
		t.Fatalf("0.10 * 3 = %s; a float would not be exact, a decimal must be", sum)
	}
	// A JSON number is read from its literal text: 2^53 + 1 survives, which a
	// float64 cannot hold.
	ev, err = orderevents.DecodeConfirmed(valid(map[string]string{"total_amount": `9007199254740993.01`}))
	if err != nil || ev.TotalAmount().String() != "9007199254740993.01" {
		t.Fatalf("got %v, %v; want the exact literal", ev.TotalAmount(), err)
	}
	if _, err := orderevents.DecodeConfirmed(valid(map[string]string{"total_amount": `"12.5000"`})); err != nil {
		t.Fatalf("an exact amount with extra zeros must be accepted: %v", err)
	}
}

func TestOneEventHasOneByteForm(t *testing.T) {
	ev, err := orderevents.NewConfirmed(uuid.Must(uuid.NewV7()), time.Date(2026, 12, 2, 10, 0, 0, 123456789, time.UTC),
		17, 42, decimal.RequireFromString("7.5"))
	if err != nil {
		t.Fatal(err)
	}
	first, _ := ev.MarshalJSON()
	back, err := orderevents.DecodeConfirmed(first)
	if err != nil {
		t.Fatal(err)
	}
	second, _ := back.MarshalJSON()
	if string(first) != string(second) {
		t.Fatalf("re-encoding changed the bytes:\n%s\n%s", first, second)
	}
	want := fmt.Sprintf(`{"event_id":%q,"event_type":"order.confirmed.v1","occurred_at":"2026-12-02T10:00:00.123456Z","order_id":17,"customer_id":42,"total_amount":"7.50"}`, ev.EventID())
	if string(first) != want {
		t.Fatalf("byte form\n%s\nwant\n%s", first, want)
	}
	// Decoded from pydantic's form, it is written in ours, always the same way.
	fromPy, _ := orderevents.DecodeConfirmed([]byte(fromPydantic[3]))
	a, _ := fromPy.MarshalJSON()
	b, _ := fromPy.MarshalJSON()
	if string(a) != string(b) || !strings.Contains(string(a), `"occurred_at":"2026-12-02T15:08:21.000000Z"`) || !strings.Contains(string(a), `"total_amount":"5.00"`) {
		t.Fatalf("pydantic's event in our form: %s", a)
	}
}

func TestNewConfirmedValidates(t *testing.T) {
	now := time.Now()
	for name, f := range map[string]func() error{
		"v4 id": func() error {
			_, err := orderevents.NewConfirmed(uuid.New(), now, 1, 1, decimal.NewFromInt(1))
			return err
		},
		"sub-cent": func() error {
			_, err := orderevents.NewConfirmed(uuid.Must(uuid.NewV7()), now, 1, 1, decimal.RequireFromString("0.001"))
			return err
		},
		"zero amount": func() error {
			_, err := orderevents.NewConfirmed(uuid.Must(uuid.NewV7()), now, 1, 1, decimal.Zero)
			return err
		},
		"zero timestamp": func() error {
			_, err := orderevents.NewConfirmed(uuid.Must(uuid.NewV7()), time.Time{}, 1, 1, decimal.NewFromInt(1))
			return err
		},
	} {
		if err := f(); !errors.Is(err, orderevents.ErrInvalid) {
			t.Errorf("%s: got %v, want ErrInvalid", name, err)
		}
	}
}

// The canonical form of events at the edges: integers with trailing zeros,
// zero and negative ones, times without a fraction, far from UTC, and with
// nanoseconds MarshalJSON drops.
func TestConfirmedCanonicalFormIsTheOneDerivedFromItsJSON(t *testing.T) {
	id := uuid.Must(uuid.NewV7())
	at := time.Date(2026, 12, 2, 15, 8, 21, 123456789, time.FixedZone("", -5*3600))
	for _, c := range []struct {
		at              time.Time
		order, customer int64
		amount          string
	}{
		{at, 1234567, 89, "129.90"},
		{at.Truncate(time.Second), 1000, 1, "0.01"},
		{at.Truncate(time.Millisecond), 9223372036854775807, 100, "999999999999999999.99"},
		{time.Date(1, 1, 1, 0, 0, 0, 1000, time.UTC), -1200, -9223372036854775808, "0.10"},
		{time.Date(9999, 12, 31, 23, 59, 59, 999999999, time.UTC), 10, 20, "5.00"},
	} {
		ev, err := orderevents.NewConfirmed(id, c.at, c.order, c.customer, decimal.RequireFromString(c.amount))
		if err != nil {
			t.Logf("%v: not a valid event (%v)", c, err)
			continue
		}
		sameCanonicalForm(t, ev)
	}
	for _, payload := range confirmedSeeds {
		if ev, err := orderevents.DecodeConfirmed([]byte(payload)); err == nil {
			sameCanonicalForm(t, ev)
		}
	}
}

// Review finding: a time that decodes (RFC 3339 with an offset) but whose
// UTC instant falls outside the years 0000-9999 was written in another form
// than idempotency.CanonicalJSON keeps for it, and a claim stored by the
// release before would not have matched.
func TestTheCanonicalFormAtTheEdgesOfTheYearRange(t *testing.T) {
	decoded := 0
	for _, at := range []string{"9999-12-31T23:30:00.5-01:00", "0000-01-01T00:30:00+01:00"} {
		payload := `{"event_id":"0190c1b2-3c4d-7e5f-8a6b-7c8d9e0f1a2b","event_type":"order.confirmed.v1","occurred_at":"` + at + `","order_id":42,"customer_id":7,"total_amount":"12.50"}`
		ev, err := orderevents.DecodeConfirmed([]byte(payload))
		if err != nil {
			t.Logf("%s: does not decode (%v)", at, err)
			continue
		}
		decoded++
		t.Run(at, func(t *testing.T) { sameCanonicalForm(t, ev) })
	}
	if decoded == 0 {
		t.Fatal("no edge time decoded: the test checks nothing")
	}
}
