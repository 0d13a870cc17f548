package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/shopspring/decimal"

	"github.com/once-dev/once/payment"
)

// paymentSettings configure billing's client of the payment provider.
type paymentSettings struct {
	URL          string `name:"url" env:"PAYMENT_URL" default:"http://127.0.0.1:18080" help:"Base URL of the payment provider."`
	APIKeyFile   string `name:"api-key-file" env:"PAYMENT_API_KEY_FILE" placeholder:"FILE" help:"File holding the merchant account's key (bearer token; the provider scopes idempotency keys to it). Or PAYMENT_API_KEY; never a flag. Default: acct_once, the simulator's."`
	apiKey       string
	Timeout      time.Duration `name:"timeout" env:"PAYMENT_TIMEOUT" default:"5s" help:"Timeout of one charge request."`
	Attempts     int           `name:"attempts" env:"PAYMENT_ATTEMPTS" default:"5" help:"Attempts per charge (same idempotency key) before the message's own retry takes over."`
	KeyRetention time.Duration `name:"key-retention" env:"PAYMENT_KEY_RETENTION" default:"24h" help:"How long the provider keeps idempotency keys (Stripe: 24h)."`
}

func (p *paymentSettings) client(onAttempt func(payment.Attempt)) (*payment.Client, error) {
	c, err := payment.NewClient(payment.ClientConfig{BaseURL: p.URL, APIKey: p.apiKey, RequestTimeout: p.Timeout, MaxAttempts: p.Attempts, OnAttempt: onAttempt})
	if err != nil {
		return nil, fmt.Errorf("--payment-url (PAYMENT_URL) or its options: %w", err)
	}
	return c, nil
}

func (p *paymentSettings) Validate() error {
	if p.Timeout <= 0 || p.Attempts < 1 || p.KeyRetention <= 0 {
		return errors.New("--payment-timeout and --payment-key-retention must be positive, --payment-attempts at least 1")
	}
	p.apiKey = cmp.Or(os.Getenv("PAYMENT_API_KEY"), "acct_once")
	if p.APIKeyFile != "" {
		b, err := os.ReadFile(p.APIKeyFile)
		if err != nil {
			return fmt.Errorf("--payment-api-key-file (PAYMENT_API_KEY_FILE): %w", err)
		}
		p.apiKey = strings.TrimSpace(string(b))
	}
	_, err := p.client(nil)
	return err
}

type paymentProviderCmd struct {
	DB dbSettings `embed:""`

	Listen          string        `name:"listen" env:"PAYMENT_LISTEN" default:"127.0.0.1:18080" help:"Address to serve the simulator on."`
	KeyRetention    time.Duration `name:"key-retention" env:"PAYMENT_KEY_RETENTION" default:"24h" help:"How long idempotency keys are remembered."`
	InFlightTimeout time.Duration `name:"in-flight-timeout" env:"PAYMENT_IN_FLIGHT_TIMEOUT" default:"30s" help:"After this, a key whose request never finished is given to the next request (a slow first request that had not begun to execute then moves no money)."`
	DeclineAbove    string        `name:"decline-above" env:"PAYMENT_DECLINE_ABOVE" default:"10000" help:"Amounts above this are declined (402 card_declined)."`
	ResetRate       float64       `name:"fault-reset-rate" env:"PAYMENT_FAULT_RESET_RATE" default:"0" help:"Share of charges answered by dropping the connection after charging."`
	Error5xxRate    float64       `name:"fault-5xx-rate" env:"PAYMENT_FAULT_5XX_RATE" default:"0" help:"Share of requests answered 503 before anything happens."`
	StoredErrorRate float64       `name:"fault-stored-error-rate" env:"PAYMENT_FAULT_STORED_ERROR_RATE" default:"0" help:"Share of charges answered 500 and stored under the key (replayed on retry)."`
	Latency         time.Duration `name:"fault-latency" env:"PAYMENT_FAULT_LATENCY" default:"0s" help:"Latency added to every executed charge, spent holding the key: below --in-flight-timeout."`
	Unauthorized    float64       `name:"fault-401-rate" env:"PAYMENT_FAULT_401_RATE" default:"0" help:"Share of requests answered 401 invalid_api_key (a key being rotated)."`
	Migrate         bool          `name:"migrate" env:"ONCE_MIGRATE" default:"true" negatable:"" help:"Apply migrations at start-up."`
}

func (c *paymentProviderCmd) Validate() error {
	if _, _, err := net.SplitHostPort(c.Listen); err != nil {
		return fmt.Errorf("--listen (PAYMENT_LISTEN): %w", err)
	}
	if _, err := decimal.NewFromString(c.DeclineAbove); err != nil {
		return fmt.Errorf("--decline-above (PAYMENT_DECLINE_ABOVE): %q is not a decimal", c.DeclineAbove)
	}
	if c.InFlightTimeout <= 0 {
		return fmt.Errorf("--in-flight-timeout (PAYMENT_IN_FLIGHT_TIMEOUT) must be positive, got %v", c.InFlightTimeout)
	}
	if c.Latency >= c.InFlightTimeout {
		return fmt.Errorf("--fault-latency (PAYMENT_FAULT_LATENCY) %v must be below --in-flight-timeout (PAYMENT_IN_FLIGHT_TIMEOUT) %v: every request would lose its key before it executes",
			c.Latency, c.InFlightTimeout)
	}
	for name, r := range map[string]float64{"--fault-reset-rate": c.ResetRate, "--fault-5xx-rate": c.Error5xxRate, "--fault-stored-error-rate": c.StoredErrorRate, "--fault-401-rate": c.Unauthorized} {
		if r < 0 || r > 1 {
			return fmt.Errorf("%s must be between 0 and 1, got %v", name, r)
		}
	}
	return nil
}

func (c *paymentProviderCmd) Run(ctx context.Context, d deps) error {
	pool, err := c.DB.open(ctx, d, c.Migrate)
	if err != nil {
		return err
	}
	defer pool.Close()
	provider, err := payment.NewProvider(payment.ProviderConfig{
		DB:              pool,
		KeyRetention:    c.KeyRetention,
		InFlightTimeout: c.InFlightTimeout,
		DeclineAbove:    decimal.RequireFromString(c.DeclineAbove),
		Faults: payment.Faults{
			ResetAfterChargeRate: c.ResetRate,
			Error5xxRate:         c.Error5xxRate,
			StoredErrorRate:      c.StoredErrorRate,
			Latency:              c.Latency,
			UnauthorizedRate:     c.Unauthorized,
		},
		Logger: d.log,
	})
	if err != nil {
		return err
	}
	go every(ctx, time.Minute, func() {
		if n, err := provider.SweepKeys(ctx); err != nil {
			d.log.Error("sweep idempotency keys", "err", err)
		} else if n > 0 {
			d.log.Info("forgot expired idempotency keys", "keys", n)
		}
	})
	return serveHTTP(ctx, d, "payment provider simulator", c.Listen, provider)
}

// serveHTTP serves h on addr until ctx ends, then shuts down gracefully.
func serveHTTP(ctx context.Context, d deps, name, addr string, h http.Handler) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", addr, err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	d.log.Info(name+" listening", "addr", ln.Addr().String())
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	shutdownCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	return srv.Shutdown(shutdownCtx)
}
