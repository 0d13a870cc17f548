package pipeline

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
)

// subscriber is a Watermill subscriber on a sarama consumer group that keeps
// up to window messages of each partition in flight, and marks a partition's
// offset only up to its first message not acknowledged yet: a crash
// redelivers from there, and whatever was processed after it is skipped by
// its claim.
//
// With a window of 1 it behaves as watermill-kafka's subscriber does, one
// message per partition at a time, which keeps a partition's events in
// order for per-event handlers. A batched group needs more than one message
// of a partition at once, or a batch could never hold more events than the
// consumer owns partitions.
//
// A partition's consumption ends with its session: messages still in flight
// are not waited for (their offsets are not marked; the partition's next
// owner receives them again), so no slow message holds a rebalance up.
type subscriber struct {
	brokers []string
	group   string
	config  *sarama.Config
	window  int
	// onSend, if set, is told of every message just before it is handed to
	// the router, in its partition's order (a batched group's ordering).
	onSend func(*message.Message)
	log    *slog.Logger

	closing   chan struct{}
	closeOnce sync.Once
	running   sync.WaitGroup
}

// nackResendSleep is how long a message given back unacknowledged waits
// before it is handed out again (watermill-kafka's default).
const nackResendSleep = 100 * time.Millisecond

func newSubscriber(brokers []string, group string, config *sarama.Config, window int, log *slog.Logger) *subscriber {
	return &subscriber{brokers: brokers, group: group, config: config, window: max(window, 1), log: log, closing: make(chan struct{})}
}

// Subscribe joins the consumer group on topic. The channel closes when ctx
// ends or the subscriber is closed.
func (s *subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	select {
	case <-s.closing:
		return nil, errors.New("pipeline: subscriber closed")
	default:
	}
	cg, err := sarama.NewConsumerGroup(s.brokers, s.group, s.config)
	if err != nil {
		return nil, fmt.Errorf("kafka consumer group %s on %v: %w", s.group, s.brokers, err)
	}
	ctx, cancel := context.WithCancel(ctx)
	out := make(chan *message.Message)
	s.running.Add(1)
	go func() {
		defer s.running.Done()
		defer close(out)
		defer cancel()
		go func() {
			select {
			case <-s.closing:
				cancel()
			case <-ctx.Done():
			}
		}()
		errorsDone := make(chan struct{})
		go func() {
			defer close(errorsDone)
			for err := range cg.Errors() {
				s.log.Warn("kafka consumer group error", "consumer_group", s.group, "topic", topic, "err", err)
			}
		}()
		h := &claimHandler{s: s, ctx: ctx, out: out}
		for ctx.Err() == nil {
			// Consume returns at every rebalance; the loop joins again.
			if err := cg.Consume(ctx, []string{topic}, h); err != nil && ctx.Err() == nil {
				if errors.Is(err, sarama.ErrClosedConsumerGroup) {
					break
				}
				s.log.Warn("kafka: consuming failed; joining the group again", "consumer_group", s.group, "topic", topic, "err", err)
				select {
				case <-ctx.Done():
				case <-time.After(time.Second):
				}
			}
		}
		if err := cg.Close(); err != nil {
			s.log.Warn("kafka: closing the consumer group", "consumer_group", s.group, "err", err)
		}
		<-errorsDone
	}()
	return out, nil
}

// Close stops every subscription and waits for them to leave the group.
func (s *subscriber) Close() error {
	s.closeOnce.Do(func() { close(s.closing) })
	s.running.Wait()
	return nil
}

type claimHandler struct {
	s   *subscriber
	ctx context.Context
	out chan<- *message.Message
}

func (h *claimHandler) Setup(sarama.ConsumerGroupSession) error   { return nil }
func (h *claimHandler) Cleanup(sarama.ConsumerGroupSession) error { return nil }

// inFlight is a message of the partition handed out and not acknowledged.
type inFlight struct {
	km    *sarama.ConsumerMessage
	acked bool
}

type settled struct {
	f     *inFlight
	acked bool
}

