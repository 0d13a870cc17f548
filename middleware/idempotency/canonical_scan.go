package idempotency

import (
	"bytes"
	"errors"
	"fmt"
	"math/big"
	"slices"
	"strconv"
	"sync"
	"unicode/utf8"
)

// maxDepth bounds nesting, as encoding/json does: the scanner recurses.
const maxDepth = 10000

var canonicalizers = sync.Pool{New: func() any { return new(canonicalizer) }}

func getCanonicalizer() *canonicalizer { return canonicalizers.Get().(*canonicalizer) }

// putCanonicalizer keeps c for the next message, unless a huge payload
// grew its buffers: those go with it.
func putCanonicalizer(c *canonicalizer) {
	if cap(c.out) > 1<<20 || cap(c.tmp) > 1<<20 || cap(c.str) > 1<<20 || cap(c.names) > 1<<20 || cap(c.members) > 1<<16 {
		return
	}
	canonicalizers.Put(c)
}

// canonicalizer is a strict JSON scanner that writes the canonical form as
// it reads, in one pass; an object whose members came out of order is
// rewritten in order when it ends. Pooled: its buffers outlive a call.
type canonicalizer struct {
	in       []byte
	pos      int
	depth    int
	decimals []string // top-level members whose strings may hold decimals
	out      []byte
	// members of the objects being written, innermost last: their names'
	// bytes (into in, or into names) and where they lie in out.
	members []memberSpan
	names   []byte
	str     []byte // a string's value, unescaped
	tmp     []byte // an object being put in order
}

type memberSpan struct {
	name       []byte
	start, end int
}

var (
	errSyntax     = errors.New("not JSON")
	errUTF8       = errors.New("invalid UTF-8")
	errDepth      = errors.New("nested deeper than 10000")
	errDuplicate  = errors.New("a member name repeated in one object")
	errAfterValue = errors.New("more after the value")
)

func (c *canonicalizer) run(b []byte, decimals []string) error {
	c.in, c.pos, c.depth, c.decimals = b, 0, 0, decimals
	c.members, c.names = c.members[:0], c.names[:0]
	defer func() {
		// Nothing of this payload stays in the pool.
		c.in = nil
		clear(c.members[:cap(c.members)])
	}()
	c.skipSpace()
	err := c.value()
	if err == nil {
		c.skipSpace()
		if c.pos < len(c.in) {
			err = errAfterValue
		}
	}
	if err != nil {
		return fmt.Errorf("idempotency: canonical JSON: %w at offset %d", err, min(c.pos, len(c.in)))
	}
	return nil
}

func (c *canonicalizer) skipSpace() {
	for c.pos < len(c.in) {
		switch c.in[c.pos] {
		case ' ', '\t', '\n', '\r':
			c.pos++
		default:
			return
		}
	}
}

func (c *canonicalizer) value() error {
	if c.pos >= len(c.in) {
		return errSyntax
	}
	switch b := c.in[c.pos]; {
	case b == '{':
		return c.object()
	case b == '[':
		return c.array()
	case b == '"':
		s, err := c.string(false)
		if err != nil {
			return err
		}
		c.writeStringValue(s)
		return nil
	case b == '-' || (b >= '0' && b <= '9'):
		n, err := c.number()
		if err != nil {
			return err
		}
		c.out = n.appendCanonical(c.out)
		return nil
	case b == 't':
		return c.literal("true")
	case b == 'f':
		return c.literal("false")
	case b == 'n':
		return c.literal("null")
	}
	return errSyntax
}

func (c *canonicalizer) literal(lit string) error {
	if !bytes.HasPrefix(c.in[c.pos:], []byte(lit)) {
		return errSyntax
	}
	c.pos += len(lit)
	c.out = append(c.out, lit...)
	return nil
}

func (c *canonicalizer) array() error {
	if c.depth++; c.depth > maxDepth {
		return errDepth
	}
	c.pos++ // [
	c.out = append(c.out, '[')
	c.skipSpace()
	if c.pos < len(c.in) && c.in[c.pos] == ']' {
		c.pos++
		c.out = append(c.out, ']')
		c.depth--
		return nil
	}
	for {
		if err := c.value(); err != nil {
			return err
		}
		c.skipSpace()
		if c.pos >= len(c.in) {
			return errSyntax
		}
		switch c.in[c.pos] {
		case ',':
			c.pos++
			c.skipSpace()
			c.out = append(c.out, ',')
		case ']':
			c.pos++
			c.out = append(c.out, ']')
			c.depth--
			return nil
		default:
			return errSyntax
		}
	}
}

