package pipeline

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
)

// DefaultKafkaVersion is the broker version dev/kafka.sh runs. Kafka 4 refuses
// the protocol versions older than 2.1 (KIP-896) that Watermill's default
// sarama configuration would announce, so the version is always set.
const DefaultKafkaVersion = "4.3.1"

// Metadata keys the pipeline sets on every consumed message. They travel with
// a dead-lettered message as headers and say where it came from.
const (
	MetaKafkaPartition = "kafka_partition"
	MetaKafkaOffset    = "kafka_offset"
	MetaKafkaKey       = "kafka_key"
)

// CommitMode says when consumed offsets are committed to Kafka.
type CommitMode string

const (
	// CommitInterval lets sarama commit acknowledged offsets every
	// [Config.CommitInterval].
	CommitInterval CommitMode = "interval"
	// CommitSync commits synchronously after every acknowledged message.
	CommitSync CommitMode = "sync"
)

func saramaBase(version sarama.KafkaVersion, clientID string) *sarama.Config {
	c := sarama.NewConfig()
	c.Version = version
	c.ClientID = clientID
	return c
}

func subscriberSaramaConfig(cfg Config, version sarama.KafkaVersion, group string) *sarama.Config {
	c := saramaBase(version, "once-"+group)
	cfg.Security.Apply(c)
	c.Consumer.Return.Errors = true
	// A new group must see the topic's history, not only what arrives after it joined.
	c.Consumer.Offsets.Initial = sarama.OffsetOldest
	c.Consumer.Offsets.AutoCommit.Enable = cfg.CommitMode == CommitInterval
	c.Consumer.Offsets.AutoCommit.Interval = cfg.CommitInterval
	if cfg.CommitMode == CommitSync {
		// A broker answers the requests of one connection in order, and
		// sarama sends the offset commit on the connection its fetches use:
		// every synchronous commit waits behind a fetch long-poll of up to
		// MaxWaitTime (500ms by default, measured: ~22 events/s). A short
		// poll bounds that wait, at the price of more fetch requests when idle.
		c.Consumer.MaxWaitTime = 20 * time.Millisecond
	}
	if cfg.SessionTimeout > 0 {
		c.Consumer.Group.Session.Timeout = cfg.SessionTimeout
		c.Consumer.Group.Heartbeat.Interval = cfg.SessionTimeout / 3
	}
	if cfg.HeartbeatInterval > 0 {
		c.Consumer.Group.Heartbeat.Interval = cfg.HeartbeatInterval
	}
	c.Consumer.Group.InstanceId = cfg.InstanceID
	return c
}

// PublisherSaramaConfig is the library's producer configuration, for the
// consumer outbox's events and dead letters, and fit for a team's own
// producer (a test's too): idempotent, acknowledged by all in-sync
// replicas, one request in flight, so a retried send neither duplicates nor
// reorders inside a partition; successes are returned, as a SyncProducer
// needs.
func PublisherSaramaConfig(version sarama.KafkaVersion) *sarama.Config {
	c := saramaBase(version, "once-producer")
	c.Producer.Return.Successes = true
	c.Producer.Return.Errors = true
	c.Producer.Idempotent = true
	c.Producer.RequiredAcks = sarama.WaitForAll
	c.Producer.Retry.Max = 10
	c.Producer.Retry.Backoff = 100 * time.Millisecond
	c.Net.MaxOpenRequests = 1
	return c
}

// ParseKafkaVersion parses a broker version such as "4.3.1".
func ParseKafkaVersion(s string) (sarama.KafkaVersion, error) {
	v, err := sarama.ParseKafkaVersion(s)
	if err != nil {
		return v, err
	}
	if !v.IsAtLeast(sarama.V2_1_0_0) {
		return v, fmt.Errorf("kafka version %s is older than 2.1, which Kafka 4 brokers refuse", s)
	}
	return v, nil
}

// EnsureTopics creates the topics that do not exist yet.
func EnsureTopics(ctx context.Context, brokers []string, version sarama.KafkaVersion, sec KafkaSecurity, partitions int32, replication int16, topics ...string) error {
	ac := saramaBase(version, "once-admin")
	sec.Apply(ac)
	admin, err := sarama.NewClusterAdmin(brokers, ac)
	if err != nil {
		return fmt.Errorf("kafka admin on %v: %w", brokers, err)
	}
	defer admin.Close()
	for _, topic := range topics {
		err := admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: partitions, ReplicationFactor: replication}, false)
		if errors.Is(err, sarama.ErrTopicAuthorizationFailed) || errors.Is(err, sarama.ErrClusterAuthorizationFailed) {
			// A least-privilege principal may not create topics; one that
			// exists already is all it needs.
			if meta, derr := admin.DescribeTopics([]string{topic}); derr == nil && len(meta) == 1 && meta[0].Err == sarama.ErrNoError {
				continue
			}
			return fmt.Errorf("%s may neither CREATE topic %s nor DESCRIBE it (consuming needs READ and DESCRIBE on it): %w", sec.principal(), topic, err)
		}
		if err != nil && !errors.Is(err, sarama.ErrTopicAlreadyExists) {
			return fmt.Errorf("create topic %s: %w", topic, err)
		}
	}
	return nil
}

// GroupLag is how many messages of topic the consumer group has not
// committed yet, summed over partitions (a partition without a committed
// offset counts from 0). Zero means the group drained the topic.
func GroupLag(client sarama.Client, admin sarama.ClusterAdmin, group, topic string) (int64, error) {
	resp, err := admin.ListConsumerGroupOffsets(group, nil)
	if err != nil {
		return 0, fmt.Errorf("offsets of group %s: %w", group, err)
	}
	partitions, err := client.Partitions(topic)
	if err != nil {
		return 0, fmt.Errorf("partitions of %s: %w", topic, err)
	}
	var lag int64
	for _, p := range partitions {
		end, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return 0, fmt.Errorf("end offset of %s/%d: %w", topic, p, err)
		}
		committed := int64(0)
		if b := resp.GetBlock(topic, p); b != nil && b.Offset >= 0 {
			committed = b.Offset
		}
		lag += end - committed
	}
	return lag, nil
}

// unmarshaler never fails: watermill-kafka stops consuming a partition on an
// unmarshal error, and a bad payload must reach the dead-letter topic instead.
// Payload validation happens in the router.
type unmarshaler struct{}

func (unmarshaler) Unmarshal(km *sarama.ConsumerMessage) (*message.Message, error) {
	md := make(message.Metadata, len(km.Headers)+3)
	for _, h := range km.Headers {
		// Reserved by watermill-kafka's marshaler; copying it would make the
		// dead-letter publish fail for messages a Watermill producer wrote.
		if string(h.Key) == kafka.UUIDHeaderKey {
			continue
		}
		md.Set(string(h.Key), string(h.Value))
	}
	partition, offset := strconv.Itoa(int(km.Partition)), strconv.FormatInt(km.Offset, 10)
	md.Set(MetaKafkaPartition, partition)
	md.Set(MetaKafkaOffset, offset)
	md.Set(MetaKafkaKey, string(km.Key))
	// Kafka coordinates name the delivery for logs; the dedup key is the payload's event_id.
	msg := message.NewMessage(km.Topic+"/"+partition+"/"+offset, km.Value)
	msg.Metadata = md
	return msg, nil
}
