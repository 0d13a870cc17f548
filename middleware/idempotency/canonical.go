package idempotency

import (
	"bytes"
	"crypto/sha256"
	"slices"

	"github.com/ThreeDotsLabs/watermill/message"
)

// PayloadSHA256 is the default Config.Fingerprint: the SHA-256 of the
// payload's [CanonicalJSON], or of its bytes when CanonicalJSON refuses it
// (not JSON, invalid UTF-8, a repeated member name, bytes after the value).
//
// It knows nothing of the event's types, so a number and a string stay
// different values: 12.5 and 12.50 are one value, 12.5 and "12.50" are two,
// and a re-publication that writes a decimal the other way is an
// [ErrPayloadMismatch]. Name such members with [FingerprintWithDecimals],
// or let package pipeline fingerprint the decoded event, which knows them.
func PayloadSHA256(msg *message.Message) ([32]byte, error) {
	return payloadSHA256(msg.Payload, nil), nil
}

// FingerprintWithDecimals is a Config.Fingerprint for events whose top-level
// members named in fields are decimals, which producers write as a JSON
// number or as a string (pydantic writes a Decimal as "12.50"): in those
// members a number and a string holding a JSON number are one value, so
// 12.5, 12.50, 1.25e1 and "12.50" are the same. A string there that is not
// a number stays a string. Everything else is as [PayloadSHA256]. Changing a
// group's fingerprint keeps redeliveries of the same bytes duplicates (the
// claim keeps their hash too); only a re-publication in another byte form
// of an event claimed before the change is then a mismatch.
func FingerprintWithDecimals(fields ...string) func(msg *message.Message) ([32]byte, error) {
	names := slices.Clone(fields)
	return func(msg *message.Message) ([32]byte, error) {
		return payloadSHA256(msg.Payload, names), nil
	}
}

func payloadSHA256(payload []byte, decimals []string) [32]byte {
	c := getCanonicalizer()
	defer putCanonicalizer(c)
	c.out = c.out[:0]
	if err := c.run(payload, decimals); err != nil {
		// Not a JSON value this package can write one way: its bytes are
		// its values. No canonical form is equal to such bytes, since
		// CanonicalJSON takes its own output back unchanged.
		return sha256.Sum256(payload)
	}
	return sha256.Sum256(c.out)
}

// CanonicalJSON rewrites one JSON value so that two encodings of the same
// values are the same bytes, and two different values never are:
//
//   - object members sorted by name (by their UTF-8 bytes), no
//     insignificant space;
//   - numbers as exact decimals without redundant zeros: 12.5, 12.50 and
//     1.25e1 are one number, written 125e-1; the exponent may be of any
//     size (1e9999999999 and 10e9999999998 are one number, -1e9999999999
//     another), and no number goes through a float;
//   - strings that are RFC 3339 times (2006-01-02T15:04:05, an optional
//     fraction of any length, then Z or an offset such as +02:00) as the
//     same instant in UTC with every fraction digit kept and trailing zeros
//     trimmed: Z, +00:00 and +02:00 name one instant three ways. A time is
//     what time.Parse(time.RFC3339Nano) reads as one, as in the releases
//     before this scanner (whose claims hold that form): a one-digit hour,
//     a comma before the fraction and offsets up to +24:60 too, but no
//     string shorter than 2006-01-02T15:04:05Z. An instant whose UTC year
//     is not between 0000 and 9999 is written with the smallest offset that
//     brings it back into those years, so that it is still a time and no
//     other string can be written the same;
//   - strings written as encoding/json writes them, except that a lone
//     surrogate escape (\ud800 without its pair) is kept as its escape:
//     it is another value than U+FFFD and than any other surrogate.
//
// A number and a string stay different values: whether "12.50" is a number
// is for the event's decoder to say (package pipeline fingerprints the
// decoded event) or for [FingerprintWithDecimals].
//
// It refuses what it cannot write one way rather than merge two values:
// invalid JSON, invalid UTF-8 (JSON text is UTF-8; decoders replace bad
// bytes with U+FFFD, which would make "M\xfcller" and "M\xe4ller" one
// value), a member name repeated in one object (decoders keep the first or
// the last), anything but space after the value, and nesting deeper than
// 10000. Its own output it returns unchanged.
func CanonicalJSON(b []byte) ([]byte, error) {
	c := getCanonicalizer()
	defer putCanonicalizer(c)
	c.out = make([]byte, 0, len(b))
	if err := c.run(b, nil); err != nil {
		return nil, err
	}
	out := c.out
	c.out = nil
	return out, nil
}

// fingerprints are what a claim stores of its event: the SHA-256 of the
// payload's bytes (payload_sha256) and of its values in canonical form
// (values_sha256).
type fingerprints struct {
	raw, values []byte
}

func fingerprintsOf(values [32]byte, msg *message.Message) fingerprints {
	raw := sha256.Sum256(msg.Payload)
	return fingerprints{raw: raw[:], values: values[:]}
}

// match: the same bytes, or the same values (a claim from a release that
// stored no values fingerprint has only its bytes). A claim with neither
// was made without a fingerprint (adopted from the style guide's table, or
// made by the guide's consumer beside us) and matches by its id alone: what
// its event said is not known, and a duplicate is what it most likely is.
func (f fingerprints) match(storedRaw, storedValues []byte) bool {
	if storedRaw == nil && storedValues == nil {
		return true
	}
	return bytes.Equal(storedRaw, f.raw) || (storedValues != nil && bytes.Equal(storedValues, f.values))
}
