package pipeline_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"

	"github.com/once-dev/once/internal/pipelinetest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/outbox"
	"github.com/once-dev/once/pipeline"
)

// TestWatermillPubSubContract runs Watermill's own Pub/Sub test suite
// (pubsub/tests) on the real broker against the pipeline's Kafka
// subscriber (NewSubscriber) and the publisher its outbox forwarder sends
// with (outbox.KafkaPublisher on a producer made from
// PublisherSaramaConfig): once as per-event groups use the subscriber, one
// message of a partition at a time, and once as batched groups do, with a
// window of messages of a partition in flight.
func TestWatermillPubSubContract(t *testing.T) {
	brokers := testenv.Brokers(t)
	// One producer for every publisher, as a pipeline has one: the
	// publisher's Close leaves it to its owner (outbox.KafkaPublisher).
	producer, err := sarama.NewSyncProducer(brokers, pipelinetest.SaramaConfig(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = producer.Close() })
	for _, c := range []struct {
		name   string
		window int
		// ordered: one message of a partition at a time keeps a key's
		// messages in order (the subscriber's doc comment); a window of
		// them in flight is handed out in order but may be acknowledged
		// in any, and the batcher, not the subscriber, keeps the order.
		ordered bool
	}{
		{name: "window_1", window: 1, ordered: true},
		{name: "window_8", window: 8, ordered: false},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			pubSub := func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
				t.Helper()
				sub, err := pipeline.NewSubscriber(brokers, group, pipeline.DefaultKafkaVersion, pipeline.KafkaSecurity{}, c.window, quietLogger())
				if err != nil {
					t.Fatal(err)
				}
				return contractPublisher{outbox.KafkaPublisher{Producer: producer}},
					&contractSubscriber{Subscriber: sub, brokers: brokers, closing: make(chan struct{})}
			}
			tests.TestPubSub(t, tests.Features{
				ConsumerGroups: true,
				// Kafka delivers at least once (a rebalance before a commit
				// delivers again); the claim, not the subscriber, makes the
				// effect happen once.
				ExactlyOnceDelivery: false,
				// Per key, which is what Kafka and the specification give:
				// contractPublisher keys each message by its payload, which
				// the suite's order test groups messages by.
				GuaranteedOrder: c.ordered,
				Persistent:      true,
				// Every subscriber is a member of a consumer group, which
				// reads what the group has not committed yet; the suite's
				// subscribers of one test share one group (contractGroup),
				// so a new one does not read what the group consumed.
				NewSubscriberReceivesOldMessages: false,
				// The subscriber gives each message a context of its own:
				// nothing of the publisher's context crosses Kafka.
				ContextPreserved: false,
				// The suite's full message counts (5,000 messages to 50
				// subscribers of one group, 10,000 published at once, 300
				// given back): about 70s for both windows, most of it the
				// 100ms wait before a given-back message is handed out
				// again. go test -short runs the suite's short counts.
				ForceShort: false,
				// RestartServiceCommand is left unset, so the suite skips
				// TestReconnect (10,000 messages around two broker restarts
				// on the broker every test of the run shares): a broker
				// killed and started again mid-stream is an e2e fault
				// scenario's (TestBrokerCrash in e2e/faults_test.go).
			}, func(t *testing.T) (message.Publisher, message.Subscriber) {
				skipUnclaimed(t)
				return pubSub(t, contractGroup(t))
			}, pubSub)
		})
	}
}

// unclaimed are the suite's tests that need what the subscriber does not
// claim, with the reason; no Features field says so, and the suite hands
// its constructor the test's own t, so the constructor skips them.
var unclaimed = map[string]string{
	// A pipeline's subscriber is one member of one consumer group, whose
	// topics are fixed before its session begins: a subscriber made by
	// NewSubscriber reads one topic, subscribed once. Each of these
	// subscribes one subscriber to several topics.
	"TestConcurrentSubscribeMultipleTopics": "subscribes one subscriber to 20 topics; NewSubscriber's reads one topic",
	"TestTopic":                             "subscribes one subscriber to two topics; NewSubscriber's reads one topic",
	// Subscribes again, on the same subscriber, after the first
	// subscription's context ended: a pipeline subscribes each of its
	// subscribers (one per consumer group, made by New) once.
	"TestSubscribeCtx": "subscribes one subscriber a second time; NewSubscriber's is subscribed once",
}

