package idempotency_test

import (
	"fmt"
	"slices"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/once-dev/once/middleware/idempotency"
)

// A team without package pipeline names its decimal members: pydantic's
// "12.50" re-published as the number 12.5 is then a duplicate of it, and
// another amount still a mismatch. Under the default fingerprint the same
// re-publication is a mismatch (a number and a string are two JSON values):
// issue 28, item 4, where the documentation promised otherwise.
func TestFingerprintWithDecimalsThroughTheMiddleware(t *testing.T) {
	pool := setup(t)
	id := uuid.Must(uuid.NewV7())
	send := func(fingerprint func(*message.Message) ([32]byte, error), forms ...string) ([]idempotency.Outcome, int64) {
		t.Helper()
		group := uniqueGroup(t, "g")
		var runs atomic.Int64
		var outcomes []idempotency.Outcome
		m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group, Fingerprint: fingerprint,
			OnResult: func(r idempotency.Result) { outcomes = append(outcomes, r.Outcome) }})
		h := m.Middleware(recordEffect(group, &runs))
		for _, f := range forms {
			msg := newMessage(id, fmt.Sprintf(f, "amount"))
			_, _ = h(msg)
		}
		if n := effects(t, pool, id, group); n != int(runs.Load()) {
			t.Fatalf("%d effects for %d runs", n, runs.Load())
		}
		return outcomes, runs.Load()
	}
	forms := []string{`"%s":"12.50","qty":2`, `"qty":2.0,"%s":12.5`, `"%s":1.25e1,"qty":2`, `"%s":"1.25E+1","qty":2`, `"%s":"12.51","qty":2`, `"%s":"12.5","qty":"2"`}

	got, runs := send(idempotency.FingerprintWithDecimals("amount"), forms...)
	want := []idempotency.Outcome{idempotency.Processed, idempotency.Duplicate, idempotency.Duplicate, idempotency.Duplicate,
		idempotency.PayloadMismatch, idempotency.PayloadMismatch}
	if !slices.Equal(got, want) || runs != 1 {
		t.Errorf("FingerprintWithDecimals(amount): %v, %d runs; want %v, 1 run", got, runs, want)
	}

	got, runs = send(nil, forms[:2]...)
	if want := []idempotency.Outcome{idempotency.Processed, idempotency.PayloadMismatch}; !slices.Equal(got, want) || runs != 1 {
		t.Errorf("the default fingerprint: %v, %d runs; want %v, 1 run", got, runs, want)
	}
}

// Only the named top-level members are decimals; a string there that is
// not a number stays a string, and a payload the canonical form refuses is
// fingerprinted by its bytes.
func TestFingerprintWithDecimalsNamesTopLevelMembersOnly(t *testing.T) {
	fp := idempotency.FingerprintWithDecimals("amount")
	sum := func(payload string) [32]byte {
		t.Helper()
		s, err := fp(message.NewMessage("m", []byte(payload)))
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	for _, c := range []struct {
		a, b string
		same bool
	}{
		{`{"amount":"12.50"}`, `{"amount":12.5}`, true},
		{`{"amount":"-0.0"}`, `{"amount":0}`, true},
		{`{"amount":"12.50 EUR"}`, `{"amount":12.5}`, false},
		{`{"amount":"+12.5"}`, `{"amount":12.5}`, false},
		{`{"amount":"NaN"}`, `{"amount":"NaN"}`, true},
		{`{"line":{"amount":"12.50"}}`, `{"line":{"amount":12.5}}`, false},
		{`[{"amount":"12.50"}]`, `[{"amount":12.5}]`, false},
		{`{"price":"12.50"}`, `{"price":12.5}`, false},
		{`{"amount":"12.50","amount":12.5}`, `{"amount":12.5}`, false},
	} {
		if same := sum(c.a) == sum(c.b); same != c.same {
			t.Errorf("%s and %s: the same fingerprint %v; want %v", c.a, c.b, same, c.same)
		}
	}
}
