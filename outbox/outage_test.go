package outbox_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/outbox"
	"github.com/once-dev/once/schema"
)

// Issue 31, item 5a: during a PostgreSQL outage the forwarder logged 152
// ERROR lines in 25 s (a poll every second, each with its rollback's
// error too), naming no setting or action. It now logs one line per step
// of its backoff, which doubles, naming the database's host, the table and
// when it tries again; and one line when it reads the outbox again.
func TestAnOutageLogsOneLinePerBackoffStep(t *testing.T) {
	direct := testenv.Postgres(t)
	pool, proxy := testenv.ProxiedPostgres(t, direct)
	var logged testenv.Logs
	ob, err := outbox.New(schema.Config{}, slog.New(slog.NewJSONHandler(&logged, nil)))
	if err != nil {
		t.Fatal(err)
	}
	fw, err := ob.Forwarder(pool, outbox.KafkaPublisher{Producer: testenv.Producer(t, testenv.Brokers(t))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- fw.Run(ctx) }()
	t.Cleanup(func() { stop(); <-done })
	<-fw.Running()

	proxy.Down(true)
	time.Sleep(10 * time.Second)
	proxy.Down(false)
	// An event written after the outage reaches Kafka: the forwarder
	// reads the outbox again.
	brokers := testenv.Brokers(t)
	topic := testenv.Topic(t, brokers, 1)
	tx, err := direct.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Publish(context.Background(), tx, outbox.Message{Topic: topic, Key: "k", ID: "after-the-outage", Payload: []byte(`{}`)}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(context.Background()); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 40*time.Second, "the event written after the outage on Kafka", func() bool { return testenv.MessageCount(t, brokers, topic) == 1 })
	// The poll publishes before it commits, and says it reads again only
	// after its commit (watermill-sql's backoff hook), so the event may be
	// on Kafka a moment before the line is written.
	testenv.Eventually(t, 10*time.Second, "a line saying the forwarder reads the outbox again", func() bool {
		return strings.Contains(logged.String(), "reads the outbox again")
	})

	failing := logged.JSONLines(t, "WARN", "ERROR")
	// A backoff of 1s, 2s, 4s, 8s... over 10 s: at most 5 lines.
	if len(failing) == 0 || len(failing) > 5 {
		t.Fatalf("%d WARN or ERROR lines over a 10 s outage; want one per backoff step:\n%s", len(failing), logged.String())
	}
	host := pool.Config().ConnConfig.Host
	for _, line := range failing {
		msg, _ := line["msg"].(string)
		if line["level"] != "WARN" || line["database"] != host || !strings.Contains(msg, "retrying") || line["retry_in"] == nil {
			t.Errorf("an outage line names no database host (%s) or when it retries: %v", host, line)
		}
	}
}

// A read the database refuses for good (the role lacks the grant) is no
// outage: its line is an ERROR that says so and names the action, with
// its error class, still one per backoff step. A line calling it a wait
// for the database would send a person to the wrong place.
func TestARefusedReadIsNamedAndNotAnOutage(t *testing.T) {
	direct := testenv.Postgres(t)
	ob, err := outbox.New(schema.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Init(context.Background(), direct); err != nil {
		t.Fatal(err)
	}
	role := "once_no_grant_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	if _, err := direct.Exec(context.Background(), "CREATE ROLE "+role+" NOLOGIN"); err != nil {
		t.Fatal(err)
	}
	// The forwarder may keep its offsets (it subscribes), not read the
	// outbox.
	offsets := schema.Config{}.OutboxOffsetsTable()
	if _, err := direct.Exec(context.Background(), "GRANT SELECT, INSERT, UPDATE ON "+offsets.Qualified+" TO "+role); err != nil {
		t.Fatal(err)
	}
	pool := testenv.PoolAs(t, direct, role)
	t.Cleanup(func() {
		pool.Close()
		_, _ = direct.Exec(context.Background(), "DROP OWNED BY "+role)
		_, _ = direct.Exec(context.Background(), "DROP ROLE "+role)
	})
	var logged testenv.Logs
	ob, err = outbox.New(schema.Config{}, slog.New(slog.NewJSONHandler(&logged, nil)))
	if err != nil {
		t.Fatal(err)
	}
	fw, err := ob.Forwarder(pool, outbox.KafkaPublisher{Producer: testenv.Producer(t, testenv.Brokers(t))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- fw.Run(ctx) }()
	t.Cleanup(func() { stop(); <-done })
	testenv.Eventually(t, 20*time.Second, "a refused read's line", func() bool {
		select {
		case err := <-done:
			done <- err
			t.Fatalf("the forwarder stopped: %v\n%s", err, logged.String())
		default:
		}
		return strings.Contains(logged.String(), "error_class")
	})
	time.Sleep(2500 * time.Millisecond) // a second step of the backoff
	lines := logged.JSONLines(t, "WARN", "ERROR")
	// The fault staged: the role's reads were refused, by the grant.
	if len(lines) == 0 || !strings.Contains(logged.String(), "permission denied for") {
		t.Fatalf("no read was refused for the grant:\n%s", logged.String())
	}
	if len(lines) > 3 {
		t.Errorf("%d lines in under 4 s; want one per backoff step (1s, 2s)", len(lines))
	}
	for _, line := range lines {
		msg, _ := line["msg"].(string)
		if line["level"] != "ERROR" || line["error_class"] != "permission_denied" || !strings.Contains(msg, "grant") || !strings.Contains(msg, "retrying in") {
			t.Errorf("a refused read's line is not an ERROR naming the grant: %v", line)
		}
	}
}
