package once

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Handler answers the operations endpoints: GET /metrics (Prometheus, the
// service's registry), GET /healthz (200 while the process runs) and GET
// /readyz (200 once every database answers and every group has joined its
// Kafka group; 503 with the reason otherwise). Mount it on a listener of
// your own (loopback, or the pod's).
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
// answers within 2 seconds, and every group has joined its Kafka group.
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
		if !st.Joined {
			return fmt.Errorf("group %s has not joined on %s yet", st.Group, st.Topic)
		}
	}
	return nil
}
