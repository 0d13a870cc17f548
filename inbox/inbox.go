// Package inbox answers what the claim table knows of one event: which
// consumer groups claimed it, when, and with which payload hash; and it
// forgets one group's claim, so that the event's next delivery (a replay)
// is processed again. An event whose id a topic derives from its
// producer's own id (idempotency.DeriveEventID) is found by that id too,
// with a scan the caller bounds. app inbox and the console both call it.
package inbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/pgdb"
	"github.com/once-dev/once/schema"
)

// ErrNoClaim: the group has no claim of the event (never processed, or
// past retention).
var ErrNoClaim = errors.New("inbox: no such claim")

// Claim is one consumer group's claim of an event.
type Claim struct {
	EventID       uuid.UUID
	Group         string
	ProcessedAt   time.Time
	PayloadSHA256 []byte
}

// Lookup returns the claims of event id in db's claim table (tables names
// it; the zero Config is the default), by group; only group's when group is
// not empty.
func Lookup(ctx context.Context, db pgdb.DB, tables schema.Config, id uuid.UUID, group string) ([]Claim, error) {
	rows, err := db.Query(ctx, `SELECT event_id, consumer_group, processed_at, payload_sha256 FROM `+tables.Claims().Qualified+`
WHERE event_id = $1 AND ($2 = '' OR consumer_group = $2) ORDER BY consumer_group`, id, group)
	if err != nil {
		return nil, fmt.Errorf("inbox: claims of %s: %w", id, err)
	}
	return pgx.CollectRows(rows, scanClaim)
}

func scanClaim(r pgx.CollectableRow) (Claim, error) {
	var c Claim
	return c, r.Scan(&c.EventID, &c.Group, &c.ProcessedAt, &c.PayloadSHA256)
}

// DefaultScanTimeout bounds a lookup by a producer's id ([LookupForeign]).
const DefaultScanTimeout = 10 * time.Second

// ErrScanTimeout: a lookup by a producer's id scanned the claim table for
// longer than its ScanTimeout and was stopped. The event's own id (a
// UUIDv7, [Lookup]) finds its claims through the key at once.
var ErrScanTimeout = errors.New("inbox: the scan for the producer's id ran out of time")

// Foreign names the events a producer sent under its own id ID (a UUIDv4,
// a number), whose event ids a topic derives with
// idempotency.DeriveEventID under Namespace (the topic's IDNamespace). An
// ID that is a UUID is looked up as given and in its canonical form
// (lower case, no braces), whichever the topic's Decode derived from.
type Foreign struct {
	Namespace, ID string
	// ScanTimeout bounds the scan on the server (its statement_timeout,
	// for its transaction only). Default: [DefaultScanTimeout].
	ScanTimeout time.Duration
}

// foreignSQL finds the claims whose event ids end with the bits a foreign id
// derives (the last 21 characters of the text form, see
// idempotency.DeriveEventID); their first bits are a time the caller does
// not know, so no index serves it: a scan of every partition, which the
// statement_timeout set before it bounds.
const foreignSQL = `SELECT event_id, consumer_group, processed_at, payload_sha256 FROM %s
WHERE right(event_id::text, 21) = ANY($1) AND ($2 = '' OR consumer_group = $2) ORDER BY event_id, consumer_group`

// LookupForeign returns the claims of the events f names, by event id and
// group; only group's when group is not empty. An event re-sent with
// another time is another event, so there may be several. It scans the
// claim table, bounded by f.ScanTimeout: [ErrScanTimeout] when that ran
// out. It sets the bound per transaction, so it works behind a
// transaction pooler (PgBouncer).
func LookupForeign(ctx context.Context, db pgdb.DB, tables schema.Config, f Foreign, group string) ([]Claim, error) {
	if f.ScanTimeout <= 0 {
		f.ScanTimeout = DefaultScanTimeout
	}
	// The last 21 characters of the text form depend on the namespace and
	// the id alone: those of any time's derived id.
	var suffixes []string
	for _, id := range foreignForms(f.ID) {
		suffixes = append(suffixes, idempotency.DeriveEventID(f.Namespace, id, time.UnixMilli(0)).String()[15:])
	}
	// The client's own bound, a little later than the server's, for a
	// database that went silent and answers nothing.
	ctx, cancel := context.WithTimeout(ctx, f.ScanTimeout+5*time.Second)
	defer cancel()
	var claims []Claim
	err := pgx.BeginTxFunc(ctx, db, pgx.TxOptions{AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT set_config('statement_timeout', $1, true)`, fmt.Sprint(max(f.ScanTimeout.Milliseconds(), 1))); err != nil {
			return err
		}
		rows, err := tx.Query(ctx, fmt.Sprintf(foreignSQL, tables.Claims().Qualified), suffixes, group)
		if err != nil {
			return err
		}
		claims, err = pgx.CollectRows(rows, scanClaim)
		return err
	})
	if pgErr := (*pgconn.PgError)(nil); errors.As(err, &pgErr) && pgErr.Code == "57014" { // query_canceled: the statement_timeout
		return nil, fmt.Errorf("%w (%s) looking for %q under %q", ErrScanTimeout, f.ScanTimeout, f.ID, f.Namespace)
	}
	if err != nil {
		return nil, fmt.Errorf("inbox: claims of %q under %q: %w", f.ID, f.Namespace, err)
	}
	return claims, nil
}

// Forget deletes group's claim of event id and returns the payload hash it
// had, or [ErrNoClaim].
func Forget(ctx context.Context, db pgdb.DB, tables schema.Config, id uuid.UUID, group string) ([]byte, error) {
	var sum []byte
	err := db.QueryRow(ctx, `DELETE FROM `+tables.Claims().Qualified+` WHERE event_id = $1 AND consumer_group = $2 RETURNING payload_sha256`, id, group).Scan(&sum)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, ErrNoClaim
	}
	if err != nil {
		return nil, fmt.Errorf("inbox: forget the claim of %s by %s: %w", id, group, err)
	}
	return sum, nil
}

// foreignForms are the spellings of a producer's id to look up: as given,
// and a UUID's canonical form too when that differs.
func foreignForms(id string) []string {
	if u, err := uuid.Parse(id); err == nil && u.String() != id {
		return []string{id, u.String()}
	}
	return []string{id}
}
