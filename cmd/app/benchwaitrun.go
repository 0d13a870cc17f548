package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/handlers/analytics"
	"github.com/once-dev/once/handlers/billing"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/orderevents"
	"github.com/once-dev/once/payment"
	"github.com/once-dev/once/pipeline"
)

// waitFlags are app bench-run's settings of the variants whose handler
// waits (W, WB, WH).
type waitFlags struct {
	Order        string        `name:"order" enum:"partition,key" default:"partition" help:"W, WB, WH: the group's order: partition (pipeline.OrderPartition) or key (pipeline.OrderKey, --concurrency at once)."`
	Window       int           `name:"window" help:"W, WB, WH in key order: the group's Window (default: the pipeline's, 4 × --concurrency)."`
	Latency      time.Duration `name:"latency" help:"W, WH: how long the handler waits inside the claim's transaction, before its upsert."`
	PaymentURL   string        `name:"payment-url" help:"WB: the payment provider simulator billing charges."`
	PaymentTopic string        `name:"payment-topic" help:"WB: the topic of billing's payment events, published through the outbox."`
	HoldKey      string        `name:"hold-key" help:"WH: the Kafka key whose handler fails, as one whose provider answers 503, for --hold-for from its first attempt."`
	HoldFor      time.Duration `name:"hold-for" help:"WH: how long the key is held."`
}

// benchAccount is the simulator's merchant account of a measurement's
// group: its charges and idempotency keys are the measurement's alone, and
// cleanup finds them by it.
func benchAccount(group string) string { return "acct_" + group }

// errProviderUnavailable is WH's held key's failure: not the message's
// fault, so the pipeline holds the message and tries it again.
var errProviderUnavailable = errors.New("bench: the held key's provider answers 503 (staged)")

// waiting (W, WB, WH) runs one per-event group whose handler waits inside
// the claim's transaction, in partition order or in key order: W waits
// --latency and upserts analytics, WB is billing against the payment
// simulator (whose --fault-latency is the wait), WH is W with one key held.
func (b *benchRunCmd) waiting(ctx context.Context, pool *pgxpool.Pool, c *clock, log *slog.Logger) error {
	w := b.Wait
	g := pipeline.Group[orderevents.Confirmed]{Name: b.Group}
	if w.Order == "key" {
		g.Order, g.Concurrency, g.Window = pipeline.OrderKey, b.Concurrency, w.Window
	}
	var cfg pipeline.Config
	var hold *holdRun
	// Where an attempt's time goes: in the handler, and in the provider's
	// calls (WB); the rest is the claim and the commit.
	var inHandler, calls durations
	switch b.Variant {
	case "W":
		g.Handle = waitThen(w.Latency, analytics.Handler{}.OnConfirmed)
	case "WH":
		if w.HoldKey == "" || w.HoldFor <= 0 {
			return errors.New("bench WH: --hold-key and a positive --hold-for are required")
		}
		hold = &holdRun{key: w.HoldKey, holdFor: w.HoldFor, keyed: map[int64]bool{}}
		g.Handle = hold.handle(waitThen(w.Latency, analytics.Handler{}.OnConfirmed))
		cfg.Hooks = hold.hooks()
	case "WB":
		if w.PaymentURL == "" || w.PaymentTopic == "" {
			return errors.New("bench WB: --payment-url and --payment-topic are required")
		}
		// Charge intents commit outside the claim's transaction, from a
		// small pool of their own, as the reference service has them.
		icfg, err := pgxpool.ParseConfig(b.DB.DatabaseURL)
		if err != nil {
			return err
		}
		icfg.MaxConns = 4
		intents, err := pgxpool.NewWithConfig(ctx, icfg)
		if err != nil {
			return err
		}
		defer intents.Close()
		client, err := payment.NewClient(payment.ClientConfig{BaseURL: w.PaymentURL, APIKey: benchAccount(b.Group),
			OnAttempt: func(a payment.Attempt) { calls.add(a.Duration) }})
		if err != nil {
			return fmt.Errorf("--payment-url: %w", err)
		}
		h := billing.Handler{Payments: client, Currency: "EUR", DB: intents,
			Publish: func(ctx context.Context, tx pgx.Tx, ev orderevents.Payment) error {
				return pipeline.PublishTo(ctx, tx, w.PaymentTopic, ev)
			}}
		g.Handle = h.OnConfirmed
		cfg.Outgoing = []pipeline.OutgoingBinding{pipeline.Outgoing[orderevents.Payment]{Name: w.PaymentTopic,
			Key:    func(p orderevents.Payment) string { return strconv.FormatInt(p.OrderID(), 10) },
			Encode: func(p orderevents.Payment) ([]byte, error) { return p.MarshalJSON() }}}
	}
	handle := g.Handle
	g.Handle = func(ctx context.Context, tx pgx.Tx, ev orderevents.Confirmed) error {
		start := time.Now()
		defer func() { inHandler.add(time.Since(start)) }()
		return handle(ctx, tx, ev)
	}
	cfg.Topics = []pipeline.Binding{pipeline.Topic[orderevents.Confirmed]{Name: b.Topic, Decode: orderevents.DecodeConfirmed, Groups: []pipeline.Group[orderevents.Confirmed]{g}}}
	if err := b.runPipeline(ctx, pool, c, log, cfg); err != nil {
		return err
	}
	b.inHandler, b.inCall = inHandler.mean(), calls.mean()
	if hold != nil {
		f := hold.figures()
		b.hold = &f
	}
	return nil
}

