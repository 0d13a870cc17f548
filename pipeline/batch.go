package pipeline

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/once-dev/once/middleware/idempotency"
)

// batcher is a group's group commit: one goroutine claims, handles and
// commits batch after batch (idempotency.Middleware.ProcessBatch). What a
// batch cannot decide runs on its own, through the router and the group's
// whole chain: holding, dead-lettering and everything else stay as they are.
//
// A message reaches a batch one of two ways. On the direct path (see
// [Batch]) the subscriber hands it to take, which decodes it and queues it:
// no router goroutine, no per-message chain, and the batch acknowledges it.
// Otherwise it passes through the whole chain on the router's goroutine,
// and at the claim its first attempt joins a batch and waits for the
// verdict there.
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
	inTx   []message.HandlerMiddleware // a team's InTx, once per batch
	cfg    Batch

	// The direct path: decode is the topic's; toRouter gives a message the
	// batch could not decide to the router, false when its partition or
	// the subscription is gone. decided counts the messages a batch
	// acknowledged on it.
	decode   func([]byte) (decoded, error)
	toRouter func(*message.Message) bool
	decided  atomic.Int64

	mu      sync.Mutex
	queues  map[partitionOf]*[]*batchEntry // announced, in order
	entries map[entryKey]*batchEntry
	wake    chan struct{} // the batch loop's
	changed chan struct{} // closed at the next change, for those awaiting their turn; nil while none does
}

// entryKey names a message as one session handed it out: the same offset
// handed out again by a later session of this process is another entry,
// so a late goroutine of the old session never touches the new one's.
type entryKey struct {
	owner context.Context
	uuid  string
}

func entryKeyOf(msg *message.Message) (entryKey, bool) {
	c, ok := claimOf(msg)
	return entryKey{c.owner, msg.UUID}, ok
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
	key    entryKey
	offset int64
	queue  partitionOf
	msg    *message.Message
	ctx    context.Context // msg's context when it reached the claim
	state  entryState
	// runAlone: its batch failed; it runs on its own once every message
	// before it in its partition is done, so that a partition's events
	// are re-run one by one, in order.
	runAlone bool
	since    time.Time
	// handedOut: when the subscriber last handed it out; zero while it
	// waits to be handed out again. See handOff.
	handedOut time.Time
	result    chan error // buffered: the batch never waits for its reader
	// direct: taken on the direct path; no goroutine waits for it, the
	// batch acknowledges it or gives it to the router. span is its trace's.
	direct bool
	span   trace.Span
	// verdict: the permanent error its batch found (a reused id); its run
	// in the chain returns it at the claim, to be dead-lettered.
	verdict error
}

// handOff is how long a message handed out may take to reach the claim
// (decoding, a team's Observe and BeforeClaim) and still be waited for by a
// batch that could leave. One that takes longer is held or slow, and a batch
// that waited for it would pay up to MaxWait for nothing.
const handOff = 2 * time.Millisecond

func newBatcher(p *Pipeline, topic, group string, idem *idempotency.Middleware, handle func(ctx context.Context, tx pgx.Tx, evs []any) error,
	inTx []message.HandlerMiddleware, cfg Batch) *batcher {
	return &batcher{topic: topic, group: group, p: p, idem: idem, handle: handle, inTx: inTx, cfg: cfg,
		queues: map[partitionOf]*[]*batchEntry{}, entries: map[entryKey]*batchEntry{}, wake: make(chan struct{}, 1)}
}