func (c *canonicalizer) object() error {
	if c.depth++; c.depth > maxDepth {
		return errDepth
	}
	c.pos++ // {
	c.out = append(c.out, '{')
	body := len(c.out)
	base, namesBase := len(c.members), len(c.names)
	inOrder := true
	c.skipSpace()
	if c.pos < len(c.in) && c.in[c.pos] == '}' {
		c.pos++
		c.out = append(c.out, '}')
		c.depth--
		return nil
	}
	for {
		if c.pos >= len(c.in) || c.in[c.pos] != '"' {
			return errSyntax
		}
		if len(c.members) > base {
			c.out = append(c.out, ',')
		}
		start := len(c.out)
		name, err := c.string(true)
		if err != nil {
			return err
		}
		c.out = appendString(c.out, name)
		c.skipSpace()
		if c.pos >= len(c.in) || c.in[c.pos] != ':' {
			return errSyntax
		}
		c.pos++
		c.skipSpace()
		c.out = append(c.out, ':')
		if c.depth == 1 && len(c.decimals) > 0 && slices.Contains(c.decimals, string(name)) {
			err = c.decimal()
		} else {
			err = c.value()
		}
		if err != nil {
			return err
		}
		if len(c.members) > base {
			switch bytes.Compare(c.members[len(c.members)-1].name, name) {
			case 0:
				return errDuplicate
			case 1:
				inOrder = false
			}
		}
		c.members = append(c.members, memberSpan{name: name, start: start, end: len(c.out)})
		c.skipSpace()
		if c.pos >= len(c.in) {
			return errSyntax
		}
		switch c.in[c.pos] {
		case ',':
			c.pos++
			c.skipSpace()
			continue
		case '}':
			c.pos++
		default:
			return errSyntax
		}
		break
	}
	if !inOrder {
		members := c.members[base:]
		slices.SortFunc(members, func(a, b memberSpan) int { return bytes.Compare(a.name, b.name) })
		for i := 1; i < len(members); i++ {
			if bytes.Equal(members[i-1].name, members[i].name) {
				return errDuplicate
			}
		}
		c.tmp = append(c.tmp[:0], c.out[body:]...)
		c.out = c.out[:body]
		for i, m := range members {
			if i > 0 {
				c.out = append(c.out, ',')
			}
			c.out = append(c.out, c.tmp[m.start-body:m.end-body]...)
		}
	}
	c.members, c.names = c.members[:base], c.names[:namesBase]
	c.out = append(c.out, '}')
	c.depth--
	return nil
}

// decimal writes a member named in FingerprintWithDecimals: a string that
// holds a JSON number is that number; any other value is written as usual.
func (c *canonicalizer) decimal() error {
	if c.pos >= len(c.in) || c.in[c.pos] != '"' {
		return c.value()
	}
	s, err := c.string(false)
	if err != nil {
		return err
	}
	if n, ok := parseNumber(s); ok {
		c.out = n.appendCanonical(c.out)
	} else {
		c.writeStringValue(s)
	}
	return nil
}

// string reads the string at c.pos and returns its value: the bytes
// between the quotes when there is no escape, else the value unescaped
// into a buffer, a lone surrogate as its WTF-8 bytes (ED A0 80 for \ud800;
// never valid UTF-8, so never equal to any other character). A name's
// value stays valid until its object ends; another string's, until the
// next string is read.
func (c *canonicalizer) string(isName bool) ([]byte, error) {
	start := c.pos + 1
	i := start
	ascii := true
	for ; i < len(c.in); i++ {
		b := c.in[i]
		if b == '"' {
			break
		}
		if b < 0x20 {
			return nil, errSyntax
		}
		if b == '\\' {
			return c.unescape(isName)
		}
		if b >= utf8.RuneSelf {
			ascii = false
		}
	}
	if i >= len(c.in) {
		return nil, errSyntax
	}
	s := c.in[start:i]
	if !ascii && !utf8.Valid(s) {
		c.pos = start
		return nil, errUTF8
	}
	c.pos = i + 1
	return s, nil
}

