package main

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/once-dev/once"
	"github.com/once-dev/once/internal/demo"
	"github.com/once-dev/once/migrations"
)

type demoCmd struct {
	Kafka kafkaSettings `embed:""`
	DB    dbSettings    `embed:""`
	Ops   opsSettings   `embed:""`

	Orders         int           `name:"orders" default:"10000" help:"Orders to confirm."`
	RepublishShare float64       `name:"republish-share" default:"0.05" help:"Share of events a producer re-publishes."`
	DeclineShare   float64       `name:"decline-share" default:"0.005" help:"Share of orders priced above the provider's decline limit."`
	Poison         int           `name:"poison" default:"24" help:"Malformed messages injected into the stream."`
	ResetRate      float64       `name:"reset-rate" default:"0.02" help:"Share of charges after which the provider drops the connection."`
	CancelShare    float64       `name:"cancel-share" default:"0.04" help:"Share of orders cancelled: half right after their confirmation (mostly before the charge), half after it (refunded)."`
	Timeout        time.Duration `name:"timeout" default:"15m" help:"Give up after this long."`
	Verbose        bool          `name:"verbose" help:"Show the services' logs (warnings and up are always shown)."`
}

func (c *demoCmd) Validate() error {
	if c.Orders < 10 {
		return fmt.Errorf("--orders must be at least 10, got %d", c.Orders)
	}
	for name, v := range map[string]float64{"--republish-share": c.RepublishShare, "--decline-share": c.DeclineShare, "--reset-rate": c.ResetRate, "--cancel-share": c.CancelShare} {
		if v <= 0 || v >= 1 {
			return fmt.Errorf("%s must be between 0 and 1 (exclusive), got %v", name, v)
		}
	}
	if c.Poison < 1 {
		return fmt.Errorf("--poison must be at least 1")
	}
	return nil
}

// errDemoFailed makes the exit code non-zero after the summary said FAIL.
var errDemoFailed = fmt.Errorf("demo FAILED: see the checks above")

func (c *demoCmd) Run(ctx context.Context, d deps) error {
	pool, err := c.DB.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	providerPool, err := c.DB.connect(ctx)
	if err != nil {
		return err
	}
	defer providerPool.Close()
	if _, err := migrations.Up(ctx, pool); err != nil {
		return err
	}
	log := d.log
	if !c.Verbose {
		// Retries, resets and dead letters are the demo's point: they are
		// counted in the summary instead of logged line by line.
		log = slog.New(newLevelFilter(d.log.Handler(), slog.LevelError))
	}
	o, err := newOps(c.Ops)
	if err != nil {
		return err
	}
	if err := o.serve(ctx, d); err != nil {
		return err
	}
	fmt.Fprintf(d.stderr, "demo: %d orders through billing and analytics, some cancelled, with duplicates from every source\n", c.Orders)
	s, err := demo.Run(ctx, demo.Config{
		DB: pool, ProviderDB: providerPool, Brokers: c.Kafka.Brokers, KafkaVersion: c.Kafka.KafkaVersion, Partitions: c.Kafka.Partitions,
		Orders: c.Orders, RepublishShare: c.RepublishShare, DeclineShare: c.DeclineShare, PoisonMessages: c.Poison,
		ResetRate: c.ResetRate, CancelShare: c.CancelShare, Timeout: c.Timeout, Progress: d.stderr, Logger: log,
		Registry: o.reg, OnService: func(svc *once.Service) {
			if err := o.attach(svc); err != nil {
				log.Error("the console is off", "err", err)
			}
		}, OnPaymentAttempt: o.paymentAttempt,
	})
	if err != nil {
		return err
	}
	s.Print(d.stdout)
	if !s.Pass() {
		return errDemoFailed
	}
	return nil
}

// levelFilter drops records below a level, whatever the handler's own level.
type levelFilter struct {
	slog.Handler
	min slog.Level
}

func newLevelFilter(h slog.Handler, min slog.Level) slog.Handler { return levelFilter{h, min} }

func (f levelFilter) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= f.min && f.Handler.Enabled(ctx, l)
}

func (f levelFilter) WithAttrs(a []slog.Attr) slog.Handler {
	return levelFilter{f.Handler.WithAttrs(a), f.min}
}
func (f levelFilter) WithGroup(n string) slog.Handler {
	return levelFilter{f.Handler.WithGroup(n), f.min}
}
