package pipeline

import (
	"encoding/json"
	"errors"
	"math/big"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/shopspring/decimal"
)

// Event types a team may write, each with values encoding/json does not
// see entirely: fingerprinted on what it sees, two events that differ
// only elsewhere would pass for duplicates, and the second one's effect
// would be skipped.

type partlyUnexported struct {
	ID     uuid.UUID `json:"event_id"`
	amount string
}

type dashTagged struct {
	ID     uuid.UUID `json:"event_id"`
	Amount string    `json:"-"`
}

type interfaceField struct {
	ID     uuid.UUID `json:"event_id"`
	Amount any       `json:"amount"`
}

// hiddenAmount is what an interface field may hold: a value encoding/json
// writes as {}.
type hiddenAmount struct{ v string }

type nestedHidden struct {
	ID    uuid.UUID `json:"event_id"`
	Order struct {
		Lines []struct {
			SKU string `json:"sku"`
			qty int
		} `json:"lines"`
	} `json:"order"`
}

// bigValue's big.Int has MarshalJSON on its pointer only: encoding/json
// writes a big.Int field it cannot address as {}.
type bigValue struct {
	ID     uuid.UUID `json:"event_id"`
	Amount big.Int   `json:"amount"`
}

// embedsTime has time.Time's MarshalJSON by promotion: json.Marshal writes
// the time alone.
type embedsTime struct {
	time.Time
	ID     uuid.UUID `json:"event_id"`
	Amount string    `json:"amount"`
}

type shadowedInner struct {
	Amount string `json:"amount"`
}

// shadowed: encoding/json writes the outer amount and drops the inner one.
type shadowed struct {
	ID uuid.UUID `json:"event_id"`
	shadowedInner
	Amount string `json:"amount"`
}

func (e partlyUnexported) EventID() uuid.UUID { return e.ID }
func (e dashTagged) EventID() uuid.UUID       { return e.ID }
func (e interfaceField) EventID() uuid.UUID   { return e.ID }
func (e nestedHidden) EventID() uuid.UUID     { return e.ID }
func (e bigValue) EventID() uuid.UUID         { return e.ID }
func (e embedsTime) EventID() uuid.UUID       { return e.ID }
func (e shadowed) EventID() uuid.UUID         { return e.ID }

// visibleEvent is seen whole: exported fields of types that marshal their
// value (uuid.UUID as text, time.Time and decimal.Decimal with MarshalJSON),
// a promoted embedded struct, a map, a pointer.
type visibleEvent struct {
	ID uuid.UUID `json:"event_id"`
	visibleInner
	At     time.Time          `json:"occurred_at"`
	Amount decimal.Decimal    `json:"amount"`
	Notes  map[string][]int64 `json:"notes,omitempty"`
	Next   *visibleEvent      `json:"next"`
	Raw    json.RawMessage    `json:"raw"`
}

type visibleInner struct {
	Reason string `json:"reason"`
}

func (e visibleEvent) EventID() uuid.UUID { return e.ID }

func TestJSONVisible(t *testing.T) {
	for _, c := range []struct {
		t    reflect.Type
		want bool
	}{
		{reflect.TypeFor[visibleEvent](), true},
		{reflect.TypeFor[*visibleEvent](), true},
		{reflect.TypeFor[partlyUnexported](), false},
		{reflect.TypeFor[dashTagged](), false},
		{reflect.TypeFor[interfaceField](), false},
		{reflect.TypeFor[nestedHidden](), false},
		{reflect.TypeFor[bigValue](), false},
		{reflect.TypeFor[embedsTime](), false},
		{reflect.TypeFor[shadowed](), false},
		{reflect.TypeFor[struct{ F func() }](), false},
		{reflect.TypeFor[struct{ M map[[2]int]string }](), false},
		{reflect.TypeFor[struct{ B *big.Int }](), true},
		{reflect.TypeFor[struct{ T []time.Time }](), true},
	} {
		if got := jsonVisible(c.t); got != c.want {
			t.Errorf("jsonVisible(%s) = %v; want %v", c.t, got, c.want)
		}
	}
}

