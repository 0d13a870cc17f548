package pipeline

import (
	"context"
	"errors"
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

// The subscriber ends a message's context with its partition's session,
// which is no shutdown: a message whose partition was revoked pauses no
// more and is given up as revoked (given back unmarked, for the new
// owner), and only the subscription's end is a shutdown. Judged by the
// context alone, as before, the revocation was a shutdown.
func TestTheEndOfAMessagesSessionIsARevocationNotAShutdown(t *testing.T) {
	for _, c := range []struct {
		name string
		end  func(session, subscription context.CancelFunc)
		want error
	}{
		{"its session ended", func(session, _ context.CancelFunc) { session() }, ErrRevoked},
		{"the subscription ended", func(_, subscription context.CancelFunc) { subscription() }, errShutdown},
	} {
		t.Run(c.name, func(t *testing.T) {
			subscription, endSubscription := context.WithCancel(context.Background())
			defer endSubscription()
			session, endSession := context.WithCancel(subscription) // as sarama derives it
			defer endSession()
			h := &claimHandler{s: newSubscriber(nil, "g", sarama.NewConfig(), slog.New(slog.DiscardHandler)), ctx: subscription}
			run := newClaimRun(session)
			msg, settle := h.message(&sarama.ConsumerMessage{Topic: "t", Partition: 0, Offset: 7}, session, run)
			defer settle()
			// What the chain's first stage remembers of the delivery.
			orig := msg.Context()
			info, _ := claimOf(msg)
			msg.SetContext(context.WithValue(orig, deliveryCtxKey{}, &deliveryInfo{orig: orig, claim: info}))
			p := &Pipeline{stopping: make(chan struct{})}

			c.end(endSession, endSubscription)
			run.finish(time.Minute, closedChan) // nothing under way: at once, as ConsumeClaim does
			if msg.Context().Err() == nil {
				t.Fatal("the message's context did not end")
			}
			if err := p.pause(msg, revokedOf(msg), time.Hour); !errors.Is(err, c.want) {
				t.Fatalf("pause after %s: %v; want %v", c.name, err, c.want)
			}
		})
	}
}
