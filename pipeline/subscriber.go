package pipeline

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
)

// subscriber is a Watermill subscriber for one consumer group on all the
// topics the group reads, in one consumer-group session: a group name that
// two topics share (billing reads orders and their cancellations) is one
// member of the Kafka group, not two that rebalance each other at every
// start. Each topic is fed to its own channel (its handler in the router).
// The price of one member: a topic the group can no longer read (deleted,
// its ACL revoked) fails the group's join, and its other topics wait with
// it, logged at every try, until it is fixed.
//
// It keeps up to a topic's window of messages of each partition in flight,
// and marks a partition's offset only up to its first message not
// acknowledged yet: a crash redelivers from there, and whatever was
// processed after it is skipped by its claim.
//
// With a window of 1 it behaves as watermill-kafka's subscriber does, one
// message per partition at a time, which keeps a partition's events in
// order for per-event handlers. A batched group needs more than one message
// of a partition at once, or a batch could never hold more events than the
// consumer owns partitions.
//
// A partition's consumption ends with its session: no message is taken any
// more, and those under way get the revocation grace to finish; what they
// finish is marked and committed with the session, the rest is given back
// (its offset unmarked; the partition's next owner receives it again).
// Nothing waits longer than the grace, so no slow message holds a
// rebalance up for more.
//
// Each message's context ends as soon as the message is acknowledged or
// given back, when its partition's grace ends, and with the subscription:
// whatever a handler started on it stops with it.
type subscriber struct {
	brokers []string
	group   string
	config  *sarama.Config
	log     *slog.Logger

	// feeds are the topics the group reads, fixed before the first
	// Subscribe; the session starts once each of them is subscribed.
	mu    sync.Mutex
	feeds map[string]*feed
	fixed bool // every feed is registered: Subscribe of another topic is refused
	// window of a topic subscribed without being registered (NewSubscriber).
	window int
	runCtx context.Context
	cancel context.CancelFunc

	closing   chan struct{}
	closeOnce sync.Once
	running   sync.WaitGroup
	// closeTimeout bounds Close's wait for the group to leave.
	closeTimeout time.Duration
	// revocationGrace: how long a partition's attempts under way may go on
	// after its session ended (see claimRun).
	revocationGrace time.Duration
	// onFatal, if set, is told of what ends consuming for good (ErrFenced);
	// without it the subscription just ends.
	onFatal func(error)
	// pipelined: a pipeline's chain (or batch) says of each message it
	// decided that it is done (settledDone); an acknowledgement without it
	// marks nothing.
	pipelined bool
}

// closeFeed closes f's channel once: its handler in the router ends.
func (f *feed) close() {
	f.outMu.Lock()
	defer f.outMu.Unlock()
	if !f.outClosed {
		f.outClosed = true
		close(f.out)
	}
}

// feed is one topic of a group's session.
type feed struct {
	topic  string
	window int
	// onSend, if set, is told of every message just before it is handed to
	// the router, in its partition's order (a batched group's ordering); it
	// returns true when it took the message itself (a batched group's
	// direct path), which the router then never sees unless it is given
	// back with send.
	onSend func(*message.Message) bool
	out    chan *message.Message
	// outMu orders sends on out against its close: the channel closes as
	// soon as the subscription ends, while sarama may still be winding the
	// session down (its last offset commit, on a broker that does not
	// answer, takes minutes), and no send may follow.
	outMu     sync.RWMutex
	outClosed bool
	// subscribed: its handler asked for it; joined: a session has begun
	// since; assigned: the current session's partitions of the topic (nil
	// between sessions).
	subscribed bool
	joined     atomic.Bool
	assigned   atomic.Pointer[[]int32]
}

// nackResendSleep is how long a message given back unacknowledged waits
// before it is handed out again (watermill-kafka's default).
const nackResendSleep = 100 * time.Millisecond