// announce records msg as its partition's next message; the subscriber calls
// it in the order it hands messages out.
func (b *batcher) announce(msg *message.Message) {
	c, ok := claimOf(msg)
	if !ok {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	e, _ := b.place(c, msg)
	e.state, e.msg, e.runAlone, e.handedOut = announced, nil, false, time.Now()
}

// take is the direct path (see [Batch]): it decodes msg and queues it for
// a batch, and reports whether it did. A message it cannot decode is only
// announced, and goes the router's way to be dead-lettered there, holding
// its followers until it is.
func (b *batcher) take(msg *message.Message) bool {
	c, ok := claimOf(msg)
	if !ok {
		return false
	}
	ev, err := decodeRecovered(b.decode, msg.Payload)
	if err != nil {
		b.announce(msg)
		return false
	}
	ctx, span, err := b.deliveredRecovered(msg)
	if err != nil {
		// A hook's bug, or the tracer's: the router's recoverer holds the
		// message on the chain (review finding: on sarama's goroutine the
		// panic ended the process, and again at every restart).
		b.p.cfg.Logger.Error("a delivery hook or the tracer panicked; the message goes through the chain", "topic", b.topic, "consumer_group", b.group, "err", err)
		b.announce(msg)
		return false
	}
	// One record of external effects for the whole delivery, as hold gives
	// one: a batch that rolls back after an effect marks it, and the
	// message's own run in the chain still sees the mark.
	ctx = context.WithValue(idempotency.WithDelivery(ctx), eventCtxKey{}, ev)
	b.mu.Lock()
	defer b.mu.Unlock()
	e, isNew := b.place(c, msg)
	if !isNew && e.state != announced {
		// Never so: a message is handed out again only once its chain
		// gave it back. Should it be, its chain decides it.
		span.End()
		return false
	}
	msg.SetContext(ctx)
	now := time.Now()
	e.state, e.msg, e.ctx, e.since, e.runAlone, e.handedOut = waiting, msg, ctx, now, false, now
	e.direct, e.span, e.verdict = true, span, nil
	b.signal()
	return true
}

// deliveredRecovered tells the hooks of msg's delivery and starts its span,
// with a panic as an error.
func (b *batcher) deliveredRecovered(msg *message.Message) (ctx context.Context, span trace.Span, err error) {
	defer func() {
		if r := recover(); r != nil {
			if span != nil {
				span.End()
			}
			ctx, span, err = nil, nil, fmt.Errorf("pipeline: %v", r)
		}
	}()
	if hook := b.p.cfg.Hooks.OnDelivered; hook != nil {
		hook(delivery(b.topic, b.group, msg))
	}
	ctx, span = b.p.startSpan(msg.Context(), b.topic, b.group, msg)
	return ctx, span, nil
}

// decodeRecovered is decode, with a panic as an error: the message then goes
// the router's way, whose recoverer holds it.
func decodeRecovered(decode func([]byte) (decoded, error), payload []byte) (ev decoded, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("pipeline: the decoder panicked: %v", r)
		}
	}()
	return decode(payload)
}

// place finds msg's entry, or puts a new one in its place in its
// partition's queue. Caller holds b.mu.
func (b *batcher) place(c claimInfo, msg *message.Message) (*batchEntry, bool) {
	ek := entryKey{c.owner, msg.UUID}
	if e := b.entries[ek]; e != nil {
		// Handed out again after it was given back: still in its place.
		return e, false
	}
	offset, _ := strconv.ParseInt(msg.Metadata.Get(MetaKafkaOffset), 10, 64)
	key := partitionOf{c.owner, c.partition}
	q := b.queues[key]
	if q == nil {
		q = new([]*batchEntry)
		b.queues[key] = q
	}
	e := &batchEntry{key: ek, offset: offset, queue: key}
	// In offset order, so that a message handed out again lands before
	// those that followed it.
	i, _ := slices.BinarySearchFunc(*q, offset, func(e *batchEntry, o int64) int { return int(e.offset - o) })
	*q = slices.Insert(*q, i, e)
	b.entries[ek] = e
	return e, true
}

// track wraps a batched group's whole chain: a message that leaves it
// acknowledged leaves its partition's queue; one given back (it will be
// handed out again) keeps its place, unless its partition was revoked.
func (b *batcher) track(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) (out []*message.Message, err error) {
		// Deferred: a team's middleware that panics outside the chain's
		// recoverer must not leave the entry behind.
		defer func() { b.leave(msg, err != nil && !isClosed(revokedOf(msg))) }()
		return h(msg)
	}
}

