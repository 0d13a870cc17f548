package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/once-dev/once"
	"github.com/once-dev/once/console"
	"github.com/once-dev/once/metrics"
	"github.com/once-dev/once/payment"
)

type opsSettings struct {
	OpsListen     string          `name:"ops-listen" env:"ONCE_OPS_LISTEN" default:"127.0.0.1:9464" help:"Address of /metrics (Prometheus), /healthz and /readyz; empty for none."`
	WatchInterval time.Duration   `name:"watch-interval" env:"ONCE_WATCH_INTERVAL" default:"10s" help:"How often consumer lag, held messages and the claim table are read for /metrics."`
	BrokerTimeout time.Duration   `name:"broker-timeout" env:"ONCE_BROKER_TIMEOUT" default:"15s" help:"How long Kafka may not answer (a hung, paused or cut-off broker) before /readyz answers 503, once_group_joined drops to 0 and the lag is unknown (no once_consumer_lag series, once_consumer_lag_unknown 1); at least 1s."`
	Console       bool            `name:"console" env:"ONCE_CONSOLE" help:"Serve the web console (dead letters, replay, groups, inbox) under /console on --ops-listen, which must then be a loopback address. Read-only, showing no reason, payload, header, key or error, unless ONCE_CONSOLE_TOKEN or --console-token-file gives a token to sign in with."`
	ConsoleOf     consoleSettings `embed:""`
}

// consoleSettings are the console's, in app serve --console and app
// console alike.
type consoleSettings struct {
	TokenFile    string        `name:"console-token-file" env:"ONCE_CONSOLE_TOKEN_FILE" type:"existingfile" help:"File holding the console's token, which lets whoever signs in with it see reasons, payloads, headers, keys and errors, replay and forget (or ONCE_CONSOLE_TOKEN; never a flag of its own)."`
	ReplayWindow time.Duration `name:"console-replay-window" env:"ONCE_DLQ_REPLAY_WINDOW" default:"24h" help:"The console replays no letter whose event is older than this, as app dlq replay --max-age; 0 replays all."`
	Hosts        []string      `name:"console-host" env:"ONCE_CONSOLE_HOSTS" help:"A host name the console answers to besides localhost and IP addresses (such as the name a port-forward is reached by); repeat or comma-separate. Others are refused, against DNS rebinding."`
}

// config is the console's configuration from these settings.
func (c consoleSettings) config() (console.Config, error) {
	token, err := c.token()
	if err != nil {
		return console.Config{}, err
	}
	window := c.ReplayWindow
	if window == 0 {
		window = -1 // 0 replays all, as app dlq replay --max-age 0
	}
	return console.Config{Token: token, ReplayWindow: window, Hosts: c.Hosts}, nil
}

// loopbackOnly refuses a listener that is not on this host: the console
// shows a signed-in person payloads, which may hold personal data, and
// everyone else the letters' ids and reasons; it is for a person on this
// host or at the end of a port-forward.
func loopbackOnly(setting, addr string) error {
	host, _, err := net.SplitHostPort(addr)
	if ip := net.ParseIP(host); err != nil || (host != "localhost" && (ip == nil || !ip.IsLoopback())) {
		return fmt.Errorf("%s needs a loopback address such as 127.0.0.1:9464, got %q: reach it with a port-forward", setting, addr)
	}
	return nil
}

func (o *opsSettings) Validate() error {
	if o.WatchInterval < time.Second {
		return fmt.Errorf("--watch-interval (ONCE_WATCH_INTERVAL) must be at least 1s, got %s", o.WatchInterval)
	}
	if o.BrokerTimeout < time.Second {
		return fmt.Errorf("--broker-timeout (ONCE_BROKER_TIMEOUT) must be at least 1s, got %s", o.BrokerTimeout)
	}
	if o.Console {
		if err := loopbackOnly("--console (ONCE_CONSOLE): --ops-listen (ONCE_OPS_LISTEN)", o.OpsListen); err != nil {
			return err
		}
	}
	return nil
}

