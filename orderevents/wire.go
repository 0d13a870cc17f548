package orderevents

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/shopspring/decimal"
)

// MaxPayloadBytes bounds a message: an event is a few hundred bytes, and a
// huge one is a producer bug that should not be decoded, stored or charged.
const MaxPayloadBytes = 64 << 10

// MaxFractionDigits bounds amounts: charges are in minor units of
// two-decimal currencies, and a third digit would be rounded somewhere.
const MaxFractionDigits = 2

// MaxAmount is the largest amount accepted: what numeric(20, 2) holds. A
// larger one is refused at the edge, before anything is claimed or charged.
var MaxAmount = decimal.RequireFromString("999999999999999999.99")

// ErrInvalid is wrapped by every validation error of the decoders, so callers
// can tell a message that can never be processed from a failure to process it.
var ErrInvalid = errors.New("invalid event")

// FieldError is a decoding error that names the event type, the field, what
// was expected and what arrived. It wraps [ErrInvalid].
//
// It never quotes the payload: Got is the JSON type that arrived and what
// is wrong with it ("a string", "a number with a fraction", "a UUID
// version 4"), not the value. Its text becomes a dead letter's reason,
// which operators read and tools keep, and a value in the wrong field is
// as often personal data (an e-mail where an id belongs) as anywhere.
type FieldError struct {
	EventType string
	Field     string // empty when the payload as a whole is wrong
	Want      string
	Got       string
}

func (e *FieldError) Error() string {
	if e.Field == "" {
		return fmt.Sprintf("%s: payload: want %s, got %s", e.EventType, e.Want, e.Got)
	}
	return fmt.Sprintf("%s: field %s: want %s, got %s", e.EventType, e.Field, e.Want, e.Got)
}

func (e *FieldError) Unwrap() error { return ErrInvalid }

// fields is one event's top-level JSON object, read as the style guide's
// pydantic models do: unknown fields are ignored, missing or mistyped ones
// are an error naming the field.
type fields struct {
	eventType string
	members   []member
	err       error // the first error; later reads are no-ops
}

// member is one name and value of a JSON object; both point into the
// payload unless the name had to be unescaped.
type member struct {
	name []byte
	raw  json.RawMessage
}

func readFields(eventType string, payload []byte) *fields {
	f := &fields{eventType: eventType}
	if len(payload) > MaxPayloadBytes {
		f.err = &FieldError{EventType: eventType, Want: fmt.Sprintf("at most %d bytes", MaxPayloadBytes), Got: fmt.Sprintf("%d bytes", len(payload))}
		return f
	}
	trimmed := bytes.TrimSpace(payload)
	if len(trimmed) == 0 || trimmed[0] != '{' {
		f.err = &FieldError{EventType: eventType, Want: "a JSON object", Got: describe(trimmed)}
		return f
	}
	if !json.Valid(trimmed) {
		f.err = &FieldError{EventType: eventType, Want: "a JSON object", Got: malformed(trimmed)}
		return f
	}
	f.members = topLevel(trimmed, make([]member, 0, 8))
	return f
}

// topLevel appends the members of a valid JSON object to members, in the
// order written, names unescaped as encoding/json unescapes them: a slice
// and no copies, where json.Unmarshal into a map[string]json.RawMessage made
// reflection a fifth of a consumer's CPU and the map most of its decoding
// allocations. b must be valid JSON and start with '{'.
func topLevel(b []byte, members []member) []member {
	i := skipSpace(b, 1)
	if b[i] == '}' {
		return members
	}
	for {
		end := stringEnd(b, i)
		name := b[i+1 : end-1]
		if bytes.IndexByte(name, '\\') >= 0 || !utf8.Valid(name) {
			var key string
			_ = json.Unmarshal(b[i:end], &key) // valid JSON: cannot fail
			name = []byte(key)
		}
		i = skipSpace(b, skipSpace(b, end)+1) // past the colon
		vend := valueEnd(b, i)
		members = append(members, member{name: name, raw: json.RawMessage(b[i:vend])})
		i = skipSpace(b, vend)
		if b[i] == '}' {
			return members
		}
		i = skipSpace(b, i+1) // past the comma
	}
}