// waitThen is h after a wait of d inside the claim's transaction, as a
// provider's call would be: the attempt holds its slot and its connection
// meanwhile.
func waitThen(d time.Duration, h pipeline.HandlerFunc[orderevents.Confirmed]) pipeline.HandlerFunc[orderevents.Confirmed] {
	return func(ctx context.Context, tx pgx.Tx, ev orderevents.Confirmed) error {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
		return h(ctx, tx, ev)
	}
}

// holdRun stages WH's held key and records what the other keys did
// meanwhile.
type holdRun struct {
	key     string
	holdFor time.Duration

	mu       sync.Mutex
	first    time.Time // the held key's first attempt
	released time.Time // its first attempt that was let through
	held     int       // attempts the pipeline held (Hooks.OnHeld): the fault, counted
	keyed    map[int64]bool
	done     []doneAt // every event processed, as its result came
	order    []int64  // the held key's offsets, in the order they were processed
}

type doneAt struct {
	offset int64
	at     time.Time
}

// handle fails the held key's attempts for holdFor from its first.
func (h *holdRun) handle(next pipeline.HandlerFunc[orderevents.Confirmed]) pipeline.HandlerFunc[orderevents.Confirmed] {
	return func(ctx context.Context, tx pgx.Tx, ev orderevents.Confirmed) error {
		if d, _ := pipeline.DeliveryFrom(ctx); d.Key == h.key {
			h.mu.Lock()
			if h.first.IsZero() {
				h.first = time.Now()
			}
			fail := time.Since(h.first) < h.holdFor
			if !fail && h.released.IsZero() {
				h.released = time.Now()
			}
			h.mu.Unlock()
			if fail {
				return errProviderUnavailable
			}
		}
		return next(ctx, tx, ev)
	}
}

func (h *holdRun) hooks() pipeline.Hooks {
	return pipeline.Hooks{
		OnDelivered: func(d pipeline.Delivery) {
			if d.Key == h.key {
				h.mu.Lock()
				h.keyed[d.Offset] = true
				h.mu.Unlock()
			}
		},
		OnHeld: func(pipeline.Held) {
			h.mu.Lock()
			h.held++
			h.mu.Unlock()
		},
		OnResult: func(r idempotency.Result) {
			if r.Outcome != idempotency.Processed {
				return
			}
			_, o, _ := cutLast(r.MessageUUID, "/")
			offset, _ := strconv.ParseInt(o, 10, 64)
			h.mu.Lock()
			h.done = append(h.done, doneAt{offset, time.Now()})
			if h.keyed[offset] {
				h.order = append(h.order, offset)
			}
			h.mu.Unlock()
		},
	}
}

// holdFigures is what WH reports besides the clock's figures.
type holdFigures struct {
	HeldEvents   int     `json:"held_events"`   // events of the held key
	HeldAttempts int     `json:"held_attempts"` // its attempts the pipeline held
	HeldSeconds  float64 `json:"held_seconds"`  // from its first attempt to the one let through
	// The other keys' events/s from the first event processed to the
	// hold's start, and from the hold's start to the last event processed
	// before the release: the window filling.
	BeforeRate  float64 `json:"before_rate"`
	DuringRate  float64 `json:"during_rate"`
	DuringCount int     `json:"during_events"`
	FillSeconds float64 `json:"fill_seconds"`
	// FullSeconds: from the last event processed before the release to
	// the release, the time the window stood full.
	FullSeconds float64 `json:"full_seconds"`
	Processed   int     `json:"processed"` // distinct events processed
	// InOrder: every event of the held key processed once, in offset
	// order, none before the release.
	InOrder bool `json:"in_order"`
}

func (h *holdRun) figures() holdFigures {
	h.mu.Lock()
	defer h.mu.Unlock()
	f := holdFigures{HeldEvents: len(h.keyed), HeldAttempts: h.held, HeldSeconds: h.released.Sub(h.first).Seconds()}
	seen := map[int64]bool{}
	var before, during int
	var t0, lastBefore time.Time
	for _, d := range h.done {
		seen[d.offset] = true
		switch {
		case h.keyed[d.offset]:
		case d.at.Before(h.first):
			if t0.IsZero() {
				t0 = d.at
			} else {
				before++
			}
		case d.at.Before(h.released):
			during++
			lastBefore = d.at
		}
	}
	f.Processed = len(seen)
	if s := h.first.Sub(t0).Seconds(); !t0.IsZero() && s > 0 {
		f.BeforeRate = float64(before) / s
	}
	f.DuringCount = during
	if !lastBefore.IsZero() {
		f.FillSeconds = lastBefore.Sub(h.first).Seconds()
		f.FullSeconds = h.released.Sub(lastBefore).Seconds()
		if f.FillSeconds > 0 {
			f.DuringRate = float64(during) / f.FillSeconds
		}
	}
	f.InOrder = len(h.order) == len(h.keyed) && slices.IsSorted(h.order) && !h.released.IsZero()
	for i := 1; i < len(h.order); i++ {
		f.InOrder = f.InOrder && h.order[i] != h.order[i-1]
	}
	return f
}

// durations are what a measurement times besides its events.
type durations struct {
	mu  sync.Mutex
	all []time.Duration
}

func (d *durations) add(x time.Duration) {
	d.mu.Lock()
	d.all = append(d.all, x)
	d.mu.Unlock()
}

// mean is the mean, in milliseconds (what throughput divides by); 0 for
// none.
func (d *durations) mean() float64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(d.all) == 0 {
		return 0
	}
	var sum time.Duration
	for _, x := range d.all {
		sum += x
	}
	return float64(sum.Microseconds()) / 1000 / float64(len(d.all))
}
