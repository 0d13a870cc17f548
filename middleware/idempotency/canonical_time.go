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

// parseTime reads s as an RFC 3339 date-time, as time.Parse reads
// time.RFC3339Nano's form (upper-case T and Z, an offset below 24 hours,
// no leap second), but keeping every digit of the fraction.
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
	if len(s) < 20 || s[4] != '-' || s[7] != '-' || s[10] != 'T' || s[13] != ':' || s[16] != ':' {
		return instant{}, false
	}
	year, month, day := num(0, 4), num(5, 2), num(8, 2)
	hour, minute, sec := num(11, 2), num(14, 2), num(17, 2)
	if year < 0 || month < 1 || month > 12 || day < 1 || day > daysIn(month, year) ||
		hour < 0 || hour > 23 || minute < 0 || minute > 59 || sec < 0 || sec > 59 {
		return instant{}, false
	}
	var t instant
	rest := s[19:]
	fracEndsInZero := false
	if rest[0] == '.' {
		end := digitsEnd(rest, 1)
		if end == 1 {
			return instant{}, false
		}
		fracEndsInZero = rest[end-1] == '0'
		t.frac = bytes.TrimRight(rest[1:end], "0")
		rest = rest[end:]
	}
	offset := 0
	switch {
	case len(rest) == 1 && rest[0] == 'Z':
		t.canonical = !fracEndsInZero
	case len(rest) == 6 && (rest[0] == '+' || rest[0] == '-') && rest[3] == ':':
		oh, om := num(len(s)-5, 2), num(len(s)-2, 2)
		if oh < 0 || oh > 23 || om < 0 || om > 59 {
			return instant{}, false
		}
		offset = (oh*60 + om) * 60
		if rest[0] == '-' {
			offset = -offset
		}
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
// zeros. One whose UTC year is outside 0000-9999 (an offset carried it
// there) is written with the smallest offset, in whole minutes, that
// brings it back: its form depends on the instant alone, and it is still
// an RFC 3339 time, which no string that is not one can be written as.
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
	return append(out, sign, byte('0'+offset/600), byte('0'+offset/60%10), ':', byte('0'+offset%60/10), byte('0'+offset%10))
}
