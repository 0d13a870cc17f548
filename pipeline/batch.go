package pipeline

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/middleware/idempotency"
)

// batcher is a group's group commit. Every message still passes through the
// whole chain on its own goroutine (the router's); at the claim, the first
// attempt of each joins a batch, and one goroutine claims, handles and
// commits batch after batch (idempotency.Middleware.ProcessBatch). What a
// batch cannot decide runs on its own, through the group's per-event claim:
// holding, dead-lettering and everything else stay as they are.
//
// A partition's events stay in order. The subscriber announces each message
// as it hands it out, in the partition's order; a message joins a batch only
// when every message announced before it in its partition is in a batch
// that committed. One that runs on its own (its batch failed) or never
// reaches the claim (dead-lettered at decoding) holds its followers until
// it is done.
type batcher struct {
	topic  string
	group  string
	p      *Pipeline
	idem   *idempotency.Middleware
	handle func(ctx context.Context, tx pgx.Tx, evs []any) error
	cfg    Batch

	mu      sync.Mutex
	queues  map[partitionOf]*[]*batchEntry // announced, in order
	entries map[string]*batchEntry         // by message UUID
	wake    chan struct{}
}

// partitionOf names a partition as one session of this process owns it: a
// partition consumed again after a rebalance starts a queue of its own.
type partitionOf struct {
	owner     context.Context
	partition int32
}

type entryState int

const (
	announced entryState = iota // handed out, not at the claim yet
	waiting                     // at the claim, waiting for a batch
	inBatch                     // in the running batch
	done                        // decided by a committed batch
	alone                       // runs on its own; holds its followers
)

type batchEntry struct {
	uuid   string
	offset int64
	queue  partitionOf
	msg    *message.Message
	state  entryState
	// runAlone: its batch failed; it runs on its own once every message
	// before it in its partition is done, so that a partition's events
	// are re-run one by one, in order.
	runAlone bool
	since    time.Time
	result   chan error // buffered: the batch never waits for its reader
}

func newBatcher(p *Pipeline, topic, group string, idem *idempotency.Middleware, handle func(ctx context.Context, tx pgx.Tx, evs []any) error, cfg Batch) *batcher {
	return &batcher{topic: topic, group: group, p: p, idem: idem, handle: handle, cfg: cfg,
		queues: map[partitionOf]*[]*batchEntry{}, entries: map[string]*batchEntry{}, wake: make(chan struct{}, 1)}
}

// announce records msg as its partition's next message; the subscriber calls
// it in the order it hands messages out.
func (b *batcher) announce(msg *message.Message) {
	c, ok := claimOf(msg)
	if !ok {
		return
	}
	offset, _ := strconv.ParseInt(msg.Metadata.Get(MetaKafkaOffset), 10, 64)
	key := partitionOf{c.owner, c.partition}
	b.mu.Lock()
	defer b.mu.Unlock()
	if e := b.entries[msg.UUID]; e != nil {
		// Handed out again after it was given back: still in its place.
		e.state, e.msg, e.runAlone = announced, nil, false
		return
	}
	q := b.queues[key]
	if q == nil {
		q = new([]*batchEntry)
		b.queues[key] = q
	}
	e := &batchEntry{uuid: msg.UUID, offset: offset, queue: key}
	// In offset order, so that a message handed out again lands before
	// those that followed it.
	i, _ := slices.BinarySearchFunc(*q, offset, func(e *batchEntry, o int64) int { return int(e.offset - o) })
	*q = slices.Insert(*q, i, e)
	b.entries[msg.UUID] = e
}

// track wraps a batched group's whole chain: a message that leaves it
// acknowledged leaves its partition's queue; one given back (it will be
// handed out again) keeps its place, unless its partition was revoked.
func (b *batcher) track(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		b.leave(msg, err != nil && !isClosed(revokedOf(msg)))
		return out, err
	}
}

func (b *batcher) leave(msg *message.Message, keepPlace bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	e := b.entries[msg.UUID]
	if e == nil {
		return
	}
	if keepPlace {
		e.state, e.msg, e.runAlone = announced, nil, false
	} else {
		b.remove(e)
	}
	b.signal()
}

func (b *batcher) remove(e *batchEntry) {
	delete(b.entries, e.uuid)
	q := b.queues[e.queue]
	if q == nil {
		return
	}
	if i := slices.Index(*q, e); i >= 0 {
		*q = slices.Delete(*q, i, i+1)
	}
	if len(*q) == 0 {
		delete(b.queues, e.queue)
	}
}

func (b *batcher) signal() {
	select {
	case b.wake <- struct{}{}:
	default:
	}
}

type attemptCtxKey struct{}

// claim is the group's claim stage: the first attempt of a message joins a
// batch; one the batch could not decide, and every later attempt, goes
// through next, the group's per-event claim.
func (b *batcher) claim(next message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if attempt, _ := msg.Context().Value(attemptCtxKey{}).(int); attempt > 1 {
			return next(msg)
		}
		b.mu.Lock()
		e := b.entries[msg.UUID]
		if e == nil || e.state != announced {
			b.mu.Unlock()
			return next(msg)
		}
		e.state, e.msg, e.since, e.result = waiting, msg, time.Now(), make(chan error, 1)
		b.signal()
		b.mu.Unlock()

		select {
		case err := <-e.result:
			if errors.Is(err, idempotency.ErrRunAlone) {
				return next(msg)
			}
			return nil, err
		case <-revokedOf(msg):
			b.withdraw(e)
			return nil, ErrRevoked
		case <-b.p.stopping:
			b.withdraw(e)
			return nil, errShutdown
		case <-msg.Context().Done():
			b.withdraw(e)
			if b.p.stopped(msg) {
				return nil, errShutdown
			}
			return nil, errMessageContextDone
		}
	}
}