// lookup is the value of the member named name; of a repeated name, the
// last, as encoding/json keeps it.
func lookup(members []member, name string) (json.RawMessage, bool) {
	for i := len(members) - 1; i >= 0; i-- {
		if string(members[i].name) == name {
			return members[i].raw, true
		}
	}
	return nil, false
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// stringEnd is the index after the string that starts at b[i].
func stringEnd(b []byte, i int) int {
	for j := i + 1; ; j++ {
		switch b[j] {
		case '\\':
			j++
		case '"':
			return j + 1
		}
	}
}

// valueEnd is the index after the value that starts at b[i].
func valueEnd(b []byte, i int) int {
	switch b[i] {
	case '"':
		return stringEnd(b, i)
	case '{', '[':
		depth := 0
		for j := i; ; j++ {
			switch b[j] {
			case '"':
				j = stringEnd(b, j) - 1
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					return j + 1
				}
			}
		}
	}
	j := i
	for j < len(b) && b[j] != ',' && b[j] != '}' && b[j] != ']' && b[j] != ' ' && b[j] != '\t' && b[j] != '\n' && b[j] != '\r' {
		j++
	}
	return j
}

// fail records that field's value, raw, is not what was wanted, naming
// its JSON type.
func (f *fields) fail(field, want string, raw json.RawMessage) {
	f.failAs(field, want, describe(raw))
}

// failAs records that field's value is not what was wanted: got says what
// it is, never what it holds.
func (f *fields) failAs(field, want, got string) {
	if f.err == nil {
		f.err = &FieldError{EventType: f.eventType, Field: field, Want: want, Got: got}
	}
}

// get returns the field's raw value, or records it as missing.
func (f *fields) get(field, want string) (json.RawMessage, bool) {
	if f.err != nil {
		return nil, false
	}
	raw, ok := lookup(f.members, field)
	if !ok {
		f.err = &FieldError{EventType: f.eventType, Field: field, Want: want, Got: "nothing (the field is missing)"}
		return nil, false
	}
	return raw, true
}

func (f *fields) str(field, want string) (string, bool) {
	raw, ok := f.get(field, want)
	if !ok {
		return "", false
	}
	s, ok := jsonString(raw)
	if !ok {
		f.fail(field, want, raw)
	}
	return s, ok
}

// jsonString is the string a raw JSON value holds, and false for a value
// that is not a string.
func jsonString(raw json.RawMessage) (string, bool) {
	if len(raw) < 2 || raw[0] != '"' {
		return "", false
	}
	if bytes.IndexByte(raw, '\\') < 0 && utf8.Valid(raw) {
		// No escapes and valid UTF-8: the text between the quotes is the
		// string (the document was validated as JSON as a whole). Invalid
		// UTF-8 goes the slow way, which replaces it with U+FFFD as
		// encoding/json always did: PostgreSQL refuses invalid text.
		return string(raw[1 : len(raw)-1]), true
	}
	var s string
	if json.Unmarshal(raw, &s) != nil {
		return "", false
	}
	return s, true
}

// eventType checks the event_type field against the one expected.
func (f *fields) checkType() {
	raw, _ := lookup(f.members, "event_type")
	if s, ok := jsonString(raw); ok && s == f.eventType && f.err == nil {
		return // the common case, without formatting the message below
	}
	want := fmt.Sprintf("the string %q", f.eventType)
	if s, ok := f.str("event_type", want); ok && s != f.eventType {
		f.failAs("event_type", want, "another string")
	}
}

// uuidV7 reads a UUID version 7 string (R-KFK-IDEM-1).
func (f *fields) uuidV7(field string) uuid.UUID {
	const want = "a UUID version 7 string"
	s, ok := f.str(field, want)
	if !ok {
		return uuid.Nil
	}
	id, err := uuid.Parse(s)
	switch {
	case err != nil:
		f.failAs(field, want, "a string that is not a UUID")
	case len(s) != 36:
		f.failAs(field, want, "a UUID not in its 36-character form")
	case id.Variant() != uuid.RFC4122:
		f.failAs(field, want, "a UUID of another variant than RFC 4122's")
	case id.Version() != 7:
		f.failAs(field, want, fmt.Sprintf("a UUID version %d", id.Version()))
	default:
		return id
	}
	return uuid.Nil
}

// timestamp reads an ISO 8601 date-time with an offset, as pydantic writes a
// datetime ("2026-12-02T15:08:21.123456Z" or "...+00:00"). A time without
// an offset is refused: its instant would depend on the reader's zone.
func (f *fields) timestamp(field string) time.Time {
	const want = "an ISO 8601 date-time with an offset (2026-12-02T15:08:21.123456Z)"
	s, ok := f.str(field, want)
	if !ok {
		return time.Time{}
	}
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		f.failAs(field, want, "a string that is not one")
		return time.Time{}
	}
	return t.UTC()
}

// isJSONInteger reports whether b is a JSON integer literal:
// -?(0|[1-9][0-9]*).
func isJSONInteger(b []byte) bool {
	if len(b) > 0 && b[0] == '-' {
		b = b[1:]
	}
	return digitsEnd(b, 0) == len(b) && len(b) > 0 && (b[0] != '0' || len(b) == 1)
}

