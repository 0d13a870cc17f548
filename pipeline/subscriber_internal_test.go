package pipeline

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/IBM/sarama"
)

// A group on two topics whose second subscription fails (no broker at
// Run) closes the first topic's channel too, so its handler ends instead of
// waiting for a session that never begins (review finding: it leaked the
// handler and its goroutines).
func TestAFailedSubscriptionClosesTheGroupsOtherTopics(t *testing.T) {
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V4_3_1_0
	cfg.Metadata.Retry.Max = 0
	cfg.Net.DialTimeout = 200 * time.Millisecond
	s := newSubscriber([]string{"127.0.0.1:1"}, "g", cfg, slog.New(slog.DiscardHandler))
	s.addTopic("a", 1, nil)
	s.addTopic("b", 1, nil)
	ctx := context.Background()
	a, err := s.Subscribe(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Subscribe(ctx, "b"); err == nil {
		t.Fatal("subscribing with no broker to reach succeeded")
	}
	select {
	case _, open := <-a:
		if open {
			t.Fatal("a message on a group that never joined")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("topic a's channel stayed open after the group's subscription failed")
	}
}
