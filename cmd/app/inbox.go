package main

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

type inboxCmd struct {
	Status inboxStatusCmd `cmd:"" help:"Was an event processed? By which consumer groups, when, and with which payload hash."`
	Forget inboxForgetCmd `cmd:"" help:"Delete a group's claim of an event, so that its next delivery (a replay) is processed again. Refused for billing without --force."`
}

type inboxStatusCmd struct {
	DB      dbSettings `embed:""`
	EventID string     `arg:"" name:"event-id" help:"The event's id (a UUIDv7)."`
	Group   string     `name:"group" help:"Only this consumer group (its full name, suffix included)."`
}

func parseEventID(s string) (uuid.UUID, error) {
	id, err := uuid.Parse(s)
	if err != nil {
		return uuid.Nil, fmt.Errorf("<event-id> %q: %w", s, err)
	}
	if id.Version() != 7 {
		return uuid.Nil, fmt.Errorf("<event-id> %s is a UUID version %d; event ids are UUIDv7", s, id.Version())
	}
	return id, nil
}

func (c *inboxStatusCmd) Validate() error {
	_, err := parseEventID(c.EventID)
	return err
}

func (c *inboxStatusCmd) Run(ctx context.Context, d deps) error {
	id, _ := parseEventID(c.EventID)
	pool, err := c.DB.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	rows, err := pool.Query(ctx, `SELECT consumer_group, processed_at, payload_sha256 FROM processed_event
WHERE event_id = $1 AND ($2 = '' OR consumer_group = $2) ORDER BY consumer_group`, id, c.Group)
	if err != nil {
		return fmt.Errorf("DATABASE_URL: %w", err)
	}
	type claim struct {
		group string
		at    time.Time
		sum   []byte
	}
	claims, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (claim, error) {
		var cl claim
		return cl, r.Scan(&cl.group, &cl.at, &cl.sum)
	})
	if err != nil {
		return fmt.Errorf("DATABASE_URL: %w", err)
	}
	sec, nsec := id.Time().UnixTime()
	fmt.Fprintf(d.stdout, "event %s (from %s)\n", id, time.Unix(sec, nsec).UTC().Format(time.RFC3339))
	if len(claims) == 0 {
		who := "any consumer group"
		if c.Group != "" {
			who = c.Group
		}
		fmt.Fprintf(d.stdout, "not processed by %s (or its claim is past retention)\n", who)
		return nil
	}
	w := tabwriter.NewWriter(d.stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "group\tprocessed at\tpayload sha256")
	for _, cl := range claims {
		fmt.Fprintf(w, "%s\t%s\t%s\n", cl.group, cl.at.UTC().Format(time.RFC3339Nano), hex.EncodeToString(cl.sum))
	}
	return w.Flush()
}

type inboxForgetCmd struct {
	DB      dbSettings `embed:""`
	EventID string     `arg:"" name:"event-id" help:"The event's id (a UUIDv7)."`
	Group   string     `name:"group" required:"" help:"The consumer group whose claim goes (its full name, suffix included)."`
	Force   bool       `name:"force" help:"Also for a billing group: its effect is money, and a replay after forgetting charges again unless the provider still knows the idempotency key."`
}

func (c *inboxForgetCmd) Validate() error {
	if _, err := parseEventID(c.EventID); err != nil {
		return err
	}
	if strings.HasPrefix(c.Group, "billing") && !c.Force {
		return fmt.Errorf("--group %s: forgetting a billing claim lets the event charge again; add --force if that is what you want", c.Group)
	}
	return nil
}

func (c *inboxForgetCmd) Run(ctx context.Context, d deps) error {
	id, _ := parseEventID(c.EventID)
	pool, err := c.DB.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	var sum []byte
	err = pool.QueryRow(ctx, `DELETE FROM processed_event WHERE event_id = $1 AND consumer_group = $2 RETURNING payload_sha256`, id, c.Group).Scan(&sum)
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("event %s has no claim by group %s (app inbox status %s lists its claims)", id, c.Group, id)
	}
	if err != nil {
		return fmt.Errorf("DATABASE_URL: %w", err)
	}
	d.log.Warn("FORGOT A CLAIM: the next delivery of this event will be processed again by its group",
		"event_id", id, "consumer_group", c.Group, "payload_sha256", hex.EncodeToString(sum), "forced", c.Force)
	fmt.Fprintf(d.stdout, "forgot the claim of %s by %s; its next delivery is processed again\n", id, c.Group)
	return nil
}
