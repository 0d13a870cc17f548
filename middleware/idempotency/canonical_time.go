package idempotency

import (
	"bytes"
	"time"
)

// instant is an RFC 3339 time: seconds since the epoch, its fraction's
// significant digits, and whether it was written canonically already.
type instant struct {
	unix      int64
	frac      []byte
	canonical bool
}

// parseTime reads s as an RFC 3339 date-time exactly where
// time.Parse(time.RFC3339Nano, s) reads one, at the same instant, but
// keeping every digit of the fraction. The release before this scanner
// canonicalised every string time.Parse took for a time, and a claim it
// stored holds that form: a re-publication after an upgrade must still
// find it. So besides RFC 3339 proper (upper-case T and Z, no leap second)
// it takes what time.Parse also takes: a one-digit hour (T5:04:05), a
// comma before the fraction (05,5Z), and an offset of up to 24 hours and
// 60 minutes (+24:00, +23:60, -24:60). As before, a string shorter than
// 2006-01-02T15:04:05Z is no time (T5:04:05Z stayed a string).
func parseTime(s []byte) (instant, bool) {
	num := func(i, n int) int {
		v := 0
		for _, d := range s[i : i+n] {
			if d < '0' || d > '9' {
				return -1
			}
			v = v*10 + int(d-'0')
		}
		return v
	}
	if len(s) < 20 || s[4] != '-' || s[7] != '-' || s[10] != 'T' {
		return instant{}, false
	}
	// time.Parse reads the hour of "15" as one or two digits; the minute
	// and the second as two.
	hourDigits := 2
	if s[12] < '0' || s[12] > '9' {
		hourDigits = 1
	}
	i := 11 + hourDigits
	if s[i] != ':' || s[i+3] != ':' {
		return instant{}, false
	}
	year, month, day := num(0, 4), num(5, 2), num(8, 2)
	hour, minute, sec := num(11, hourDigits), num(i+1, 2), num(i+4, 2)
	if year < 0 || month < 1 || month > 12 || day < 1 || day > daysIn(month, year) ||
		hour < 0 || hour > 23 || minute < 0 || minute > 59 || sec < 0 || sec > 59 {
		return instant{}, false
	}
	t := instant{canonical: hourDigits == 2}
	rest := s[i+6:]
	if len(rest) > 0 && (rest[0] == '.' || rest[0] == ',') {
		end := digitsEnd(rest, 1)
		if end == 1 {
			return instant{}, false
		}
		if rest[0] == ',' || rest[end-1] == '0' {
			t.canonical = false
		}
		t.frac = bytes.TrimRight(rest[1:end], "0")
		rest = rest[end:]
	}
	offset := 0
	switch {
	case len(rest) == 1 && rest[0] == 'Z':
	case len(rest) == 6 && (rest[0] == '+' || rest[0] == '-') && rest[3] == ':':
		// time.Parse takes up to 24 hours and 60 minutes: "some people
		// do write offsets of 24 hours or 60 minutes".
		oh, om := num(len(s)-5, 2), num(len(s)-2, 2)
		if oh < 0 || oh > 24 || om < 0 || om > 60 {
			return instant{}, false
		}
		offset = (oh*60 + om) * 60
		if rest[0] == '-' {
			offset = -offset
		}
		t.canonical = false
	default:
		return instant{}, false
	}
	if !t.canonical { // a canonical time is written as it came
		t.unix = time.Date(year, time.Month(month), day, hour, minute, sec, 0, time.UTC).Unix() - int64(offset)
	}
	return t, true
}

func daysIn(month, year int) int {
	switch month {
	case 2:
		if year%4 == 0 && (year%100 != 0 || year%400 == 0) {
			return 29
		}
		return 28
	case 4, 6, 9, 11:
		return 30
	}
	return 31
}

var (
	firstYear = time.Date(0, 1, 1, 0, 0, 0, 0, time.UTC).Unix()
	afterYear = time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC).Unix()
)

// appendCanonical writes the instant in UTC, its fraction without trailing
// zeros: for a time of at most 9 fraction digits in the years 0000-9999,
// what the release before wrote (t.UTC().Format(time.RFC3339Nano)). One
// whose UTC year is outside 0000-9999 (an offset carried it there) is
// written with the smallest offset, in whole minutes, that brings it back:
// its form depends on the instant alone, and it is still a time
// parseTime reads, which no string that is not one can be written as.
// written is the time as it came, returned as it is when it is canonical.
func (t instant) appendCanonical(out, written []byte) []byte {
	if t.canonical {
		return append(out, written...)
	}
	offset := int64(0)
	switch {
	case t.unix < firstYear:
		offset = (firstYear - t.unix + 59) / 60
	case t.unix >= afterYear:
		offset = -((t.unix-afterYear)/60 + 1)
	}
	at := time.Unix(t.unix+offset*60, 0).UTC()
	out = at.AppendFormat(out, "2006-01-02T15:04:05")
	if len(t.frac) > 0 {
		out = append(out, '.')
		out = append(out, t.frac...)
	}
	if offset == 0 {
		return append(out, 'Z')
	}
	sign := byte('+')
	if offset < 0 {
		sign, offset = '-', -offset
	}
	// At most 25 hours (an offset of 24:60 took it out of range): 25:00
	// is written 24:60, the largest offset parseTime takes, so that the
	// form is a time and no string that is not one is written the same.
	h, m := offset/60, offset%60
	if h > 24 {
		h, m = 24, m+60
	}
	return append(out, sign, byte('0'+h/10), byte('0'+h%10), ':', byte('0'+m/10), byte('0'+m%10))
}
