package main

import (
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/internal/testenv"
)

func get(url string) (int, string) {
	resp, err := http.Get(url)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// app serve answers /healthz, /readyz once its groups joined, and /metrics
// with the groups' gauges; the end of its context (SIGTERM) stops it
// cleanly, endpoint included.
func TestServeAnswersHealthReadinessAndMetrics(t *testing.T) {
	brokers := testenv.Brokers(t)
	pool := reftest.Postgres(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	suffix := "." + uuid.NewString()[:8]
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var logs testenv.Logs
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"serve", "--kafka-brokers", strings.Join(brokers, ","), "--database-url", pool.Config().ConnString(),
			"--topic-suffix", suffix, "--group-suffix", suffix, "--groups", "analytics", "--partitions", "2",
			"--ops-listen", addr, "--watch-interval", "1s", "--maintenance-interval", "0", "--session-timeout", "6s"}, &logs, &logs)
	}()
	testenv.Eventually(t, 30*time.Second, "/healthz", func() bool { code, _ := get("http://" + addr + "/healthz"); return code == 200 })
	testenv.Eventually(t, 60*time.Second, "/readyz", func() bool { code, _ := get("http://" + addr + "/readyz"); return code == 200 })
	testenv.Eventually(t, 30*time.Second, "the groups' gauges in /metrics", func() bool {
		code, body := get("http://" + addr + "/metrics")
		return code == 200 && strings.Contains(body, `once_group_joined{group="analytics`+suffix+`",topic="order.confirmed.v1`+suffix+`"} 1`) &&
			strings.Contains(body, "once_consumer_lag{") && strings.Contains(body, "once_claim_partitions{")
	})
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("serve: %v\n%s", err, logs.String())
		}
	case <-time.After(45 * time.Second):
		t.Fatal("serve did not stop within 45s of its context's end")
	}
	if code, _ := get("http://" + addr + "/healthz"); code == 200 {
		t.Fatal("/healthz still answers after serve returned")
	}
}
