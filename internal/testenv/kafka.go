package testenv

import (
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

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
	cfg := sarama.NewConfig()
	// Closing a partition's consumer waits for its fetch in flight, which
	// past the end waits this long for more (sarama's 500ms made reading
	// twelve partitions one by one take six seconds); and the partitions
	// are read side by side.
	cfg.Consumer.MaxWaitTime = 10 * time.Millisecond
	client, err := sarama.NewClient(brokers, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	c, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ends := partitionEnds(client, topic)
	read := make(map[int32][]*sarama.ConsumerMessage, len(ends))
	var mu sync.Mutex
	var wg sync.WaitGroup
	for p, end := range ends {
		if end == 0 {
			continue
		}
		pc, err := c.ConsumePartition(topic, p, sarama.OffsetOldest)
		if err != nil {
			t.Fatal(err)
		}
		var msgs []*sarama.ConsumerMessage
		wg.Add(1)
		go func() {
			defer wg.Done()
			for m := range pc.Messages() {
				msgs = append(msgs, m)
				if m.Offset >= end-1 {
					break
				}
			}
			_ = pc.Close()
			mu.Lock()
			read[p] = msgs
			mu.Unlock()
		}()
	}
	wg.Wait()
	var out []*sarama.ConsumerMessage
	for _, p := range slices.Sorted(maps.Keys(read)) {
		out = append(out, read[p]...)
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
