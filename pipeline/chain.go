package pipeline

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/internal/tracing"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/pgdb"
)

// The stages of the safety chain that are the pipeline's own; the package
// documentation lists them in order.

// DB is the library's one database type (pgdb.DB): where a group's claims,
// business tables, dead letters and outbox events live. *pgxpool.Pool is one.
type DB = pgdb.DB

type pgxTx = pgx.Tx

// errShutdown replaces an error that happened because the pipeline is
// stopping: neither held nor dead-lettered, the message stays uncommitted.
var errShutdown = errors.New("pipeline: stopped while processing; the message stays uncommitted")

// ErrRevoked means a held message was given up because its partition was
// revoked: it was not processed, and the partition's new owner receives it
// again.
var ErrRevoked = errors.New("pipeline: partition revoked while the message was held; left for its new owner")

// ErrReturnedMessages is the error of a handler chain that returned messages
// to publish: the router would publish them after the commit, where a crash
// loses them for good. Publish through the claim's transaction instead.
var ErrReturnedMessages = errors.New("pipeline: a handler returned messages to publish after the commit; publish them in the claim's transaction instead")

// maxReasonBytes bounds the reason header of a dead letter: the error text
// is ours, and the letter must still fit the broker's message size.
const maxReasonBytes = 4 << 10

type deliveryCtxKey struct{}

// deliveryInfo is what the chain knows of a delivery from its start: the
// subscriber's context, and where the message came from.
type deliveryInfo struct {
	orig     context.Context
	claim    claimInfo
	delivery Delivery
}

// DeliveryFrom is where the message a handler or a team's middleware works
// on came from: its topic, partition, offset, key and headers, the group,
// and the attempt. ok is false outside a pipeline's handler chain.
func DeliveryFrom(ctx context.Context) (d Delivery, ok bool) {
	info, ok := ctx.Value(deliveryCtxKey{}).(*deliveryInfo)
	if !ok {
		return Delivery{}, false
	}
	d = info.delivery
	d.Attempt, _ = ctx.Value(attemptCtxKey{}).(int)
	return d, true
}

// EventFrom is the decoded event of the message a handler or a team's
// BeforeClaim or InTx middleware works on (Observe runs before decoding).
// ok is false when there is none, or it is not an E; and in the handler
// and InTx middleware of a batch, which has many.
func EventFrom[E Event](ctx context.Context) (ev E, ok bool) {
	d, found := ctx.Value(eventCtxKey{}).(decoded)
	if !found {
		return ev, false
	}
	ev, ok = d.value.(E)
	return ev, ok
}

// delivered reports the delivery and remembers the context the subscriber
// gave the message and where it came from, whatever contexts a team's
// middleware puts in front of it later: see stopped.
func (p *Pipeline) delivered(topic, group string) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			d := delivery(topic, group, msg)
			if p.cfg.Hooks.OnDelivered != nil && !givenBack(msg) {
				// A message the direct path gave back was reported there.
				p.cfg.Hooks.OnDelivered(d)
			}
			orig := msg.Context()
			// The claim is looked up here once: later lookups find it a few
			// contexts up instead of at the bottom of the router's chain.
			c, _ := claimOf(msg)
			if c.run != nil {
				// Under way until its verdict: a revocation's grace waits
				// for it, and none is taken after the revocation.
				if !c.run.begin(c.owner) {
					return nil, ErrRevoked
				}
				defer c.run.end()
			}
			ctx, span := p.startSpan(orig, topic, group, msg)
			defer span.End()
			ctx = context.WithValue(ctx, publisherCtxKey{}, p.publisher)
			msg.SetContext(context.WithValue(ctx, deliveryCtxKey{}, &deliveryInfo{orig: orig, claim: c, delivery: d}))
			defer msg.SetContext(orig)
			out, err := h(msg)
			if err != nil {
				span.SetStatus(codes.Error, err.Error())
			} else {
				settledDone(msg) // before its acknowledgement, which marks it
			}
			return out, err
		}
	}
}

