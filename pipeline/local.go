package pipeline

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/once-dev/once/middleware/idempotency"
)

// Local runs a pipeline's handler chains in this process, on messages
// handed to [Local.Deliver] rather than read from Kafka; package oncetest
// builds on it. A message goes through each group's whole chain as one from
// Kafka would: the group's Extra middleware, the topic's Decode, the claim
// (or the group commit), the handler, the commit, a dead letter parked in
// the group's database, the outbox rows of [Publish]. But once: an attempt
// that fails for a reason that is not the message's own is reported held
// (the pipeline would try it again, and the partition would wait behind
// it), and its partition is given up. Kafka's part (offsets, sessions,
// forwarding the parked dead letters and the outbox) is not exercised.
type Local struct {
	p      *Pipeline
	groups map[string][]builtGroup // by topic
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	offsets map[string]int64 // the next offset of each topic
	held    map[localKey]Held
	dead    map[localKey]DeadLetter
	claims  map[localKey]idempotency.Result // the last of each message
	owners  map[localKey]context.CancelFunc
	// rollBack are the messages whose transactions roll back after their
	// handler ran, by UUID.
	rollBack map[string]bool
	// exclusive keeps a DeliverRolledBack's messages out of other
	// Delivers' batches: a batch rolls back by its first message.
	exclusive sync.RWMutex
}

// errRolledBack fails an attempt of [Local.DeliverRolledBack] after its
// handler returned: what a crash before the commit does.
var errRolledBack = errors.New("pipeline: rolled back after the handler ran, as a crash before the commit would (Local.DeliverRolledBack)")

// rollBackAfterHandler is the innermost InTx middleware of a local
// pipeline's groups: it fails the attempts of DeliverRolledBack's messages
// (a batch's by its first message) once the handler returned, whatever it
// returned.
func (p *Pipeline) rollBackAfterHandler(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		switch {
		case !p.rollBack(msg.UUID):
			return out, err
		case err != nil:
			// Not wrapped: a crash rolls a rejection back too.
			return nil, fmt.Errorf("%w; the handler returned: %v", errRolledBack, err)
		default:
			return nil, errRolledBack
		}
	}
}

type localKey struct {
	topic, group string
	offset       int64
}

// LocalMessage is a message as a producer sent it.
type LocalMessage struct {
	Key     string
	Payload []byte
	Headers map[string]string
}

// LocalResult is what one group's chain did with one message.
type LocalResult struct {
	Group  string
	Offset int64
	// Claim is the last result of the message's claim: its Outcome
	// (Processed, Duplicate, Rejected, PayloadMismatch, Failed...). Zero
	// when it never reached the claim (it could not be decoded).
	Claim idempotency.Result
	// Err is the chain's error: nil when the message was acknowledged
	// (processed, a duplicate or dead-lettered); the hold's when Held.
	Err error
	// DeadLetter is the message's dead letter, parked in the group's
	// database; nil if it was not dead-lettered.
	DeadLetter *DeadLetter
	// Held is the failed attempt the pipeline would have tried again; nil
	// if no attempt failed that way. A held message's transaction did not
	// commit.
	Held *Held
	// NotRun: an earlier message of the same Deliver was held, and this one
	// waited behind it (its partition was given up before it ran).
	NotRun bool
}

// NewLocal builds cfg's handler chains without connecting to Kafka:
// Brokers may be empty. Close it when done.
func NewLocal(cfg Config) (*Local, error) {
	if len(cfg.Brokers) == 0 {
		cfg.Brokers = []string{"local.invalid:9092"} // never dialled
	}
	l := &Local{offsets: map[string]int64{}, held: map[localKey]Held{}, dead: map[localKey]DeadLetter{}, claims: map[localKey]idempotency.Result{},
		owners: map[localKey]context.CancelFunc{}, groups: map[string][]builtGroup{}, rollBack: map[string]bool{}}
	// ComposeHooks runs the Local's own even when a team's hook panics.
	cfg.Hooks = ComposeHooks(cfg.Hooks, Hooks{OnHeld: l.onHeld, OnDeadLetter: l.onDeadLetter, OnResult: l.onResult})
	p, topics, err := newPipeline(cfg, true)
	if err != nil {
		return nil, err
	}
	p.rollBack = func(msgUUID string) bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		return l.rollBack[msgUUID]
	}
	all, err := p.buildGroups(topics)
	if err != nil {
		return nil, err
	}
	l.p = p
	l.ctx, l.cancel = context.WithCancel(context.Background())
	for _, b := range all {
		l.groups[b.t.name] = append(l.groups[b.t.name], b)
		if b.batch != nil {
			l.wg.Go(func() { b.batch.run(l.ctx) })
		}
	}
	return l, nil
}

// Close stops the group commits; a Deliver in flight ends.
func (l *Local) Close() {
	l.p.stop()
	l.cancel()
	l.wg.Wait()
}

func (l *Local) onHeld(h Held) {
	k := localKey{h.Topic, h.Group, h.Offset}
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.held[k]; !ok {
		l.held[k] = h
	}
	if give := l.owners[k]; give != nil {
		give() // the hold's wait ends at once, and the message is given back
	}
}