// ConsumeClaim hands out a partition's messages, up to the window at once,
// and marks the offset after the longest acknowledged prefix.
func (h *claimHandler) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	owner := sess.Context()
	window := h.s.window
	var queue []*inFlight
	// Each message in flight settles once before it is handed out again, so
	// the buffer never fills.
	results := make(chan settled, window)
	send := func(f *inFlight) bool {
		msg, err := unmarshaler{}.Unmarshal(f.km)
		if err != nil { // unreachable: the unmarshaler never fails
			h.s.log.Error("kafka: unreadable message", "err", err)
			return false
		}
		msg.SetContext(context.WithValue(h.ctx, claimCtxKey{}, claimInfo{owner: owner, topic: f.km.Topic, partition: f.km.Partition}))
		// Announced before it is handed out: the router may run it at once.
		if h.s.onSend != nil {
			h.s.onSend(msg)
		}
		select {
		case h.out <- msg:
		case <-owner.Done():
			return false
		case <-h.ctx.Done():
			return false
		}
		go func() {
			select {
			case <-msg.Acked():
				results <- settled{f, true}
			case <-msg.Nacked():
				results <- settled{f, false}
			case <-owner.Done():
			case <-h.ctx.Done():
			}
		}()
		return true
	}
	commitEach := !h.s.config.Consumer.Offsets.AutoCommit.Enable
	messages := claim.Messages()
	for {
		var next <-chan *sarama.ConsumerMessage
		if len(queue) < window {
			next = messages
		}
		select {
		case km, ok := <-next:
			if !ok {
				return nil
			}
			f := &inFlight{km: km}
			queue = append(queue, f)
			if !send(f) {
				return nil
			}
		case r := <-results:
			if !r.acked {
				// Given back (a shutdown, a revocation, a middleware's
				// timeout): hand it out again, as watermill-kafka does.
				select {
				case <-time.After(nackResendSleep):
				case <-owner.Done():
					return nil
				case <-h.ctx.Done():
					return nil
				}
				if !send(r.f) {
					return nil
				}
				continue
			}
			r.f.acked = true
			var last *inFlight
			for len(queue) > 0 && queue[0].acked {
				last, queue = queue[0], queue[1:]
			}
			if last != nil && owner.Err() == nil {
				sess.MarkOffset(last.km.Topic, last.km.Partition, last.km.Offset+1, "")
				if commitEach {
					sess.Commit()
				}
			}
		case <-owner.Done():
			return nil
		case <-h.ctx.Done():
			return nil
		}
	}
}

type claimCtxKey struct{}

// claimInfo is where a message came from, and the session that owns its
// partition: its end is the partition's revocation.
type claimInfo struct {
	owner     context.Context
	topic     string
	partition int32
}

func claimOf(msg *message.Message) (claimInfo, bool) {
	c, ok := msg.Context().Value(claimCtxKey{}).(claimInfo)
	return c, ok
}

// revokedOf is closed when the partition msg came from is revoked from this
// process (or its session ends for any other reason).
func revokedOf(msg *message.Message) <-chan struct{} {
	if c, ok := claimOf(msg); ok {
		return c.owner.Done()
	}
	return nil
}

// NewSubscriber returns the pipeline's Kafka subscriber for one consumer
// group, on its own: at most window messages of a partition in flight,
// offsets committed every second up to the first unacknowledged message.
// Pipelines make their own; this is for tools that measure the pipeline
// against the bare subscriber, and for chains built by hand.
func NewSubscriber(brokers []string, group, kafkaVersion string, window int, logger *slog.Logger) (message.Subscriber, error) {
	cfg := Config{Brokers: brokers, KafkaVersion: kafkaVersion, Logger: logger}
	cfg.setDefaults()
	version, err := ParseKafkaVersion(cfg.KafkaVersion)
	if err != nil {
		return nil, err
	}
	return newSubscriber(brokers, group, subscriberSaramaConfig(cfg, version, group), window, cfg.Logger), nil
}