// startSpan continues the producer's trace: the handler's context carries
// this span to the provider's HTTP request and into the events it publishes
// through the outbox.
func (p *Pipeline) startSpan(ctx context.Context, topic, group string, msg *message.Message) (context.Context, trace.Span) {
	ctx = otel.GetTextMapPropagator().Extract(ctx, tracing.MetadataCarrier(msg.Metadata))
	ctx, span := p.tracer.Start(ctx, "process "+topic, trace.WithSpanKind(trace.SpanKindConsumer))
	if span.IsRecording() {
		// Only for a span that is kept: without a tracer provider these
		// allocations would be the whole cost of tracing.
		span.SetAttributes(attribute.String("messaging.system", "kafka"), attribute.String("messaging.destination.name", topic),
			attribute.String("messaging.consumer.group.name", group), attribute.String("messaging.kafka.offset", msg.Metadata.Get(MetaKafkaOffset)),
			attribute.String("messaging.destination.partition.id", msg.Metadata.Get(MetaKafkaPartition)))
	}
	return ctx, span
}

// stopped reports whether the message is being processed while the pipeline
// or its router shuts down: an error then is the shutdown's, not the
// message's. A message context a team's middleware shortened is no evidence.
func (p *Pipeline) stopped(msg *message.Message) bool {
	select {
	case <-p.stopping:
		return true
	default:
	}
	if d, ok := msg.Context().Value(deliveryCtxKey{}).(*deliveryInfo); ok && d.subscriptionEnded() {
		return true
	}
	return p.router != nil && p.router.IsClosed()
}

// subscriptionEnded: the subscription that delivered the message ended. The
// context our subscriber gives a message ends at its partition's
// revocation too, which is no shutdown: its subscription's is asked.
func (d *deliveryInfo) subscriptionEnded() bool {
	if d.claim.subscription != nil {
		return d.claim.subscription.Err() != nil
	}
	return d.orig.Err() != nil
}

// releaseRevoked gives back, unacknowledged, a message given up because its
// partition was revoked: the partition's new owner receives it again. It is
// never acknowledged: the subscriber goes on marking what the attempts under
// way finish during the revocation grace, and an acknowledgement would mark
// a message that was not processed.
func releaseRevoked(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		if errors.Is(err, ErrRevoked) {
			return nil, ErrRevoked
		}
		return out, err
	}
}

// refuseReturnedMessages drops messages that a team's Observe or BeforeClaim
// middleware returned after the claim committed: publishing them now could
// be lost, and failing the delivery would redeliver a duplicate that returns
// them again, forever. They are logged as the bug they are.
func refuseReturnedMessages(log *slog.Logger, topic, group string) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if len(out) > 0 {
				log.Error("dropped messages a middleware returned to publish after the commit; publish them in the claim's transaction instead",
					"topic", topic, "consumer_group", group, "messages", len(out), "partition", logPartition(msg), "offset", logOffset(msg))
			}
			return nil, err
		}
	}
}

// refuseMessagesInTx fails an attempt whose handler or InTx middleware
// returned messages, before the commit: nothing of it is kept.
func refuseMessagesInTx(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		if err == nil && len(out) > 0 {
			return nil, fmt.Errorf("%w (%d messages)", ErrReturnedMessages, len(out))
		}
		return out, err
	}
}

// deadLetter acknowledges a message that failed for good after its dead
// letter is committed in the group's database: in the claim's transaction
// for a handler's rejection, in a transaction of its own otherwise. The
// group's drainer publishes it to the topic's dead-letter topic. While the
// letter cannot be written, the message is held like any other.
func (p *Pipeline) deadLetter(t topicBinding, g groupBinding) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil || !idempotency.IsPermanent(err) {
				return out, err
			}
			var rejected *idempotency.RejectedError
			var eventID string
			if !errors.As(err, &rejected) || !rejected.DeadLettered {
				letter := p.letter(t, g, msg, err, rejected != nil)
				eventID = letter.Headers[dlq.HeaderEventID]
				revoked := revokedOf(msg)
				wait := p.cfg.HoldBackoff
				var heldSince time.Time
				for attempt := 1; ; attempt++ {
					parked, perr := p.park(msg, g.db, delivery(t.name, g.name, msg), letter)
					if perr == nil && !parked {
						p.cfg.Logger.Info("dead-lettered before (an offset reset or a re-read partition delivered it again); not sent twice",
							"topic", t.name, "consumer_group", g.name, "partition", logPartition(msg), "offset", logOffset(msg))
						return nil, nil
					}
					if perr == nil {
						break
					}
					if attempt == 1 {
						// Held like any message the environment fails: the
						// status and once_held_messages show it.
						heldSince = time.Now()
						p.holding(msg, t.name, g.name, heldSince)
						defer p.released(msg)
					}
					p.holdFailed(msg, attempt, fmt.Errorf("write the dead letter: %w", perr))
					p.cfg.Logger.Warn("cannot write the dead letter; holding the message", "topic", t.name, "consumer_group", g.name,
						"partition", logPartition(msg), "offset", logOffset(msg), "attempt", attempt, "err", perr)
					if p.cfg.Hooks.OnHeld != nil {
						// Held as the environment's failures are: the hook
						// (and its metric) sees it too.
						p.cfg.Hooks.OnHeld(Held{Delivery: delivery(t.name, g.name, msg), Attempts: attempt, Since: time.Since(heldSince), Err: fmt.Errorf("write the dead letter: %w", perr)})
					}
					if werr := p.pause(msg, revoked, wait); werr != nil {
						return nil, fmt.Errorf("%w: %w", werr, perr)
					}
					wait = min(2*wait, p.cfg.HoldMaxBackoff)
				}
			}
			p.letters.Nudge()
			if rejected == nil {
				// A rejection was logged where it was recorded: one line
				// per dead letter, the hook (OnDeadLetter) logs none.
				p.cfg.Logger.Warn("dead-lettered: the message itself is at fault", "topic", t.name, "consumer_group", g.name, "dlq", t.dlq,
					"partition", logPartition(msg), "offset", logOffset(msg), "event_id", eventID, "reason", err.Error())
			}
			if p.cfg.Hooks.OnDeadLetter != nil {
				p.cfg.Hooks.OnDeadLetter(DeadLetter{Delivery: delivery(t.name, g.name, msg), DLQ: t.dlq, Reason: err.Error(), Err: err})
			}
			return nil, nil
		}
	}
}

