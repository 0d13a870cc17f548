package testenv

import (
	"testing"

	"github.com/IBM/sarama"
)

// MessageCount is how many messages topic holds (the sum of its
// partitions' end offsets); 0 for a topic that does not exist yet.
func MessageCount(t testing.TB, brokers []string, topic string) int64 {
	t.Helper()
	client, err := sarama.NewClient(brokers, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	var n int64
	for _, end := range partitionEnds(client, topic) {
		n += end
	}
	return n
}

// ReadTopic reads every message topic holds now, partition by partition.
func ReadTopic(t testing.TB, brokers []string, topic string) []*sarama.ConsumerMessage {
	t.Helper()
	client, err := sarama.NewClient(brokers, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	c, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var out []*sarama.ConsumerMessage
	for p, end := range partitionEnds(client, topic) {
		if end == 0 {
			continue
		}
		pc, err := c.ConsumePartition(topic, p, sarama.OffsetOldest)
		if err != nil {
			t.Fatal(err)
		}
		for m := range pc.Messages() {
			out = append(out, m)
			if m.Offset >= end-1 {
				break
			}
		}
		_ = pc.Close()
	}
	return out
}

// partitionEnds are the end offsets of topic's partitions; none for a
// topic that does not exist yet.
func partitionEnds(client sarama.Client, topic string) map[int32]int64 {
	ends := map[int32]int64{}
	partitions, err := client.Partitions(topic)
	if err != nil {
		return ends
	}
	for _, p := range partitions {
		if end, err := client.GetOffset(topic, p, sarama.OffsetNewest); err == nil {
			ends[p] = end
		}
	}
	return ends
}
