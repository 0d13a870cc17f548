package idempotency_test

import (
	"bytes"
	"errors"
	"fmt"
	"math/big"
	"regexp"
	"strconv"
	"testing"
	"time"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/once-dev/once/middleware/idempotency"
)

// FuzzCanonicalJSON holds CanonicalJSON to its contract against an oracle
// written apart from it: a plain strict decoder that compares numbers
// exactly (digits and a math/big exponent), strings as their code points
// (a lone surrogate as itself), RFC 3339 times as instants with their full
// fraction, objects by their members whatever the order. For any two
// inputs: CanonicalJSON accepts exactly what the oracle accepts, its output
// is the same value and its own canonical form, and two outputs are equal
// exactly when the values are. The normal test run replays the seeds and
// testdata/fuzz/FuzzCanonicalJSON;
// go test -fuzz FuzzCanonicalJSON ./middleware/idempotency explores further.
func FuzzCanonicalJSON(f *testing.F) {
	for _, seed := range [][2]string{
		// Collisions of the scanner before this one.
		{`1e9999999999`, `-1e9999999999`},
		{`1e9999999999`, `10e9999999998`},
		{`"2026-12-02T15:08:21.1234567891Z"`, `"2026-12-02T15:08:21.1234567892Z"`},
		{"\"M\xfcller\"", "\"M\xe4ller\""},
		{`"\ud800"`, `"\udbff"`},
		{`"\ud800"`, `"\ufffd"`},
		{`{"a":1}xyz`, `{"a":1}`},
		{`{"a":1,"a":2}`, `{"a":2}`},
		{`"0000-01-01T00:30:00+01:00"`, `"-0001-12-31T23:30:00Z"`},
		{`"9999-12-31T23:30:00-01:00"`, `"10000-01-01T00:30:00Z"`},
		{`"0000-01-01T00:00:00+24:60"`, `"0000-01-01T00:00:00+25:00"`},
		{`"9999-12-31T23:59:59-24:60"`, `"9999-12-31T23:59:59-25:00"`},
		// Equal values in other forms.
		{`{"a":1,"b":[12.50,true,null]}`, `{ "b" : [1.25e1, true, null], "a" : 1.0 }`},
		{`"2026-12-02T15:08:21.123456Z"`, `"2026-12-02T17:08:21.123456000+02:00"`},
		// Forms time.Parse takes, which the release before canonicalised.
		{`"2026-12-02T05:08:21,5Z"`, `"2026-12-03T5:08:21.5+24:00"`},
		{`"2026-12-02T05:08:21.5Z"`, `"2026-12-03T5:08:21,50+23:60"`},
		{`"caf\u00e9 \ud83d\ude00 <&>"`, `"café 😀 \u003c\u0026\u003e"`},
		{`{"event_id":"0192f3a4-5b6c-7d8e-9f01-23456789abcd","event_type":"order.confirmed.v1","occurred_at":"2026-12-02T15:08:21.123456Z","order_id":1234567,"customer_id":89,"total_amount":"129.90"}`,
			`{"total_amount":"129.90","customer_id":89,"order_id":1234567,"occurred_at":"2026-12-02T16:08:21.123456+01:00","event_type":"order.confirmed.v1","event_id":"0192f3a4-5b6c-7d8e-9f01-23456789abcd"}`},
		{`0`, `-0.0e-0`},
		{`""`, `[]`},
	} {
		f.Add([]byte(seed[0]), []byte(seed[1]))
	}
	f.Fuzz(func(t *testing.T, a, b []byte) {
		ca, va, ok := checkCanonical(t, a)
		if !ok {
			return
		}
		cb, vb, ok := checkCanonical(t, b)
		if !ok {
			return
		}
		if sameBytes, sameValue := bytes.Equal(ca, cb), va.equal(vb); sameBytes != sameValue {
			t.Fatalf("%q -> %s and %q -> %s: the same bytes %v, the same values %v", a, ca, b, cb, sameBytes, sameValue)
		}
	})
}

// checkCanonical checks one input on its own and returns its canonical form
// and value, ok false when both refuse it.
func checkCanonical(t *testing.T, in []byte) ([]byte, jvalue, bool) {
	t.Helper()
	canonical, err := idempotency.CanonicalJSON(in)
	v, oracleErr := decodeOracle(in)
	if (err == nil) != (oracleErr == nil) {
		t.Fatalf("%q: CanonicalJSON says %v, the oracle %v", in, err, oracleErr)
	}
	if err != nil {
		return nil, jvalue{}, false
	}
	back, err := decodeOracle(canonical)
	if err != nil || !back.equal(v) {
		t.Fatalf("%q -> %s, which is another value (%v)", in, canonical, err)
	}
	again, err := idempotency.CanonicalJSON(canonical)
	if err != nil || !bytes.Equal(again, canonical) {
		t.Fatalf("%q -> %s -> %s (%v): not its own canonical form", in, canonical, again, err)
	}
	return canonical, v, true
}