// isJSONNumber reports whether s is a JSON number literal:
// -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?.
func isJSONNumber(s string) bool {
	b := []byte(s)
	if len(b) > 0 && b[0] == '-' {
		b = b[1:]
	}
	i := digitsEnd(b, 0)
	if i == 0 || (b[0] == '0' && i > 1) {
		return false
	}
	if i < len(b) && b[i] == '.' {
		j := digitsEnd(b, i+1)
		if j == i+1 {
			return false
		}
		i = j
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		j := digitsEnd(b, i)
		if j == i {
			return false
		}
		i = j
	}
	return i == len(b)
}

// digitsEnd is the index of the first byte at or after i that is not a digit.
func digitsEnd(b []byte, i int) int {
	for i < len(b) && b[i] >= '0' && b[i] <= '9' {
		i++
	}
	return i
}

// int64 reads a JSON integer literal. A string holding digits, a fraction or
// an exponent is refused: the guide's field is an int, and a producer that
// writes anything else follows another contract.
func (f *fields) int64(field string) int64 {
	const want = "a JSON integer (64-bit)"
	raw, ok := f.get(field, want)
	if !ok {
		return 0
	}
	if !isJSONInteger(raw) {
		if isJSONNumber(string(raw)) {
			f.failAs(field, want, "a number with a fraction or an exponent")
		} else {
			f.fail(field, want, raw)
		}
		return 0
	}
	n, err := strconv.ParseInt(string(raw), 10, 64)
	if err != nil {
		f.failAs(field, want, "an integer beyond 64 bits")
		return 0
	}
	return n
}

// amount reads a positive decimal with at most two fraction digits, from the
// string pydantic writes for a Decimal or from a JSON number, parsed from its
// literal text: never through a float64.
func (f *fields) amount(field string) decimal.Decimal {
	const want = "a positive decimal below 10^18 with at most 2 fraction digits, as a string (\"129.90\") or a JSON number"
	raw, ok := f.get(field, want)
	if !ok {
		return decimal.Decimal{}
	}
	text, kind := string(raw), "a number"
	if raw[0] == '"' {
		if text, ok = jsonString(raw); !ok {
			f.fail(field, want, raw)
			return decimal.Decimal{}
		}
		kind = "a string holding a number"
	}
	if !isJSONNumber(text) {
		if raw[0] == '"' {
			f.failAs(field, want, "a string that is not a JSON number")
		} else {
			f.fail(field, want, raw)
		}
		return decimal.Decimal{}
	}
	d, err := decimal.NewFromString(text)
	switch {
	case err != nil:
		f.failAs(field, want, kind+" beyond what a decimal holds")
	case !d.IsPositive():
		f.failAs(field, want, kind+" that is not positive")
	case !d.Equal(d.Round(MaxFractionDigits)):
		f.failAs(field, want, fmt.Sprintf("%s with more than %d fraction digits", kind, MaxFractionDigits))
	case d.GreaterThan(MaxAmount):
		f.failAs(field, want, kind+" of 10^18 or more")
	default:
		return d
	}
	return decimal.Decimal{}
}

// describe names a raw JSON value's type in an error, never the value
// itself (see [FieldError]).
func describe(raw []byte) string {
	switch {
	case len(raw) == 0:
		return "an empty payload"
	case raw[0] == '"':
		return "a string"
	case raw[0] == '{':
		return "an object"
	case raw[0] == '[':
		return "an array"
	case bytes.Equal(raw, []byte("null")):
		return "null"
	case bytes.Equal(raw, []byte("true")), bytes.Equal(raw, []byte("false")):
		return "a boolean"
	case raw[0] == '-' || (raw[0] >= '0' && raw[0] <= '9'):
		return "a number"
	}
	return fmt.Sprintf("%d bytes of text that is not JSON", len(raw))
}

// malformed says where a payload that starts as an object stops being
// JSON, by its offset: encoding/json's own message quotes the character
// it met there.
func malformed(payload []byte) string {
	var probe any
	var syntax *json.SyntaxError
	if err := json.Unmarshal(payload, &probe); errors.As(err, &syntax) {
		return fmt.Sprintf("malformed JSON (at byte %d of %d)", syntax.Offset, len(payload))
	}
	return "malformed JSON"
}

// nonEmpty reads a string that must not be empty.
func (f *fields) nonEmpty(field string) string {
	const want = "a non-empty string"
	s, ok := f.str(field, want)
	if ok && s == "" {
		f.failAs(field, want, "an empty string")
	}
	return s
}