// Two events under one id that differ only where encoding/json does not
// look have different fingerprints: the type is fingerprinted by its
// payload (review finding, issue 28: its exported fields alone were
// fingerprinted, and a reused id with another amount was a duplicate).
func TestHiddenValuesCountInTheFingerprint(t *testing.T) {
	id := uuid.Must(uuid.NewV7())
	one := []byte(`{"event_id":"` + id.String() + `","amount":"1.00","order":{"lines":[{"sku":"a","qty":1}]}}`)
	other := []byte(`{"event_id":"` + id.String() + `","amount":"99.00","order":{"lines":[{"sku":"a","qty":2}]}}`)
	reordered := []byte(`{"order":{"lines":[{"qty":1,"sku":"a"}]},"amount":"1.00","event_id":"` + id.String() + `"}`)
	check := func(name string, fp func(payload []byte) ([32]byte, error)) {
		t.Helper()
		a, errA := fp(one)
		b, errB := fp(other)
		c, errC := fp(reordered)
		if err := errors.Join(errA, errB, errC); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if a == b {
			t.Errorf("%s: other values under the same id, the same fingerprint", name)
		}
		if a != c {
			t.Errorf("%s: the same values in another member order, another fingerprint", name)
		}
	}
	check("partly unexported", typed(t, partlyUnexported{ID: id, amount: "1.00"}, partlyUnexported{ID: id, amount: "99.00"}))
	check("json:\"-\"", typed(t, dashTagged{ID: id, Amount: "1.00"}, dashTagged{ID: id, Amount: "99.00"}))
	check("interface", typed(t, interfaceField{ID: id, Amount: hiddenAmount{"1.00"}}, interfaceField{ID: id, Amount: hiddenAmount{"99.00"}}))
	var n1, n2 nestedHidden
	n1.ID, n2.ID = id, id
	n1.Order.Lines = append(n1.Order.Lines, struct {
		SKU string `json:"sku"`
		qty int
	}{"a", 1})
	n2.Order.Lines = append(n2.Order.Lines, struct {
		SKU string `json:"sku"`
		qty int
	}{"a", 2})
	check("nested unexported", typed(t, n1, n2))
	check("big.Int value", typed(t, bigValue{ID: id, Amount: *big.NewInt(1)}, bigValue{ID: id, Amount: *big.NewInt(99)}))
	check("embedded time.Time", typed(t, embedsTime{ID: id, Amount: "1.00"}, embedsTime{ID: id, Amount: "99.00"}))
	check("shadowed", typed(t, shadowed{ID: id, shadowedInner: shadowedInner{"1.00"}}, shadowed{ID: id, shadowedInner: shadowedInner{"99.00"}}))
}

// typed is E's fingerprint of a payload whose event is first for the
// payload one of TestHiddenValuesCountInTheFingerprint and second for
// any other: what a decoder that reads those payloads returns.
func typed[E Event](t *testing.T, first, second E) func(payload []byte) ([32]byte, error) {
	t.Helper()
	fp := fingerprinterOf[E]()
	return func(payload []byte) ([32]byte, error) {
		ev := first
		if strings.Contains(string(payload), "99.00") {
			ev = second
		}
		return fp(ev, payload)
	}
}

// A type encoding/json sees whole is fingerprinted by its decoded value:
// a decimal written as a string or a number, a time at any offset, are
// one value.
func TestVisibleEventsAreFingerprintedByTheirValues(t *testing.T) {
	fp := fingerprinterOf[visibleEvent]()
	id := uuid.Must(uuid.NewV7())
	var sums [][32]byte
	for _, payload := range []string{
		`{"event_id":"%s","occurred_at":"2026-12-02T15:08:21.123456Z","amount":"12.50","raw":{"a":1}}`,
		`{"raw":{ "a" : 1.0 },"amount":12.5,"occurred_at":"2026-12-02T17:08:21.123456+02:00","event_id":"%s"}`,
	} {
		var ev visibleEvent
		if err := json.Unmarshal([]byte(strings.Replace(payload, "%s", id.String(), 1)), &ev); err != nil {
			t.Fatal(err)
		}
		sum, err := fp(ev, nil)
		if err != nil {
			t.Fatal(err)
		}
		sums = append(sums, sum)
	}
	if sums[0] != sums[1] {
		t.Fatal("the same values in two byte forms: two fingerprints")
	}
}

// BenchmarkFingerprint is the fingerprint's share of a consumer's CPU per
// event: a type encoding/json sees whole (json.Marshal made canonical) and
// one it does not (the payload made canonical).
func BenchmarkFingerprint(b *testing.B) {
	id := uuid.Must(uuid.NewV7())
	payload := []byte(`{"event_id":"` + id.String() + `","occurred_at":"2026-12-02T17:08:21.123456+02:00","amount":"129.90","reason":"late","notes":{"b":[1,2],"a":[3]},"next":null,"raw":{"k":1}}`)
	var ev visibleEvent
	if err := json.Unmarshal(payload, &ev); err != nil {
		b.Fatal(err)
	}
	visibleFP := fingerprinterOf[visibleEvent]()
	hiddenFP := fingerprinterOf[partlyUnexported]()
	b.Run("visible", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := visibleFP(ev, payload); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("payload", func(b *testing.B) {
		b.ReportAllocs()
		hidden := partlyUnexported{ID: id, amount: "129.90"}
		for b.Loop() {
			if _, err := hiddenFP(hidden, payload); err != nil {
				b.Fatal(err)
			}
		}
	})
}
