package pipeline

import (
	"context"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Order is how a per-event group orders the messages of a partition.
type Order string

const (
	// OrderPartition runs one message of a partition at a time, in offset
	// order: the strongest order, and the default. A handler that waits
	// (a provider's call) caps a partition at one call's latency, and a
	// held message stops its whole partition.
	OrderPartition Order = "partition"
	// OrderKey runs a partition's messages at once, up to the group's
	// Concurrency, and orders them by their Kafka key: never two messages
	// of one key at once, each key's in offset order. A message without a
	// key is ordered with every other message of its partition. A held
	// message holds its key; the partition's committed offset stays at its
	// first unfinished message, and a crash redelivers from there, the
	// claims skipping what ran after it. The order the specification
	// owes (R-KFK-IDEM, "Order"), which a producer keying each event by its
	// aggregate's id gives.
	OrderKey Order = "key"
)

// keyGate orders a key-ordered group's messages within each partition (see
// [OrderKey]): a message runs once no message before it in its partition
// that is not finished has its key, or none, and none before it has no key
// when it has none. The subscriber announces each message as it hands it
// out, in its partition's order, and a message leaves its place once it is
// acknowledged; one given back (to be handed out again) keeps its place, so
// that its key's later messages still wait for it.
type keyGate struct {
	window int

	mu      sync.Mutex
	queues  map[partitionOf]*[]*keyEntry // announced and unfinished, in offset order
	latest  map[partitionOf]int64        // the highest offset announced
	entries map[entryKey]*keyEntry
	changed chan struct{} // closed at the next change; nil while nobody waits
}

type keyEntry struct {
	key     entryKey
	queue   partitionOf
	offset  int64
	kafka   string // the message's Kafka key; "" for none
	running bool
	// since: when it was first handed out, which pins its partition's
	// commit point for as long as it is unfinished.
	since time.Time
}

func newKeyGate(window int) *keyGate {
	return &keyGate{window: window, queues: map[partitionOf]*[]*keyEntry{}, latest: map[partitionOf]int64{}, entries: map[entryKey]*keyEntry{}}
}

// announce records msg as its partition's next message; the subscriber calls
// it in the order it hands messages out. It never takes the message.
func (g *keyGate) announce(msg *message.Message) bool {
	c, ok := claimOf(msg)
	if !ok {
		return false
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	ek := entryKey{c.owner, msg.UUID}
	if e := g.entries[ek]; e != nil {
		e.running = false // handed out again after it was given back: still in its place
		return false
	}
	q := partitionOf{c.owner, c.partition}
	queue := g.queues[q]
	if queue == nil {
		queue = new([]*keyEntry)
		g.queues[q] = queue
		// The session's end is the partition's revocation: what it still
		// holds is the next owner's. Those waiting for their turn leave
		// by themselves; what was announced and never reached the chain
		// goes here.
		context.AfterFunc(c.owner, func() { g.drop(q) })
	}
	offset, _ := strconv.ParseInt(msg.Metadata.Get(MetaKafkaOffset), 10, 64)
	e := &keyEntry{key: ek, queue: q, offset: offset, kafka: msg.Metadata.Get(MetaKafkaKey), since: time.Now()}
	g.latest[q] = max(g.latest[q], offset)
	i, _ := slices.BinarySearchFunc(*queue, offset, func(x *keyEntry, o int64) int { return int(x.offset - o) })
	*queue = slices.Insert(*queue, i, e)
	g.entries[ek] = e
	g.signal()
	return false
}

// drop forgets a revoked partition's queue.
func (g *keyGate) drop(q partitionOf) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if queue := g.queues[q]; queue != nil {
		for _, e := range *queue {
			delete(g.entries, e.key)
		}
		delete(g.queues, q)
		delete(g.latest, q)
	}
	g.signal()
}

// order is the stage that keeps the order: a message waits for its turn,
// runs through the rest of the chain, and leaves its place once it is
// acknowledged (returned without an error).
func (g *keyGate) order(p *Pipeline) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			ek, ok := entryKeyOf(msg)
			if !ok {
				return h(msg)
			}
			if err := g.awaitTurn(p, msg, ek); err != nil {
				return nil, err
			}
			out, err := h(msg)
			g.finish(ek, err == nil)
			return out, err
		}
	}
}

// awaitTurn waits until msg may run, and marks it running.
func (g *keyGate) awaitTurn(p *Pipeline, msg *message.Message, ek entryKey) error {
	revoked := revokedOf(msg)
	for {
		g.mu.Lock()
		e := g.entries[ek]
		if e == nil {
			// Its partition was revoked: the next owner has it.
			g.mu.Unlock()
			return ErrRevoked
		}
		if g.mayRun(e) {
			e.running = true
			g.mu.Unlock()
			return nil
		}
		if g.changed == nil {
			g.changed = make(chan struct{})
		}
		changed := g.changed
		g.mu.Unlock()
		select {
		case <-changed:
		case <-revoked:
			return ErrRevoked
		case <-p.stopping:
			return errShutdown
		}
	}
}

// mayRun: nothing unfinished before e in its partition has e's key, or no
// key, nor anything at all when e has none. Caller holds g.mu.
func (g *keyGate) mayRun(e *keyEntry) bool {
	for _, x := range *g.queues[e.queue] {
		if x == e {
			return true
		}
		if e.kafka == "" || x.kafka == "" || x.kafka == e.kafka {
			return false
		}
	}
	return true // not queued (never so)
}

// finish ends a message's run: acknowledged, it leaves its place; given
// back, it keeps it (not running) until it is handed out again.
func (g *keyGate) finish(ek entryKey, acked bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	e := g.entries[ek]
	if e == nil {
		return
	}
	if !acked {
		e.running = false
		return
	}
	delete(g.entries, ek)
	if queue := g.queues[e.queue]; queue != nil {
		if i := slices.Index(*queue, e); i >= 0 {
			*queue = slices.Delete(*queue, i, i+1)
		}
	}
	g.signal()
}

// signal wakes those awaiting their turn. Caller holds g.mu.
func (g *keyGate) signal() {
	if g.changed != nil {
		close(g.changed)
		g.changed = nil
	}
}

// keyGateStatus is what a key-ordered group's partitions look like now.
type keyGateStatus struct {
	// pinned: the longest any partition's commit point has stood at its
	// first unfinished message; full: partitions whose window is full.
	pinned time.Duration
	full   int
}

func (g *keyGate) status(now time.Time) keyGateStatus {
	g.mu.Lock()
	defer g.mu.Unlock()
	var s keyGateStatus
	for q, queue := range g.queues {
		if q.owner.Err() != nil || len(*queue) == 0 {
			continue
		}
		head := (*queue)[0]
		s.pinned = max(s.pinned, now.Sub(head.since))
		// The subscriber hands out no message a window or more past the
		// first unfinished one, finished ones behind it included.
		if g.latest[q]-head.offset+1 >= int64(g.window) {
			s.full++
		}
	}
	return s
}