func (b *batcher) leave(msg *message.Message, keepPlace bool) {
	ek, ok := entryKeyOf(msg)
	if !ok {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	e := b.entries[ek]
	if e == nil || (e.msg != nil && e.msg != msg) {
		return
	}
	if keepPlace {
		e.state, e.msg, e.runAlone, e.handedOut, e.verdict = announced, nil, false, time.Time{}, nil
	} else {
		b.remove(e)
	}
	b.signal()
}

func (b *batcher) remove(e *batchEntry) {
	delete(b.entries, e.key)
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

// signal wakes the batch loop and those awaiting their turn. Caller holds
// b.mu.
func (b *batcher) signal() {
	select {
	case b.wake <- struct{}{}:
	default:
	}
	if b.changed != nil {
		close(b.changed)
		b.changed = nil
	}
}

type attemptCtxKey struct{}

// batchCtxKey marks the context of a batch's handler and InTx middleware.
type batchCtxKey struct{}

// errInTxSkippedTheBatch: a team's InTx middleware returned without calling
// the batch's handler.
var errInTxSkippedTheBatch = errors.New("pipeline: an InTx middleware returned without calling the batch's handler; its events run on their own, where it decides event by event")

// claim is the group's claim stage: the first attempt of a message joins a
// batch; one the batch could not decide, and every later attempt, goes
// through next, the group's per-event claim, once every message before it
// in its partition is done.
func (b *batcher) claim(next message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ek, ok := entryKeyOf(msg)
		if !ok {
			return next(msg)
		}
		attempt, _ := msg.Context().Value(attemptCtxKey{}).(int)
		b.mu.Lock()
		e := b.entries[ek]
		if e == nil {
			b.mu.Unlock()
			return next(msg)
		}
		if verdict := e.verdict; verdict != nil {
			// Its batch on the direct path proved it permanent.
			b.mu.Unlock()
			return nil, verdict
		}
		if attempt > 1 || e.state != announced {
			// Its first attempt failed before it reached a batch, or its
			// batch gave it back: it runs on its own, in its turn.
			b.mu.Unlock()
			if err := b.awaitTurn(msg, e); err != nil {
				return nil, err
			}
			if msg.Context().Err() != nil {
				return nil, errOutwaited
			}
			return next(msg)
		}
		e.state, e.msg, e.ctx, e.since, e.result = waiting, msg, msg.Context(), time.Now(), make(chan error, 1)
		b.signal()
		b.mu.Unlock()

		// giveUp leaves the wait for why (a revocation, the shutdown), unless
		// the batch's verdict is there already: a message its batch decided
		// is acknowledged even when the partition is revoked or the pipeline
		// stops at the same moment. (Run alone is no verdict: there is no
		// running now.)
		giveUp := func(why error) ([]*message.Message, error) {
			select {
			case err := <-e.result:
				if !errors.Is(err, idempotency.ErrRunAlone) {
					return nil, err
				}
			default:
			}
			b.withdraw(e)
			return nil, why
		}
		ctxDone := msg.Context().Done()
		revoked, stopping := revokedOf(msg), b.p.stopping
		for {
			select {
			case err := <-e.result:
				if errors.Is(err, idempotency.ErrRunAlone) {
					if msg.Context().Err() != nil {
						return nil, errOutwaited
					}
					return next(msg)
				}
				return nil, err
			case <-revoked:
				if b.inBatch(e) {
					// Its batch is under way: within the revocation
					// grace it decides the message, which is then marked.
					revoked = nil
					continue
				}
				return giveUp(ErrRevoked)
			case <-stopping:
				if b.inBatch(e) {
					stopping = nil
					continue
				}
				return giveUp(errShutdown)
			case <-ctxDone:
				if b.p.stopped(msg) && !b.inBatch(e) {
					return giveUp(errShutdown)
				}
				if b.p.stopped(msg) {
					ctxDone = nil
					continue
				}
				// The attempt's time (or a team's timeout) ran out while it
				// waited for the messages before it, a wait that is not its
				// work: it keeps its place, as a per-event group's message
				// keeps its place behind a held one.
				ctxDone = nil
			}
		}
	}
}

// errOutwaited: the attempt's time ran out while the message waited for its
// turn, which was not its work; the hold tries it again at once, on a fresh
// attempt, without counting a failure.
var errOutwaited = errors.New("pipeline: the attempt's time ran out while the message waited for its turn")

// awaitTurn waits until every message before e in its partition is done,
// and makes e the one its followers wait for.
func (b *batcher) awaitTurn(msg *message.Message, e *batchEntry) error {
	for {
		b.mu.Lock()
		if b.isHead(e) {
			e.state, e.runAlone = alone, false
			b.signal() // no longer on its way to a batch
			b.mu.Unlock()
			return nil
		}
		if b.changed == nil {
			// Made for those who wait only: the direct path signals at
			// every message, and mostly nobody waits.
			b.changed = make(chan struct{})
		}
		changed := b.changed
		b.mu.Unlock()
		select {
		case <-changed:
		case <-revokedOf(msg):
			return ErrRevoked
		case <-b.p.stopping:
			return errShutdown
		}
	}
}

// isHead: every message before e in its partition is done. Caller holds b.mu.
func (b *batcher) isHead(e *batchEntry) bool {
	q := b.queues[e.queue]
	if q == nil {
		return true
	}
	for _, x := range *q {
		if x == e {
			return true
		}
		if x.state != done {
			return false
		}
	}
	return true
}

// inBatch: e is in the batch under way, which decides it.
func (b *batcher) inBatch(e *batchEntry) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return e.state == inBatch
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

// batchItem is an entry as its batch took it: the message, and a copy of it
// that only the batch uses (the message's own goroutine may give up and
// change its context meanwhile).
type batchItem struct {
	e      *batchEntry
	msg    *message.Message
	frozen *message.Message
}

// next, called with a commit slot free, waits for a batch: Size messages
// that may join one; or fewer, as soon as no more are on their way (unless
// WaitToFill), and at the latest once the oldest of them waited MaxWait.
func (b *batcher) next(ctx context.Context) []batchItem {
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		b.mu.Lock()
		ready, oldest, arriving := b.ready()
		onTheirWay := !arriving.IsZero()
		if len(ready) >= b.cfg.Size || (len(ready) > 0 && ((!onTheirWay && !b.cfg.WaitToFill) || time.Since(oldest) >= b.cfg.MaxWait)) {
			ready = ready[:min(len(ready), b.cfg.Size)]
			items := make([]batchItem, len(ready))
			for i, e := range ready {
				e.state = inBatch
				frozen := e.msg // on the direct path, the batch's alone
				if !e.direct {
					// Not NewMessage: nothing acknowledges the copy, so it
					// needs none of the acknowledgement channels NewMessage
					// makes.
					frozen = &message.Message{UUID: e.msg.UUID, Metadata: maps.Clone(e.msg.Metadata), Payload: e.msg.Payload}
					frozen.SetContext(e.ctx)
				}
				items[i] = batchItem{e: e, msg: e.msg, frozen: frozen}
			}
			b.mu.Unlock()
			return items
		}
		b.mu.Unlock()
		var fire <-chan time.Time
		if len(ready) > 0 {
			// At the latest when the oldest waited MaxWait; before that,
			// when the messages on their way stop counting as such.
			wait := b.cfg.MaxWait - time.Since(oldest)
			if !b.cfg.WaitToFill {
				wait = min(wait, time.Until(arriving.Add(handOff)))
			}
			if timer == nil {
				timer = time.NewTimer(wait)
			} else {
				timer.Reset(wait)
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

// ready lists the waiting messages that may join a batch, up to Size,
// oldest first across partitions: every message before them in their
// partition is done or in the list before them. And whether more could
// join it soon: handed out less than handOff ago, on their way to the
// claim, with nothing before them that is not in the list or done
// (arriving is when the latest of them was handed out; zero for none).
// Caller holds b.mu.
func (b *batcher) ready() (ready []*batchEntry, oldest time.Time, arriving time.Time) {
	now := time.Now()
	// Each partition's candidates, one partition after another: from
	// starts[i] up to starts[i+1].
	var candidates []*batchEntry
	var starts []int
	for key, q := range b.queues {
		if key.owner.Err() != nil {
			// The session ended: its messages are the next owner's. Those
			// no goroutine holds (announced, never handed out; waiting on
			// the direct path) go now; the others leave with their
			// goroutines, or their batch.
			for _, e := range slices.Clone(*q) {
				if e.state == announced || e.state == done || (e.direct && e.state == waiting) {
					b.endSpan(e, ErrRevoked)
					b.remove(e)
				}
			}
			continue
		}
		starts = append(starts, len(candidates))
		pending := false // a message before this one is in the batch being formed
		for _, e := range *q {
			if e.state == done {
				continue
			}
			if e.state == waiting && e.runAlone {
				// Its turn to run on its own comes when all before it
				// are done, not while one of them is still to be batched.
				if !pending {
					e.state = alone
					e.result <- idempotency.ErrRunAlone
				}
				break
			}
			if e.state == waiting {
				pending = true
				candidates = append(candidates, e)
				if oldest.IsZero() || e.since.Before(oldest) {
					oldest = e.since
				}
				if len(candidates)-starts[len(starts)-1] >= b.cfg.Size {
					break
				}
				continue
			}
			// Announced, in a batch or alone: its followers wait. One
			// handed out just now (everything before it is done or in this
			// list) is on its way to this batch.
			if e.state == announced && !e.handedOut.IsZero() && now.Sub(e.handedOut) < handOff && e.handedOut.After(arriving) {
				arriving = e.handedOut
			}
			break
		}
	}
	if len(candidates) <= b.cfg.Size {
		return candidates, oldest, arriving
	}
	// More than a batch: the oldest first, each partition's in its order,
	// so that no partition waits batch after batch behind busier ones (map
	// order would pick them at random).
	next := slices.Clone(starts)
	starts = append(starts, len(candidates))
	ready = make([]*batchEntry, 0, b.cfg.Size)
	for len(ready) < b.cfg.Size {
		best := -1
		for p, i := range next {
			if i < starts[p+1] && (best < 0 || candidates[i].since.Before(candidates[next[best]].since)) {
				best = p
			}
		}
		ready = append(ready, candidates[next[best]])
		next[best]++
	}
	return ready, oldest, arriving
}

// commit runs one batch and hands each message its result. The batch's
// attempt ends at shutdown and when any of its partitions is revoked, as a
// per-event attempt does: its claims roll back (a commit under way is let
// finish), and the messages run on their own or go to the next owner.
func (b *batcher) commit(ctx context.Context, batch []batchItem) {
	// Partition by partition, in order: the handler sees each partition's
	// events as they were written.
	slices.SortFunc(batch, func(x, y batchItem) int {
		if x.e.queue.partition != y.e.queue.partition {
			return int(x.e.queue.partition - y.e.queue.partition)
		}
		return int(x.e.offset - y.e.offset)
	})
	msgs := make([]*message.Message, len(batch))
	for i, it := range batch {
		msgs[i] = it.frozen
	}
	// Not ctx, which the stop ends at once: a batch under way gets the
	// revocation grace of its partitions, at a stop as at a rebalance.
	attemptCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), b.p.cfg.AttemptTimeout)
	defer cancel()
	// Each partition's attempts under way count the batch: it gets the
	// revocation grace of every partition it holds, and ends when the
	// first of those ends. One revoked already cancels it at once.
	owners := map[context.Context]bool{}
	for _, it := range batch {
		o := it.e.queue.owner
		if owners[o] {
			continue
		}
		owners[o] = true
		run := runOf(it.frozen)
		if run == nil {
			// Not from a subscriber (Local): no grace, the stop ends it.
			defer context.AfterFunc(o, cancel)()
			defer context.AfterFunc(ctx, cancel)()
			continue
		}
		if !run.begin(o) {
			cancel()
			continue
		}
		defer run.end()
		defer context.AfterFunc(run.hard, cancel)()
	}
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
		// Publish works in a batch as in a handler of one event; DerivedID
		// and EventFrom do not (there is no one event): they say so.
		ctx = context.WithValue(context.WithValue(ctx, publisherCtxKey{}, b.p.publisher), batchCtxKey{}, true)
		if len(b.inTx) == 0 {
			return b.handle(ctx, tx, evs)
		}
		// A team's InTx middleware wraps the batch once, in its
		// transaction; the message it sees is the batch's first, with the
		// batch's context. One that does not call the handler (a filter
		// written for one event) fails the batch, whose events then run on
		// their own, each through the middleware: it decides event by
		// event, and no event is claimed without its handler.
		handled := false
		h := func(msg *message.Message) ([]*message.Message, error) {
			handled = true
			return nil, b.handle(msg.Context(), tx, evs)
		}
		for i := len(b.inTx) - 1; i >= 0; i-- {
			h = b.inTx[i](h)
		}
		carrier := &message.Message{UUID: claimed[0].UUID, Metadata: claimed[0].Metadata, Payload: claimed[0].Payload}
		carrier.SetContext(ctx)
		out, err := h(carrier)
		switch {
		case err == nil && !handled:
			return errInTxSkippedTheBatch
		case err == nil && len(out) > 0:
			return fmt.Errorf("%w (%d messages)", ErrReturnedMessages, len(out))
		}
		return err
	})
	if b.p.cfg.Hooks.OnBatch != nil {
		done := BatchDone{Topic: b.topic, Group: b.group, Size: len(batch), Duration: time.Since(started)}
		for _, err := range results {
			if errors.Is(err, idempotency.ErrRunAlone) {
				done.RunAlone++
				done.Deadlock = done.Deadlock || idempotency.IsDeadlock(err)
			}
		}
		b.p.cfg.Hooks.OnBatch(done)
	}
	type verdict struct {
		e   *batchEntry
		err error
	}
	var acked []*batchEntry
	var givenBack []verdict
	b.mu.Lock()
	first := map[partitionOf]bool{}
	for i, it := range batch {
		e := it.e
		runAlone := errors.Is(results[i], idempotency.ErrRunAlone)
		if e.direct {
			if results[i] == nil {
				b.remove(e)
				acked = append(acked, e)
				continue
			}
			// Everything else runs on its own through the chain, where
			// awaitTurn keeps its partition's order. It is its partition's
			// first undecided message, which a later entry of the same
			// partition in this batch must not take itself for (review
			// finding).
			first[e.queue] = true
			if !runAlone {
				e.verdict = results[i]
			}
			e.state, e.direct = alone, false
			givenBack = append(givenBack, verdict{e, results[i]})
			continue
		}
		if e.msg != it.msg {
			// Its goroutine gave up and left meanwhile. Undecided, it will
			// be handed out again in its place, and its followers wait.
			if runAlone {
				first[e.queue] = true
			}
			continue
		}
		switch {
		case !runAlone:
			e.state = done
			e.result <- results[i]
		case !first[e.queue] && e.state == inBatch:
			// The first of its partition runs on its own now; the others
			// follow it one by one (runAlone), in order.
			first[e.queue] = true
			e.state = alone
			e.result <- results[i]
		case e.state == inBatch:
			e.state, e.runAlone = waiting, true
		}
	}
	b.signal()
	b.mu.Unlock()
	b.decided.Add(int64(len(acked)))
	for _, e := range acked {
		b.endSpan(e, nil)
		settledDone(e.msg) // its batch committed: the acknowledgement marks it
		e.msg.Ack()
	}
	for _, v := range givenBack {
		b.endSpan(v.e, v.err)
		go b.giveBack(v.e, v.e.msg)
	}
}

// giveBack sends a message its batch could not decide through the router
// and the whole chain, as if it came from the subscriber now; one whose
// partition or subscription is gone leaves its queue for the next owner.
func (b *batcher) giveBack(e *batchEntry, msg *message.Message) {
	msg.SetContext(context.WithValue(msg.Context(), givenBackCtxKey{}, true))
	if b.toRouter(msg) {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.entries[e.key] == e && e.msg == msg {
		b.remove(e)
		b.signal()
	}
}

// givenBackCtxKey marks a message the direct path gave to the router: its
// delivery was reported, and its record of external effects made, there.
type givenBackCtxKey struct{}

func givenBack(msg *message.Message) bool { return msg.Context().Value(givenBackCtxKey{}) != nil }

// endSpan ends a direct entry's span with its outcome.
func (b *batcher) endSpan(e *batchEntry, err error) {
	if e.span == nil {
		return
	}
	if err != nil {
		e.span.SetStatus(codes.Error, err.Error())
	}
	e.span.End()
	e.span = nil
}