// park writes a dead letter in a transaction of its own, bounded by the
// statement timeout and by the partition's revocation: a silent database
// cannot hold the partition up here either.
func (p *Pipeline) park(msg *message.Message, db DB, d Delivery, letter dlq.Letter) (bool, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(msg.Context()), p.cfg.StatementTimeout)
	defer cancel()
	if run := runOf(msg); run != nil {
		// A letter being written at the revocation gets the grace.
		defer context.AfterFunc(run.hard, cancel)()
	} else if owner := ownerOf(msg); owner != nil {
		defer context.AfterFunc(owner, cancel)()
	}
	parked := true
	// Bounded on the server too: a client that vanished mid-park would
	// leave its source row's key locked, and every retry of this message
	// (here or at the partition's next owner) would wait on it.
	err := pgdb.InTxBounded(ctx, db, p.cfg.StatementTimeout, func(tx pgx.Tx) error {
		if _, fromKafka := claimOf(msg); !fromKafka {
			// Not read from Kafka by the pipeline: no place to know it by.
			return p.letters.Park(ctx, tx, letter)
		}
		var err error
		parked, err = p.letters.ParkFrom(ctx, tx, dlq.Source{Group: d.Group, Topic: d.Topic, Partition: d.Partition, Offset: d.Offset}, letter)
		return err
	})
	return parked, err
}

// letter is a message's dead letter, with Watermill's poison-queue headers:
// the reason, the topic, and the consumer group as the handler; verdict
// when the group recorded its verdict with the claim (a rejection), which
// the console tells from a fault a replay may cure.
func (p *Pipeline) letter(t topicBinding, g groupBinding, msg *message.Message, reason error, verdict bool) dlq.Letter {
	headers := make(map[string]string, len(msg.Metadata)+4)
	for k, v := range msg.Metadata {
		headers[k] = v
	}
	text := reason.Error()
	if len(text) > maxReasonBytes {
		text = text[:maxReasonBytes] + "... (truncated)"
	}
	headers[middleware.ReasonForPoisonedKey] = text
	headers[middleware.PoisonedTopicKey] = t.name
	headers[middleware.PoisonedHandlerKey] = g.name
	// The event's id as its claim knows it: a derived id (DeriveEventID) is
	// in no payload field, and the replay window judges the letter by its
	// time.
	delete(headers, dlq.HeaderEventID)
	delete(headers, dlq.HeaderVerdict)
	if verdict {
		headers[dlq.HeaderVerdict] = dlq.VerdictRecorded
	}
	if id, ok := decodedID(g.decode, msg.Payload); ok {
		headers[dlq.HeaderEventID] = id.String()
	}
	return dlq.Letter{Topic: t.dlq, Key: []byte(msg.Metadata.Get(MetaKafkaKey)), Payload: msg.Payload, Headers: headers}
}

