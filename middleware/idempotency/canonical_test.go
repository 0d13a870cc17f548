package idempotency_test

import (
	"testing"

	"github.com/once-dev/once/middleware/idempotency"
)

func TestCanonicalJSON(t *testing.T) {
	for _, c := range []struct{ a, b string }{
		{`{"a":1,"b":2}`, `{ "b" : 2 , "a" : 1 }`},
		{`12.5`, `12.50`},
		{`12.5`, `1.25e1`},
		{`125`, `1.25E+2`},
		{`0`, `-0.000`},
		{`0.001`, `1e-3`},
		{`-7`, `-7.0`},
		{`"2026-12-02T15:08:21.123456Z"`, `"2026-12-02T15:08:21.123456+00:00"`},
		{`"2026-12-02T15:08:21.123456Z"`, `"2026-12-02T17:08:21.123456+02:00"`},
		{`"2026-12-02T15:08:21Z"`, `"2026-12-02T15:08:21.000000Z"`},
		{`{"x":[1,{"b":true,"a":null}]}`, `{"x":[1.0,{"a":null,"b":true}]}`},
		{`"caf\u00e9"`, `"café"`},
		{`1e9999999999`, `10e9999999998`},
		{`-1e9999999999`, `-0.1e10000000000`},
		{`1e-9999999999`, `0.1e-9999999998`},
		{`"2026-12-02T15:08:21.1234567891Z"`, `"2026-12-02T16:08:21.12345678910000+01:00"`},
		{`"\ud800"`, `"\uD800"`},
		{`"\ud83d\ude00"`, `"😀"`},
		{`"0000-01-01T00:30:00+01:00"`, `"0000-01-01T01:30:00+02:00"`},
		{`"9999-12-31T23:30:00-01:00"`, `"9999-12-31T22:30:00-02:00"`},
		{`"<&>\u2028"`, `"\u003c\u0026\u003e\u2028"`},
	} {
		a, err := idempotency.CanonicalJSON([]byte(c.a))
		if err != nil {
			t.Fatalf("%s: %v", c.a, err)
		}
		b, err := idempotency.CanonicalJSON([]byte(c.b))
		if err != nil {
			t.Fatalf("%s: %v", c.b, err)
		}
		if string(a) != string(b) {
			t.Errorf("%s -> %s and %s -> %s; want the same", c.a, a, c.b, b)
		}
	}
	for _, c := range []struct{ a, b string }{
		{`12.5`, `"12.5"`},
		{`12.5`, `12.51`},
		{`[1,2]`, `[2,1]`},
		{`"2026-12-02T15:08:21Z"`, `"2026-12-02T15:08:21+01:00"`},
		{`"not a time 2026"`, `"not a time 2027"`},
		{`1e400`, `1e401`},
		{`{"a":1}`, `{"a":1,"b":null}`},
		// Different values the scanner before this one wrote the same.
		{`1e9999999999`, `-1e9999999999`},
		{`1e9999999999`, `1e9999999998`},
		{`"2026-12-02T15:08:21.1234567891Z"`, `"2026-12-02T15:08:21.1234567892Z"`},
		{`"\ud800"`, `"\udbff"`},
		{`"\ud800"`, `"\ufffd"`},
		{`"\udc00"`, `"\ufffd"`},
		{`"0000-01-01T00:30:00+01:00"`, `"-0001-12-31T23:30:00Z"`},
		{`"9999-12-31T23:30:00-01:00"`, `"10000-01-01T00:30:00Z"`},
	} {
		a, _ := idempotency.CanonicalJSON([]byte(c.a))
		b, _ := idempotency.CanonicalJSON([]byte(c.b))
		if string(a) == string(b) {
			t.Errorf("%s and %s are both %s; want them different", c.a, c.b, a)
		}
	}
	for _, bad := range []string{``, `{`, `{} {}`, `nope`,
		// Bytes after the value are not part of it.
		`{"a":1}xyz`, `{"a":1}}`, `1 2`, `"a" "b"`, `[1]]`, `{"a":1},`,
		// Invalid UTF-8 is not JSON text: replacing it with U+FFFD would
		// make M\xfcller and M\xe4ller one name.
		"\"M\xfcller\"", "\"M\xe4ller\"", "{\"n\xff\":1}", "\"\xed\xa0\x80\"",
		// A repeated name: a decoder keeps the first or the last.
		`{"a":1,"a":2}`, `{"b":0,"a":1,"a":2}`, `{"a":1,"\u0061":1}`,
		// Not JSON numbers, escapes or literals.
		`01`, `1.`, `.5`, `-`, `1e`, `+1`, `"\x41"`, `"\u12"`, `tru`, `nul`, "\"a\tb\"",
	} {
		if _, err := idempotency.CanonicalJSON([]byte(bad)); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
	// Its own output it takes back unchanged: no canonical form equals the
	// bytes PayloadSHA256 hashes as they are.
	for _, v := range []string{`{"b":[1.50,"\ud800"],"a":"2026-12-02T17:08:21.1234567890+02:00"}`, `"0000-01-01T00:30:00+01:00"`, `-12e9999999999999999999`} {
		once, err := idempotency.CanonicalJSON([]byte(v))
		if err != nil {
			t.Fatal(err)
		}
		twice, err := idempotency.CanonicalJSON(once)
		if err != nil || string(twice) != string(once) {
			t.Errorf("%s -> %s -> %s (%v); want it unchanged", v, once, twice, err)
		}
	}
}

// The canonical form as the package documentation describes it.
func TestCanonicalJSONForm(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{`{ "b" : 12.50, "a" : [1200, -0.0, 1e9999999999999999999] }`, `{"a":[12e2,0,1e9999999999999999999],"b":125e-1}`},
		{`"2026-12-02T17:08:21.12345678900+02:00"`, `"2026-12-02T15:08:21.123456789Z"`},
		{`"2026-12-02T15:08:21.000Z"`, `"2026-12-02T15:08:21Z"`},
		{`"0000-01-01T00:30:00.5+01:00"`, `"0000-01-01T00:00:00.5+00:30"`},
		{`"9999-12-31T23:30:00-01:00"`, `"9999-12-31T23:59:00-00:31"`},
		// What time.Parse takes besides RFC 3339, as the release before
		// wrote it; an offset of 25 hours is written 24:60.
		{`"2006-01-02T5:04:05,50+24:00"`, `"2006-01-01T05:04:05.5Z"`},
		{`"2006-01-02T15:04:05+23:60"`, `"2006-01-01T15:04:05Z"`},
		{`"0000-01-01T00:00:00.5+24:60"`, `"0000-01-01T00:00:00.5+24:60"`},
		{`"0000-01-01T01:00:00+24:60"`, `"0000-01-01T00:00:00+24:00"`},
		{`"\ud800 \uDBFF\u0041 \ufffd"`, `"\ud800 \udbffA �"`},
		{`"<a href=\"x\">\u2028\b"`, `"\u003ca href=\"x\"\u003e\u2028\b"`},
	} {
		got, err := idempotency.CanonicalJSON([]byte(c.in))
		if err != nil || string(got) != c.want {
			t.Errorf("%s -> %s (%v); want %s", c.in, got, err, c.want)
		}
	}
}
