package idempotency

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// PayloadSHA256 is the default Config.Fingerprint: the SHA-256 of the
// payload's [CanonicalJSON], or of its bytes when it is not JSON.
func PayloadSHA256(msg *message.Message) ([32]byte, error) {
	if c, err := CanonicalJSON(msg.Payload); err == nil {
		return sha256.Sum256(c), nil
	}
	return sha256.Sum256(msg.Payload), nil
}

// CanonicalJSON rewrites one JSON value so that two encodings of the same
// values are the same bytes: object members sorted by name, no insignificant
// space, numbers as exact decimals without redundant zeros (12.5, 12.50 and
// 1.25e1 are one number), and strings that are RFC 3339 times as the same
// instant in UTC (Z, +00:00 and +02:00 name one instant three ways). A
// number and a string stay different values: whether "12.50" is a number is
// for the event's decoder to say, and a decoded event marshals it one way.
func CanonicalJSON(b []byte) ([]byte, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, fmt.Errorf("idempotency: canonical JSON: %w", err)
	}
	if _, err := dec.Token(); err == nil {
		return nil, errors.New("idempotency: canonical JSON: more than one value")
	}
	var out bytes.Buffer
	out.Grow(len(b))
	if err := writeCanonical(&out, v); err != nil {
		return nil, err
	}
	return out.Bytes(), nil
}

func writeCanonical(out *bytes.Buffer, v any) error {
	switch v := v.(type) {
	case map[string]any:
		names := make([]string, 0, len(v))
		for name := range v {
			names = append(names, name)
		}
		slices.Sort(names)
		out.WriteByte('{')
		for i, name := range names {
			if i > 0 {
				out.WriteByte(',')
			}
			writeString(out, name)
			out.WriteByte(':')
			if err := writeCanonical(out, v[name]); err != nil {
				return err
			}
		}
		out.WriteByte('}')
	case []any:
		out.WriteByte('[')
		for i, e := range v {
			if i > 0 {
				out.WriteByte(',')
			}
			if err := writeCanonical(out, e); err != nil {
				return err
			}
		}
		out.WriteByte(']')
	case json.Number:
		out.WriteString(canonicalNumber(string(v)))
	case string:
		writeString(out, canonicalString(v))
	case bool:
		out.WriteString(strconv.FormatBool(v))
	case nil:
		out.WriteString("null")
	default:
		return fmt.Errorf("idempotency: canonical JSON: unexpected %T", v)
	}
	return nil
}

func writeString(out *bytes.Buffer, s string) {
	b, _ := json.Marshal(s) // a string always marshals
	out.Write(b)
}

// canonicalString is s, or, when s is an RFC 3339 time, that instant in UTC.
func canonicalString(s string) string {
	// Cheap test first: most strings are not times.
	if len(s) < len("2006-01-02T15:04:05Z") || s[4] != '-' || s[0] < '0' || s[0] > '9' {
		return s
	}
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		return s
	}
	return t.UTC().Format(time.RFC3339Nano)
}

// canonicalNumber writes a JSON number exactly, as sign, significant digits
// and a power of ten: 12.50 -> 125e-1, 0.0 -> 0. The text is never
// converted to a float, so no digit is lost.
func canonicalNumber(n string) string {
	neg := strings.HasPrefix(n, "-")
	n = strings.TrimPrefix(n, "-")
	mantissa, exp := n, int64(0)
	if i := strings.IndexAny(n, "eE"); i >= 0 {
		e, err := strconv.ParseInt(strings.TrimPrefix(n[i+1:], "+"), 10, 32)
		if err != nil {
			return n // an exponent beyond int32: keep the text as it came
		}
		mantissa, exp = n[:i], e
	}
	digits := mantissa
	if i := strings.IndexByte(mantissa, '.'); i >= 0 {
		digits = mantissa[:i] + mantissa[i+1:]
		exp -= int64(len(mantissa) - i - 1)
	}
	digits = strings.TrimLeft(digits, "0")
	trimmed := strings.TrimRight(digits, "0")
	exp += int64(len(digits) - len(trimmed))
	if trimmed == "" {
		return "0"
	}
	sign := ""
	if neg {
		sign = "-"
	}
	if exp == 0 {
		return sign + trimmed
	}
	return sign + trimmed + "e" + strconv.FormatInt(exp, 10)
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
