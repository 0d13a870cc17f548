package main

import (
	"bytes"
	"context"
	neturl "net/url"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/migrations"
	"github.com/once-dev/once/schema"
)

func runApp(t *testing.T, args ...string) (string, error) {
	t.Helper()
	var out, errOut bytes.Buffer
	err := run(context.Background(), args, &out, &errOut)
	return out.String() + errOut.String(), err
}

// inbox status shows a claim with its group and hash; forget removes that
// group's claim only, and forgetting it again is an error.
// Directly and behind PgBouncer in transaction pooling.
func TestInboxStatusAndForget(t *testing.T) {
	for _, w := range []testenv.Where{{Pooled: false, Mode: pgx.QueryExecModeCacheStatement}, {Pooled: true, Mode: pgx.QueryExecModeExec}} {
		t.Run(w.String(), func(t *testing.T) { testInboxStatusAndForget(t, w.URL(t)) })
	}
}

func testInboxStatusAndForget(t *testing.T, url string) {
	ctx := context.Background()
	pool := reftest.Postgres(t)
	if _, err := migrations.Up(ctx, pool); err != nil {
		t.Fatal(err)
	}
	id := uuid.Must(uuid.NewV7())
	suffix := "_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	for _, g := range []string{"analytics" + suffix, "billing" + suffix} {
		if _, err := pool.Exec(ctx, `INSERT INTO processed_event (event_id, consumer_group, payload_sha256) VALUES ($1, $2, '\xabcd')`, id, g); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), `DELETE FROM processed_event WHERE event_id = $1`, id) })

	out, err := runApp(t, "inbox", "status", id.String(), "--database-url", url)
	if err != nil || !strings.Contains(out, "analytics"+suffix) || !strings.Contains(out, "billing"+suffix) || !strings.Contains(out, "abcd") {
		t.Fatalf("status: %v\n%s", err, out)
	}
	if out, err := runApp(t, "inbox", "forget", id.String(), "--group", "billing"+suffix, "--database-url", url); err == nil {
		t.Fatalf("forgetting billing without --force was allowed:\n%s", out)
	}
	if out, err := runApp(t, "inbox", "forget", id.String(), "--group", "analytics"+suffix, "--database-url", url); err != nil {
		t.Fatalf("forget: %v\n%s", err, out)
	}
	out, err = runApp(t, "inbox", "status", id.String(), "--database-url", url)
	if err != nil || strings.Contains(out, "analytics"+suffix) || !strings.Contains(out, "billing"+suffix) {
		t.Fatalf("status after forgetting analytics' claim: %v\n%s", err, out)
	}
	if out, err := runApp(t, "inbox", "forget", id.String(), "--group", "analytics"+suffix, "--database-url", url); err == nil {
		t.Fatalf("forgetting a claim that is gone succeeded:\n%s", out)
	}
}

// A group with a database of its own (--group-database, as serve takes it)
// has its claims there: status lists them beside the main database's, and
// forget deletes the group's claim in its own database.
func TestInboxWithAGroupsOwnDatabase(t *testing.T) {
	ctx := context.Background()
	main := reftest.Postgres(t)
	other := testenv.OtherPostgres(t, "once_inbox_other")
	if _, err := schema.Migrate(ctx, other, schema.Config{}); err != nil {
		t.Fatal(err)
	}
	id := uuid.Must(uuid.NewV7())
	suffix := "_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	for _, c := range []struct {
		db    *pgxpool.Pool
		group string
	}{{main, "billing" + suffix}, {other, "analytics" + suffix}} {
		if _, err := c.db.Exec(ctx, `INSERT INTO processed_event (event_id, consumer_group, payload_sha256) VALUES ($1, $2, '\xabcd')`, id, c.group); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		_, _ = main.Exec(context.Background(), `DELETE FROM processed_event WHERE event_id = $1`, id)
		_, _ = other.Exec(context.Background(), `DELETE FROM processed_event WHERE event_id = $1`, id)
	})
	url := main.Config().ConnString()
	otherURL, err := neturl.Parse(url)
	if err != nil {
		t.Fatal(err)
	}
	otherURL.Path = "/once_inbox_other" // the pool's ConnString is the main database's
	groupDB := "--group-database=analytics=" + otherURL.String()
	out, err := runApp(t, "inbox", "status", id.String(), "--database-url", url, groupDB)
	if err != nil || !strings.Contains(out, "analytics"+suffix) || !strings.Contains(out, "billing"+suffix) {
		t.Fatalf("status over both databases: %v\n%s", err, out)
	}
	if out, err := runApp(t, "inbox", "forget", id.String(), "--group", "analytics"+suffix, "--database-url", url, groupDB); err != nil {
		t.Fatalf("forget in the group's own database: %v\n%s", err, out)
	}
	var n int
	if err := other.QueryRow(ctx, `SELECT count(*) FROM processed_event WHERE event_id = $1`, id).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d claims left in the group's database (%v); want 0", n, err)
	}
}