// skipUnclaimed skips the suite's test t if it needs what the subscriber
// does not claim (see unclaimed).
func skipUnclaimed(t *testing.T) {
	t.Helper()
	if reason, ok := unclaimed[suiteTest(t)]; ok {
		t.Skipf("not claimed by the pipeline's subscriber: %s", reason)
	}
}

// suiteTest is the name of the suite's test t runs in: the suite names
// each test's subtest after the test's id, under the test's name.
func suiteTest(t *testing.T) string {
	parts := strings.Split(t.Name(), "/")
	if len(parts) < 2 {
		return ""
	}
	return parts[len(parts)-2]
}

// contractGroup is the consumer group of the suite's test t: every
// subscriber of one test shares it (they are the test's consumers, and one
// continues where the one before it stopped), and no other test has it.
func contractGroup(t *testing.T) string {
	return "contract." + strings.ReplaceAll(t.Name(), "/", ".")
}

// contractUUID is the header that carries a Watermill message's UUID
// through Kafka for the suite, which names messages by their UUID. Neither
// side of the pipeline does: a delivered message is named by its Kafka
// coordinates (topic/partition/offset), and an event by the id in its
// payload.
const contractUUID = "contract_uuid"

// contractPublisher is the outbox's Kafka publisher, with each message's
// UUID in a header and, unless the message names its key (outbox.MetaKey),
// its payload as its key: the suite publishes without keys, and a key's
// messages share a partition, which is where Kafka keeps order.
type contractPublisher struct{ outbox.KafkaPublisher }

func (p contractPublisher) Publish(topic string, msgs ...*message.Message) error {
	out := make([]*message.Message, len(msgs))
	for i, m := range msgs {
		c := m.Copy() // the suite keeps its messages to compare
		c.Metadata.Set(contractUUID, m.UUID)
		if c.Metadata.Get(outbox.MetaKey) == "" {
			c.Metadata.Set(outbox.MetaKey, string(m.Payload))
		}
		out[i] = c
	}
	return p.KafkaPublisher.Publish(topic, out...)
}

// contractPartitions is how many partitions each of the suite's topics has.
const contractPartitions = 4

// contractSubscriber is the pipeline's subscriber, with the UUID each
// message was published with (contractUUID) given back to it, and topics
// made as a pipeline makes them (the broker creates none by itself).
type contractSubscriber struct {
	message.Subscriber
	brokers []string

	closing    chan struct{}
	closeOnce  sync.Once
	forwarders sync.WaitGroup
}

// SubscribeInitialize creates topic (the suite calls it before it
// publishes).
func (s *contractSubscriber) SubscribeInitialize(topic string) error {
	version, err := pipeline.ParseKafkaVersion(pipeline.DefaultKafkaVersion)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return pipeline.EnsureTopics(ctx, s.brokers, version, pipeline.KafkaSecurity{}, contractPartitions, 1, topic)
}

// Subscribe hands on the subscriber's messages, each the same message (its
// context and acknowledgement are the subscriber's), renamed: one at a
// time, so a message the subscriber holds back stays held back.
func (s *contractSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	in, err := s.Subscriber.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	out := make(chan *message.Message)
	s.forwarders.Add(1)
	go func() {
		defer s.forwarders.Done()
		defer close(out)
		for {
			select {
			case msg, ok := <-in:
				if !ok {
					return
				}
				if id := msg.Metadata.Get(contractUUID); id != "" {
					msg.UUID = id
				}
				select {
				case out <- msg:
				case <-s.closing:
					return
				}
			case <-s.closing:
				return
			}
		}
	}()
	return out, nil
}

// Close closes the subscriber, and then every channel it returned: the
// suite checks that they are closed once Close returns.
func (s *contractSubscriber) Close() error {
	err := s.Subscriber.Close()
	s.closeOnce.Do(func() { close(s.closing) })
	s.forwarders.Wait()
	if err != nil {
		return fmt.Errorf("pipeline subscriber: %w", err)
	}
	return nil
}
