package pipeline_test

import (
	"context"
	"fmt"
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