// decodedID is the id of payload's event, decoded again (a decoder is pure:
// what decoded before decodes the same); false for a payload that does not
// decode, or a decoder that panics, here outside the chain's recoverer.
func decodedID(decode func([]byte) (decoded, error), payload []byte) (id uuid.UUID, ok bool) {
	defer func() {
		if recover() != nil {
			id, ok = uuid.Nil, false
		}
	}()
	ev, err := decode(payload)
	return ev.id, err == nil
}

// hold tries a message again, with backoff and without end, for as long as
// its attempts fail for a reason that is not the message's own: only a
// permanent error leaves it (to be dead-lettered). Every attempt runs on a
// context that ends when the partition is revoked, so a call stuck on a
// database that went silent cannot hold a rebalance up; the wait between
// attempts ends on revocation (ErrRevoked) and on shutdown (errShutdown).
//
// slots, when not nil, bounds a key-ordered group's attempts at once (its
// Concurrency): each attempt takes a slot (and so a connection) for its
// run only, and none while it waits for its next try.
func (p *Pipeline) hold(topic, group string, slots chan struct{}) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			// One record of external effects for every attempt of this
			// delivery: after an attempt charged, none is permanent. A
			// message the direct path gave back has its record from there,
			// marked by its batch.
			delivered := msg.Context()
			if !givenBack(msg) {
				msg.SetContext(idempotency.WithDelivery(delivered))
				defer msg.SetContext(delivered)
			}
			revoked := revokedOf(msg)
			wait := p.cfg.HoldBackoff
			var heldSince time.Time
			owner := ownerOf(msg)
			for attempt := 1; ; attempt++ {
				if err := p.awaitSlot(slots, revoked); err != nil {
					return nil, err
				}
				out, err := p.attempt(msg, h, owner, attempt)
				freeSlot(slots)
				if errors.Is(err, errOutwaited) && !p.stopped(msg) && !isClosed(revoked) {
					if msg.Context().Err() != nil {
						// Not the attempt's time but the message's own
						// context ran out (a team's Timeout in Observe):
						// every attempt on it would end at once. Give it
						// back; it comes again with a fresh context.
						return nil, fmt.Errorf("%w: %w", p.whyEnded(msg, revoked), err)
					}
					continue
				}
				if err == nil || idempotency.IsPermanent(err) {
					if attempt > 1 {
						p.cfg.Logger.Info("held message passed", "topic", topic, "consumer_group", group, "attempts", attempt,
							"held_for", time.Since(heldSince).Round(time.Millisecond), "partition", logPartition(msg), "offset", logOffset(msg))
					}
					return out, err
				}
				if attempt == 1 {
					heldSince = time.Now()
					p.holding(msg, topic, group, heldSince)
					defer p.released(msg)
				}
				p.holdFailed(msg, attempt, err)
				if !p.stopped(msg) && !isClosed(revoked) {
					if p.cfg.Hooks.OnHeld != nil {
						p.cfg.Hooks.OnHeld(Held{Delivery: delivery(topic, group, msg), Attempts: attempt, Since: time.Since(heldSince), Err: err})
					}
					// Loud while the wait grows, then one line in ten.
					if wait < p.cfg.HoldMaxBackoff || attempt%10 == 0 {
						p.cfg.Logger.Warn("holding the message: its attempt failed for a reason that is not the message's own; retrying",
							"topic", topic, "consumer_group", group, "partition", logPartition(msg), "offset", logOffset(msg),
							"attempt", attempt, "held_for", time.Since(heldSince).Round(time.Millisecond), "retry_in", wait, "err", err)
					}
				}
				if werr := p.pause(msg, revoked, wait); werr != nil {
					return nil, fmt.Errorf("%w: %w", werr, err)
				}
				wait = min(2*wait, p.cfg.HoldMaxBackoff)
			}
		}
	}
}

// awaitSlot takes one of slots, once one is free (nil slots: none to
// take). A revocation or the shutdown ends the wait.
func (p *Pipeline) awaitSlot(slots chan struct{}, revoked <-chan struct{}) error {
	if slots == nil {
		return nil
	}
	select {
	case slots <- struct{}{}:
		return nil
	case <-revoked:
		return ErrRevoked
	case <-p.stopping:
		return errShutdown
	}
}

func freeSlot(slots chan struct{}) {
	if slots != nil {
		<-slots
	}
}

// pause waits d before a message's next try, or says why there is none:
// ErrRevoked or errShutdown.
func (p *Pipeline) pause(msg *message.Message, revoked <-chan struct{}, d time.Duration) error {
	if p.stopped(msg) {
		return errShutdown
	}
	if isClosed(revoked) {
		return ErrRevoked
	}
	if msg.Context().Err() != nil {
		return p.whyEnded(msg, revoked)
	}
	msgDone := msg.Context().Done()
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
	case <-revoked:
		return ErrRevoked
	case <-p.stopping:
		return errShutdown
	case <-msgDone:
		return p.whyEnded(msg, revoked)
	}
	return nil
}

