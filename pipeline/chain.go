package pipeline

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/middleware/idempotency"
)

// The stages of the safety chain that are the pipeline's own; the package
// documentation lists them in order.

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

func (p *Pipeline) shouldDeadLetter(err error) bool {
	return idempotency.IsPermanent(err) && !errors.Is(err, errShutdown) && !errors.Is(err, ErrRevoked)
}

// deadLetter publishes a message whose processing failed for good to the
// topic's dead-letter topic, with Watermill's poison-queue headers: the
// reason, the topic, and the consumer group as the handler. A publish that
// fails leaves the message unacknowledged, to be delivered again.
func (p *Pipeline) deadLetter(t topicBinding, g groupBinding, pub message.Publisher) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil || !p.shouldDeadLetter(err) {
				return out, err
			}
			dead := message.NewMessage(msg.UUID, msg.Payload)
			for k, v := range msg.Metadata {
				dead.Metadata.Set(k, v)
			}
			dead.Metadata.Set(middleware.ReasonForPoisonedKey, err.Error())
			dead.Metadata.Set(middleware.PoisonedTopicKey, t.name)
			dead.Metadata.Set(middleware.PoisonedHandlerKey, g.name)
			dead.Metadata.Set(middleware.PoisonedSubscriberKey, message.SubscriberNameFromCtx(msg.Context()))
			if perr := pub.Publish(t.dlq, dead); perr != nil {
				return nil, errors.Join(err, fmt.Errorf("pipeline: dead-letter to %s: %w", t.dlq, perr))
			}
			if p.cfg.OnDeadLetter != nil {
				p.cfg.OnDeadLetter(DeadLetter{Delivery: delivery(t.name, g.name, msg), DLQ: t.dlq, Reason: err.Error()})
			}
			return nil, nil
		}
	}
}

func (p *Pipeline) delivered(topic, group string) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			if p.cfg.OnDelivered != nil {
				p.cfg.OnDelivered(delivery(topic, group, msg))
			}
			return h(msg)
		}
	}
}

// releaseRevoked acknowledges a message given up because its partition was
// revoked: watermill-kafka does not mark the offset of a message acknowledged
// after its session ended, so the partition's new owner receives it again.
func releaseRevoked(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		if errors.Is(err, ErrRevoked) {
			return nil, nil
		}
		return out, err
	}
}

// hold tries a message again, with backoff and without end, for as long as
// its attempts fail for a reason that is not the message's own: only a
// permanent error leaves it (to be dead-lettered). Every attempt runs on a
// context that ends when the partition is revoked, so a call stuck on a
// database that went silent cannot hold a rebalance up; the wait between
// attempts ends on revocation (ErrRevoked) and on shutdown (errShutdown).
func (p *Pipeline) hold(topic, group string, owners *sessions) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			revoked := owners.revoked(msg)
			wait := p.cfg.HoldBackoff
			var heldSince time.Time
			for attempt := 1; ; attempt++ {
				out, err := p.attempt(msg, h, revoked)
				if err == nil || idempotency.IsPermanent(err) {
					if attempt > 1 {
						p.cfg.Logger.Info("held message passed", "topic", topic, "consumer_group", group, "attempts", attempt,
							"held_for", time.Since(heldSince).Round(time.Millisecond), "partition", msg.Metadata.Get(MetaKafkaPartition), "offset", msg.Metadata.Get(MetaKafkaOffset))
					}
					return out, err
				}
				if p.stopped() {
					return nil, fmt.Errorf("%w: %w", errShutdown, err)
				}
				if isClosed(revoked) {
					return nil, fmt.Errorf("%w: %w", ErrRevoked, err)
				}
				if attempt == 1 {
					heldSince = time.Now()
				}
				if p.cfg.OnHeld != nil {
					p.cfg.OnHeld(Held{Delivery: delivery(topic, group, msg), Attempts: attempt, Since: time.Since(heldSince), Err: err})
				}
				// One line per doubling of the wait: loud at first, then sparse.
				if wait < p.cfg.HoldMaxBackoff || attempt%10 == 0 {
					p.cfg.Logger.Warn("holding the message: its attempt failed for a reason that is not the message's own; retrying",
						"topic", topic, "consumer_group", group, "partition", msg.Metadata.Get(MetaKafkaPartition), "offset", msg.Metadata.Get(MetaKafkaOffset),
						"attempt", attempt, "held_for", time.Since(heldSince).Round(time.Millisecond), "retry_in", wait, "err", err)
				}
				// The router closing ends the message context; so may a team's
				// timeout, which must not turn the wait into a busy loop.
				var msgDone <-chan struct{}
				if msg.Context().Err() == nil {
					msgDone = msg.Context().Done()
				}
				timer := time.NewTimer(wait)
				select {
				case <-timer.C:
				case <-revoked:
					timer.Stop()
					return nil, fmt.Errorf("%w: %w", ErrRevoked, err)
				case <-p.stopping:
					timer.Stop()
					return nil, fmt.Errorf("%w: %w", errShutdown, err)
				case <-msgDone:
					timer.Stop()
					if p.stopped() {
						return nil, fmt.Errorf("%w: %w", errShutdown, err)
					}
				}
				wait = min(2*wait, p.cfg.HoldMaxBackoff)
			}
		}
	}
}

// attempt runs the rest of the chain once, on a context that is cancelled
// when the partition is revoked.
func (p *Pipeline) attempt(msg *message.Message, h message.HandlerFunc, revoked <-chan struct{}) ([]*message.Message, error) {
	parent := msg.Context()
	ctx, cancel := context.WithCancel(parent)
	defer cancel()
	if revoked != nil {
		go func() {
			select {
			case <-revoked:
				cancel()
			case <-ctx.Done():
			}
		}()
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
func decodedKey(msg *message.Message) (uuid.UUID, error) {
	ev, ok := msg.Context().Value(eventCtxKey{}).(decoded)
	if !ok {
		return uuid.Nil, errors.New("pipeline: no decoded event in the message context")
	}
	return ev.id, nil
}

func refuseReturnedMessages(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		if err == nil && len(out) > 0 {
			return nil, fmt.Errorf("%w (%d messages)", ErrReturnedMessages, len(out))
		}
		return out, err
	}
}

func handleWith(handle func(ctx context.Context, tx pgx.Tx, ev any) error) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		ctx := msg.Context()
		tx, err := idempotency.TxFromContext(ctx)
		if err != nil {
			return err
		}
		ev, ok := ctx.Value(eventCtxKey{}).(decoded)
		if !ok {
			return errors.New("pipeline: no decoded event in the message context")
		}
		return handle(ctx, tx, ev.value)
	}
}