func (c *canonicalizer) unescape(isName bool) ([]byte, error) {
	var s []byte
	if isName {
		s = c.names
	} else {
		s = c.str[:0]
	}
	from := len(s)
	i := c.pos + 1
	for {
		if i >= len(c.in) {
			return nil, errSyntax
		}
		b := c.in[i]
		switch {
		case b == '"':
			c.pos = i + 1
			if isName {
				c.names = s
			} else {
				c.str = s
			}
			return s[from:len(s):len(s)], nil
		case b < 0x20:
			c.pos = i
			return nil, errSyntax
		case b == '\\':
			if i+1 >= len(c.in) {
				return nil, errSyntax
			}
			switch e := c.in[i+1]; e {
			case '"', '\\', '/':
				s = append(s, e)
			case 'b':
				s = append(s, '\b')
			case 'f':
				s = append(s, '\f')
			case 'n':
				s = append(s, '\n')
			case 'r':
				s = append(s, '\r')
			case 't':
				s = append(s, '\t')
			case 'u':
				r, ok := hex4(c.in, i+2)
				if !ok {
					c.pos = i
					return nil, errSyntax
				}
				i += 6
				if r >= 0xd800 && r < 0xdc00 && i+6 <= len(c.in) && c.in[i] == '\\' && c.in[i+1] == 'u' {
					if lo, ok := hex4(c.in, i+2); ok && lo >= 0xdc00 && lo < 0xe000 {
						s = utf8.AppendRune(s, 0x10000+(r-0xd800)<<10+(lo-0xdc00))
						i += 6
						continue
					}
				}
				if r >= 0xd800 && r < 0xe000 {
					s = append(s, 0xe0|byte(r>>12), 0x80|byte(r>>6)&0x3f, 0x80|byte(r)&0x3f)
				} else {
					s = utf8.AppendRune(s, r)
				}
				continue
			default:
				c.pos = i
				return nil, errSyntax
			}
			i += 2
		case b < utf8.RuneSelf:
			s = append(s, b)
			i++
		default:
			r, size := utf8.DecodeRune(c.in[i:])
			if r == utf8.RuneError && size == 1 {
				c.pos = i
				return nil, errUTF8
			}
			s = append(s, c.in[i:i+size]...)
			i += size
		}
	}
}

func hex4(b []byte, i int) (rune, bool) {
	if i+4 > len(b) {
		return 0, false
	}
	var r rune
	for _, h := range b[i : i+4] {
		switch {
		case h >= '0' && h <= '9':
			h -= '0'
		case h >= 'a' && h <= 'f':
			h -= 'a' - 10
		case h >= 'A' && h <= 'F':
			h -= 'A' - 10
		default:
			return 0, false
		}
		r = r<<4 | rune(h)
	}
	return r, true
}

// writeStringValue writes a string's value: the instant, when it is an
// RFC 3339 time; else the string.
func (c *canonicalizer) writeStringValue(s []byte) {
	if len(s) >= len("2006-01-02T15:04:05Z") && s[4] == '-' && s[0] >= '0' && s[0] <= '9' {
		if t, ok := parseTime(s); ok {
			c.out = append(c.out, '"')
			c.out = t.appendCanonical(c.out, s)
			c.out = append(c.out, '"')
			return
		}
	}
	c.out = appendString(c.out, s)
}

const hexDigits = "0123456789abcdef"