// whyEnded says why msg's context ended: the shutdown, its partition's
// revocation (the subscriber ends a message's context with its session),
// or else a team's middleware (a Watermill Timeout in Observe), after which
// every attempt on it would fail: it is given back unacknowledged, and the
// subscriber resends it with a fresh context.
func (p *Pipeline) whyEnded(msg *message.Message, revoked <-chan struct{}) error {
	if p.stopped(msg) {
		return errShutdown
	}
	if isClosed(revoked) {
		return ErrRevoked
	}
	return errMessageContextDone
}

// errMessageContextDone gives a message back for redelivery: its context
// ended while the pipeline runs on.
var errMessageContextDone = errors.New("pipeline: the message context ended (a middleware's timeout?); redelivering it")

// attempt runs the rest of the chain once, on a context that ends after
// AttemptTimeout, or when the partition's revocation grace ends after the
// session that owns it (owner, nil for none) ended. No attempt begins
// after that session's end.
func (p *Pipeline) attempt(msg *message.Message, h message.HandlerFunc, owner context.Context, attempt int) ([]*message.Message, error) {
	parent := msg.Context()
	ctx, cancel := context.WithTimeout(context.WithValue(parent, attemptCtxKey{}, attempt), p.cfg.AttemptTimeout)
	defer cancel()
	if run := runOf(msg); run != nil {
		if owner != nil && owner.Err() != nil {
			return nil, ErrRevoked // no attempt begins after the revocation
		}
		// A callback, not a goroutine watching the revocation: this runs
		// for every message.
		defer context.AfterFunc(run.hard, cancel)()
	} else if owner != nil {
		defer context.AfterFunc(owner, cancel)()
	}
	msg.SetContext(ctx)
	defer msg.SetContext(parent)
	return h(msg)
}

func isClosed(c <-chan struct{}) bool {
	if c == nil {
		return false
	}
	select {
	case <-c:
		return true
	default:
		return false
	}
}

type eventCtxKey struct{}

// decodeWith validates the payload at the edge, before any database work: an
// invalid event is permanent and never claims anything.
func decodeWith(decode func([]byte) (decoded, error)) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			ev, err := decode(msg.Payload)
			if err != nil {
				return nil, idempotency.Permanent(err)
			}
			ctx := msg.Context()
			msg.SetContext(context.WithValue(ctx, eventCtxKey{}, ev))
			defer msg.SetContext(ctx)
			return h(msg)
		}
	}
}

// decodedKey is the idempotency key of a decoded message: its event's id.
// An id that is not a UUIDv7 is refused here, naming where it came from
// (the event's EventID method, not a payload field the event may not
// have) and the way out for a producer with ids of its own.
func decodedKey(msg *message.Message) (uuid.UUID, error) {
	ev, ok := msg.Context().Value(eventCtxKey{}).(decoded)
	if !ok {
		return uuid.Nil, errors.New("pipeline: no decoded event in the message context")
	}
	if ev.id.Version() != 7 || ev.id.Variant() != uuid.RFC4122 {
		return uuid.Nil, fmt.Errorf("%w: %T.EventID() returned %s, a UUID version %d, want 7 "+
			"(for a producer whose ids are not UUIDv7s, derive one in Decode or EventID() with once.DeriveEventID "+
			"from the producer's id and a time the event carries)", idempotency.ErrInvalidKey, ev.value, ev.id, ev.id.Version())
	}
	return ev.id, nil
}

// decodedFingerprint is the fingerprint of a decoded message's event.
func decodedFingerprint(msg *message.Message) ([32]byte, error) {
	ev, ok := msg.Context().Value(eventCtxKey{}).(decoded)
	if !ok {
		return [32]byte{}, errors.New("pipeline: no decoded event in the message context")
	}
	return ev.fingerprint, nil
}

func handleWith(handle func(ctx context.Context, tx pgx.Tx, ev any) error) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx, err := idempotency.TxFromContext(ctx)
		if err != nil {
			return nil, err
		}
		ev, ok := ctx.Value(eventCtxKey{}).(decoded)
		if !ok {
			return nil, errors.New("pipeline: no decoded event in the message context")
		}
		return nil, handle(ctx, tx, ev.value)
	}
}
