package main

import (
	"context"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/internal/testenv"
)

// forwardTo accepts on addr and forwards every connection to target: a
// broker that comes up at addr.
func forwardTo(t *testing.T, addr, target string) {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				b, err := net.Dial("tcp", target)
				if err != nil {
					return
				}
				defer b.Close()
				go func() { _, _ = io.Copy(b, c) }()
				_, _ = io.Copy(c, b)
			}()
		}
	}()
}

// serve started while its broker cannot be reached waits for it, says so,
// and consumes once it is there; after --kafka-start-timeout it gives up,
// naming the setting.
func TestServeWaitsForKafkaAtStartUp(t *testing.T) {
	brokers := testenv.Brokers(t)
	pool := reftest.Postgres(t)
	serve := func(ctx context.Context, broker, ops, wait string, logs *testenv.Logs) <-chan error {
		suffix := "." + uuid.NewString()[:8]
		done := make(chan error, 1)
		go func() {
			done <- run(ctx, []string{"serve", "--kafka-brokers", broker, "--database-url", pool.Config().ConnString(),
				"--topic-suffix", suffix, "--group-suffix", suffix, "--groups", "analytics", "--partitions", "2",
				"--ops-listen", ops, "--watch-interval", "1s", "--maintenance-interval", "0", "--session-timeout", "6s",
				"--kafka-start-timeout", wait}, logs, logs)
		}()
		return done
	}

	t.Run("comes up", func(t *testing.T) {
		broker, ops := testenv.FreeAddr(t), testenv.FreeAddr(t)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		var logs testenv.Logs
		done := serve(ctx, broker, ops, "60s", &logs)
		testenv.Eventually(t, 30*time.Second, "a line saying serve waits for Kafka", func() bool {
			return strings.Count(logs.String(), "waiting for Kafka") >= 2
		})
		select {
		case err := <-done:
			t.Fatalf("serve gave up while waiting: %v\n%s", err, logs.String())
		default:
		}
		forwardTo(t, broker, brokers[0])
		testenv.Eventually(t, 60*time.Second, "/readyz once the broker is there", func() bool {
			code, _ := get("http://" + ops + "/readyz")
			return code == 200
		})
		cancel()
		if err := <-done; err != nil {
			t.Fatalf("serve: %v\n%s", err, logs.String())
		}
	})

	t.Run("stops cleanly when asked to while waiting", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		var logs testenv.Logs
		done := serve(ctx, testenv.FreeAddr(t), testenv.FreeAddr(t), "60s", &logs)
		testenv.Eventually(t, 30*time.Second, "a line saying serve waits for Kafka", func() bool {
			return strings.Contains(logs.String(), "waiting for Kafka")
		})
		cancel() // what SIGTERM does to serve's context
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("serve stopped during its wait returned %v; want a clean stop\n%s", err, logs.String())
			}
			if !strings.Contains(logs.String(), "stopped during start-up") {
				t.Fatalf("no line saying why serve stopped:\n%s", logs.String())
			}
		case <-time.After(30 * time.Second):
			t.Fatal("serve did not stop within 30s of being asked to while waiting for Kafka")
		}
	})

	t.Run("gives up", func(t *testing.T) {
		var logs testenv.Logs
		started := time.Now()
		select {
		case err := <-serve(context.Background(), testenv.FreeAddr(t), testenv.FreeAddr(t), "3s", &logs):
			if err == nil || !strings.Contains(err.Error(), "KAFKA_BROKERS") || !strings.Contains(err.Error(), "--kafka-start-timeout") {
				t.Fatalf("serve: %v; want an error naming KAFKA_BROKERS and --kafka-start-timeout", err)
			}
			if !strings.Contains(logs.String(), "waiting for Kafka") {
				t.Fatalf("gave up without waiting:\n%s", logs.String())
			}
			t.Logf("gave up after %s: %v", time.Since(started).Round(time.Millisecond), err)
		case <-time.After(60 * time.Second):
			t.Fatal("serve did not give up within 60s of a 3s --kafka-start-timeout")
		}
	})
}