// jvalue is a JSON value as the oracle sees it.
type jvalue struct {
	kind    byte // o(bject), a(rray), s(tring), t(ime), n(umber), b(oolean), z (null)
	members map[string]jvalue
	items   []jvalue
	runes   []rune // a string's code points, a lone surrogate as itself
	// a time: its instant's whole seconds and its fraction's digits
	// without trailing zeros
	unix int64
	frac string
	// a number: sign, significant digits, power of ten; zero has
	// no digits
	neg    bool
	digits string
	exp    *big.Int
	b      bool
}

func (v jvalue) equal(w jvalue) bool {
	if v.kind != w.kind {
		return false
	}
	switch v.kind {
	case 'o':
		if len(v.members) != len(w.members) {
			return false
		}
		for name, m := range v.members {
			if n, ok := w.members[name]; !ok || !m.equal(n) {
				return false
			}
		}
		return true
	case 'a':
		if len(v.items) != len(w.items) {
			return false
		}
		for i := range v.items {
			if !v.items[i].equal(w.items[i]) {
				return false
			}
		}
		return true
	case 's':
		return len(v.runes) == len(w.runes) && runesEqual(v.runes, w.runes)
	case 't':
		return v.unix == w.unix && v.frac == w.frac
	case 'n':
		return v.neg == w.neg && v.digits == w.digits && v.exp.Cmp(w.exp) == 0
	case 'b':
		return v.b == w.b
	}
	return true
}

