// Package retrylog paces a loop that retries what its database failed, so
// that an outage logs one line per step of its backoff (not one per
// attempt), and names the server for a person to look at.
package retrylog

import (
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Steps is a backoff that doubles from First to Last while attempts fail
// and is back to nothing after one that worked. The zero value is not
// usable: set First and Last. Not safe for concurrent use.
type Steps struct {
	First, Last time.Duration
	wait        time.Duration
	since       time.Time
}

// Failed records a failed attempt and returns how long to wait before the
// next, and since when attempts fail.
func (s *Steps) Failed() (wait time.Duration, since time.Time) {
	if s.wait == 0 {
		s.wait, s.since = s.First, time.Now()
	} else {
		s.wait = min(2*s.wait, s.Last)
	}
	return s.wait, s.since
}

// Worked records an attempt that worked: recovered reports that attempts
// had failed before it, for failingFor.
func (s *Steps) Worked() (recovered bool, failingFor time.Duration) {
	if s.wait == 0 {
		return false, 0
	}
	s.wait = 0
	return true, time.Since(s.since).Round(time.Millisecond)
}

// Host names db's server for a log line (never its URL, which may hold a
// password): its host, or "" when db is not a pool that says.
func Host(db any) string {
	if c, ok := db.(interface{ Config() *pgxpool.Config }); ok {
		return c.Config().ConnConfig.Host
	}
	return ""
}
