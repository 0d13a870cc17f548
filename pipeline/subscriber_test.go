package pipeline_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/pipeline"
)

// With a window of messages in flight, the committed offset never passes a
// message that is not acknowledged yet, however many after it are: a crash
// then redelivers from it. A message given back (nacked) is handed out
// again and holds the offset until it is acknowledged.
func TestTheWindowCommitsOnlyBelowTheFirstUnacknowledgedMessage(t *testing.T) {
	brokers := testenv.Brokers(t)
	topic := testenv.Topic(t, brokers, 1)
	group := uniqueGroup("window")
	producer := testenv.Producer(t, brokers)
	const n = 8
	for i := range n {
		testenv.Publish(t, producer, topic, "k", []byte(fmt.Sprint(i)))
	}
	sub, err := pipeline.NewSubscriber(brokers, group, pipeline.DefaultKafkaVersion, pipeline.KafkaSecurity{}, 10, quietLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	receive := func() *message.Message {
		select {
		case m := <-msgs:
			return m
		case <-time.After(30 * time.Second):
			t.Fatal("no message in 30s")
			return nil
		}
	}
	var first []*message.Message
	for range n {
		first = append(first, receive()) // all in flight at once: the window is 10
	}
	admin := testenv.Admin(t, brokers)
	committed := func() int64 {
		if off, ok := testenv.CommittedOffsets(t, admin, group, topic)[0]; ok {
			return off
		}
		return -1
	}
	// Acknowledge all but offsets 0 and 3; give 3 back.
	for i, m := range first {
		switch i {
		case 0:
		case 3:
			m.Nack()
		default:
			m.Ack()
		}
	}
	time.Sleep(2500 * time.Millisecond) // past two commit intervals
	if off := committed(); off > 0 {
		t.Fatalf("committed offset %d while offset 0 is not acknowledged", off)
	}
	first[0].Ack()
	// The given-back 3 is handed out again in its turn, after 0.
	again := receive()
	if string(again.Payload) != "3" {
		t.Fatalf("handed out again: %q, want the given-back 3", again.Payload)
	}
	testenv.Eventually(t, 10*time.Second, "offset 3 committed", func() bool { return committed() == 3 })
	time.Sleep(2500 * time.Millisecond)
	if off := committed(); off != 3 {
		t.Fatalf("committed offset %d while offset 3 (given back, handed out again) is not acknowledged", off)
	}
	again.Ack()
	testenv.Eventually(t, 10*time.Second, fmt.Sprintf("offset %d committed", n), func() bool { return committed() == n })
}

// A message's context ends as soon as the message is acknowledged or given
// back, in whatever order a window's messages are, and when its
// partition's session ends: what a handler started on it stops with it
// (Watermill's TestMessageCtx; it lived until the subscriber closed).
func TestAMessageContextEndsWhenItIsSettledOrItsSessionEnds(t *testing.T) {
	brokers := testenv.Brokers(t)
	for _, window := range []int{1, 4} {
		t.Run(fmt.Sprintf("window_%d", window), func(t *testing.T) {
			topic := testenv.Topic(t, brokers, 1)
			group := uniqueGroup("message-context")
			producer := testenv.Producer(t, brokers)
			for i := range 3 {
				testenv.Publish(t, producer, topic, "k", []byte(fmt.Sprint(i)))
			}
			msgs := subscribeFor(t, brokers, group, topic, window)
			receive := func() *message.Message {
				t.Helper()
				select {
				case m := <-msgs:
					return m
				case <-time.After(30 * time.Second):
					t.Fatal("no message in 30s")
					return nil
				}
			}
			alive := func(m *message.Message, when string) {
				t.Helper()
				if err := m.Context().Err(); err != nil {
					t.Fatalf("the context of message %s ended %s: %v", m.Payload, when, err)
				}
			}
			ends := func(m *message.Message, when string) {
				t.Helper()
				select {
				case <-m.Context().Done():
				case <-time.After(30 * time.Second):
					t.Fatalf("the context of message %s did not end within 30s %s", m.Payload, when)
				}
			}

			var kept *message.Message // unsettled, until its session ends
			if window == 1 {
				m0 := receive()
				alive(m0, "before it was acknowledged")
				m0.Ack()
				ends(m0, "after it was acknowledged")
				m1 := receive()
				m1.Nack()
				ends(m1, "after it was given back")
				kept = receive()
				if string(kept.Payload) != "1" {
					t.Fatalf("after 1 was given back, %q was handed out", kept.Payload)
				}
			} else {
				m0, m1, m2 := receive(), receive(), receive() // all in flight
				m2.Ack()
				ends(m2, "after it was acknowledged behind two that are not")
				m1.Nack()
				ends(m1, "after it was given back behind one that is not")
				alive(m0, "while it is neither acknowledged nor given back")
				kept = m0
			}
			alive(kept, "before its session ended")
			// A second member of the group: the rebalance ends the first
			// member's session, which revokes the partition.
			subscribeFor(t, brokers, group, topic, window)
			ends(kept, "after its partition's session ended")
		})
	}
}

// subscribeFor subscribes a new subscriber of group to topic until the test
// ends.
func subscribeFor(t *testing.T, brokers []string, group, topic string, window int) <-chan *message.Message {
	t.Helper()
	sub, err := pipeline.NewSubscriber(brokers, group, pipeline.DefaultKafkaVersion, pipeline.KafkaSecurity{}, window, quietLogger())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() {
		cancel()
		_ = sub.Close()
	})
	msgs, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	return msgs
}

// A message's context now ends with its partition's session, and the
// pipeline still tells a revocation from a shutdown: a message whose
// attempt waits on a database that went silent, when another instance
// takes its partition, is given up as revoked (acknowledged unmarked, for
// the new owner), not as stopped by a shutdown, which the end of its
// context alone would have said.
func TestAMessageWhosePartitionIsRevokedMidAttemptIsGivenUpAsRevoked(t *testing.T) {
	e := newEnv(t, 1)
	r := &recorder{group: uniqueGroup("revoked")}
	silentPool, proxy := testenv.ProxiedPostgres(t, e.Pool)
	proxy.BlackHole(true) // the attempt waits, up to StatementTimeout (30s)
	var delivered atomic.Int64
	ended := make(chan error, 1)
	cfgA := e.config()
	cfgA.DB = silentPool
	cfgA.Hooks.OnDelivered = func(pipeline.Delivery) { delivered.Add(1) }
	cfgA.Topics = []pipeline.Binding{e.topicOf(pipeline.Group[confirmed]{Name: r.group, Handle: r.Handle, Extra: pipeline.Extra{
		Observe: []message.HandlerMiddleware{func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				out, err := h(msg)
				select {
				case ended <- err: // the first delivery's end
				default:
				}
				return out, err
			}
		}},
	}})}
	stopA := run(t, cfgA)
	testenv.Publish(t, e.Prod, e.Topic, "k", payload(t, validEvent(t, "1.00")))
	testenv.Eventually(t, 30*time.Second, "the message delivered, its attempt waiting on the silent database", func() bool {
		return delivered.Load() == 1 && proxy.Swallowed()
	})

	run(t, e.config(group(r))) // a second instance: the rebalance revokes the partition
	select {
	case err := <-ended:
		if !errors.Is(err, pipeline.ErrRevoked) {
			t.Fatalf("the message was given up with %v; want %v", err, pipeline.ErrRevoked)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the message was not given up within 20s of the rebalance")
	}
	stopA() // the partition may have gone back to it
	testenv.Eventually(t, 30*time.Second, "the other instance processed the message", func() bool { return effects(t, e.Pool, r.group) == 1 })
}
