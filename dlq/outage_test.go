package dlq_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/internal/testenv"
)

// Issue 31, item 5a: the drainer read the parked letters every
// PollInterval (500ms) during a database outage, with a WARN each time
// that named no database. It now backs off, one line per step (1s, 2s,
// 4s...), naming the database's host and when it retries; a letter parked
// after the outage still reaches Kafka.
func TestADrainerOutageLogsOneLinePerBackoffStep(t *testing.T) {
	store, _, direct := newStore(t)
	pool, proxy := testenv.ProxiedPostgres(t, direct)
	brokers := testenv.Brokers(t)
	topic := testenv.Topic(t, brokers, 1)
	var logged testenv.Logs
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		store.Drain(ctx, dlq.DrainConfig{DB: pool, Producer: testenv.Producer(t, brokers), Logger: slog.New(slog.NewJSONHandler(&logged, nil))})
	}()
	t.Cleanup(func() { stop(); <-done })

	// Draining first: its start (forgetting old sources) is behind it.
	if err := park(context.Background(), store, direct, dlq.Letter{Topic: topic, Payload: []byte("before the outage")}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "the letter parked before the outage on Kafka", func() bool { return testenv.MessageCount(t, brokers, topic) == 1 })
	proxy.Down(true)
	time.Sleep(6 * time.Second)
	proxy.Down(false)
	if err := park(context.Background(), store, direct, dlq.Letter{Topic: topic, Payload: []byte("after the outage")}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "the letter parked after the outage on Kafka", func() bool { return testenv.MessageCount(t, brokers, topic) == 2 })
	// A letter parks by publishing first, so it may reach Kafka before the
	// drainer's next step (4 s after its third) reads again and says so.
	testenv.Eventually(t, 30*time.Second, "the drainer reading again", func() bool {
		return strings.Contains(logged.String(), "reading the parked ones again")
	})

	failing := logged.JSONLines(t, "WARN", "ERROR")
	// 1s, 2s, 4s over 6 s: at most 4 lines (a read failing as the
	// proxy went down may start the count a little early).
	if len(failing) == 0 || len(failing) > 4 {
		t.Fatalf("%d WARN or ERROR lines over a 6 s outage; want one per backoff step:\n%s", len(failing), logged.String())
	}
	host := pool.Config().ConnConfig.Host
	for _, line := range failing {
		if msg, _ := line["msg"].(string); line["database"] != host || !strings.Contains(msg, "retrying in") || line["retry_in"] == nil {
			t.Errorf("an outage line names no database host (%s) or when it retries: %v", host, line)
		}
	}
}