// appendString writes s as encoding/json's Marshal writes a string (so that
// fingerprints stored before this scanner still match), and a lone
// surrogate (its WTF-8 bytes in s) as its \u escape.
func appendString(out, s []byte) []byte {
	out = append(out, '"')
	start := 0
	for i := 0; i < len(s); {
		b := s[i]
		if b < utf8.RuneSelf {
			if b >= 0x20 && b != '"' && b != '\\' && b != '<' && b != '>' && b != '&' {
				i++
				continue
			}
			out = append(out, s[start:i]...)
			switch b {
			case '"', '\\':
				out = append(out, '\\', b)
			case '\b':
				out = append(out, '\\', 'b')
			case '\f':
				out = append(out, '\\', 'f')
			case '\n':
				out = append(out, '\\', 'n')
			case '\r':
				out = append(out, '\\', 'r')
			case '\t':
				out = append(out, '\\', 't')
			default:
				out = append(out, '\\', 'u', '0', '0', hexDigits[b>>4], hexDigits[b&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRune(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			// A lone surrogate: the scanner lets no other invalid byte in.
			r = rune(s[i]&0x0f)<<12 | rune(s[i+1]&0x3f)<<6 | rune(s[i+2]&0x3f)
			size = 3
		case r != '\u2028' && r != '\u2029':
			i += size
			continue
		}
		out = append(out, s[start:i]...)
		out = append(out, '\\', 'u', hexDigits[r>>12], hexDigits[r>>8&0xf], hexDigits[r>>4&0xf], hexDigits[r&0xf])
		i += size
		start = i
	}
	out = append(out, s[start:]...)
	return append(out, '"')
}

// number is a JSON number's parts, as written: sign, integer digits,
// fraction digits, exponent sign and digits.
type number struct {
	neg         bool
	whole, frac []byte
	expNeg      bool
	exp         []byte
}

// number reads the number at c.pos: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?.
// What follows it is the caller's to check.
func (c *canonicalizer) number() (number, error) {
	n, end, ok := scanNumber(c.in, c.pos)
	if !ok {
		c.pos = end
		return n, errSyntax
	}
	c.pos = end
	return n, nil
}

// parseNumber is s as a number, if all of s is one.
func parseNumber(s []byte) (number, bool) {
	n, end, ok := scanNumber(s, 0)
	return n, ok && end == len(s)
}

func scanNumber(b []byte, i int) (n number, end int, ok bool) {
	if i < len(b) && b[i] == '-' {
		n.neg = true
		i++
	}
	j := digitsEnd(b, i)
	if j == i || (b[i] == '0' && j > i+1) {
		return n, j, false
	}
	n.whole, i = b[i:j], j
	if i < len(b) && b[i] == '.' {
		j = digitsEnd(b, i+1)
		if j == i+1 {
			return n, j, false
		}
		n.frac, i = b[i+1:j], j
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			n.expNeg = b[i] == '-'
			i++
		}
		j = digitsEnd(b, i)
		if j == i {
			return n, j, false
		}
		n.exp, i = b[i:j], j
	}
	return n, i, true
}

func digitsEnd(b []byte, i int) int {
	for i < len(b) && b[i] >= '0' && b[i] <= '9' {
		i++
	}
	return i
}

// appendCanonical writes the number as sign, significant digits and a
// power of ten: 12.50 -> 125e-1, 1200 -> 12e2, -0.0 -> 0. The exponent is
// exact at any size (math/big beyond what an int64 holds).
func (n number) appendCanonical(out []byte) []byte {
	// The significant digits run from the first non-zero digit of
	// whole+frac to the last.
	digits := len(n.whole) + len(n.frac)
	at := func(k int) byte {
		if k < len(n.whole) {
			return n.whole[k]
		}
		return n.frac[k-len(n.whole)]
	}
	first := 0
	for first < digits && at(first) == '0' {
		first++
	}
	if first == digits {
		return append(out, '0')
	}
	last := digits - 1
	for at(last) == '0' {
		last--
	}
	if n.neg {
		out = append(out, '-')
	}
	if first < len(n.whole) {
		out = append(out, n.whole[first:min(last+1, len(n.whole))]...)
	}
	if last >= len(n.whole) {
		out = append(out, n.frac[max(first-len(n.whole), 0):last+1-len(n.whole)]...)
	}
	// The value is significand * 10^(exp - len(frac) + trailing zeros).
	shift := int64(digits-1-last) - int64(len(n.frac))
	exp := bytes.TrimLeft(n.exp, "0")
	if len(exp) <= 17 { // below 10^17: the sum cannot overflow an int64
		e := int64(0)
		for _, d := range exp {
			e = e*10 + int64(d-'0')
		}
		if n.expNeg {
			e = -e
		}
		if e += shift; e != 0 {
			out = append(out, 'e')
			out = strconv.AppendInt(out, e, 10)
		}
		return out
	}
	e, _ := new(big.Int).SetString(string(exp), 10)
	if n.expNeg {
		e.Neg(e)
	}
	e.Add(e, big.NewInt(shift)) // never 0: |exp| is at least 10^17
	out = append(out, 'e')
	return e.Append(out, 10)
}