func runesEqual(a, b []rune) bool {
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

var errOracle = errors.New("oracle: not JSON")

func decodeOracle(in []byte) (jvalue, error) {
	d := &oracle{in: in}
	d.space()
	v, err := d.value(0)
	if err != nil {
		return v, err
	}
	d.space()
	if d.i != len(d.in) {
		return v, errOracle
	}
	return v, nil
}

type oracle struct {
	in []byte
	i  int
}

func (d *oracle) space() {
	for d.i < len(d.in) && bytes.IndexByte([]byte(" \t\r\n"), d.in[d.i]) >= 0 {
		d.i++
	}
}

func (d *oracle) eat(s string) bool {
	if bytes.HasPrefix(d.in[d.i:], []byte(s)) {
		d.i += len(s)
		return true
	}
	return false
}

var numberRE = regexp.MustCompile(`^-?(0|[1-9][0-9]*)(\.([0-9]+))?([eE]([+-]?[0-9]+))?`)

func (d *oracle) value(depth int) (jvalue, error) {
	if depth > 10000 {
		return jvalue{}, errOracle
	}
	switch {
	case d.eat("null"):
		return jvalue{kind: 'z'}, nil
	case d.eat("true"):
		return jvalue{kind: 'b', b: true}, nil
	case d.eat("false"):
		return jvalue{kind: 'b'}, nil
	case d.eat("{"):
		v := jvalue{kind: 'o', members: map[string]jvalue{}}
		d.space()
		if d.eat("}") {
			return v, nil
		}
		for {
			d.space()
			name, err := d.str()
			if err != nil {
				return v, err
			}
			key := fmt.Sprint(name) // its code points, lone surrogates apart
			if _, dup := v.members[key]; dup {
				return v, errOracle
			}
			d.space()
			if !d.eat(":") {
				return v, errOracle
			}
			d.space()
			m, err := d.value(depth + 1)
			if err != nil {
				return v, err
			}
			v.members[key] = m
			d.space()
			if d.eat("}") {
				return v, nil
			}
			if !d.eat(",") {
				return v, errOracle
			}
		}
	case d.eat("["):
		v := jvalue{kind: 'a'}
		d.space()
		if d.eat("]") {
			return v, nil
		}
		for {
			d.space()
			item, err := d.value(depth + 1)
			if err != nil {
				return v, err
			}
			v.items = append(v.items, item)
			d.space()
			if d.eat("]") {
				return v, nil
			}
			if !d.eat(",") {
				return v, errOracle
			}
		}
	case d.i < len(d.in) && d.in[d.i] == '"':
		runes, err := d.str()
		if err != nil {
			return jvalue{}, err
		}
		if t, ok := oracleTime(runes); ok {
			return t, nil
		}
		return jvalue{kind: 's', runes: runes}, nil
	}
	m := numberRE.FindSubmatch(d.in[d.i:])
	if m == nil {
		return jvalue{}, errOracle
	}
	d.i += len(m[0])
	v := jvalue{kind: 'n', neg: m[0][0] == '-', exp: new(big.Int)}
	if len(m[5]) > 0 {
		v.exp.SetString(string(bytes.TrimPrefix(m[5], []byte("+"))), 10)
	}
	v.exp.Sub(v.exp, big.NewInt(int64(len(m[3]))))
	digits := string(m[1]) + string(m[3])
	for len(digits) > 0 && digits[0] == '0' {
		digits = digits[1:]
	}
	for len(digits) > 0 && digits[len(digits)-1] == '0' {
		digits = digits[:len(digits)-1]
		v.exp.Add(v.exp, big.NewInt(1))
	}
	if digits == "" {
		v.neg, v.exp = false, new(big.Int)
	}
	v.digits = digits
	return v, nil
}

// str reads a string as UTF-16 would carry it: pairs of surrogates become
// their character, a lone one stays itself.
func (d *oracle) str() ([]rune, error) {
	if !d.eat(`"`) {
		return nil, errOracle
	}
	var units []rune // code points, surrogates still apart
	for {
		if d.i >= len(d.in) {
			return nil, errOracle
		}
		c := d.in[d.i]
		switch {
		case c == '"':
			d.i++
			var out []rune
			for k := 0; k < len(units); k++ {
				if k+1 < len(units) && utf16.IsSurrogate(units[k]) && units[k] < 0xdc00 && units[k+1] >= 0xdc00 && units[k+1] < 0xe000 {
					out = append(out, utf16.DecodeRune(units[k], units[k+1]))
					k++
					continue
				}
				out = append(out, units[k])
			}
			return out, nil
		case c < 0x20:
			return nil, errOracle
		case c == '\\':
			if d.i+1 >= len(d.in) {
				return nil, errOracle
			}
			esc := map[byte]rune{'"': '"', '\\': '\\', '/': '/', 'b': '\b', 'f': '\f', 'n': '\n', 'r': '\r', 't': '\t'}
			if r, ok := esc[d.in[d.i+1]]; ok {
				units = append(units, r)
				d.i += 2
				continue
			}
			if d.in[d.i+1] != 'u' || d.i+6 > len(d.in) {
				return nil, errOracle
			}
			hex := string(d.in[d.i+2 : d.i+6])
			if !hexRE.MatchString(hex) {
				return nil, errOracle
			}
			n, _ := strconv.ParseUint(hex, 16, 32)
			units = append(units, rune(n))
			d.i += 6
		default:
			r, size := utf8.DecodeRune(d.in[d.i:])
			if r == utf8.RuneError && size <= 1 {
				return nil, errOracle
			}
			if r >= 0x10000 {
				// Kept as a pair, so that an escaped pair and the
				// character itself decode alike above.
				hi, lo := utf16.EncodeRune(r)
				units = append(units, hi, lo)
			} else {
				units = append(units, r)
			}
			d.i += size
		}
	}
}

var hexRE = regexp.MustCompile(`^[0-9a-fA-F]{4}$`)

// oracleFraction is the fraction's digits of a time time.Parse took: the
// digits after its only '.' or ','.
var oracleFraction = regexp.MustCompile(`[.,]([0-9]+)`)

// oracleTime: time.Parse(time.RFC3339Nano) says what a time is and which
// instant (what the release before CanonicalJSON's scanner canonicalised:
// a one-digit hour, a comma before the fraction and offsets up to +24:60
// among them), except a string shorter than 2006-01-02T15:04:05Z, which
// that release kept as a string; the fraction is kept apart, all of it.
func oracleTime(runes []rune) (jvalue, bool) {
	s := string(runes)
	if len(runes) < len("2006-01-02T15:04:05Z") {
		return jvalue{}, false
	}
	at, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		return jvalue{}, false
	}
	frac := ""
	if m := oracleFraction.FindStringSubmatch(s); m != nil {
		frac = m[1]
	}
	for len(frac) > 0 && frac[len(frac)-1] == '0' {
		frac = frac[:len(frac)-1]
	}
	return jvalue{kind: 't', unix: at.Unix(), frac: frac}, true
}