// dlq list reads the dead-letter topics and shows each letter that the
// filters select, with its event id, origin and reason; a filtered replay
// republishes only those, and an unfiltered one later still finds the rest.
func TestDLQListAndFilteredReplay(t *testing.T) {
	brokers := testenv.Brokers(t)
	suffix := "." + uuid.NewString()[:8]
	admin := testenv.Admin(t, brokers)
	for _, name := range []string{"order.confirmed.v1", "order.cancelled.v1", "payment.events.v1"} {
		for _, topic := range []string{name + suffix, name + suffix + ".dlq"} {
			if err := admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1}, false); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = admin.DeleteTopic(topic) })
		}
	}
	producer := testenv.Producer(t, brokers)
	letter := func(group, reason string) uuid.UUID {
		id := uuid.Must(uuid.NewV7())
		_, _, err := producer.SendMessage(&sarama.ProducerMessage{Topic: "order.confirmed.v1" + suffix + ".dlq",
			Value: sarama.StringEncoder(`{"event_id":"` + id.String() + `"}`),
			Headers: []sarama.RecordHeader{{Key: []byte("reason_poisoned"), Value: []byte(reason)},
				{Key: []byte("topic_poisoned"), Value: []byte("order.confirmed.v1" + suffix)},
				{Key: []byte("handler_poisoned"), Value: []byte(group + suffix)}}})
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	declined := letter("billing", "payment declined: card expired")
	mismatch := letter("analytics", "payload mismatch")
	common := []string{"--kafka-brokers", strings.Join(brokers, ","), "--topic-suffix", suffix, "--group-suffix", suffix}

	out, err := runApp(t, append([]string{"dlq", "list", "--source-group", "billing", "--reason", "declined"}, common...)...)
	if err != nil || !strings.Contains(out, declined.String()) || strings.Contains(out, mismatch.String()) || !strings.Contains(out, "1 dead letters on the topics") {
		t.Fatalf("filtered list: %v\n%s", err, out)
	}
	out, err = runApp(t, append([]string{"dlq", "list"}, common...)...)
	if err != nil || !strings.Contains(out, declined.String()) || !strings.Contains(out, mismatch.String()) {
		t.Fatalf("list: %v\n%s", err, out)
	}
	group := "replay" + suffix
	out, err = runApp(t, append([]string{"dlq", "replay", "--group", group, "--source-group", "analytics"}, common...)...)
	if err != nil || !strings.Contains(out, "replayed 1 dead letters") || !strings.Contains(out, "left 1 out by the filter") {
		t.Fatalf("filtered replay: %v\n%s", err, out)
	}
	out, err = runApp(t, append([]string{"dlq", "replay", "--group", group}, common...)...)
	if err != nil || !strings.Contains(out, "replayed 2 dead letters") {
		t.Fatalf("unfiltered replay after a filtered one: %v\n%s", err, out)
	}
	c, err := sarama.NewConsumer(brokers, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	pc, err := c.ConsumePartition("order.confirmed.v1"+suffix, 0, sarama.OffsetOldest)
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	seen := map[string]int{}
	for len(seen) < 2 || seen[mismatch.String()] < 2 {
		select {
		case m := <-pc.Messages():
			seen[string(m.Value)[13:49]]++
		case <-time.After(20 * time.Second):
			t.Fatalf("republished: %v", seen)
		}
	}
	if seen[declined.String()] != 1 || seen[mismatch.String()] != 2 {
		t.Fatalf("republished %v; want the declined letter once, the mismatch twice (filtered, then unfiltered)", seen)
	}
}

// dlq replay leaves a group's recorded verdicts out unless asked
// (--include-verdicts), and counts them: for their group a replay is a
// duplicate that changes nothing (issue 31, item 4's review).
func TestDLQReplaySkipsVerdictsUnlessIncluded(t *testing.T) {
	brokers := testenv.Brokers(t)
	suffix := "." + uuid.NewString()[:8]
	admin := testenv.Admin(t, brokers)
	source := "order.confirmed.v1" + suffix
	for _, topic := range []string{source, source + ".dlq"} {
		if err := admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1}, false); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = admin.DeleteTopic(topic) })
	}
	producer := testenv.Producer(t, brokers)
	letter := func(reason string, verdict bool) uuid.UUID {
		id := uuid.Must(uuid.NewV7())
		headers := []sarama.RecordHeader{{Key: []byte("reason_poisoned"), Value: []byte(reason)},
			{Key: []byte("topic_poisoned"), Value: []byte(source)}, {Key: []byte("handler_poisoned"), Value: []byte("billing" + suffix)}}
		if verdict {
			headers = append(headers, sarama.RecordHeader{Key: []byte(dlq.HeaderVerdict), Value: []byte(dlq.VerdictRecorded)})
		}
		if _, _, err := producer.SendMessage(&sarama.ProducerMessage{Topic: source + ".dlq", Value: sarama.StringEncoder(`{"event_id":"` + id.String() + `"}`), Headers: headers}); err != nil {
			t.Fatal(err)
		}
		return id
	}
	declined := letter("billing: provider refused order 7: card declined", true)
	fault := letter("price zero not handled", false)
	common := []string{"--kafka-brokers", strings.Join(brokers, ","), "--topic-suffix", suffix, "--group-suffix", suffix, "--source-topic", "order.confirmed.v1"}

	out, err := runApp(t, append([]string{"dlq", "replay", "--group", "replay" + suffix}, common...)...)
	if err != nil || !strings.Contains(out, "replayed 1 dead letters") || !strings.Contains(out, "skipped 1 letters of a group's recorded verdict") {
		t.Fatalf("a replay by default: %v\n%s", err, out)
	}
	out, err = runApp(t, append([]string{"dlq", "replay", "--group", "replay-all" + suffix, "--include-verdicts"}, common...)...)
	if err != nil || !strings.Contains(out, "replayed 2 dead letters") || !strings.Contains(out, "--include-verdicts") {
		t.Fatalf("a replay with --include-verdicts: %v\n%s", err, out)
	}
	seen := map[string]int{}
	testenv.Eventually(t, 20*time.Second, "the replayed records", func() bool { return testenv.MessageCount(t, brokers, source) == 3 })
	for _, m := range testenv.ReadTopic(t, brokers, source) {
		seen[string(m.Value)[13:49]]++
	}
	if seen[declined.String()] != 1 || seen[fault.String()] != 2 {
		t.Fatalf("republished %v; want the verdict once (with --include-verdicts), the fault twice", seen)
	}
}