func (l *Local) onResult(r idempotency.Result) {
	topic, offset, ok := localCoordinates(r.MessageUUID)
	if !ok {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.claims[localKey{topic, r.ConsumerGroup, offset}] = r
}

// localUUID names a local message as the subscriber names one from Kafka.
func localUUID(topic string, offset int64) string {
	return topic + "/0/" + strconv.FormatInt(offset, 10)
}

// localCoordinates reads a local message's topic and offset from its UUID
// (topic/0/offset, as the subscriber names messages).
func localCoordinates(uuid string) (topic string, offset int64, ok bool) {
	i := strings.LastIndex(uuid, "/0/")
	if i < 0 {
		return "", 0, false
	}
	offset, err := strconv.ParseInt(uuid[i+3:], 10, 64)
	return uuid[:i], offset, err == nil
}

func (l *Local) onDeadLetter(d DeadLetter) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.dead[localKey{d.Topic, d.Group, d.Offset}] = d
}

// Deliver hands msgs, in this order, to every group of topic, as the
// consecutive messages of one partition; it returns when every group is
// done with them, a result per group and message. A batched group gets them
// all at once, so that they may share a batch (its Size and MaxWait
// permitting).
func (l *Local) Deliver(ctx context.Context, topic string, msgs ...LocalMessage) ([]LocalResult, error) {
	return l.deliver(ctx, topic, false, msgs)
}

// DeliverRolledBack delivers msgs as Deliver does, but every transaction
// they run in rolls back after its handler returned, as a crash before the
// commit would: the first message of each group is then held (a batch's
// events run on their own, and the first fails the same way), and those
// behind it are not run. Only the handler's effects outside its
// transaction remain. It runs alone: no other Deliver's message shares
// its batches.
func (l *Local) DeliverRolledBack(ctx context.Context, topic string, msgs ...LocalMessage) ([]LocalResult, error) {
	return l.deliver(ctx, topic, true, msgs)
}

func (l *Local) deliver(ctx context.Context, topic string, rollBack bool, msgs []LocalMessage) ([]LocalResult, error) {
	if rollBack {
		l.exclusive.Lock()
		defer l.exclusive.Unlock()
	} else {
		l.exclusive.RLock()
		defer l.exclusive.RUnlock()
	}
	groups := l.groups[topic]
	if len(groups) == 0 {
		return nil, fmt.Errorf("pipeline: no topic %s in the local pipeline", topic)
	}
	l.mu.Lock()
	if _, ok := l.offsets[topic]; !ok {
		// Offsets no earlier local pipeline used on this database: the
		// dead-letter sources table remembers (group, topic, partition,
		// offset), and a repeated one would be skipped as dead-lettered
		// before.
		l.offsets[topic] = time.Now().UnixMicro()
	}
	first := l.offsets[topic]
	l.offsets[topic] += int64(len(msgs))
	if rollBack {
		for i := range msgs {
			l.rollBack[localUUID(topic, first+int64(i))] = true
		}
	}
	l.mu.Unlock()
	defer func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		for i := range msgs {
			delete(l.rollBack, localUUID(topic, first+int64(i)))
		}
	}()
	var out []LocalResult
	for _, g := range groups {
		owner, giveUp := context.WithCancel(ctx)
		results := make([]LocalResult, len(msgs))
		wms := make([]*message.Message, len(msgs))
		for i, m := range msgs {
			offset := first + int64(i)
			k := localKey{topic, g.g.name, offset}
			l.mu.Lock()
			l.owners[k] = giveUp
			l.mu.Unlock()
			wms[i] = l.message(topic, offset, m, owner)
			results[i] = LocalResult{Group: g.g.name, Offset: offset}

		}
		if g.batch != nil {
			for _, wm := range wms {
				g.batch.announce(wm)
			}
			var wg sync.WaitGroup
			for i, wm := range wms {
				wg.Go(func() { results[i].Err = g.h(wm) })
			}
			wg.Wait()
		} else {
			for i, wm := range wms {
				if owner.Err() != nil {
					results[i].NotRun = true
					continue
				}
				results[i].Err = g.h(wm)
			}
		}
		giveUp()
		l.mu.Lock()
		for i := range results {
			k := localKey{topic, g.g.name, results[i].Offset}
			delete(l.owners, k)
			if h, ok := l.held[k]; ok {
				results[i].Held = &h
				delete(l.held, k)
			}
			if d, ok := l.dead[k]; ok {
				results[i].DeadLetter = &d
				delete(l.dead, k)
			}
			results[i].Claim = l.claims[k]
			delete(l.claims, k)
			if results[i].Held == nil && errors.Is(results[i].Err, ErrRevoked) {
				// Given up, unrun, when the one before it was held.
				results[i].NotRun, results[i].Err = true, nil
			}
		}
		l.mu.Unlock()
		out = append(out, results...)
	}
	return out, ctx.Err()
}

// message is m as the subscriber would hand it out: offset in partition 0
// of topic, owned by owner.
func (l *Local) message(topic string, offset int64, m LocalMessage, owner context.Context) *message.Message {
	km := &sarama.ConsumerMessage{Topic: topic, Partition: 0, Offset: offset, Key: []byte(m.Key), Value: m.Payload}
	for k, v := range m.Headers {
		km.Headers = append(km.Headers, &sarama.RecordHeader{Key: []byte(k), Value: []byte(v)})
	}
	msg, _ := unmarshaler{}.Unmarshal(km)
	msg.SetContext(context.WithValue(l.ctx, claimCtxKey{}, claimInfo{owner: owner, topic: topic, partition: 0}))
	return msg
}
