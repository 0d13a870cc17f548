package pipeline

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/outbox"
)

// Outgoing is a topic the pipeline's handlers publish events of type E to,
// with [Publish]: through the consumer outbox of the group's database, in the
// claim's transaction, so that an event reaches Kafka if and only if the
// transaction that caused it commits, and once however often its handler
// ran (its id is its dedup key downstream).
type Outgoing[E Event] struct {
	// Name of the Kafka topic. Required.
	Name string
	// Key is an event's Kafka key: every event of one aggregate (an order)
	// shares one, so that they stay in one partition and in order.
	// Required; an event whose key is empty is refused at the call.
	Key func(E) string
	// Encode is an event's payload. Default: json.Marshal.
	Encode func(E) ([]byte, error)
}

// OutgoingBinding is an [Outgoing] of any event type, as
// [Config.Outgoing] lists them. Only Outgoing implements it.
type OutgoingBinding interface {
	outgoing() (outgoingBinding, error)
}

// outgoingBinding is an Outgoing with its event type erased.
type outgoingBinding struct {
	name   string
	typ    reflect.Type
	encode func(ev any) (key string, payload []byte, err error)
}

func (o Outgoing[E]) outgoing() (outgoingBinding, error) {
	var errs []error
	if o.Name == "" {
		errs = append(errs, fmt.Errorf("pipeline: an Outgoing[%s] has no Name", reflect.TypeFor[E]()))
	}
	if o.Key == nil {
		errs = append(errs, fmt.Errorf("pipeline: Outgoing %s: Key is required (its events' Kafka key)", o.Name))
	}
	encode := o.Encode
	if encode == nil {
		encode = func(ev E) ([]byte, error) { return json.Marshal(ev) }
	}
	return outgoingBinding{name: o.Name, typ: reflect.TypeFor[E](), encode: func(ev any) (string, []byte, error) {
		e := ev.(E)
		payload, err := encode(e)
		return o.Key(e), payload, err
	}}, errors.Join(errs...)
}

// publisher is the pipeline's outbox and outgoing topics, which a handler's
// context carries to [Publish].
type publisher struct {
	outbox *outbox.Outbox
	byName map[string]outgoingBinding
	byType map[reflect.Type][]outgoingBinding
}

func newPublisher(box *outbox.Outbox, outgoing []OutgoingBinding) (*publisher, error) {
	p := &publisher{outbox: box, byName: map[string]outgoingBinding{}, byType: map[reflect.Type][]outgoingBinding{}}
	var errs []error
	for _, o := range outgoing {
		if o == nil {
			errs = append(errs, errors.New("pipeline: a nil Outgoing entry"))
			continue
		}
		b, err := o.outgoing()
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if _, dup := p.byName[b.name]; dup {
			errs = append(errs, fmt.Errorf("pipeline: Outgoing %s listed twice", b.name))
		}
		p.byName[b.name] = b
		p.byType[b.typ] = append(p.byType[b.typ], b)
	}
	return p, errors.Join(errs...)
}

type publisherCtxKey struct{}

// ErrNotAHandlersContext is the error of [Publish] and the other calls that
// need the context a pipeline gives its handlers and middleware.
var ErrNotAHandlersContext = errors.New("pipeline: not the context of a pipeline's handler")

// EventTime is the time in ev's id, a UUIDv7: when its producer made it,
// to the millisecond. The dedup horizon judges an event's age by it.
func EventTime(ev Event) time.Time { return idempotency.IDTime(ev.EventID()).UTC() }

// Publish writes ev, in tx, into the consumer outbox for the [Outgoing]
// topic of its type (Config.Outgoing): keyed by that topic's Key, encoded by
// its Encode, identified by ev's EventID. It reaches Kafka once tx commits,
// and never if tx rolls back. ctx and tx are the handler's (River's
// InsertTx is the model). An event type with no Outgoing topic, or with
// several (use [PublishTo]), and an event whose key is empty fail here, with
// an error that says so.
func Publish[E Event](ctx context.Context, tx pgx.Tx, ev E) error {
	p, ok := ctx.Value(publisherCtxKey{}).(*publisher)
	if !ok {
		return fmt.Errorf("%w: Publish(%T)", ErrNotAHandlersContext, ev)
	}
	typ := reflect.TypeFor[E]()
	switch topics := p.byType[typ]; len(topics) {
	case 0:
		return fmt.Errorf("pipeline: Publish(%s): no Outgoing topic of this event type in Config.Outgoing", typ)
	case 1:
		return p.publish(ctx, tx, topics[0], ev.EventID(), ev)
	default:
		names := make([]string, len(topics))
		for i, o := range topics {
			names[i] = o.name
		}
		return fmt.Errorf("pipeline: Publish(%s): the Outgoing topics %s take this event type: name one with PublishTo", typ, strings.Join(names, ", "))
	}
}

// PublishTo is [Publish] to the Outgoing topic named topic.
func PublishTo[E Event](ctx context.Context, tx pgx.Tx, topic string, ev E) error {
	p, ok := ctx.Value(publisherCtxKey{}).(*publisher)
	if !ok {
		return fmt.Errorf("%w: PublishTo(%s)", ErrNotAHandlersContext, topic)
	}
	o, ok := p.byName[topic]
	if !ok {
		return fmt.Errorf("pipeline: PublishTo(%s): no such Outgoing topic in Config.Outgoing", topic)
	}
	if o.typ != reflect.TypeFor[E]() {
		return fmt.Errorf("pipeline: PublishTo(%s): the topic takes %s, not %T", topic, o.typ, ev)
	}
	return p.publish(ctx, tx, o, ev.EventID(), ev)
}

func (p *publisher) publish(ctx context.Context, tx pgx.Tx, o outgoingBinding, id uuid.UUID, ev any) error {
	if id.Version() != 7 {
		// Its consumers would dead-letter it: refused where it is made.
		return fmt.Errorf("pipeline: %T for %s: its EventID %s is not a UUIDv7 (DerivedID, or outbox.EventID, makes one)", ev, o.name, id)
	}
	key, payload, err := o.encode(ev)
	if err != nil {
		return fmt.Errorf("pipeline: encode %T %s for %s: %w", ev, id, o.name, err)
	}
	if key == "" {
		return fmt.Errorf("pipeline: %T %s for %s: its Key is empty (every event needs one: the aggregate's id)", ev, id, o.name)
	}
	return p.outbox.Publish(ctx, tx, outbox.Message{Topic: o.name, Key: key, ID: id.String(), Payload: payload})
}

// DerivedID is the id of an event a handler publishes because of the event
// it handles: a UUIDv7 whose time is at and whose other bits come from the
// handled event's id and eventType (outbox.EventID). Every attempt, and a
// replay, derive the same id, which downstream consumers dedup; take at
// from a durable record of what happened (a row committed earlier), never
// from the clock of the attempt. Without such a row, the handled event's
// own time, [EventTime](ev), is one.
//
// A batch's handler has many events: it derives each one's follow-up id
// with outbox.EventID(ev.EventID(), eventType, at); DerivedID refuses.
func DerivedID(ctx context.Context, eventType string, at time.Time) (uuid.UUID, error) {
	if ctx.Value(batchCtxKey{}) != nil {
		return uuid.Nil, errors.New("pipeline: DerivedID in a batch, which has no one event: derive each event's with outbox.EventID(ev.EventID(), eventType, at)")
	}
	ev, ok := ctx.Value(eventCtxKey{}).(decoded)
	if !ok {
		return uuid.Nil, fmt.Errorf("%w: DerivedID", ErrNotAHandlersContext)
	}
	return outbox.EventID(ev.id, eventType, at), nil
}
