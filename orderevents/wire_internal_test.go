package orderevents

import (
	"bytes"
	"encoding/json"
	"regexp"
	"testing"
)

// The hand-written literal checks accept exactly what the JSON grammar's
// regular expressions accept.
func TestLiteralChecksMatchTheGrammar(t *testing.T) {
	integer := regexp.MustCompile(`^-?(0|[1-9][0-9]*)$`)
	number := regexp.MustCompile(`^-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?$`)
	for _, s := range []string{"", "-", "0", "-0", "00", "01", "10", "123", "-123", "1.", "1.5", ".5", "1.50", "0.01", "1e5", "1E+5", "1e-5",
		"1e", "1e+", "1.5e3", "-0.0", "1..2", "1.2.3", "+1", "1 ", " 1", "12a", "9223372036854775808", "1.2e3.4", "--1", "0e0"} {
		if got, want := isJSONInteger([]byte(s)), integer.MatchString(s); got != want {
			t.Errorf("isJSONInteger(%q) = %v, want %v", s, got, want)
		}
		if got, want := isJSONNumber(s), number.MatchString(s); got != want {
			t.Errorf("isJSONNumber(%q) = %v, want %v", s, got, want)
		}
	}
}

// FuzzLiteralChecks compares the checks with the grammar on any input.
func FuzzLiteralChecks(f *testing.F) {
	integer := regexp.MustCompile(`^-?(0|[1-9][0-9]*)$`)
	number := regexp.MustCompile(`^-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?$`)
	for _, s := range []string{"0", "-1.5e3", "01", "1e"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if isJSONInteger([]byte(s)) != integer.MatchString(s) || isJSONNumber(s) != number.MatchString(s) {
			t.Fatalf("%q: the checks and the grammar disagree", s)
		}
	})
}

// Invalid UTF-8 in a string field decodes as encoding/json decodes it (each
// bad byte becomes U+FFFD): a reason PostgreSQL would refuse as text must
// not turn a good event into a dead letter.
func TestInvalidUTF8DecodesAsEncodingJSONDoes(t *testing.T) {
	payload := []byte("{\"event_id\":\"0190c1b2-3c4d-7e5f-8a6b-7c8d9e0f1a2b\",\"event_type\":\"order.cancelled.v1\",\"occurred_at\":\"2024-07-17T17:16:26Z\",\"order_id\":42,\"reason\":\"caf\xe9\"}")
	ev, err := DecodeCancelled(payload)
	if err != nil {
		t.Fatal(err)
	}
	if ev.Reason() != "caf\uFFFD" {
		t.Fatalf("reason %q, want %q", ev.Reason(), "caf\uFFFD")
	}
}

// FuzzTopLevel: on every valid JSON object, the hand-written member split
// agrees with encoding/json's (names, the last of a repeated name, raw
// values byte for byte).
func FuzzTopLevel(f *testing.F) {
	for _, s := range []string{`{}`, `{"a":1}`, ` { "a" : "x\"}" , "b":[1,{"c":"]"}], "a":null } `, `{"\u0061":true,"caf\u00e9":{"x":[]}}`,
		"{\"\xe9\":1}", `{"a":-1.5e3,"b":"\\","c":{}}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		trimmed := bytes.TrimSpace(b)
		if !json.Valid(trimmed) || len(trimmed) == 0 || trimmed[0] != '{' {
			return
		}
		var want map[string]json.RawMessage
		if err := json.Unmarshal(trimmed, &want); err != nil {
			t.Fatalf("%q: valid, yet %v", b, err)
		}
		members := topLevel(trimmed, nil)
		names := map[string]bool{}
		for _, m := range members {
			names[string(m.name)] = true
		}
		if len(names) != len(want) {
			t.Fatalf("%q: %d names, encoding/json %d", b, len(names), len(want))
		}
		for k, v := range want {
			if g, ok := lookup(members, k); !ok || !bytes.Equal(g, v) {
				t.Fatalf("%q: member %q = %q, encoding/json %q", b, k, g, v)
			}
		}
	})
}
