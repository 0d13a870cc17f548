package once

import (
	"context"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/pipeline"
)

// What a team writes its topics and handlers with: the pipeline's types,
// named here so that one import serves.
type (
	// Event is what a topic carries once decoded: a value that knows its
	// own event id, a UUIDv7 from the payload (R-KFK-IDEM-1).
	Event = pipeline.Event
	// Topic binds a Kafka topic and its event type to the groups that read
	// it. Its fields (Name, DLQ, Decode, Groups, Extra, IDNamespace) are
	// documented at [pipeline.Topic].
	Topic[E Event] = pipeline.Topic[E]
	// Group is one consumer group on a topic. Its fields (Name, Handle,
	// HandleBatch, Batch, DB, TooOld, Extra) are documented at
	// [pipeline.Group]. A new group starts at the topic's oldest retained
	// message; what is older than the dedup horizon follows its TooOld
	// policy (dead-lettered by default).
	Group[E Event] = pipeline.Group[E]
	// Decoder validates a payload into an event; its error dead-letters the
	// message.
	Decoder[E Event] = pipeline.Decoder[E]
	// HandlerFunc is a group's business logic for one event, in the claim's
	// transaction.
	HandlerFunc[E Event] = pipeline.HandlerFunc[E]
	// BatchHandlerFunc is a group's business logic for a batch of events
	// (the group commit).
	BatchHandlerFunc[E Event] = pipeline.BatchHandlerFunc[E]
	// Batch sizes a group's group commit (Size, MaxWait, WaitToFill, Window,
	// Concurrency, ThroughRouter; see [pipeline.Batch]).
	Batch = pipeline.Batch
	// Extra holds a team's Watermill middleware in fixed slots.
	Extra = pipeline.Extra
	// Binding is a Topic of any event type.
	Binding = pipeline.Binding
	// Outgoing is a topic the handlers publish events to with [Publish]
	// (Name, Key, Encode; see [pipeline.Outgoing]).
	Outgoing[E Event] = pipeline.Outgoing[E]
	// OutgoingBinding is an Outgoing of any event type.
	OutgoingBinding = pipeline.OutgoingBinding
	// Delivery is where a message came from.
	Delivery = pipeline.Delivery
	// Hooks are callbacks on what happens to messages.
	Hooks = pipeline.Hooks
	// KafkaSecurity is TLS and SASL for every Kafka connection.
	KafkaSecurity = pipeline.KafkaSecurity
	// TooOldPolicy says what a group does with an event older than the
	// dedup horizon.
	TooOldPolicy = idempotency.TooOldPolicy
)

// The too-old policies of a [Group].
const (
	RejectTooOld  = idempotency.RejectTooOld
	ProcessTooOld = idempotency.ProcessTooOld
)

// Publish writes ev, in the handler's transaction, into the consumer outbox
// for the [Outgoing] topic of its type (Config.Outgoing): it reaches Kafka
// once tx commits, keyed by the topic's Key. An event type with no Outgoing
// topic, or an empty key, fails here.
func Publish[E Event](ctx context.Context, tx pgx.Tx, ev E) error {
	return pipeline.Publish(ctx, tx, ev)
}

// PublishTo is [Publish] to the Outgoing topic named topic, for an event
// type that several Outgoing topics take.
func PublishTo[E Event](ctx context.Context, tx pgx.Tx, topic string, ev E) error {
	return pipeline.PublishTo(ctx, tx, topic, ev)
}

// EventTime is the time in an event's id, a UUIDv7 (see pipeline.EventTime).
func EventTime(ev Event) time.Time { return pipeline.EventTime(ev) }

// DerivedID is the id of an event a handler publishes because of the one it
// handles: the same in every attempt and replay (see [pipeline.DerivedID]).
// A batched handler has many events, so DerivedID refuses there; it derives
// each follow-up's id with outbox.EventID(ev.EventID(), eventType, at).
func DerivedID(ctx context.Context, eventType string, at time.Time) (uuid.UUID, error) {
	return pipeline.DerivedID(ctx, eventType, at)
}

// DeriveEventID is the event id, a UUIDv7, of an event whose producer
// sends ids of its own (UUIDv4s, numbers): made from the producer's id and
// a time the event carries, the same on every delivery, and kept apart
// from other producers' ids by namespace (the producer's or the topic's
// name; name it in Topic.IDNamespace too). Call it in Decode or in the
// event's EventID method. A re-send whose time changed is another event:
// pick a time the producer never changes. See [idempotency.DeriveEventID].
func DeriveEventID(namespace, foreignID string, at time.Time) uuid.UUID {
	return idempotency.DeriveEventID(namespace, foreignID, at)
}

// DeliveryFrom is where the message a handler or middleware works on came
// from: topic, partition, offset, key, headers, group and attempt.
func DeliveryFrom(ctx context.Context) (Delivery, bool) { return pipeline.DeliveryFrom(ctx) }

// EventFrom is the decoded event of the message a handler, or a team's
// BeforeClaim or InTx middleware, works on.
func EventFrom[E Event](ctx context.Context) (E, bool) { return pipeline.EventFrom[E](ctx) }

// Permanent marks err as the handler's verdict that the event can never
// succeed: it is dead-lettered at once. Any other error holds the message
// and tries it again.
func Permanent(err error) error { return idempotency.Permanent(err) }

// RejectAfterCommit commits what the handler recorded of a failure (a
// declined charge) with the claim, and dead-letters the event.
func RejectAfterCommit(err error) error { return idempotency.RejectAfterCommit(err) }

// MarkExternalEffect records that the attempt charged, refunded or sent
// something outside its transaction: from then on nothing it returns is
// permanent, and the message is held until its record commits.
func MarkExternalEffect(ctx context.Context, what string) { idempotency.MarkExternalEffect(ctx, what) }

// ComposeHooks calls each of hooks' callbacks in turn.
func ComposeHooks(hooks ...Hooks) Hooks { return pipeline.ComposeHooks(hooks...) }
