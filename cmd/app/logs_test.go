package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unicode"

	"github.com/IBM/sarama"
	"github.com/google/uuid"

	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/internal/testenv"
)

// jsonLines are the JSON lines of logs.
func jsonLines(t *testing.T, logs string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, l := range strings.Split(logs, "\n") {
		var line map[string]any
		if json.Unmarshal([]byte(l), &line) == nil {
			out = append(out, line)
		}
	}
	return out
}

// serveJSON runs app serve with --log-format json and the analytics group
// on topics of its own; it returns the confirmed topic, the logs, and a
// stop that waits for serve to return.
func serveJSON(t *testing.T, extra ...string) (string, *testenv.Logs, func() error) {
	t.Helper()
	brokers := testenv.Brokers(t)
	pool := reftest.Postgres(t)
	suffix := "." + uuid.NewString()[:8]
	ctx, cancel := context.WithCancel(context.Background())
	logs := &testenv.Logs{}
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, append([]string{"--log-format", "json", "serve", "--kafka-brokers", strings.Join(brokers, ","), "--database-url", pool.Config().ConnString(),
			"--topic-suffix", suffix, "--group-suffix", suffix, "--groups", "analytics", "--partitions", "1",
			"--maintenance-interval", "0", "--session-timeout", "6s"}, extra...), logs, logs)
	}()
	stopped := false
	stop := func() error {
		if stopped {
			return nil
		}
		stopped = true
		cancel()
		select {
		case err := <-done:
			return err
		case <-time.After(60 * time.Second):
			t.Fatal("serve did not stop within 60s of its context's end")
			return nil
		}
	}
	t.Cleanup(func() { _ = stop() })
	testenv.Eventually(t, 60*time.Second, "serve consuming", func() bool { return strings.Contains(logs.String(), "session began") })
	return "order.confirmed.v1" + suffix, logs, stop
}

// Issue 31, item 5c: every dead letter was logged twice, by the library
// ("partition":"0") and by app serve's OnDeadLetter hook ("partition":0).
// Now once, by the library, its partition and offset numbers.
func TestADeadLetterIsLoggedOnceWithTypedFields(t *testing.T) {
	topic, logs, stop := serveJSON(t)
	testenv.Publish(t, testenv.Producer(t, testenv.Brokers(t)), topic, "k", []byte("not an event"))
	testenv.Eventually(t, 30*time.Second, "the dead letter logged", func() bool { return strings.Contains(logs.String(), "dead-lettered") })
	if err := stop(); err != nil { // every line of it written
		t.Fatalf("serve: %v", err)
	}
	var letters []map[string]any
	for _, line := range jsonLines(t, logs.String()) {
		if msg, _ := line["msg"].(string); strings.Contains(msg, "dead-lettered") && line["topic"] == topic {
			letters = append(letters, line)
		}
	}
	if len(letters) != 1 {
		t.Fatalf("%d lines for one dead letter; want 1: %v", len(letters), letters)
	}
	if _, ok := letters[0]["partition"].(float64); !ok {
		t.Errorf("partition %#v: want a number", letters[0]["partition"])
	}
	if _, ok := letters[0]["offset"].(float64); !ok {
		t.Errorf("offset %#v: want a number", letters[0]["offset"])
	}
}

// Issue 31, item 5f (and issue 28): app dlq list wrote its progress line's
// control codes ("\r\033[K") into a pipe or a file, and a letter's
// reason and headers as they were, control codes and all (a letter may
// be written by anyone who can produce to the topic). Now no progress line
// unless stderr is a terminal, and a letter's text has its control codes
// escaped.
func TestDLQListWritesNoControlCodes(t *testing.T) {
	brokers := testenv.Brokers(t)
	suffix := "." + uuid.NewString()[:8]
	dlqTopic := "order.confirmed.v1" + suffix + ".dlq"
	admin := testenv.Admin(t, brokers)
	if err := admin.CreateTopic(dlqTopic, &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1}, false); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = admin.DeleteTopic(dlqTopic) })
	id := uuid.Must(uuid.NewV7())
	if _, _, err := testenv.Producer(t, brokers).SendMessage(&sarama.ProducerMessage{Topic: dlqTopic, Value: sarama.StringEncoder(`{"event_id":"` + id.String() + `"}`),
		Headers: []sarama.RecordHeader{{Key: []byte("reason_poisoned"), Value: []byte("card \x1b[31mdeclined\x1b]0;owned\x07")},
			{Key: []byte("topic_poisoned"), Value: []byte("order.confirmed.v1" + suffix)},
			{Key: []byte("handler_poisoned"), Value: []byte("billing\x1b[2J" + suffix)}, {Key: []byte(dlq.HeaderVerdict), Value: []byte(dlq.VerdictRecorded)}}}); err != nil {
		t.Fatal(err)
	}
	// Files, as a shell's redirection or a pipe gives: no terminal.
	stdout, err := os.Create(filepath.Join(t.TempDir(), "stdout"))
	if err != nil {
		t.Fatal(err)
	}
	stderr, err := os.Create(filepath.Join(t.TempDir(), "stderr"))
	if err != nil {
		t.Fatal(err)
	}
	if err := run(context.Background(), []string{"dlq", "list", "--kafka-brokers", strings.Join(brokers, ","), "--topic-suffix", suffix, "--group-suffix", suffix}, stdout, stderr); err != nil {
		t.Fatal(err)
	}
	out, _ := os.ReadFile(stdout.Name())
	errOut, _ := os.ReadFile(stderr.Name())
	if !strings.Contains(string(out), id.String()) {
		t.Fatalf("the letter is not listed:\n%s", out)
	}
	for name, b := range map[string][]byte{"stdout": out, "stderr": errOut} {
		for _, c := range string(b) {
			if c != '\n' && c != '\t' && unicode.IsControl(c) {
				t.Errorf("%s holds the control code %q:\n%q", name, c, b)
				break
			}
		}
	}
	if !strings.Contains(string(out), `card \x1b[31mdeclined\x1b]0;owned\a`) || !strings.Contains(string(out), `billing\x1b[2J`) {
		t.Errorf("the letter's reason and group, their control codes escaped:\n%s", out)
	}
	if !strings.Contains(string(out), "[recorded verdict: a replay is a duplicate for its group] card") {
		t.Errorf("the letter of a recorded verdict is not marked:\n%s", out)
	}
}
