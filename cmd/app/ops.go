package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/once-dev/once/metrics"
	"github.com/once-dev/once/pipeline"
	"github.com/once-dev/once/service/payment"
)

type opsSettings struct {
	OpsListen     string        `name:"ops-listen" env:"ONCE_OPS_LISTEN" default:"127.0.0.1:9464" help:"Address of /metrics (Prometheus), /healthz and /readyz; empty for none."`
	WatchInterval time.Duration `name:"watch-interval" env:"ONCE_WATCH_INTERVAL" default:"10s" help:"How often consumer lag, held messages and the claim table are read for /metrics."`
}

func (o *opsSettings) Validate() error {
	if o.WatchInterval < time.Second {
		return fmt.Errorf("--watch-interval (ONCE_WATCH_INTERVAL) must be at least 1s, got %s", o.WatchInterval)
	}
	return nil
}

// ops is the process's operating surface: its metrics, and what /readyz
// checks.
type ops struct {
	settings opsSettings
	reg      *prometheus.Registry
	metrics  *metrics.Metrics
	payments *prometheus.CounterVec
	payTime  *prometheus.HistogramVec

	mu        sync.Mutex
	pipelines []*pipeline.Pipeline
	pools     []*pgxpool.Pool
}

func newOps(s opsSettings) (*ops, error) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	m, err := metrics.New(reg)
	if err != nil {
		return nil, err
	}
	o := &ops{settings: s, reg: reg, metrics: m,
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

// watch adds a pipeline to /readyz and its gauges to /metrics.
func (o *ops) watch(ctx context.Context, p *pipeline.Pipeline, pools ...*pgxpool.Pool) {
	o.mu.Lock()
	o.pipelines = append(o.pipelines, p)
	o.pools = append(o.pools, pools...)
	o.mu.Unlock()
	stores := make(metrics.Stores, 0, len(pools))
	for i, db := range pools {
		name := "default"
		if i > 0 {
			name = db.Config().ConnConfig.Database
		}
		stores = append(stores, metrics.Store{Name: name, DB: db})
	}
	go o.metrics.Watch(ctx, p, stores, o.settings.WatchInterval)
}

// ready: every database answers, and every group of every pipeline has
// joined its consumer group.
func (o *ops) ready(ctx context.Context) error {
	o.mu.Lock()
	pipelines, pools := append([]*pipeline.Pipeline(nil), o.pipelines...), append([]*pgxpool.Pool(nil), o.pools...)
	o.mu.Unlock()
	if len(pipelines) == 0 {
		return errors.New("not consuming yet")
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	for _, db := range pools {
		if err := db.Ping(ctx); err != nil {
			return fmt.Errorf("postgres %s: %w", db.Config().ConnConfig.Database, err)
		}
	}
	for _, p := range pipelines {
		for _, s := range p.Status() {
			if !s.Joined {
				return fmt.Errorf("group %s has not joined on %s yet", s.Group, s.Topic)
			}
		}
	}
	return nil
}

// serve answers /metrics, /healthz and /readyz until ctx ends.
func (o *ops) serve(ctx context.Context, d deps) error {
	if o.settings.OpsListen == "" {
		return nil
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(o.reg, promhttp.HandlerOpts{Registry: o.reg}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		if err := o.ready(r.Context()); err != nil {
			http.Error(w, "not ready: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ready")
	})
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