// withdraw takes a message that gave up waiting out of the next batch; one
// already in the running batch is decided there all the same (its claim
// makes a redelivery a duplicate).
func (b *batcher) withdraw(e *batchEntry) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if e.state == waiting {
		e.state = alone
	}
}

// run forms and commits batches until ctx ends.
//
// Up to Concurrency batches run at once. They never share a partition: a
// message joins a batch only when everything before it in its partition is
// done, so a partition's events stay in one batch at a time, in order.
func (b *batcher) run(ctx context.Context) {
	slots := make(chan struct{}, b.cfg.Concurrency)
	var running sync.WaitGroup
	defer running.Wait()
	for {
		select {
		case slots <- struct{}{}:
		case <-ctx.Done():
			return
		}
		batch := b.next(ctx)
		if batch == nil {
			return
		}
		running.Go(func() {
			defer func() { <-slots }()
			b.commit(ctx, batch)
		})
	}
}

// next waits for a batch: Size messages that may join one, or fewer once
// the oldest of them waited MaxWait.
func (b *batcher) next(ctx context.Context) []*batchEntry {
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		b.mu.Lock()
		ready, oldest := b.ready()
		if len(ready) >= b.cfg.Size || (len(ready) > 0 && time.Since(oldest) >= b.cfg.MaxWait) {
			ready = ready[:min(len(ready), b.cfg.Size)]
			for _, e := range ready {
				e.state = inBatch
			}
			b.mu.Unlock()
			return ready
		}
		b.mu.Unlock()
		var fire <-chan time.Time
		if len(ready) > 0 {
			if timer == nil {
				timer = time.NewTimer(b.cfg.MaxWait - time.Since(oldest))
			} else {
				timer.Reset(b.cfg.MaxWait - time.Since(oldest))
			}
			fire = timer.C
		}
		select {
		case <-ctx.Done():
			return nil
		case <-b.wake:
		case <-fire:
		}
	}
}

// ready lists the waiting messages that may join a batch: every message
// before them in their partition is done. Caller holds b.mu.
func (b *batcher) ready() (ready []*batchEntry, oldest time.Time) {
	for key, q := range b.queues {
		if key.owner.Err() != nil {
			// The session ended: its messages are the next owner's. Those
			// no goroutine holds (announced, never handed out) go now; the
			// others leave with their goroutines.
			for _, e := range slices.Clone(*q) {
				if e.state == announced || e.state == done {
					b.remove(e)
				}
			}
			continue
		}
		for _, e := range *q {
			if e.state == done {
				continue
			}
			if e.state == waiting && e.runAlone {
				e.state = alone
				e.result <- idempotency.ErrRunAlone
				break
			}
			if e.state == waiting {
				ready = append(ready, e)
				if oldest.IsZero() || e.since.Before(oldest) {
					oldest = e.since
				}
				if len(ready) >= b.cfg.Size {
					return ready, oldest
				}
				continue
			}
			break // announced, in a batch or alone: its followers wait
		}
	}
	return ready, oldest
}

// commit runs one batch and hands each message its result.
func (b *batcher) commit(ctx context.Context, batch []*batchEntry) {
	// Partition by partition, in order: the handler sees each partition's
	// events as they were written.
	slices.SortFunc(batch, func(x, y *batchEntry) int {
		if x.queue.partition != y.queue.partition {
			return int(x.queue.partition - y.queue.partition)
		}
		return int(x.offset - y.offset)
	})
	msgs := make([]*message.Message, len(batch))
	for i, e := range batch {
		msgs[i] = e.msg
	}
	attemptCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), b.p.cfg.AttemptTimeout)
	defer cancel()
	started := time.Now()
	results := b.idem.ProcessBatch(attemptCtx, msgs, func(ctx context.Context, tx pgx.Tx, claimed []*message.Message) error {
		evs := make([]any, len(claimed))
		for i, msg := range claimed {
			ev, ok := msg.Context().Value(eventCtxKey{}).(decoded)
			if !ok {
				return errors.New("pipeline: no decoded event in the message context")
			}
			evs[i] = ev.value
		}
		return b.handle(ctx, tx, evs)
	})
	if b.p.cfg.OnBatch != nil {
		done := BatchDone{Topic: b.topic, Group: b.group, Size: len(batch), Duration: time.Since(started)}
		for _, err := range results {
			if errors.Is(err, idempotency.ErrRunAlone) {
				done.RunAlone++
			}
		}
		b.p.cfg.OnBatch(done)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	first := map[int32]bool{}
	for i, e := range batch {
		if e.msg != msgs[i] {
			continue // its goroutine gave up and left meanwhile
		}
		switch {
		case !errors.Is(results[i], idempotency.ErrRunAlone):
			e.state = done
			e.result <- results[i]
		case !first[e.queue.partition] && e.state == inBatch:
			// The first of its partition runs on its own now; the others
			// follow it one by one (runAlone), in order.
			first[e.queue.partition] = true
			e.state = alone
			e.result <- results[i]
		case e.state == inBatch:
			e.state, e.runAlone = waiting, true
		}
	}
	b.signal()
}
