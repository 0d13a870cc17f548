// Package reference assembles the reference service on the library's front
// door (package once): billing and analytics on the order topics, billing's
// payment events through the consumer outbox. app serve and app demo both
// run it; they differ only in where the settings come from.
package reference

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once"
	"github.com/once-dev/once/handlers/analytics"
	"github.com/once-dev/once/handlers/billing"
	"github.com/once-dev/once/migrations"
	"github.com/once-dev/once/orderevents"
	"github.com/once-dev/once/pgdb"
)

// The consumer groups the reference service can run, by their base names.
const (
	Billing   = "billing"
	Analytics = "analytics"
)

// Groups are the groups it can run.
var Groups = []string{Analytics, Billing}

// Config is the reference service: the library's settings and what its
// groups need.
type Config struct {
	// Service holds the library's settings: brokers, databases (by full
	// group names, suffix included), timeouts, hooks. Its Topics and
	// Outgoing are filled here.
	Service once.Config
	// Groups to run, by base name. Default: both.
	Groups []string
	// GroupSuffix is appended to every group's name (isolated copies side
	// by side, as the tests run them).
	GroupSuffix string
	// The topics, full names.
	ConfirmedTopic, CancelledTopic, PaymentTopic string
	// Currency billing charges in (the guide's events carry none).
	Currency string
	// Payments is billing's payment provider client.
	Payments billing.Provider
	// Concurrency runs the groups whose handlers wait or follow (billing
	// on confirmations, whose handler calls the payment provider, and on
	// cancellations; analytics on payment events) in key order, up to this
	// many messages of each at once (once.OrderKey): each order's events
	// in their order, different orders at once. 0: one message of a
	// partition at a time.
	Concurrency int
	// AnalyticsBatch turns on analytics' group commit on the confirmations:
	// up to this many events per transaction. 0: one per transaction.
	AnalyticsBatch int
	// TooOld is each group's policy for events past the dedup horizon, by
	// base name. Default: reject.
	TooOld map[string]once.TooOldPolicy
}

// keyOrdered is g in key order, up to n messages at once; g as it is for
// n 0. Every event of the reference service is keyed by its order's id.
func keyOrdered[E once.Event](g once.Group[E], n int) once.Group[E] {
	if n > 0 {
		g.Order, g.Concurrency = once.OrderKey, n
	}
	return g
}

// Group is a group's full name.
func (c Config) Group(base string) string { return base + c.GroupSuffix }

// Service is the reference service on the front door, and the small pool
// billing commits its charge intents from.
type Service struct {
	*once.Service
	intents *pgxpool.Pool
}

// New builds the reference service's topics and handlers and the service.
func New(ctx context.Context, cfg Config) (*Service, error) {
	if len(cfg.Groups) == 0 {
		cfg.Groups = Groups
	}
	for _, g := range cfg.Groups {
		if !slices.Contains(Groups, g) {
			return nil, fmt.Errorf("reference: unknown group %q: want %v", g, Groups)
		}
	}
	oc := cfg.Service
	confirmed := once.Topic[orderevents.Confirmed]{Name: cfg.ConfirmedTopic, Decode: orderevents.DecodeConfirmed}
	cancelled := once.Topic[orderevents.Cancelled]{Name: cfg.CancelledTopic, Decode: orderevents.DecodeCancelled}
	payments := once.Topic[orderevents.Payment]{Name: cfg.PaymentTopic, Decode: orderevents.DecodePayment}
	s := &Service{}
	if slices.Contains(cfg.Groups, Analytics) {
		h := analytics.Handler{}
		g := once.Group[orderevents.Confirmed]{Name: cfg.Group(Analytics), Handle: h.OnConfirmed, TooOld: cfg.TooOld[Analytics]}
		if cfg.AnalyticsBatch > 0 {
			g.Handle, g.HandleBatch, g.Batch = nil, h.OnConfirmedBatch, once.Batch{Size: cfg.AnalyticsBatch}
		}
		confirmed.Groups = append(confirmed.Groups, g)
		payments.Groups = append(payments.Groups, keyOrdered(once.Group[orderevents.Payment]{Name: cfg.Group(Analytics), Handle: h.OnPayment, TooOld: cfg.TooOld[Analytics]}, cfg.Concurrency))
	}
	var billingDB *pgxpool.Pool
	if slices.Contains(cfg.Groups, Billing) {
		// Charge intents are committed outside the claim's transaction:
		// from a small pool of their own, so that an attempt holding a
		// claim's connection never waits for another of the same pool.
		intents, err := intentsPool(ctx, oc, cfg.Group(Billing))
		if err != nil {
			return nil, err
		}
		s.intents = intents
		h := billing.Handler{Payments: cfg.Payments, Currency: cfg.Currency, DB: intents, Horizon: billingHorizon(oc, cfg.TooOld[Billing]),
			Publish: func(ctx context.Context, tx pgx.Tx, ev orderevents.Payment) error {
				return once.PublishTo(ctx, tx, cfg.PaymentTopic, ev)
			}}
		if err := h.Validate(); err != nil {
			intents.Close()
			return nil, err
		}
		confirmed.Groups = append(confirmed.Groups, keyOrdered(once.Group[orderevents.Confirmed]{Name: cfg.Group(Billing), Handle: h.OnConfirmed, TooOld: cfg.TooOld[Billing]}, cfg.Concurrency))
		cancelled.Groups = append(cancelled.Groups, keyOrdered(once.Group[orderevents.Cancelled]{Name: cfg.Group(Billing), Handle: h.OnCancelled, TooOld: cfg.TooOld[Billing]}, cfg.Concurrency))
		oc.Outgoing = append(oc.Outgoing, once.Outgoing[orderevents.Payment]{Name: cfg.PaymentTopic,
			Key:    func(p orderevents.Payment) string { return strconv.FormatInt(p.OrderID(), 10) },
			Encode: func(p orderevents.Payment) ([]byte, error) { return p.MarshalJSON() }})
		retain := oc.Retention
		if retain == 0 {
			retain = once.DefaultRetention
		}
		onMaintenance := oc.OnMaintenance
		oc.OnMaintenance = func(ctx context.Context, db pgdb.DB) error {
			var err error
			if onMaintenance != nil {
				err = onMaintenance(ctx, db)
			}
			if billingDB == nil || db != pgdb.DB(billingDB) {
				return err
			}
			// Intents whose payment is recorded serve no more purpose.
			_, perr := billing.PruneIntents(ctx, db, retain)
			return errors.Join(err, perr)
		}
	}
	oc.Needs = cfg.needs(oc.Needs)
	if len(confirmed.Groups) > 0 {
		oc.Topics = append(oc.Topics, confirmed)
	}
	if len(cancelled.Groups) > 0 {
		oc.Topics = append(oc.Topics, cancelled)
	}
	if len(payments.Groups) > 0 {
		oc.Topics = append(oc.Topics, payments)
	}
	svc, err := once.New(ctx, oc)
	if err != nil {
		if s.intents != nil {
			s.intents.Close()
		}
		return nil, err
	}
	s.Service = svc
	if slices.Contains(cfg.Groups, Billing) {
		billingDB = svc.DB(cfg.Group(Billing))
	}
	return s, nil
}

