package main

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"

	"github.com/once-dev/once/inbox"
	"github.com/once-dev/once/schema"
)

type inboxCmd struct {
	Status inboxStatusCmd `cmd:"" help:"Was an event processed? By which consumer groups, when, and with which payload hash."`
	Forget inboxForgetCmd `cmd:"" help:"Delete a group's claim of an event, so that its next delivery (a replay) is processed again. Refused for billing without --force."`
}

type inboxStatusCmd struct {
	DB             dbSettings        `embed:""`
	GroupDatabases map[string]string `name:"group-database" env:"ONCE_GROUP_DATABASES" mapsep:";" placeholder:"GROUP=URL;..." help:"The databases of groups that have one of their own, as serve takes them: their claims are there, and are listed too."`
	EventID        string            `arg:"" name:"event-id" help:"The event's id (a UUIDv7)."`
	Group          string            `name:"group" help:"Only this consumer group (its full name, suffix included)."`
}

// groupDatabase is the URL of group's own database (its name, or its name
// with the suffix serve was given), or "" for the main one.
func groupDatabase(urls map[string]string, group string) string {
	for name, url := range urls {
		if group == name || strings.HasPrefix(group, name) {
			return url
		}
	}
	return ""
}

// claimDatabases are the databases an event's claims may be in: the main one
// first, then each group's own, each once.
func claimDatabases(main dbSettings, urls map[string]string, group string) []dbSettings {
	if group != "" {
		if url := groupDatabase(urls, group); url != "" {
			return []dbSettings{main.forGroup(url)}
		}
		return []dbSettings{main}
	}
	out := []dbSettings{main}
	seen := map[string]bool{main.DatabaseURL: true}
	for _, name := range slices.Sorted(maps.Keys(urls)) {
		if url := urls[name]; !seen[url] {
			seen[url] = true
			out = append(out, main.forGroup(url))
		}
	}
	return out
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
	var claims []inbox.Claim
	for _, db := range claimDatabases(c.DB, c.GroupDatabases, c.Group) {
		pool, err := db.connect(ctx)
		if err != nil {
			return err
		}
		found, err := inbox.Lookup(ctx, pool, schema.Config{}, id, c.Group)
		pool.Close()
		if err != nil {
			return fmt.Errorf("%s: %w", db.setting(), err)
		}
		claims = append(claims, found...)
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
		fmt.Fprintf(w, "%s\t%s\t%s\n", cl.Group, cl.ProcessedAt.UTC().Format(time.RFC3339Nano), hex.EncodeToString(cl.PayloadSHA256))
	}
	return w.Flush()
}

type inboxForgetCmd struct {
	DB             dbSettings        `embed:""`
	GroupDatabases map[string]string `name:"group-database" env:"ONCE_GROUP_DATABASES" mapsep:";" placeholder:"GROUP=URL;..." help:"The databases of groups that have one of their own, as serve takes them: a group's claim is forgotten in its own."`
	EventID        string            `arg:"" name:"event-id" help:"The event's id (a UUIDv7)."`
	Group          string            `name:"group" required:"" help:"The consumer group whose claim goes (its full name, suffix included)."`
	Force          bool              `name:"force" help:"Also for a billing group: its effect is money, and a replay after forgetting charges again unless the provider still knows the idempotency key."`
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
	db := claimDatabases(c.DB, c.GroupDatabases, c.Group)[0]
	pool, err := db.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	sum, err := inbox.Forget(ctx, pool, schema.Config{}, id, c.Group)
	if errors.Is(err, inbox.ErrNoClaim) {
		return fmt.Errorf("event %s has no claim by group %s in %s (app inbox status %s lists its claims)", id, c.Group, db.setting(), id)
	}
	if err != nil {
		return fmt.Errorf("%s: %w", db.setting(), err)
	}
	d.log.Warn("FORGOT A CLAIM: the next delivery of this event will be processed again by its group",
		"event_id", id, "consumer_group", c.Group, "payload_sha256", hex.EncodeToString(sum), "forced", c.Force)
	fmt.Fprintf(d.stdout, "forgot the claim of %s by %s; its next delivery is processed again\n", id, c.Group)
	return nil
}
