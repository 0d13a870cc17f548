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
	} {
		a, _ := idempotency.CanonicalJSON([]byte(c.a))
		b, _ := idempotency.CanonicalJSON([]byte(c.b))
		if string(a) == string(b) {
			t.Errorf("%s and %s are both %s; want them different", c.a, c.b, a)
		}
	}
	for _, bad := range []string{``, `{`, `{} {}`, `nope`} {
		if _, err := idempotency.CanonicalJSON([]byte(bad)); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}
