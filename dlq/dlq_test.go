package dlq_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"

	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/pipeline"
)

func saramaConfig(t *testing.T) *sarama.Config {
	v, err := pipeline.ParseKafkaVersion(pipeline.DefaultKafkaVersion)
	if err != nil {
		t.Fatal(err)
	}
	return pipeline.PublisherSaramaConfig(v)
}

func count(t *testing.T, brokers []string, topic string) int64 {
	t.Helper()
	client, err := sarama.NewClient(brokers, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	partitions, _ := client.Partitions(topic)
	var n int64
	for _, p := range partitions {
		end, _ := client.GetOffset(topic, p, sarama.OffsetNewest)
		n += end
	}
	return n
}

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
	cfg := dlq.Config{Brokers: brokers, Sarama: saramaConfig(t), DLQTopic: dlqTopic, Topic: "unused", Group: "replay-" + uuid.NewString()[:8]}
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
	if n := count(t, brokers, topic); n != 20 {
		t.Fatalf("topic holds %d messages, want 20", n)
	}

	c, err := sarama.NewConsumer(brokers, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// All carry key order-1, so they share one partition.
	for _, p := range []int32{0, 1} {
		pc, err := c.ConsumePartition(topic, p, sarama.OffsetOldest)
		if err != nil {
			t.Fatal(err)
		}
		select {
		case m := <-pc.Messages():
			headers := map[string]string{}
			for _, h := range m.Headers {
				headers[string(h.Key)] = string(h.Value)
			}
			if string(m.Key) != "order-1" || headers["traceparent"] == "" || headers[middleware.ReasonForPoisonedKey] != "" || headers[dlq.HeaderReplayedFrom] == "" {
				t.Fatalf("replayed message key %q headers %v", m.Key, headers)
			}
		case <-time.After(2 * time.Second):
		}
		pc.Close()
	}
}

func TestReplaySkipsDeadLettersOlderThanMaxAge(t *testing.T) {
	brokers := testenv.Brokers(t)
	dlqTopic := testenv.Topic(t, brokers, 1)
	target := testenv.Topic(t, brokers, 1)
	testenv.Publish(t, testenv.Producer(t, brokers), dlqTopic, "", []byte("old"))
	rep, err := dlq.Replay(context.Background(), dlq.Config{Brokers: brokers, Sarama: saramaConfig(t), DLQTopic: dlqTopic, Topic: target,
		Group: "replay-" + uuid.NewString()[:8], MaxAge: time.Hour, Now: func() time.Time { return time.Now().Add(2 * time.Hour) }})
	if err != nil || rep.Replayed != 0 || rep.SkippedStale != 1 {
		t.Fatalf("report %+v, %v; want the stale dead letter skipped", rep, err)
	}
}
