// Package retrylog paces a loop that retries what its database failed, so
// that an outage logs one line per step of its backoff (not one per
// attempt), and names the server for a person to look at.
package retrylog

import (
	"errors"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
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

// Class says what kind of failure err is, for a person reading the line:
// a server that cannot be reached or is going away is an outage (WARN:
// it passes by itself, and the backoff waits it out); a server that
// answered and refused (a privilege, a missing table, a login) will
// refuse every retry until someone acts (ERROR, with the action). what is
// a short name for the log's error_class field, action the sentence.
func Class(err error) (level slog.Level, what, action string) {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return slog.LevelWarn, "unreachable", "the database cannot be reached; waiting for it"
	}
	switch code := pgErr.Code; {
	case code == "42501":
		return slog.LevelError, "permission_denied", "permission denied: grant the service's role what it needs on the table (docs/operating.md, least privilege)"
	case code == "3D000" || code == "3F000" || code == "42P01":
		return slog.LevelError, "missing", "the database, schema or table does not exist: run the migrations (app migrate)"
	case strings.HasPrefix(code, "28"):
		return slog.LevelError, "login_refused", "the login was refused: check the role and its password in the database URL"
	case strings.HasPrefix(code, "08"), strings.HasPrefix(code, "53"), strings.HasPrefix(code, "57"):
		return slog.LevelWarn, "unavailable", "the database is unavailable (" + code + "); waiting for it"
	}
	return slog.LevelError, "refused", "the database refused the read (" + pgErr.Code + ")"
}
