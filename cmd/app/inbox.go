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
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/schema"
)

type inboxCmd struct {
	Status inboxStatusCmd `cmd:"" help:"Was an event processed? By which consumer groups, when, and with which payload hash."`
	Forget inboxForgetCmd `cmd:"" help:"Delete a group's claim of an event, so that its next delivery (a replay) is processed again. Refused for billing without --force."`
}

type inboxStatusCmd struct {
	DB             dbSettings        `embed:""`
	GroupDatabases map[string]string `name:"group-database" env:"ONCE_GROUP_DATABASES" mapsep:";" placeholder:"GROUP=URL;..." help:"The databases of groups that have one of their own, as serve takes them: their claims are there, and are listed too."`
	EventID        string            `arg:"" name:"event-id" help:"The event's id (a UUIDv7); with --id-namespace, the producer's own id."`
	Group          string            `name:"group" help:"Only this consumer group (its full name, suffix included)."`
	Foreign        foreignFlags      `embed:""`
}

// foreignFlags let status and forget take a producer's own id, for a topic
// that derives its event ids from it (Topic.IDNamespace).
type foreignFlags struct {
	IDNamespace string        `name:"id-namespace" placeholder:"NAMESPACE" help:"The namespace the topic derives its event ids under (its Topic.IDNamespace, the first argument of DeriveEventID): <event-id> is then the producer's own id, found in every event derived from it. A scan of the claim table, bounded by --scan-timeout."`
	ScanTimeout time.Duration `name:"scan-timeout" default:"10s" help:"Bound on the scan for a producer's id (--id-namespace), on the server."`
}

func (f foreignFlags) validate() error {
	if f.IDNamespace != "" && f.ScanTimeout <= 0 {
		return fmt.Errorf("--scan-timeout %s: want a positive bound on the scan", f.ScanTimeout)
	}
	return nil
}

// lookup finds the claims of the event the argument names in db: by its id,
// or by the producer's id with --id-namespace.
func (f foreignFlags) lookup(ctx context.Context, db dbSettings, arg, group string) ([]inbox.Claim, error) {
	pool, err := db.connect(ctx)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	var claims []inbox.Claim
	if f.IDNamespace != "" {
		claims, err = inbox.LookupForeign(ctx, pool, schema.Config{}, inbox.Foreign{Namespace: f.IDNamespace, ID: arg, ScanTimeout: f.ScanTimeout}, group)
		if errors.Is(err, inbox.ErrScanTimeout) {
			err = fmt.Errorf("%w: give the event's own id (a UUIDv7, found at once through the key), or a longer --scan-timeout", err)
		}
	} else {
		id, _ := parseEventID(arg)
		claims, err = inbox.Lookup(ctx, pool, schema.Config{}, id, group)
	}
	if err != nil {
		return nil, fmt.Errorf("%s: %w", db.setting(), err)
	}
	return claims, nil
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
		return uuid.Nil, fmt.Errorf("<event-id> %s is a UUID version %d; event ids are UUIDv7 "+
			"(a producer's own id, of a topic that derives its event ids from it, needs --id-namespace)", s, id.Version())
	}
	return id, nil
}

func (c *inboxStatusCmd) Validate() error {
	if c.Foreign.IDNamespace != "" {
		return c.Foreign.validate()
	}
	_, err := parseEventID(c.EventID)
	return err
}

func (c *inboxStatusCmd) Run(ctx context.Context, d deps) error {
	var claims []inbox.Claim
	for _, db := range claimDatabases(c.DB, c.GroupDatabases, c.Group) {
		found, err := c.Foreign.lookup(ctx, db, c.EventID, c.Group)
		if err != nil {
			return err
		}
		claims = append(claims, found...)
	}
	foreign := c.Foreign.IDNamespace != ""
	if foreign {
		fmt.Fprintf(d.stdout, "events derived from the producer's id %s under %s\n", c.EventID, c.Foreign.IDNamespace)
	} else {
		id, _ := parseEventID(c.EventID)
		fmt.Fprintf(d.stdout, "event %s (from %s)\n", id, idempotency.IDTime(id).UTC().Format(time.RFC3339))
	}
	if len(claims) == 0 {
		who := "any consumer group"
		if c.Group != "" {
			who = c.Group
		}
		fmt.Fprintf(d.stdout, "not processed by %s (or its claim is past retention)\n", who)
		return nil
	}
	w := tabwriter.NewWriter(d.stdout, 0, 0, 2, ' ', 0)
	if foreign {
		fmt.Fprint(w, "event id\tevent time\t")
	}
	fmt.Fprintln(w, "group\tprocessed at\tpayload sha256")
	for _, cl := range claims {
		if foreign {
			fmt.Fprintf(w, "%s\t%s\t", cl.EventID, idempotency.IDTime(cl.EventID).UTC().Format(time.RFC3339Nano))
		}
		fmt.Fprintf(w, "%s\t%s\t%s\n", cl.Group, cl.ProcessedAt.UTC().Format(time.RFC3339Nano), hex.EncodeToString(cl.PayloadSHA256))
	}
	return w.Flush()
}

type inboxForgetCmd struct {
	DB             dbSettings        `embed:""`
	GroupDatabases map[string]string `name:"group-database" env:"ONCE_GROUP_DATABASES" mapsep:";" placeholder:"GROUP=URL;..." help:"The databases of groups that have one of their own, as serve takes them: a group's claim is forgotten in its own."`
	EventID        string            `arg:"" name:"event-id" help:"The event's id (a UUIDv7); with --id-namespace, the producer's own id (refused when it names more than one event of the group: give that event's id)."`
	Group          string            `name:"group" required:"" help:"The consumer group whose claim goes (its full name, suffix included)."`
	Force          bool              `name:"force" help:"Also for a group whose name starts with billing (the reference service's money): a replay after forgetting charges again unless the provider still knows the idempotency key."`
	Foreign        foreignFlags      `embed:""`
}

func (c *inboxForgetCmd) Validate() error {
	if c.Foreign.IDNamespace != "" {
		if err := c.Foreign.validate(); err != nil {
			return err
		}
	} else if _, err := parseEventID(c.EventID); err != nil {
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
	if c.Foreign.IDNamespace != "" {
		// The producer's id stands for an event only when it names one.
		claims, err := c.Foreign.lookup(ctx, db, c.EventID, c.Group)
		if err != nil {
			return err
		}
		switch len(claims) {
		case 0:
			return fmt.Errorf("no event derived from %s under %s has a claim by group %s in %s", c.EventID, c.Foreign.IDNamespace, c.Group, db.setting())
		case 1:
			id = claims[0].EventID
		default:
			var ids []string
			for _, cl := range claims {
				ids = append(ids, cl.EventID.String())
			}
			return fmt.Errorf("%d events derived from %s under %s have a claim by group %s (%s): give the one to forget by its event id",
				len(claims), c.EventID, c.Foreign.IDNamespace, c.Group, strings.Join(ids, ", "))
		}
	}
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
