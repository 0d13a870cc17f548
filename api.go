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
// named here so that one import serves. They are aliases, and go doc shows
// an alias's fields only at its pipeline type: the doc of each one a team
// fills in lists its fields here (TestTheAliasesListTheirFields keeps the
// lists complete).
type (
	// Event is what a topic carries once decoded: a value that knows its
	// own event id, a UUIDv7 from the payload (R-KFK-IDEM-1).
	Event = pipeline.Event
	// Topic binds a Kafka topic and its event type to the groups that read
	// it (an alias of [pipeline.Topic]). Its fields:
	//
	//   - Name: the Kafka topic. Required.
	//   - DLQ: its dead-letter topic, created when missing. Default:
	//     Name + ".dlq".
	//   - Decode: validates a payload into an E; its error dead-letters the
	//     message, with the error as its reason. Required.
	//   - Groups: the consumer groups that read the topic, each with its own
	//     dedup. At least one.
	//   - Extra: a team's middleware for every group of the topic, outside
	//     each group's own. Default: none.
	//   - IDNamespace: the namespace its events' ids are derived under with
	//     [DeriveEventID] from the producer's own ids; the console and
	//     app inbox then find an event by the producer's id. Default: none.
	Topic[E Event] = pipeline.Topic[E]
	// Group is one consumer group on a topic (an alias of
	// [pipeline.Group]): its Kafka group id and the second half of its
	// dedup key are both Name. A new group starts at the topic's oldest
	// retained message; what is older than the dedup horizon follows its
	// TooOld policy. Its fields:
	//
	//   - Name: the consumer group. Required.
	//   - Handle: the business logic, one event per transaction, the
	//     claim's. Required unless HandleBatch is set.
	//   - HandleBatch: turns the group commit on, the group's events
	//     claimed, handled and committed in batches; Handle, if set too,
	//     runs the events of a failed batch one by one. Default: none.
	//   - Batch: sizes HandleBatch's batches (see [Batch]). Default: its
	//     defaults.
	//   - Order: a partition's messages one at a time ([OrderPartition]), or
	//     many at once in order per Kafka key ([OrderKey]), for a handler
	//     that waits on a provider. Not for a batched group. Default:
	//     OrderPartition.
	//   - Concurrency: with OrderKey, the most messages of the group that
	//     run at once in this instance, each on a connection of its own
	//     (MaxConns must serve them). Default: 16.
	//   - Window: with OrderKey, the most messages of one partition in
	//     flight (running, waiting for their key, held). Default: 4 ×
	//     Concurrency.
	//   - DB: the group's database. With the front door leave it nil and
	//     name the database in Config.GroupDatabases, which the service
	//     opens, migrates and retains. Default: Config.GroupDatabases[Name],
	//     else the service's database.
	//   - TooOld: what the group does with an event older than the dedup
	//     horizon. Default: [RejectTooOld] (dead-lettered), the only safe
	//     one for money.
	//   - Extra: a team's middleware for this group, inside the topic's.
	//     Default: none.
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
	// Batch sizes a group's group commit (an alias of [pipeline.Batch],
	// which says how batches form). Its fields:
	//
	//   - Size: the most events in one transaction. Default: 100.
	//   - MaxWait: the longest a batch's oldest event waits, with a commit
	//     slot free, for the events on their way to join it. Default: 5ms.
	//   - WaitToFill: wait for Size events, up to MaxWait, even when none is
	//     on its way: fewer, fuller commits, for latency. Default: false.
	//   - Window: how many messages of one partition may be in flight at
	//     once; they still reach the handler and commit in order. Default:
	//     Size.
	//   - Concurrency: how many batches may run at once, each on a
	//     connection of its own. Default: 2.
	//   - ThroughRouter: keep every message on the router's path, for
	//     router-level middleware that must see each one (slower). Default:
	//     false.
	Batch = pipeline.Batch
	// Extra holds a team's Watermill middleware in fixed slots of the
	// safety chain, so that where one runs is decided by what it is for
	// (an alias of [pipeline.Extra]; within a slot the first runs
	// outermost). Its fields, each a list that defaults to none:
	//
	//   - Observe: sees every delivery and how it ended; for metrics, logs
	//     and traces.
	//   - BeforeClaim: after decoding, before the claim's transaction
	//     begins; nothing it does is part of the claim.
	//   - InTx: inside the claim's transaction, around the handler, for
	//     first deliveries only (once per batch in a batched group).
	Extra = pipeline.Extra
	// Binding is a Topic of any event type.
	Binding = pipeline.Binding
	// Outgoing is a topic the handlers publish events to with [Publish],
	// through the consumer outbox in the claim's transaction (an alias of
	// [pipeline.Outgoing]). Its fields:
	//
	//   - Name: the Kafka topic. Required.
	//   - Key: an event's Kafka key; one aggregate's events share one, so
	//     that they stay in one partition and in order. Required; an event
	//     whose key is empty is refused at the call.
	//   - Encode: an event's payload. Default: json.Marshal.
	Outgoing[E Event] = pipeline.Outgoing[E]
	// OutgoingBinding is an Outgoing of any event type.
	OutgoingBinding = pipeline.OutgoingBinding
	// Delivery is where a message came from.
	Delivery = pipeline.Delivery
	// Hooks are callbacks on what happens to messages (an alias of
	// [pipeline.Hooks]), called on the pipeline's own goroutines: keep
	// them short, never block. Its fields, each nil by default:
	//
	//   - OnResult: the idempotency outcome of every claim attempt.
	//   - OnDelivered: every message a group's chain receives.
	//   - OnHeld: after each failed attempt of a held message.
	//   - OnDeadLetter: a message dead-lettered, its letter committed.
	//   - OnForwarded: an event of a group's outbox reached Kafka.
	//   - OnBatch: after each batch of a batched group.
	Hooks = pipeline.Hooks
	// KafkaSecurity is TLS and SASL for every Kafka connection (an alias
	// of [pipeline.KafkaSecurity]; the zero value is plaintext without
	// authentication). Its fields:
	//
	//   - TLS: encrypts every connection. Default: nil, plaintext.
	//   - SASLMechanism: SCRAM-SHA-512, SCRAM-SHA-256, or PLAIN (only over
	//     TLS). Default: "", none.
	//   - User, Password: the SASL principal. Default: none.
	KafkaSecurity = pipeline.KafkaSecurity
	// TooOldPolicy says what a group does with an event older than the
	// dedup horizon.
	TooOldPolicy = idempotency.TooOldPolicy
	// Order is how a group orders a partition's messages.
	Order = pipeline.Order
)

// The orders of a [Group]: one message of a partition at a time, the
// default; or many at once, in order per Kafka key.
const (
	OrderPartition = pipeline.OrderPartition
	OrderKey       = pipeline.OrderKey
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
//
// In a HandleBatch it marks every event of the batch, since it cannot tell
// which one moved money: use [MarkExternalEffectOf] there.
func MarkExternalEffect(ctx context.Context, what string) { idempotency.MarkExternalEffect(ctx, what) }

// MarkExternalEffectOf is [MarkExternalEffect] for ev, one event of a
// HandleBatch's batch: should the batch roll back, ev alone runs on its own
// held after the effect, and the batch's other events keep their own
// verdicts (a declined one is dead-lettered).
func MarkExternalEffectOf(ctx context.Context, ev Event, what string) {
	idempotency.MarkExternalEffectOf(ctx, ev.EventID(), what)
}

// ComposeHooks calls each of hooks' callbacks in turn.
func ComposeHooks(hooks ...Hooks) Hooks { return pipeline.ComposeHooks(hooks...) }
