package idempotency_test

import (
	"encoding/json"
	"regexp"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/once-dev/once/middleware/idempotency"
)

// previousCanonicalString is how the release before issue 28 wrote a string
// value in canonical form (CanonicalJSON's canonicalString and writeString
// at commit 246e57f): an RFC 3339 time, as time.Parse(time.RFC3339Nano)
// reads one, as its instant in UTC; any other string as encoding/json
// writes it. Claims stored by that release hold the SHA-256 of this form.
func previousCanonicalString(s string) string {
	if len(s) >= len("2006-01-02T15:04:05Z") && s[4] == '-' && s[0] >= '0' && s[0] <= '9' {
		if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
			s = t.UTC().Format(time.RFC3339Nano)
		}
	}
	b, _ := json.Marshal(s)
	return string(b)
}

// previousMerged reports whether the previous release wrote s as it wrote
// some other value (the collisions issue 28 removed, which CanonicalJSON
// now writes apart): a time with more than 9 fraction digits (truncated),
// or one whose UTC year is outside 0000-9999 (written as a string such as
// "-0001-12-31T23:30:00Z", which is also a string that is no time).
func previousMerged(s string) bool {
	if len(s) < len("2006-01-02T15:04:05Z") || s[4] != '-' || s[0] < '0' || s[0] > '9' {
		return false
	}
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		return false
	}
	if y := t.UTC().Year(); y < 0 || y > 9999 {
		return true
	}
	return len(fractionOf(s)) > 9
}

// fractionOf is the fraction's digits of a time time.Parse accepted: the
// digits after its only '.' or ','.
var fractionRE = regexp.MustCompile(`[.,]([0-9]+)`)

func fractionOf(s string) string {
	if m := fractionRE.FindStringSubmatch(s); m != nil {
		return m[1]
	}
	return ""
}

// sameAsBefore checks that CanonicalJSON writes the string s as the
// previous release did, wherever that release did not merge two values.
func sameAsBefore(t *testing.T, s string) {
	t.Helper()
	if !utf8.ValidString(s) || previousMerged(s) {
		return
	}
	in, _ := json.Marshal(s)
	got, err := idempotency.CanonicalJSON(in)
	if err != nil {
		t.Fatalf("%s: %v", in, err)
	}
	if want := previousCanonicalString(s); string(got) != want {
		t.Errorf("%s -> %s; the previous release wrote %s (a claim it stored would now be a mismatch)", in, got, want)
	}
}

// Review finding of issue 28: the scanner's own time parser took fewer
// forms than time.Parse(time.RFC3339Nano) had (a comma before the
// fraction, a one-digit hour, offsets of +24:00 or +23:60), so such a time
// re-published after an upgrade was a mismatch against the claim the
// previous release stored. Every string of a corpus of times, in every
// form time.Parse accepted and many it did not, is written as it was,
// except where the previous release merged two values.
func TestCanonicalTimesAreWrittenAsThePreviousReleaseWroteThem(t *testing.T) {
	corpus := []string{
		"2006-01-02T15:04:05,5Z", "2006-01-02T5:04:05.1Z", "2006-01-02T15:04:05.1+24:00", "2006-01-02T15:04:05.1+23:60",
		"2006-01-02T15:04:05.1-00:00", "2006-01-02T15:04:05.123456789+02:00", "2006-01-02T15:04:05Z", "2006-02-29T15:04:05Z",
		"2006-01-02t15:04:05Z", "2006-01-02T15:04:05z", "2006-01-02T15:04:05+0100", "2006-01-02T15:04:05.Z",
		"2006-01-02T15:04:05+01:00:00", "2006-01-02T24:00:00Z", "2006-01-02T23:59:60Z", "2006-1-02T15:04:05.12Z",
		"2006-01-2T15:04:05.12Z", "2006-01-02T15:4:05.123Z", "2006-01-02T15:04:5.1234Z", "2006-01-02T15:04:05.1+1:00",
		"2006-01-02T15:04:05 Z", "2006-01-02 15:04:05Z", "2006-01-02T15:04:05.000Z", "2006-01-02T5:04:05Z",
		"2006-01-02T5:04:05,0Z", "2006-01-02T15:04:05,Z", "2006-01-02T15:04:05..5Z", "2006-01-02T15:04:05.5.5Z",
		"+006-01-02T15:04:05Z", "2006-01-02T15:04:05-24:60", "9999-12-31T23:59:59-24:60", "0000-01-01T00:00:00+24:60",
		"2006-01-02T005:04:05Z", "2006-01-02T15:04:05+24:61", "2006-01-02T15:04:05+25:00", "2006-01-02T15:04:05±01:00",
		"2006-01-02T15:04:05Z ", " 2006-01-02T15:04:05Z", "2006-01-02T15:04:05ZZ", "2006-01-02T15:04:05.5+01:00Z",
	}
	// And every combination of these parts.
	for _, date := range []string{"2006-01-02", "2004-02-29", "2006-02-29", "2006-12-31", "0000-01-01", "9999-12-31", "2006-00-10", "2006-13-01", "2006-04-31"} {
		for _, clock := range []string{"15:04:05", "5:04:05", "05:04:05", "0:00:00", "23:59:59", "24:00:00", "23:60:00", "23:00:60", "1:2:03"} {
			for _, frac := range []string{"", ".5", ",5", ".500", ",500", ".000", ",0", ".123456789", ",123456789", ".1234567890", "."} {
				for _, zone := range []string{"Z", "+00:00", "-00:00", "+01:30", "-01:30", "+24:00", "-24:00", "+23:60", "+24:60", "-24:60", "+24:61", "+25:00", "+00:61", "z", "+0100", "+1:00", ""} {
					corpus = append(corpus, date+"T"+clock+frac+zone)
				}
			}
		}
	}
	for _, s := range corpus {
		sameAsBefore(t, s)
	}
}

// FuzzCanonicalTimesAsBefore explores the same check beyond the corpus:
// go test -fuzz FuzzCanonicalTimesAsBefore ./middleware/idempotency.
func FuzzCanonicalTimesAsBefore(f *testing.F) {
	for _, s := range []string{"2006-01-02T15:04:05,5Z", "2006-01-02T5:04:05.1Z", "2006-01-02T15:04:05.1+24:00",
		"2006-01-02T15:04:05.1+23:60", "2026-12-02T17:08:21.123456+02:00", "not a time", strings.Repeat("9", 25)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) { sameAsBefore(t, s) })
}
