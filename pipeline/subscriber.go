package pipeline

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
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

	// joined: a session has begun since Subscribe; assigned: the current
	// session's partitions (nil between sessions).
	joined   atomic.Bool
	assigned atomic.Pointer[[]int32]

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

func (h *claimHandler) Setup(sess sarama.ConsumerGroupSession) error {
	var parts []int32
	for _, ps := range sess.Claims() {
		parts = append(parts, ps...)
	}
	slices.Sort(parts)
	h.s.assigned.Store(&parts)
	h.s.joined.Store(true)
	return nil
}

func (h *claimHandler) Cleanup(sarama.ConsumerGroupSession) error {
	h.s.assigned.Store(nil)
	return nil
}

// ConsumeClaim hands out a partition's messages, up to the window at once,
// and marks each offset once its message and every one before it are
// acknowledged.
func (h *claimHandler) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	owner := sess.Context()
	// In flight, in order. Its capacity and the one the acker waits on make
	// the window: a message is queued here before it is handed out.
	inFlight := make(chan *handedOut, h.s.window-1)
	ackerDone := make(chan struct{})
	go func() {
		defer close(ackerDone)
		h.ack(sess, owner, inFlight)
	}()
	defer func() { <-ackerDone }()
	messages := claim.Messages()
	for {
		select {
		case km, ok := <-messages:
			if !ok {
				return nil
			}
			m := &handedOut{km: km, msg: h.message(km, owner)}
			select {
			case inFlight <- m:
			case <-owner.Done():
				return nil
			case <-h.ctx.Done():
				return nil
			}
			if !h.handOut(m.msg, owner) {
				return nil
			}
		case <-owner.Done():
			return nil
		case <-h.ctx.Done():
			return nil
		}
	}
}

// handedOut is a message of the partition handed to the router.
type handedOut struct {
	km  *sarama.ConsumerMessage
	msg *message.Message
}

// ack waits for the partition's messages in order: an acknowledged one
// marks its offset; one given back (a shutdown, a revocation, a
// middleware's timeout) is handed out again, as watermill-kafka does. A
// message given back behind one still in flight is handed out again when
// its turn comes.
func (h *claimHandler) ack(sess sarama.ConsumerGroupSession, owner context.Context, inFlight <-chan *handedOut) {
	commitEach := !h.s.config.Consumer.Offsets.AutoCommit.Enable
	for {
		var m *handedOut
		select {
		case m = <-inFlight:
		case <-owner.Done():
			return
		case <-h.ctx.Done():
			return
		}
		for {
			select {
			case <-m.msg.Acked():
			case <-m.msg.Nacked():
				select {
				case <-time.After(nackResendSleep):
				case <-owner.Done():
					return
				case <-h.ctx.Done():
					return
				}
				m.msg = h.message(m.km, owner)
				if !h.handOut(m.msg, owner) {
					return
				}
				continue
			case <-owner.Done():
				return
			case <-h.ctx.Done():
				return
			}
			break
		}
		if owner.Err() == nil {
			sess.MarkOffset(m.km.Topic, m.km.Partition, m.km.Offset+1, "")
			if commitEach {
				sess.Commit()
			}
		}
	}
}

// message makes the Watermill message of km, owned by the session.
func (h *claimHandler) message(km *sarama.ConsumerMessage, owner context.Context) *message.Message {
	msg, _ := unmarshaler{}.Unmarshal(km) // never fails
	msg.SetContext(context.WithValue(h.ctx, claimCtxKey{}, claimInfo{owner: owner, topic: km.Topic, partition: km.Partition}))
	return msg
}

// handOut gives msg to the router, announced first (a batched group's
// ordering): the router may run it at once.
func (h *claimHandler) handOut(msg *message.Message, owner context.Context) bool {
	if h.s.onSend != nil {
		h.s.onSend(msg)
	}
	select {
	case h.out <- msg:
		return true
	case <-owner.Done():
		return false
	case <-h.ctx.Done():
		return false
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

// ownerOf is the context of the session that handed msg out: it ends when
// the partition msg came from is revoked from this process (or the session
// ends for any other reason). Nil for a message from another subscriber.
func ownerOf(msg *message.Message) context.Context {
	if d, ok := msg.Context().Value(deliveryCtxKey{}).(*deliveryInfo); ok {
		return d.claim.owner
	}
	if c, ok := claimOf(msg); ok {
		return c.owner
	}
	return nil
}

// revokedOf is closed when the partition msg came from is revoked from this
// process (or its session ends for any other reason).
func revokedOf(msg *message.Message) <-chan struct{} {
	if owner := ownerOf(msg); owner != nil {
		return owner.Done()
	}
	return nil
}

// NewSubscriber returns the pipeline's Kafka subscriber for one consumer
// group, on its own: at most window messages of a partition in flight,
// offsets committed every second up to the first unacknowledged message.
// Pipelines make their own; this is for tools that measure the pipeline
// against the bare subscriber, and for chains built by hand.
func NewSubscriber(brokers []string, group, kafkaVersion string, sec KafkaSecurity, window int, logger *slog.Logger) (message.Subscriber, error) {
	cfg := Config{Brokers: brokers, KafkaVersion: kafkaVersion, Security: sec, Logger: logger}
	cfg.setDefaults()
	version, err := ParseKafkaVersion(cfg.KafkaVersion)
	if err != nil {
		return nil, err
	}
	return newSubscriber(brokers, group, subscriberSaramaConfig(cfg, version, group), window, cfg.Logger), nil
}