// needs are what the groups' handlers need, beside what the library
// needs: the migrations of package migrations applied, and each group's
// privileges on its own tables (its statements' DML; an INSERT ... ON
// CONFLICT DO UPDATE takes UPDATE too).
func (c Config) needs(n once.Needs) once.Needs {
	if n.Migrations == nil {
		n.Migrations, n.MigrateCommand = migrations.FS, "app migrate"
	}
	read, write, upsert := []string{"SELECT", "INSERT"}, []string{"SELECT", "INSERT", "UPDATE", "DELETE"}, []string{"SELECT", "INSERT", "UPDATE"}
	groups := map[string][]once.Grant{}
	for g, grants := range n.Groups {
		groups[g] = grants
	}
	if slices.Contains(c.Groups, Analytics) {
		groups[c.Group(Analytics)] = append(groups[c.Group(Analytics)],
			once.Grant{Table: "analytics.customer_daily_revenue", Privileges: upsert},
			once.Grant{Table: "analytics.customer_daily_payments", Privileges: upsert})
	}
	if slices.Contains(c.Groups, Billing) {
		groups[c.Group(Billing)] = append(groups[c.Group(Billing)],
			once.Grant{Table: "billing.payments", Privileges: read},
			once.Grant{Table: "billing.charge_intents", Privileges: write},
			once.Grant{Table: "billing.cancellations", Privileges: read},
			once.Grant{Table: "billing.refunds", Privileges: read})
	}
	n.Groups = groups
	return n
}

// Close closes the service and billing's pool.
func (s *Service) Close() {
	s.Service.Close()
	if s.intents != nil {
		s.intents.Close()
	}
}

// intentsPool opens a small pool of the billing group's database.
func intentsPool(ctx context.Context, oc once.Config, group string) (*pgxpool.Pool, error) {
	var cfg *pgxpool.Config
	switch url, own := oc.GroupDatabases[group]; {
	case own:
		c, err := pgxpool.ParseConfig(url)
		if err != nil {
			return nil, fmt.Errorf("reference: GroupDatabases[%s]: %w", group, err)
		}
		cfg = c
	case oc.DB != nil:
		cfg = oc.DB.Config().Copy()
	default:
		c, err := pgxpool.ParseConfig(oc.DatabaseURL)
		if err != nil {
			return nil, fmt.Errorf("reference: DatabaseURL: %w", err)
		}
		cfg = c
	}
	cfg.MaxConns = 4
	timeout := oc.ConnectTimeout
	if timeout == 0 {
		timeout = once.DefaultConnectTimeout
	}
	pgdb.BoundConnect(cfg, timeout)
	return pgxpool.NewWithConfig(ctx, cfg)
}

// billingHorizon is the age past which billing's confirmations are never
// processed again, or 0 when they always are (TooOld process): then a
// confirmation past the horizon still settles its charge, and its
// cancellation waits for it instead of being dead-lettered as one whose
// charge will never be recorded.
func billingHorizon(oc once.Config, tooOld once.TooOldPolicy) time.Duration {
	if tooOld == once.ProcessTooOld {
		return 0
	}
	retain, skew := oc.Retention, oc.MaxClockSkew
	if retain == 0 {
		retain = once.DefaultRetention
	}
	if skew == 0 {
		skew = once.DefaultMaxClockSkew
	}
	if oc.MaxEventAge > 0 {
		return oc.MaxEventAge
	}
	return retain - skew
}
