package dlq_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"

	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/internal/pipelinetest"
	"github.com/once-dev/once/internal/testenv"
)

// Dead letters go back to the topic they came from, with their key, without
// the headers that described the failure; each once, however often replay runs.
func TestReplayRepublishesEachDeadLetterOnce(t *testing.T) {
	brokers := testenv.Brokers(t)
	topic := testenv.Topic(t, brokers, 2)
	dlqTopic := testenv.Topic(t, brokers, 2)
	prod := testenv.Producer(t, brokers)
	for i := range 20 {
		_, _, err := prod.SendMessage(&sarama.ProducerMessage{Topic: dlqTopic, Value: sarama.StringEncoder(fmt.Sprintf("msg-%d", i)),
			Headers: []sarama.RecordHeader{
				{Key: []byte(middleware.PoisonedTopicKey), Value: []byte(topic)},
				{Key: []byte(middleware.ReasonForPoisonedKey), Value: []byte("bad")},
				{Key: []byte("kafka_key"), Value: []byte("order-1")},
				{Key: []byte("traceparent"), Value: []byte("00-abc-def-01")},
			}})
		if err != nil {
			t.Fatal(err)
		}
	}
	cfg := dlq.Config{Brokers: brokers, Sarama: pipelinetest.SaramaConfig(t), DLQTopic: dlqTopic, Topic: "unused", Group: "replay-" + uuid.NewString()[:8]}
	start := time.Now()
	rep, err := dlq.Replay(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("replayed %d in %s", rep.Replayed, time.Since(start))
	if rep.Replayed != 20 || rep.ByTopic[topic] != 20 {
		t.Fatalf("report %+v; want 20 replayed to %s", rep, topic)
	}
	if rep, err := dlq.Replay(context.Background(), cfg); err != nil || rep.Replayed != 0 {
		t.Fatalf("second replay: %+v, %v; want nothing replayed twice", rep, err)
	}
	if n := testenv.MessageCount(t, brokers, topic); n != 20 {
		t.Fatalf("topic holds %d messages, want 20", n)
	}

	// All carry key order-1, so they share one partition: every one of the
	// 20 is read and checked, from whichever partition holds them.
	checked := 0
	for _, m := range testenv.ReadTopic(t, brokers, topic) {
		headers := map[string]string{}
		for _, h := range m.Headers {
			headers[string(h.Key)] = string(h.Value)
		}
		if string(m.Key) != "order-1" || headers["traceparent"] == "" || headers[middleware.ReasonForPoisonedKey] != "" || headers[dlq.HeaderReplayedFrom] == "" {
			t.Fatalf("replayed message key %q headers %v", m.Key, headers)
		}
		checked++
	}
	if checked != 20 {
		t.Fatalf("checked %d replayed messages, want all 20", checked)
	}
}

// A dead letter's age is its event's: the time in its UUIDv7 event_id,
// always before its first charge, not the dead-letter record's, which is new
// each time a replayed event is dead-lettered again.
func TestReplayJudgesAgeByTheEventsOwnTime(t *testing.T) {
	brokers := testenv.Brokers(t)
	dlqTopic := testenv.Topic(t, brokers, 1)
	target := testenv.Topic(t, brokers, 1)
	prod := testenv.Producer(t, brokers)
	old := retentionID(time.Now().Add(-3 * time.Hour))
	fresh := uuid.Must(uuid.NewV7())
	testenv.Publish(t, prod, dlqTopic, "", []byte(fmt.Sprintf(`{"event_id":%q}`, old))) // recorded now, happened 3h ago
	testenv.Publish(t, prod, dlqTopic, "", []byte(fmt.Sprintf(`{"event_id":%q}`, fresh)))
	rep, err := dlq.Replay(context.Background(), dlq.Config{Brokers: brokers, Sarama: pipelinetest.SaramaConfig(t), DLQTopic: dlqTopic, Topic: target,
		Group: "replay-" + uuid.NewString()[:8], MaxAge: time.Hour})
	if err != nil || rep.Replayed != 1 || rep.SkippedStale != 1 {
		t.Fatalf("report %+v, %v; want the event from 3h ago skipped and the fresh one replayed", rep, err)
	}
}

// retentionID is a UUIDv7 whose timestamp is at.
func retentionID(at time.Time) uuid.UUID {
	id := uuid.Must(uuid.NewV7())
	ms := uint64(at.UnixMilli())
	for i := 0; i < 6; i++ {
		id[i] = byte(ms >> (40 - 8*i))
	}
	return id
}

func TestReplaySkipsDeadLettersOlderThanMaxAge(t *testing.T) {
	brokers := testenv.Brokers(t)
	dlqTopic := testenv.Topic(t, brokers, 1)
	target := testenv.Topic(t, brokers, 1)
	testenv.Publish(t, testenv.Producer(t, brokers), dlqTopic, "", []byte("old"))
	rep, err := dlq.Replay(context.Background(), dlq.Config{Brokers: brokers, Sarama: pipelinetest.SaramaConfig(t), DLQTopic: dlqTopic, Topic: target,
		Group: "replay-" + uuid.NewString()[:8], MaxAge: time.Hour, Now: func() time.Time { return time.Now().Add(2 * time.Hour) }})
	if err != nil || rep.Replayed != 0 || rep.SkippedStale != 1 {
		t.Fatalf("report %+v, %v; want the stale dead letter skipped", rep, err)
	}
}

// Review finding: a letter an age filter left out because it was still too
// young was marked done in the filter's progress group, and the same
// filter never replayed it once it was old enough. The replay now stops
// there and the next run starts from it; a MinAge at or above MaxAge is
// refused (every letter it selects would be skipped as stale, for good).
func TestAnAgeFilterLeavesAYoungLetterForLater(t *testing.T) {
	brokers := testenv.Brokers(t)
	dlqTopic := testenv.Topic(t, brokers, 1)
	target := testenv.Topic(t, brokers, 1)
	prod := testenv.Producer(t, brokers)
	id := uuid.Must(uuid.NewV7())
	testenv.Publish(t, prod, dlqTopic, "k", []byte(`{"event_id":"`+id.String()+`"}`))
	cfg := dlq.Config{Brokers: brokers, Sarama: pipelinetest.SaramaConfig(t), DLQTopic: dlqTopic, Topic: target,
		Group: "age-" + uuid.NewString()[:8], Filter: dlq.Filter{MinAge: time.Hour}}
	now := time.Now()
	cfg.Now = func() time.Time { return now }
	rep, err := dlq.Replay(context.Background(), cfg)
	if err != nil || rep.Replayed != 0 || rep.NotYet != 1 {
		t.Fatalf("a letter younger than the filter: %+v (%v); want it left for later", rep, err)
	}
	later := now.Add(2 * time.Hour)
	cfg.Now = func() time.Time { return later }
	if rep, err = dlq.Replay(context.Background(), cfg); err != nil || rep.Replayed != 1 {
		t.Fatalf("two hours later, the same filter: %+v (%v); want the letter replayed", rep, err)
	}
	cfg.MaxAge = time.Hour
	if _, err := dlq.Replay(context.Background(), cfg); err == nil {
		t.Fatal("a MinAge at MaxAge was accepted")
	}
}

// A letter asked for past its partition's end is an error at once (review
// finding: the read waited for a record not yet written, holding a Kafka
// consumer for as long as the console's visitor waited).
func TestReadingALetterPastTheEndFailsAtOnce(t *testing.T) {
	brokers := testenv.Brokers(t)
	dlqTopic := testenv.Topic(t, brokers, 1)
	prod := testenv.Producer(t, brokers)
	if _, _, err := prod.SendMessage(&sarama.ProducerMessage{Topic: dlqTopic, Value: sarama.StringEncoder(`{}`),
		Headers: []sarama.RecordHeader{{Key: []byte(middleware.ReasonForPoisonedKey), Value: []byte("bad")}}}); err != nil {
		t.Fatal(err)
	}
	cfg := dlq.Config{Brokers: brokers, Sarama: pipelinetest.SaramaConfig(t), DLQTopic: dlqTopic}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if e, err := dlq.ReadLetter(ctx, cfg, 0, 0); err != nil || e.Reason != "bad" {
		t.Fatalf("the letter at 0: %+v, %v", e, err)
	}
	_, err := dlq.ReadLetter(ctx, cfg, 0, 1)
	if err == nil || ctx.Err() != nil || !strings.Contains(err.Error(), "no such letter") {
		t.Fatalf("the letter at 1 of a partition of one: %v (context: %v); want no such letter, at once", err, ctx.Err())
	}
}

// A dry run judges every letter as the replay after it will, from the
// same progress (a letter an earlier replay sent is not counted again),
// and sends nothing and moves no progress: the console's confirmation
// shows what the replay will do, not every letter on the topic.
func TestADryRunSaysWhatTheReplayWillDo(t *testing.T) {
	brokers := testenv.Brokers(t)
	dlqTopic := testenv.Topic(t, brokers, 1)
	target := testenv.Topic(t, brokers, 1)
	prod := testenv.Producer(t, brokers)
	publish := func(id uuid.UUID) {
		testenv.Publish(t, prod, dlqTopic, "k", []byte(fmt.Sprintf(`{"event_id":%q}`, id)))
	}
	publish(uuid.Must(uuid.NewV7()))
	cfg := dlq.Config{Brokers: brokers, Sarama: pipelinetest.SaramaConfig(t), DLQTopic: dlqTopic, Topic: target,
		Group: "dry-" + uuid.NewString()[:8], MaxAge: time.Hour}
	if rep, err := dlq.Replay(context.Background(), cfg); err != nil || rep.Replayed != 1 {
		t.Fatalf("the first replay: %+v, %v", rep, err)
	}
	publish(uuid.Must(uuid.NewV7()))
	publish(retentionID(time.Now().Add(-3 * time.Hour)))

	dry := cfg
	dry.DryRun = true
	seen := map[dlq.Outcome]int{}
	dry.Each = func(_ dlq.Entry, o dlq.Outcome) { seen[o]++ }
	for range 2 { // twice: the first moved nothing
		clear(seen)
		rep, err := dlq.Replay(context.Background(), dry)
		if err != nil || rep.Replayed != 1 || rep.SkippedStale != 1 || seen[dlq.Replayed] != 1 || seen[dlq.SkippedStale] != 1 {
			t.Fatalf("the dry run: %+v %v, told %v; want 1 to replay and 1 stale, not the letter replayed before", rep, err, seen)
		}
	}
	if n := testenv.MessageCount(t, brokers, target); n != 1 {
		t.Fatalf("%d messages on the target after the dry runs; want only the first replay's 1", n)
	}
	if rep, err := dlq.Replay(context.Background(), cfg); err != nil || rep.Replayed != 1 || rep.SkippedStale != 1 {
		t.Fatalf("the replay after the dry runs: %+v, %v; want what they said", rep, err)
	}
}

// A route whose dead-letter topic was never made (it is made with its
// first letter) has nothing to replay: a replay of every route goes on to
// the next (review finding: it stopped the console's "replay all").
func TestAReplayOfEveryRouteSkipsADeadLetterTopicNeverMade(t *testing.T) {
	brokers := testenv.Brokers(t)
	dlqTopic := testenv.Topic(t, brokers, 1)
	target := testenv.Topic(t, brokers, 1)
	testenv.Publish(t, testenv.Producer(t, brokers), dlqTopic, "k", []byte(`{}`))
	never := "never-made-" + uuid.NewString()[:8]
	rep, err := dlq.ReplayRoutes(context.Background(), dlq.Config{Brokers: brokers, Sarama: pipelinetest.SaramaConfig(t), Group: "routes-" + uuid.NewString()[:8]},
		[]dlq.Route{{Topic: target, DLQTopic: never}, {Topic: target, DLQTopic: dlqTopic}})
	if err != nil || rep.Replayed != 1 {
		t.Fatalf("a replay of a route without a dead-letter topic and one with a letter: %+v, %v; want the letter replayed", rep, err)
	}
}

// Review finding: retention deleting letters ahead of a replay's read
// makes sarama close the partition consumer's Messages (ErrOffsetOutOfRange);
// Replay read a nil message and panicked. It now returns an error.
func TestAReplayOutrunByRetentionFailsWithoutPanicking(t *testing.T) {
	brokers := testenv.Brokers(t)
	dlqTopic := testenv.Topic(t, brokers, 1)
	target := testenv.Topic(t, brokers, 1)
	pad := strings.Repeat("x", 2000)
	var msgs []*sarama.ProducerMessage
	for range 3000 {
		msgs = append(msgs, &sarama.ProducerMessage{Topic: dlqTopic, Value: sarama.StringEncoder(`{"event_id":"` + uuid.Must(uuid.NewV7()).String() + `","pad":"` + pad + `"}`)})
	}
	if err := testenv.Producer(t, brokers).SendMessages(msgs); err != nil {
		t.Fatal(err)
	}
	admin := testenv.Admin(t, brokers)
	deleted := 0
	cfg := dlq.Config{Brokers: brokers, Sarama: pipelinetest.SaramaConfig(t), DLQTopic: dlqTopic, Topic: target,
		Group: "retention-" + uuid.NewString()[:8], DryRun: true,
		Each: func(dlq.Entry, dlq.Outcome) {
			if deleted == 0 {
				if err := admin.DeleteRecords(dlqTopic, map[int32]int64{0: 2900}); err != nil {
					t.Errorf("delete records: %v", err)
				}
			}
			deleted++
		}}
	rep, err := dlq.Replay(context.Background(), cfg)
	if deleted == 0 {
		t.Fatal("no letter was read: the deletion was not staged")
	}
	// Either sarama had fetched past 2900 already (the read goes on, and
	// ends at the end), or its read stopped: an error, never a panic.
	t.Logf("read %d letters; report %+v, err %v", deleted, rep, err)
	if err == nil && rep.Replayed+rep.SkippedStale < 100 {
		t.Fatalf("no error, and only %d letters judged", rep.Replayed)
	}
}

// Review finding: nothing kept two replays of one progress group apart (a
// double-clicked button, two operators of one console): both read from the
// same offset and each letter was sent twice.
func TestTwoReplaysAtOnceSendEachLetterOnce(t *testing.T) {
	brokers := testenv.Brokers(t)
	dlqTopic := testenv.Topic(t, brokers, 1)
	target := testenv.Topic(t, brokers, 1)
	var msgs []*sarama.ProducerMessage
	for range 100 {
		msgs = append(msgs, &sarama.ProducerMessage{Topic: dlqTopic, Value: sarama.StringEncoder(`{"event_id":"` + uuid.Must(uuid.NewV7()).String() + `"}`)})
	}
	if err := testenv.Producer(t, brokers).SendMessages(msgs); err != nil {
		t.Fatal(err)
	}
	cfg := dlq.Config{Brokers: brokers, Sarama: pipelinetest.SaramaConfig(t), DLQTopic: dlqTopic, Topic: target, Group: "twice-" + uuid.NewString()[:8]}
	var wg sync.WaitGroup
	var sent atomic.Int64
	for range 2 {
		wg.Go(func() {
			rep, err := dlq.Replay(context.Background(), cfg)
			if err != nil {
				t.Error(err)
			}
			sent.Add(rep.Replayed)
		})
	}
	wg.Wait()
	if n := testenv.MessageCount(t, brokers, target); n != 100 || sent.Load() != 100 {
		t.Fatalf("two replays at once sent %d (reported %d); want each of the 100 letters once", n, sent.Load())
	}
}

// Review finding: a letter that cannot be sent (its topic deleted, or not
// writable) stopped the replay: every later replay stopped at it, the
// other partitions and routes included. It now holds its own partition
// only (its letters wait, none is lost), and the error names it.
func TestALetterThatCannotBeSentHoldsItsPartitionOnly(t *testing.T) {
	brokers := testenv.Brokers(t)
	dlqTopic := testenv.Topic(t, brokers, 2)
	otherDLQ := testenv.Topic(t, brokers, 1)
	target := testenv.Topic(t, brokers, 1)
	pc := pipelinetest.SaramaConfig(t)
	pc.Producer.Partitioner = sarama.NewManualPartitioner
	prod, err := sarama.NewSyncProducer(brokers, pc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { prod.Close() })
	retired := "retired-" + uuid.NewString()[:8]
	send := func(topic string, partition int32, to string) {
		if _, _, err := prod.SendMessage(&sarama.ProducerMessage{Topic: topic, Partition: partition, Value: sarama.StringEncoder(`{"event_id":"` + uuid.Must(uuid.NewV7()).String() + `"}`),
			Headers: []sarama.RecordHeader{{Key: []byte(middleware.PoisonedTopicKey), Value: []byte(to)}}}); err != nil {
			t.Fatal(err)
		}
	}
	send(dlqTopic, 0, retired) // cannot be sent: the topic does not exist
	send(dlqTopic, 0, target)  // behind it: waits
	send(dlqTopic, 1, target)  // another partition
	send(otherDLQ, 0, target)  // another route
	sc := pipelinetest.SaramaConfig(t)
	sc.Producer.Retry.Max = 1
	sc.Metadata.AllowAutoTopicCreation = false
	cfg := dlq.Config{Brokers: brokers, Sarama: sc, Group: "held-" + uuid.NewString()[:8]}
	routes := []dlq.Route{{Topic: target, DLQTopic: dlqTopic}, {Topic: target, DLQTopic: otherDLQ}}
	rep, err := dlq.ReplayRoutes(context.Background(), cfg, routes)
	if err == nil || !strings.Contains(err.Error(), retired) || rep.Replayed != 2 {
		t.Fatalf("a replay with a letter that cannot be sent: %+v, %v; want the other partition's and route's 2 sent and the error naming %s", rep, err, retired)
	}
	rep, err = dlq.ReplayRoutes(context.Background(), cfg, routes)
	if err == nil || rep.Replayed != 0 {
		t.Fatalf("the next replay: %+v, %v; want it held at the same letter again, nothing sent twice", rep, err)
	}
	if n := testenv.MessageCount(t, brokers, target); n != 2 {
		t.Fatalf("%d on the target; want 2", n)
	}
}

// A replay bounded by a dry run's ends sends what the dry run read, and
// not the letters that came after.
func TestAReplayUntilADryRunsEndsSendsWhatItRead(t *testing.T) {
	brokers := testenv.Brokers(t)
	dlqTopic := testenv.Topic(t, brokers, 2)
	target := testenv.Topic(t, brokers, 1)
	prod := testenv.Producer(t, brokers)
	for i := range 4 {
		testenv.Publish(t, prod, dlqTopic, fmt.Sprint("k", i), []byte(`{}`))
	}
	cfg := dlq.Config{Brokers: brokers, Sarama: pipelinetest.SaramaConfig(t), DLQTopic: dlqTopic, Topic: target, Group: "until-" + uuid.NewString()[:8], DryRun: true}
	dry, err := dlq.Replay(context.Background(), cfg)
	if err != nil || dry.Replayed != 4 {
		t.Fatalf("the dry run: %+v, %v", dry, err)
	}
	for i := range 6 {
		testenv.Publish(t, prod, dlqTopic, fmt.Sprint("later", i), []byte(`{}`))
	}
	cfg.DryRun, cfg.Until = false, dry.Ends
	if rep, err := dlq.Replay(context.Background(), cfg); err != nil || rep.Replayed != 4 {
		t.Fatalf("the replay until the dry run's ends: %+v, %v; want its 4", rep, err)
	}
	cfg.Until = nil
	if rep, err := dlq.Replay(context.Background(), cfg); err != nil || rep.Replayed != 6 {
		t.Fatalf("the next replay: %+v, %v; want the 6 that came later", rep, err)
	}
}