// token is the console's token: ONCE_CONSOLE_TOKEN, else the contents of
// --console-token-file; "" for a read-only console.
func (c consoleSettings) token() (string, error) {
	if t := os.Getenv("ONCE_CONSOLE_TOKEN"); t != "" || c.TokenFile == "" {
		return t, nil
	}
	b, err := os.ReadFile(c.TokenFile)
	if err != nil {
		return "", fmt.Errorf("--console-token-file (ONCE_CONSOLE_TOKEN_FILE): %w", err)
	}
	return strings.TrimSpace(string(b)), nil
}

// ops is the process's operating surface: the metrics' registry (the
// service's, and the payment client's), and the endpoint that answers from
// the start, delegating to the service once it is there.
type ops struct {
	settings opsSettings
	reg      *prometheus.Registry
	payments *prometheus.CounterVec
	payTime  *prometheus.HistogramVec
	service  atomic.Pointer[once.Service]
	console  atomic.Pointer[console.Console]
}

func newOps(s opsSettings) (*ops, error) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	o := &ops{settings: s, reg: reg,
		payments: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: metrics.Namespace, Name: "payment_requests_total",
			Help: "HTTP attempts of the payment client by path and outcome: ok, replayed, declined, retryable, network."}, []string{"path", "outcome"}),
		payTime: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: metrics.Namespace, Name: "payment_request_seconds",
			Help: "HTTP attempts of the payment client.", Buckets: prometheus.DefBuckets}, []string{"path"}),
	}
	reg.MustRegister(o.payments, o.payTime)
	return o, nil
}

// paymentAttempt is the payment client's OnAttempt.
func (o *ops) paymentAttempt(a payment.Attempt) {
	o.payments.WithLabelValues(a.Path, a.Outcome).Inc()
	o.payTime.WithLabelValues(a.Path).Observe(a.Duration.Seconds())
}

// attach makes /readyz the service's, and /console its console.
func (o *ops) attach(svc *once.Service) error {
	o.service.Store(svc)
	if !o.settings.Console {
		return nil
	}
	cfg, err := o.settings.ConsoleOf.config()
	if err != nil {
		return err
	}
	c, err := svc.Console(cfg)
	if err != nil {
		return fmt.Errorf("--console (ONCE_CONSOLE): %w", err)
	}
	o.console.Store(c)
	return nil
}

// serve answers /metrics, /healthz and /readyz until ctx ends: alive from
// the start, ready once the service consumes.
func (o *ops) serve(ctx context.Context, d deps) error {
	if o.settings.OpsListen == "" {
		return nil
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(o.reg, promhttp.HandlerOpts{Registry: o.reg}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		svc := o.service.Load()
		if svc == nil {
			http.Error(w, "not ready: starting", http.StatusServiceUnavailable)
			return
		}
		svc.Handler().ServeHTTP(w, r)
	})
	if o.settings.Console {
		serveConsole := func(w http.ResponseWriter, r *http.Request) {
			c := o.console.Load()
			if c == nil {
				http.Error(w, "console: the service is starting", http.StatusServiceUnavailable)
				return
			}
			c.ServeHTTP(w, r)
		}
		mux.HandleFunc(console.DefaultPrefix, serveConsole)
		mux.HandleFunc(console.DefaultPrefix+"/", serveConsole)
	}
	ln, err := net.Listen("tcp", o.settings.OpsListen)
	if err != nil {
		return fmt.Errorf("--ops-listen (ONCE_OPS_LISTEN): %w", err)
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		<-ctx.Done()
		_ = srv.Close()
	}()
	d.log.Info("operations endpoint", "metrics", "http://"+ln.Addr().String()+"/metrics", "healthz", "/healthz", "readyz", "/readyz")
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			d.log.Error("operations endpoint stopped", "err", err)
		}
	}()
	return nil
}