func newSubscriber(brokers []string, group string, config *sarama.Config, log *slog.Logger) *subscriber {
	return &subscriber{brokers: brokers, group: group, config: config, log: log, feeds: map[string]*feed{}, closing: make(chan struct{})}
}

// addTopic registers a topic of the group before anything is subscribed.
func (s *subscriber) addTopic(topic string, window int, onSend func(*message.Message) bool) *feed {
	f := &feed{topic: topic, window: max(window, 1), onSend: onSend, out: make(chan *message.Message)}
	s.feeds[topic] = f
	s.fixed = true
	return f
}

// Subscribe returns topic's messages. The group's session begins when every
// topic registered for it is subscribed (the router subscribes each of its
// handlers as it starts); a subscriber made for one topic (NewSubscriber)
// begins at once. Every channel closes when ctx ends or the subscriber is
// closed.
func (s *subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	select {
	case <-s.closing:
		return nil, errors.New("pipeline: subscriber closed")
	default:
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	f := s.feeds[topic]
	if f == nil {
		if s.fixed {
			return nil, fmt.Errorf("pipeline: consumer group %s does not read topic %s", s.group, topic)
		}
		f = s.addTopic(topic, s.window, nil)
	}
	if f.subscribed {
		return nil, fmt.Errorf("pipeline: topic %s of consumer group %s is subscribed already", topic, s.group)
	}
	f.subscribed = true
	if s.runCtx == nil {
		s.runCtx, s.cancel = context.WithCancel(ctx)
	} else {
		// Any subscriber's end ends the session: they are one member.
		context.AfterFunc(ctx, s.cancel)
	}
	for _, other := range s.feeds {
		if !other.subscribed {
			return f.out, nil
		}
	}
	cg, err := sarama.NewConsumerGroup(s.brokers, s.group, s.config)
	if err != nil {
		// The topics subscribed before this one would wait for a session
		// that never begins: their channels close, and their handlers end.
		s.cancel()
		for _, other := range s.feeds {
			other.close()
		}
		return nil, fmt.Errorf("kafka consumer group %s on %v: %w", s.group, s.brokers, err)
	}
	s.running.Add(1)
	go s.consume(s.runCtx, cg)
	return f.out, nil
}

// consume runs the group's sessions until ctx ends or the subscriber closes.
func (s *subscriber) consume(ctx context.Context, cg sarama.ConsumerGroup) {
	defer s.running.Done()
	topics := make([]string, 0, len(s.feeds))
	for t := range s.feeds {
		topics = append(topics, t)
	}
	slices.Sort(topics)
	closeFeeds := func() {
		for _, f := range s.feeds {
			f.close()
		}
	}
	defer closeFeeds()
	defer s.cancel()
	go func() {
		select {
		case <-s.closing:
			s.cancel()
		case <-ctx.Done():
		}
		// The handlers end now, whatever sarama still waits for.
		closeFeeds()
	}()
	errorsDone := make(chan struct{})
	go func() {
		defer close(errorsDone)
		for err := range cg.Errors() {
			if errors.Is(err, sarama.ErrFencedInstancedId) {
				continue // Consume returns it too; said once, there
			}
			s.log.Warn("kafka consumer group error", "consumer_group", s.group, "topics", topics, "err", err)
		}
	}()
	h := &claimHandler{s: s, ctx: ctx}
	for ctx.Err() == nil {
		// Consume returns at every rebalance; the loop joins again.
		if err := cg.Consume(ctx, topics, h); err != nil && ctx.Err() == nil {
			if errors.Is(err, sarama.ErrClosedConsumerGroup) {
				break
			}
			if errors.Is(err, sarama.ErrFencedInstancedId) {
				// Another process joined under this one's group.instance.id:
				// rejoining would fence it in turn, every second, for ever.
				fenced := fmt.Errorf("%w (consumer group %s, group.instance.id %s)", ErrFenced, s.group, s.config.Consumer.Group.InstanceId)
				s.log.Error("kafka: fenced out of the consumer group; stopping", "consumer_group", s.group, "instance_id", s.config.Consumer.Group.InstanceId, "err", err)
				if s.onFatal != nil {
					s.onFatal(fenced)
				}
				break
			}
			s.log.Warn("kafka: consuming failed; joining the group again", "consumer_group", s.group, "topics", topics, "err", err)
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
}

// Close stops every subscription and waits for them to leave the group,
// for closeTimeout at most: a broker that does not answer would hold the
// group's last offset commit for minutes. Offsets not committed then are
// delivered again, and their claims skip them.
func (s *subscriber) Close() error {
	s.closeOnce.Do(func() { close(s.closing) })
	left := make(chan struct{})
	go func() { s.running.Wait(); close(left) }()
	timeout := s.closeTimeout
	if timeout <= 0 {
		timeout = 30 * time.Second
	}
	deadline := time.After(timeout)
	// A broker that answers lets the group leave within a second; one that
	// does not holds the stop up to the whole drain: said at once, not
	// after it.
	select {
	case <-left:
		return nil
	case <-time.After(min(time.Second, timeout/4)):
		s.log.Warn(fmt.Sprintf("stopping: waiting up to %s for Kafka to take consumer group %s's last offset commit and its leave, which it has not answered yet. "+
			"The drain timeout bounds it (pipeline.Config.CloseTimeout, once.Config.DrainTimeout, app serve --drain-timeout)", timeout, s.group),
			"consumer_group", s.group, "waits_for", "the group's last offset commit and its leave", "drain_timeout", timeout)
	}
	select {
	case <-left:
		s.log.Info("stopping: consumer group left", "consumer_group", s.group)
		return nil
	case <-deadline:
		return fmt.Errorf("pipeline: consumer group %s did not leave within %s (the broker does not answer); "+
			"offsets it had not committed yet are delivered again, and skipped", s.group, timeout)
	}
}

type claimHandler struct {
	s   *subscriber
	ctx context.Context
}

func (h *claimHandler) Setup(sess sarama.ConsumerGroupSession) error {
	claims := sess.Claims()
	attrs := []any{"consumer_group", h.s.group, "generation", sess.GenerationID()}
	for _, topic := range slices.Sorted(maps.Keys(h.s.feeds)) {
		f := h.s.feeds[topic]
		parts := slices.Clone(claims[topic])
		slices.Sort(parts)
		f.assigned.Store(&parts)
		f.joined.Store(true)
		attrs = append(attrs, slog.Any(topic, parts))
	}
	// One line per rebalance: which partitions this member owns now.
	h.s.log.Info("kafka: session began", attrs...)
	return nil
}

func (h *claimHandler) Cleanup(sarama.ConsumerGroupSession) error {
	for _, f := range h.s.feeds {
		f.assigned.Store(nil)
	}
	return nil
}

// ConsumeClaim hands out a partition's messages, up to the window at once,
// and marks each offset once its message and every one before it are
// acknowledged.
func (h *claimHandler) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	owner := sess.Context()
	f := h.s.feeds[claim.Topic()]
	if f == nil {
		return fmt.Errorf("pipeline: consumer group %s was given topic %s, which it does not read", h.s.group, claim.Topic())
	}
	run := newClaimRun(owner)
	// In flight, in order. Its capacity and the one the acker waits on make
	// the window: a message is queued here before it is handed out.
	inFlight := make(chan *handedOut, f.window-1)
	ackerDone := make(chan struct{})
	go func() {
		defer close(ackerDone)
		h.ack(sess, owner, run, f, inFlight)
	}()
	grace := h.s.revocationGrace
	defer func() {
		// The messages under way finish (within the grace), their offsets
		// are marked, and the session commits them once this returns.
		run.finish(grace, ackerDone)
		<-ackerDone
	}()
	messages := claim.Messages()
	for {
		select {
		case km, ok := <-messages:
			if !ok {
				if owner.Err() == nil && h.ctx.Err() == nil {
					// The partition's consumer stopped inside the session:
					// its offset is out of range (the log was truncated, or
					// retention passed a message held longer than it). The
					// session ends once this returns, and the group joins
					// again from the committed offset. Waiting for the
					// acker here would wait for the session's end, which
					// waits for this: the partition would stall until an
					// unrelated rebalance.
					h.s.log.Warn("kafka: a partition's consumer stopped inside the session (offset out of range?); rejoining the group",
						"consumer_group", h.s.group, "topic", claim.Topic(), "partition", claim.Partition())
					grace = 0
				}
				return nil
			}
			m := &handedOut{km: km}
			m.msg, m.settle = h.message(km, owner, run)
			select {
			case inFlight <- m:
			case <-owner.Done():
				return nil
			case <-h.ctx.Done():
				return nil
			}
			if !h.handOut(f, m.msg) {
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
	// settle ends msg's context.
	settle context.CancelFunc
}

// ack waits for the partition's messages in order: an acknowledged one
// marks its offset; one given back (a shutdown, a revocation, a
// middleware's timeout) is handed out again, as watermill-kafka does. A
// message given back behind one still in flight is handed out again when
// its turn comes. Each message's context ends here when its turn comes,
// and sooner when a watcher of its own saw it settled (see sendLocked).
//
// In a pipeline an acknowledged message marks its offset only when the
// pipeline decided it (msgState); one acknowledged by anything else (a
// team's router middleware that swallowed the error of a message given
// back) is handed out again, as a message given back is.
//
// After the session ended it goes on during the revocation grace: what the
// messages under way finish is marked, and the session commits it. It
// stops at the first message given back, once nothing is under way
// (run.draining) at the first one not settled, and at the grace's end.
func (h *claimHandler) ack(sess sarama.ConsumerGroupSession, owner context.Context, run *claimRun, f *feed, inFlight <-chan *handedOut) {
	commitEach := !h.s.config.Consumer.Offsets.AutoCommit.Enable
	hard := run.hard.Done()
	for {
		var m *handedOut
		select {
		case m = <-inFlight:
		case <-run.draining:
			select {
			case m = <-inFlight:
			default:
				return // everything handed out is marked
			}
		case <-hard:
			return
		}
		for {
			acked := false
			select {
			case <-m.msg.Acked():
				acked = true
			case <-m.msg.Nacked():
			case <-hard:
				return
			}
			if acked && h.decided(m.msg) {
				break
			}
			// Given back: handed out again, unless the session ended.
			if owner.Err() != nil {
				return
			}
			select {
			case <-time.After(nackResendSleep):
			case <-owner.Done():
				return
			}
			m.settle()
			m.msg, m.settle = h.message(m.km, owner, run)
			if !h.handOut(f, m.msg) {
				return
			}
		}
		m.settle()
		if run.hard.Err() == nil {
			sess.MarkOffset(m.km.Topic, m.km.Partition, m.km.Offset+1, "")
			if commitEach {
				sess.Commit()
			}
		}
	}
}

// decided: msg was acknowledged because it is done, as a pipeline decided
// it, or by any consumer for a subscriber outside a pipeline.
func (h *claimHandler) decided(msg *message.Message) bool {
	if !h.s.pipelined {
		return true
	}
	c, ok := claimOf(msg)
	return ok && c.state != nil && c.state.done.Load()
}

// message makes the Watermill message of km, owned by the session. Its
// context ends with the session (whose context is the subscription's
// child), or sooner by settle, once the message is acknowledged or given
// back: goroutines a handler started on it must not live on until the
// shutdown. Nothing of the pipeline works on a message's context after
// that: the router acknowledges a message once its chain returned, a batch
// after its commit, and the claim's commit runs on a context of its own.
func (h *claimHandler) message(km *sarama.ConsumerMessage, owner context.Context, run *claimRun) (*message.Message, context.CancelFunc) {
	msg, _ := unmarshaler{}.Unmarshal(km) // never fails
	ctx, settle := context.WithCancel(run.hard)
	msg.SetContext(context.WithValue(ctx, claimCtxKey{}, claimInfo{owner: owner, subscription: h.ctx, topic: km.Topic, partition: km.Partition,
		settle: settle, run: run, state: &msgState{}}))
	return msg, settle
}

// handOut gives msg to the router, announced first (a batched group's
// ordering): the router may run it at once. A batched group may take it
// instead.
func (h *claimHandler) handOut(f *feed, msg *message.Message) bool {
	f.outMu.RLock()
	defer f.outMu.RUnlock()
	if f.outClosed {
		return false
	}
	if f.onSend != nil && f.onSend(msg) {
		return true
	}
	return f.sendLocked(msg)
}

// send gives msg, a message of the current session, to the router, unless
// the subscription ended or msg's partition was revoked meanwhile.
func (f *feed) send(msg *message.Message) bool {
	f.outMu.RLock()
	defer f.outMu.RUnlock()
	if f.outClosed {
		return false
	}
	return f.sendLocked(msg)
}

// sendLocked: the caller holds f.outMu for reading. msg's context ends with
// the subscription, and its claim's owner with the partition's session.
func (f *feed) sendLocked(msg *message.Message) bool {
	var revoked <-chan struct{}
	if c, ok := claimOf(msg); ok {
		if c.owner.Err() != nil {
			return false // revoked: the select below might still pick the send
		}
		revoked = c.owner.Done()
		if f.window > 1 {
			// Messages of a window are acknowledged in any order, and the
			// acker sees one only when its turn comes: one behind a held
			// message would keep its context for as long. Watched from
			// before the router has it, which may set its context.
			watch(msg, c.settle)
		}
	}
	select {
	case f.out <- msg:
		return true
	case <-revoked:
		return false
	case <-msg.Context().Done():
		return false
	}
}

// watch ends msg's context by settle as soon as msg is acknowledged or
// given back. A goroutine per message, so only for a window's messages
// that go to the router: a window of 1 has its one message in flight
// watched by the acker, and a batch acknowledges its messages all at once,
// in their partition's order.
func watch(msg *message.Message, settle context.CancelFunc) {
	if settle == nil {
		return
	}
	done := msg.Context().Done()
	go func() {
		select {
		case <-msg.Acked():
		case <-msg.Nacked():
		case <-done:
		}
		settle()
	}()
}

type claimCtxKey struct{}

// claimInfo is where a message came from, and the session that owns its
// partition: its end is the partition's revocation.
type claimInfo struct {
	owner context.Context
	// subscription, when set, is the subscription's context: its end is
	// the shutdown. The message's context ends sooner: with owner, and
	// once the message is settled (settle; nil for none).
	subscription context.Context
	settle       context.CancelFunc
	topic        string
	partition    int32
	// run is the partition's messages under way: they outlive owner by
	// the revocation grace (see claimRun); nil for none.
	run *claimRun
	// state is what the pipeline decided of this delivery (nil outside a
	// pipeline's subscriber).
	state *msgState
}

// claimRun is a partition's messages under way in this session: counted
// from the moment the pipeline's chain takes one (or a batch holds it) until
// the chain has returned its verdict. When the session ends (a revocation,
// or the stop), no message is taken any more; the ones under way get the
// revocation grace to finish and commit, and the acker marks what they
// finished; then hard ends, which cancels whatever still runs: an attempt
// cut off before its commit rolls back and the partition's next owner runs
// it, but a provider's call is rarely cut off in the middle, and the next
// owner does not wait on that call's idempotency key. A message the chain
// took waits for nothing but its attempt once the session ended (its key's
// turn, a slot, a batch, a pause between attempts all end at once).
type claimRun struct {
	hard    context.Context
	endHard context.CancelFunc
	// draining is closed once nothing is under way any more after the
	// session's end, or the grace ran out: the acker marks what settled
	// as done, and stops at the first message that did not.
	draining chan struct{}

	mu       sync.Mutex
	underWay int
	idle     chan struct{} // closed when underWay drops to 0; nil while nobody waits
}

func newClaimRun(owner context.Context) *claimRun {
	hard, end := context.WithCancel(context.WithoutCancel(owner))
	return &claimRun{hard: hard, endHard: end, draining: make(chan struct{})}
}

// begin counts a message under way, unless the session has ended (owner):
// none is taken after the revocation.
func (r *claimRun) begin(owner context.Context) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if owner.Err() != nil || r.hard.Err() != nil {
		return false
	}
	r.underWay++
	return true
}

func (r *claimRun) end() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.underWay--
	if r.underWay == 0 && r.idle != nil {
		close(r.idle)
		r.idle = nil
	}
}

// finish runs once the session ended: it waits for the messages under way
// (for grace at most), lets the acker mark what they finished (done, its
// wait until then), and ends hard.
func (r *claimRun) finish(grace time.Duration, acker <-chan struct{}) {
	defer r.endHard()
	deadline := make(chan struct{})
	defer time.AfterFunc(max(grace, 0), func() { close(deadline) }).Stop()
	r.mu.Lock()
	idle := closedChan
	if r.underWay > 0 && grace > 0 {
		if r.idle == nil {
			r.idle = make(chan struct{})
		}
		idle = r.idle
	}
	r.mu.Unlock()
	select {
	case <-idle:
	case <-deadline:
	}
	close(r.draining)
	select {
	case <-acker:
	case <-deadline:
	}
}

var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// msgState is what the pipeline's chain decided of one message: done (its
// effect or its verdict committed: processed, a duplicate, dead-lettered),
// or not, when it was given back to come again. An acknowledgement by
// anything else (a team's router-level middleware that swallows the error
// of a message given back) marks nothing.
type msgState struct {
	done atomic.Bool
}

// settledDone marks msg as decided by the pipeline.
func settledDone(msg *message.Message) {
	if c, ok := claimOf(msg); ok && c.state != nil {
		c.state.done.Store(true)
	}
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

// runOf is the attempts under way of msg's partition, nil for a message
// from another subscriber.
func runOf(msg *message.Message) *claimRun {
	if d, ok := msg.Context().Value(deliveryCtxKey{}).(*deliveryInfo); ok {
		return d.claim.run
	}
	if c, ok := claimOf(msg); ok {
		return c.run
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
// group on one topic, on its own: at most window messages of a partition in
// flight, offsets committed every second up to the first unacknowledged
// message. It is subscribed once, to one topic. A message's context ends
// once it is acknowledged or nacked, when its partition is revoked from
// this member, and when the subscription ends (no revocation grace: that
// is a pipeline's). It passes Watermill's Pub/Sub
// test suite (pubsub/tests) but for the tests of several subscriptions on
// one subscriber.
// Pipelines make their own; this is for tools that measure the pipeline
// against the bare subscriber, and for chains built by hand.
func NewSubscriber(brokers []string, group, kafkaVersion string, sec KafkaSecurity, window int, logger *slog.Logger) (message.Subscriber, error) {
	cfg := Config{Brokers: brokers, KafkaVersion: kafkaVersion, Security: sec, Logger: logger}
	cfg.setDefaults()
	version, err := ParseKafkaVersion(cfg.KafkaVersion)
	if err != nil {
		return nil, err
	}
	sub := newSubscriber(brokers, group, subscriberSaramaConfig(cfg, version, group), cfg.Logger)
	sub.window = window
	sub.fixed = false
	return sub, nil
}
