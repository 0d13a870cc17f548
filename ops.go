package once

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/once-dev/once/console"
	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/pipeline"
)

// Handler answers the operations endpoints: GET /metrics (Prometheus, the
// service's registry), GET /healthz (200 while the process runs) and GET
// /readyz (200 once every database answers and every group has joined its
// Kafka group, while Kafka answers; 503 with the reason otherwise). Mount
// it on a listener of your own (loopback, or the pod's).
func (s *Service) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(s.registry, promhttp.HandlerOpts{Registry: s.registry}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		if err := s.Ready(r.Context()); err != nil {
			http.Error(w, "not ready: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ready")
	})
	return mux
}

// Ready reports why the service is not ready, or nil: every database
// answers within 2 seconds, every group has joined its Kafka group, and
// Kafka has answered within BrokerTimeout.
func (s *Service) Ready(ctx context.Context) error {
	s.mu.Lock()
	running := s.running
	s.mu.Unlock()
	if !running {
		return errors.New("not consuming yet")
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	for _, db := range s.dbs {
		if err := db.pool.Ping(ctx); err != nil {
			return fmt.Errorf("postgres %s (%s): %w", db.name, db.setting, err)
		}
	}
	for _, st := range s.pipeline.Status() {
		if st.KafkaSilent > 0 {
			return fmt.Errorf("kafka has not answered for %s (BrokerTimeout %s): group %s on %s", st.KafkaSilent.Round(time.Second),
				s.cfg.BrokerTimeout, st.Group, st.Topic)
		}
		if !st.Joined {
			return fmt.Errorf("group %s has not joined on %s yet", st.Group, st.Topic)
		}
	}
	return nil
}

// Console returns the web console of this service (package console), for a
// listener of your own under cfg.Prefix (/console): cfg's Brokers, Sarama,
// Routes, Databases, Tables, Groups and IDNamespaces (the topics'
// IDNamespace: its inbox finds those topics' events by their producer's
// id) are the service's own, the other settings (Token above all; without
// it the console is read-only) are cfg's. Serve it on loopback, or behind a
// proxy that authenticates.
func (s *Service) Console(cfg console.Config) (*console.Console, error) {
	version, err := pipeline.ParseKafkaVersion(s.cfg.KafkaVersion)
	if err != nil {
		return nil, settingError("KafkaVersion", err)
	}
	sc := pipeline.PublisherSaramaConfig(version)
	s.cfg.Security.Apply(sc)
	cfg.Brokers, cfg.Sarama, cfg.Tables, cfg.Groups = s.cfg.Brokers, sc, s.cfg.Tables, s.pipeline
	cfg.Routes, cfg.Databases, cfg.IDNamespaces = nil, nil, nil
	for _, t := range s.pipeline.Topics() {
		cfg.Routes = append(cfg.Routes, dlq.Route{Topic: t.Name, DLQTopic: t.DLQ})
		if t.IDNamespace != "" {
			cfg.IDNamespaces = append(cfg.IDNamespaces, t.IDNamespace)
		}
	}
	for _, db := range s.dbs {
		cfg.Databases = append(cfg.Databases, console.Database{Name: db.name, DB: db.pool})
	}
	if cfg.Logger == nil {
		cfg.Logger = s.cfg.Logger
	}
	return console.New(cfg)
}
