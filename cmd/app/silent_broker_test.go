package main

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/google/uuid"

	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/internal/testenv"
)

// metadataAnswered is whether the broker answers a metadata request within
// timeout, asked on a connection of its own.
func metadataAnswered(addr string, timeout time.Duration) error {
	cfg := sarama.NewConfig()
	cfg.Net.DialTimeout, cfg.Net.ReadTimeout, cfg.Net.WriteTimeout = timeout, timeout, timeout
	b := sarama.NewBroker(addr)
	if err := b.Open(cfg); err != nil {
		return err
	}
	defer b.Close()
	_, err := b.GetMetadata(&sarama.MetadataRequest{})
	return err
}

// A broker that neither answers nor fails (paused: hung, or cut off) makes
// serve not ready within --broker-timeout: /readyz 503 naming it,
// once_group_joined 0, the lag unknown (no once_consumer_lag series,
// once_consumer_lag_unknown 1, the console's "unknown") rather than frozen at its last value; all three come
// back once the broker answers again.
func TestReadinessFollowsASilentBroker(t *testing.T) {
	testenv.RequireDevService(t, "kafka")
	brokers := testenv.Brokers(t)
	pool := reftest.Postgres(t)
	ops := testenv.FreeAddr(t)
	suffix := "." + uuid.NewString()[:8]
	group, topic := "analytics"+suffix, "order.confirmed.v1"+suffix
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var logs testenv.Logs
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"serve", "--kafka-brokers", strings.Join(brokers, ","), "--database-url", pool.Config().ConnString(),
			"--topic-suffix", suffix, "--group-suffix", suffix, "--groups", "analytics", "--partitions", "1", "--console",
			"--ops-listen", ops, "--watch-interval", "1s", "--broker-timeout", "3s", "--maintenance-interval", "0",
			"--session-timeout", "6s", "--drain-timeout", "5s", "--revocation-grace", "2s"}, &logs, &logs)
	}()
	joined := func(v int) string { return fmt.Sprintf(`once_group_joined{group=%q,topic=%q} %d`, group, topic, v) }
	lagSeries := fmt.Sprintf(`once_consumer_lag{group=%q,partition="0",topic=%q}`, group, topic)
	lagUnknown := func(v int) string {
		return fmt.Sprintf(`once_consumer_lag_unknown{group=%q,partition="0",topic=%q} %d`, group, topic, v)
	}
	metrics := func() string { _, body := get("http://" + ops + "/metrics"); return body }
	atWork := func(within time.Duration) {
		t.Helper()
		testenv.Eventually(t, within, "/readyz 200, joined 1 and the lag known", func() bool {
			code, _ := get("http://" + ops + "/readyz")
			m := metrics()
			_, page := get("http://" + ops + "/console/groups")
			return code == 200 && strings.Contains(m, joined(1)) && strings.Contains(m, lagSeries) && strings.Contains(m, lagUnknown(0)) &&
				strings.Contains(page, "Lag (total ")
		})
	}
	atWork(60 * time.Second)

	testenv.DevService(t, "kafka", "pause")
	paused := time.Now()
	resumed := false
	resume := func() {
		if !resumed {
			resumed = true
			testenv.DevService(t, "kafka", "resume")
			testenv.WaitForKafka(t, brokers, time.Minute)
		}
	}
	t.Cleanup(resume)
	// The pause happened: the broker takes the connection (the kernel
	// does) and answers nothing on it.
	if err := metadataAnswered(brokers[0], 2*time.Second); err == nil {
		t.Fatal("the paused broker answered a metadata request: the pause did not happen")
	} else {
		t.Logf("paused: a metadata request fails: %v", err)
	}

	var readyz string
	testenv.Eventually(t, 20*time.Second, "/readyz 503, joined 0 and the lag unknown while the broker is silent", func() bool {
		code, body := get("http://" + ops + "/readyz")
		m := metrics()
		_, page := get("http://" + ops + "/console/groups")
		readyz = body
		return code == 503 && strings.Contains(body, "kafka has not answered") &&
			strings.Contains(m, joined(0)) && !strings.Contains(m, lagSeries) && strings.Contains(m, lagUnknown(1)) &&
			strings.Contains(page, "Lag (unknown)") && strings.Contains(page, "Kafka has not answered for")
	})
	t.Logf("%s after the pause: %s", time.Since(paused).Round(100*time.Millisecond), strings.TrimSpace(readyz))
	// Readiness reads the silence from the last answer's time; the probe
	// says so at its next step, a moment later.
	testenv.Eventually(t, 20*time.Second, "a log line saying Kafka is silent", func() bool {
		return strings.Contains(logs.String(), "kafka has not answered for longer than the broker timeout")
	})

	resume()
	atWork(60 * time.Second)
	testenv.Eventually(t, 20*time.Second, "a log line saying Kafka answers again", func() bool {
		return strings.Contains(logs.String(), "kafka answers again")
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
}
