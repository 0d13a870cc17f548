// Package inbox answers what the claim table knows of one event: which
// consumer groups claimed it, when, and with which payload hash; and it
// forgets one group's claim, so that the event's next delivery (a replay)
// is processed again. app inbox and the console both call it.
package inbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/pgdb"
	"github.com/once-dev/once/schema"
)

// ErrNoClaim: the group has no claim of the event (never processed, or
// past retention).
var ErrNoClaim = errors.New("inbox: no such claim")

// Claim is one consumer group's claim of an event.
type Claim struct {
	Group         string
	ProcessedAt   time.Time
	PayloadSHA256 []byte
}

// Lookup returns the claims of event id in db's claim table (tables names
// it; the zero Config is the default), by group; only group's when group is
// not empty.
func Lookup(ctx context.Context, db pgdb.DB, tables schema.Config, id uuid.UUID, group string) ([]Claim, error) {
	rows, err := db.Query(ctx, `SELECT consumer_group, processed_at, payload_sha256 FROM `+tables.Claims().Qualified+`
WHERE event_id = $1 AND ($2 = '' OR consumer_group = $2) ORDER BY consumer_group`, id, group)
	if err != nil {
		return nil, fmt.Errorf("inbox: claims of %s: %w", id, err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Claim, error) {
		var c Claim
		return c, r.Scan(&c.Group, &c.ProcessedAt, &c.PayloadSHA256)
	})
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
