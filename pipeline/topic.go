package pipeline

import (
	"context"
	"crypto/sha256"
	"encoding"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/middleware/idempotency"
)

// Event is what a topic carries once decoded: a value that knows its own
// event id, a UUIDv7 from the payload (R-KFK-IDEM-1) and the only dedup key.
type Event interface {
	EventID() uuid.UUID
}

// Decoder turns a message payload into an event. Any error it returns is
// permanent: the message is dead-lettered with the error as its reason,
// before anything is claimed; so is an event it returns whose values
// cannot be fingerprinted (see [Topic]). It must not do I/O.
type Decoder[E Event] func(payload []byte) (E, error)

// HandlerFunc is a consumer group's business logic. It runs at most once to
// completion per event and group: tx holds the event's claim, and every write
// that must happen once goes through it. It must not commit or roll back tx.
//
// Return nil to commit; an error marked [idempotency.Permanent] for an event
// that can never succeed (dead-lettered at once); [idempotency.RejectAfterCommit]
// to commit what tx recorded and dead-letter the event; any other error rolls
// back and the event is tried again.
type HandlerFunc[E Event] func(ctx context.Context, tx pgx.Tx, ev E) error

// BatchHandlerFunc is a consumer group's business logic for a batch of
// events claimed together (see [Batch]): evs are the batch's events claimed
// for the first time, in the order of their partitions, and tx holds their
// claims. It must not commit or roll back tx. Any error rolls the whole
// batch back, and each of its events is then handled on its own (by
// [Group.Handle], or by this function with one event), where the error of
// the one bad event decides its fate alone: held, or dead-lettered when
// permanent.
//
// Write rows in key order (sort what the batch upserts by its key, or add
// ORDER BY to an INSERT ... SELECT FROM unnest): two batches at once
// (Batch.Concurrency, or two instances during a rebalance) that lock shared
// rows in different orders deadlock, and one of them is rolled back and run
// event by event (logged as a warning, and counted in BatchDone.Deadlock).
// The batch's claims are taken in event-id order for the same reason.
//
// A call outside the transaction (a provider's charge) is marked with
// idempotency.MarkExternalEffectOf and the event's id: should the batch
// roll back, that event alone is held until its record commits.
type BatchHandlerFunc[E Event] func(ctx context.Context, tx pgx.Tx, evs []E) error

// Batch configures a group's group commit: the events of up to Size
// messages, from every partition the consumer owns, are claimed in one
// statement and handled and committed in one transaction. The database
// pays one commit per batch instead of one per event.
//
// A batch leaves as soon as one of the Concurrency commit slots is free
// and no more of its events are on their way (handed out by Kafka, still
// being decoded), with whatever is ready, as PostgreSQL's own group commit
// does: while the slots are busy the next batch grows, up to Size, so
// batches are large under load and a single event when the stream is
// quiet, which then waits for nothing. MaxWait bounds the wait for events
// on their way.
//
// A batched group's messages take the direct path unless the group has
// Extra.Observe or Extra.BeforeClaim middleware, the pipeline runs in a
// team's Config.Router, or ThroughRouter is set: the subscriber hands each message, decoded,
// straight to the group commit, without a router goroutine and the chain
// of stages every message passes otherwise, and the batch acknowledges it
// once it committed. A message a batch cannot decide (the batch failed, a
// reused id) or that cannot be decoded goes through the router and the
// whole chain, on its own, as on the other path: held, dead-lettered or
// processed, its partition's order kept. Router-level middleware and
// subscriber decorators (Watermill's router metrics that SetupRouter adds)
// see only those; [Hooks] see every message. A group with Observe or
// BeforeClaim, which must see each message, keeps the chain for all of its
// messages; InTx runs once per batch on either path. On the direct path the
// decoder and Hooks.OnDelivered run on the partition's Kafka consumer
// goroutine: they must be quick and must not block (a call that waits on
// the network holds the partition, and a rebalance waits for it); a panic
// in either sends the message through the chain, whose recoverer holds it.
type Batch struct {
	// Size is the most events in one transaction. Default: 100.
	Size int
	// MaxWait is the longest a batch's oldest event waits, with a slot
	// free, for the events on their way to join it. Default: 5ms.
	MaxWait time.Duration
	// WaitToFill makes a batch wait for Size events, up to MaxWait, even
	// when none is on its way: fewer, fuller commits, for latency whenever
	// the stream is slower than the database (the group commit before it
	// was adaptive). Default: false.
	WaitToFill bool
	// Window is how many messages of one partition may be in flight at once.
	// A partition's events still reach the handler in order and commit in
	// order. Default: Size.
	Window int
	// Concurrency is how many batches may run at once, each on a
	// connection of its own; they never share a partition. Default: 2.
	Concurrency int
	// ThroughRouter keeps every message on the router's path and its
	// chain, for router-level middleware added with Config.SetupRouter
	// that must see each message (the direct path skips the router).
	// Slower: a goroutine and the chain per message. Default: false.
	ThroughRouter bool
}

func (b *Batch) setDefaults() {
	if b.Size == 0 {
		b.Size = 100
	}
	if b.MaxWait == 0 {
		b.MaxWait = 5 * time.Millisecond
	}
	if b.Window == 0 {
		b.Window = b.Size
	}
	if b.Concurrency == 0 {
		b.Concurrency = 2
	}
}

// Topic binds one Kafka topic and its event type to the consumer groups that
// read it. Each group gets the whole safety chain (see the package
// documentation) and its own dedup.
//
// Each claim stores a fingerprint of its event's values (see
// idempotency.Config.Fingerprint): a re-published event whose values are
// the same is a duplicate, one with other values under a claimed id a
// payload mismatch. The fingerprint is made of the decoded event, so that
// what E makes one value is one value ("12.50" and 12.5 decoded into one
// decimal, a time at any offset), but only where it sees all of E:
//
//   - an E that is a [CanonicalEvent]: its CanonicalJSON;
//   - an E that encoding/json writes whole (exported fields all the way
//     down, or a MarshalJSON or MarshalText on the value itself):
//     json.Marshal made canonical by idempotency.CanonicalJSON;
//   - any other E (an unexported field, a json:"-" field, an interface
//     field, a field hidden by another of its name, a marshaler on the
//     pointer only or promoted from an embedded field): its payload made
//     canonical, as idempotency.PayloadSHA256 does. Its exported fields
//     alone would make two events that differ elsewhere one, and the
//     second one's effect would be skipped. Here the number 12.5 and the
//     string "12.50" are two values; write a CanonicalEvent to make them one.
//
// An event whose values cannot be fingerprinted (time.Time's MarshalJSON
// refuses a year outside 0000-9999, which a valid time with an offset
// reaches in UTC; a MarshalJSON of E's refuses them) is the message's
// fault: dead-lettered with the reason, as if it did not decode. Nothing
// is fingerprinted at start-up: E's zero value is no event, and a
// MarshalJSON or CanonicalJSON that refuses it (a zero id) is accepted.
type Topic[E Event] struct {
	// Name of the Kafka topic. Required.
	Name string
	// DLQ is the topic's dead-letter topic. Default: Name + ".dlq".
	DLQ string
	// Decode validates a payload into an E. Required.
	Decode Decoder[E]
	// Groups reading the topic; at least one.
	Groups []Group[E]
	// Extra middleware for every group of the topic.
	Extra Extra
	// IDNamespace is the namespace the topic's events derive their ids
	// under, for a producer whose ids are not UUIDv7s: the one Decode or
	// the event's EventID method gives [idempotency.DeriveEventID]. It
	// changes no claim; it lets an operator find an event by the
	// producer's own id (the console's inbox, [Pipeline.Topics]). No NUL
	// byte. Default: "", the events carry their UUIDv7s.
	IDNamespace string
}

// DefaultConcurrency is a key-ordered group's Concurrency by default.
const DefaultConcurrency = 16

// Group is one consumer group on a topic: its Kafka consumer group id and the
// second half of its dedup key are both Name.
type Group[E Event] struct {
	// Name of the consumer group. Required.
	Name string
	// Handle is the group's business logic, one event per transaction.
	// Required unless HandleBatch is set.
	Handle HandlerFunc[E]
	// HandleBatch turns the group commit on (see [Batch]): the group's
	// events are claimed, handled and committed in batches. Handle, if set
	// too, handles the events of a failed batch one by one. Extra.InTx runs
	// once per batch around it, in the batch's transaction (and around
	// Handle, or a batch of one, for an event of a failed batch run on its
	// own).
	HandleBatch BatchHandlerFunc[E]
	// Batch sizes HandleBatch's batches.
	Batch Batch
	// Order is how the group orders a partition's messages: [OrderPartition],
	// one at a time, or [OrderKey], many at once in order per Kafka key, for
	// a handler that waits (a provider's call). A batched group keeps its
	// partitions' order in its batches and takes no other. Default:
	// OrderPartition, the order the group had before it could choose: a
	// handler written for it may rely on events of two keys not running at
	// once.
	Order Order
	// Concurrency is, with OrderKey, the most messages of the group's
	// partitions of this topic that run at once in this process. Each runs
	// in a transaction of its own, on a connection of its own, for the
	// whole attempt (a provider's call inside it included): New refuses a
	// pool that cannot serve every such group at once. Default: 16.
	Concurrency int
	// Window is, with OrderKey, the most messages of one partition in
	// flight at once (running, waiting for their key, or held): how far the
	// other keys of a partition run past a held one, and what a partition
	// keeps in memory whatever its lag. Default: 4 × Concurrency.
	Window int
	// DB holds the group's claims and business tables. Default: Config.DB.
	DB DB
	// TooOld is the group's policy for events beyond Config.MaxEventAge.
	// Default: idempotency.RejectTooOld, the only safe one for money.
	TooOld idempotency.TooOldPolicy
	// Extra middleware for this group, inside the topic's Extra.
	Extra Extra
}

// Extra holds a team's own Watermill middleware in fixed slots of the safety
// chain, so that where a middleware runs is decided by what it is for, not by
// the order it was added in. Within a slot the first runs outermost.
type Extra struct {
	// Observe sees every delivery and how it ended: nil when the message was
	// acknowledged (processed, skipped or dead-lettered), an error when it
	// was left for redelivery; Hooks.OnResult and OnDeadLetter tell which.
	// It runs before the attempts: [DeliveryFrom] gives Attempt 0 there.
	// For metrics, logs and traces. A batched group with Observe or
	// BeforeClaim leaves the direct path (see [Batch]): every message
	// passes the whole chain on a goroutine of its own, as it must for
	// them to see it.
	Observe []message.HandlerMiddleware
	// BeforeClaim runs after decoding and before the claim's transaction
	// begins, inside the retries and the recoverer: a failure there is
	// handled like the handler's own. Nothing it does is part of the claim.
	BeforeClaim []message.HandlerMiddleware
	// InTx runs inside the claim's transaction, around the handler, for first
	// deliveries only (idempotency.TxFromContext gives the transaction). For
	// a batched group it runs once per batch, around the batch handler, in
	// the batch's transaction: the message it sees is the batch's first,
	// and [EventFrom] and [DeliveryFrom] report none (a batch has many). A
	// middleware that returns without calling the handler (a filter) fails
	// the batch, whose events then run on their own, through it, one by
	// one: no event is claimed without its handler. It must not return
	// messages: publishing after the commit could be lost ([Publish] in the
	// transaction instead).
	InTx []message.HandlerMiddleware
}

func (e Extra) then(inner Extra) Extra {
	return Extra{
		Observe:     append(append([]message.HandlerMiddleware(nil), e.Observe...), inner.Observe...),
		BeforeClaim: append(append([]message.HandlerMiddleware(nil), e.BeforeClaim...), inner.BeforeClaim...),
		InTx:        append(append([]message.HandlerMiddleware(nil), e.InTx...), inner.InTx...),
	}
}

// Binding is a [Topic] of any event type, as [Config.Topics] lists them.
// Only Topic implements it.
type Binding interface {
	binding() (topicBinding, error)
}

// topicBinding is a Topic with its event type erased: the pipeline's
// machinery is the same for every type, and only decode and handle know E.
type topicBinding struct {
	name, dlq string
	groups    []groupBinding
	// idNamespace is Topic.IDNamespace.
	idNamespace string
}

type groupBinding struct {
	name   string
	db     DB
	tooOld idempotency.TooOldPolicy
	extra  Extra
	decode func(payload []byte) (decoded, error)
	handle func(ctx context.Context, tx pgx.Tx, ev any) error
	// handleBatch is nil for a group without the group commit.
	handleBatch func(ctx context.Context, tx pgx.Tx, evs []any) error
	batch       Batch
	// keyOrdered: Order is OrderKey, with concurrency and window set.
	keyOrdered          bool
	concurrency, window int
}

// decoded is an event as the chain carries it between decode and handle.
type decoded struct {
	id    uuid.UUID
	value any
	// fingerprint is the SHA-256 of the event's values in canonical form,
	// stored with its claim (see idempotency.Config.Fingerprint).
	fingerprint [32]byte
}

// CanonicalEvent is an event type whose JSON encoding is canonical already:
// equal values always give the same bytes (times in UTC at one precision,
// decimals at one scale, members in one order), and different values never
// do. Its CanonicalJSON is the event's fingerprint as it is. For other event
// types see [Topic].
type CanonicalEvent interface {
	CanonicalJSON() ([]byte, error)
}

// fingerprinterOf is how a claim fingerprints the values of an E (see
// idempotency.Config.Fingerprint): a re-published event in another byte
// form (member order, a time zone offset, 12.5 or "12.50") decodes to the
// same values and so has the same fingerprint, while other values under the
// same id are a payload mismatch. So the fingerprint must take in the whole
// decoded value, or two events that differ only where it does not look pass
// for duplicates and the second one's effect is skipped:
//
//   - a [CanonicalEvent]: its CanonicalJSON;
//   - a type encoding/json sees entirely (see jsonVisible): json.Marshal of
//     the decoded event, made canonical by idempotency.CanonicalJSON;
//   - any other (unexported fields behind getters, a json:"-" field, an
//     interface field, a MarshalJSON on the pointer only): json.Marshal
//     would leave out part of the values; the payload's own JSON, made
//     canonical (which never merges two different values), stands in for
//     them. A re-publication is then a duplicate when its JSON values are
//     the same, not when its decoded values are: 12.5 and "12.50" differ.
//
// Whether an event's values can be written down is the event's to say, not
// the type's: nothing is tried at start-up. A type's zero value is no
// event (a MarshalJSON or CanonicalJSON that validates refuses its zero
// id, and writes every real one), so failing on it proves nothing about
// the events; an event whose fingerprint fails is dead-lettered with the
// reason (see binding).
func fingerprinterOf[E Event]() func(ev E, payload []byte) ([32]byte, error) {
	t := reflect.TypeFor[E]()
	switch {
	case t.Implements(reflect.TypeFor[CanonicalEvent]()):
		return func(ev E, _ []byte) ([32]byte, error) {
			b, err := any(ev).(CanonicalEvent).CanonicalJSON()
			if err != nil {
				return [32]byte{}, fmt.Errorf("the canonical form of %T: %w", ev, err)
			}
			return sha256.Sum256(b), nil
		}
	case jsonVisible(t):
		return func(ev E, _ []byte) ([32]byte, error) {
			b, err := json.Marshal(ev)
			if err == nil {
				b, err = idempotency.CanonicalJSON(b)
			}
			if err != nil {
				return [32]byte{}, fmt.Errorf("the canonical form of %T: %w", ev, err)
			}
			return sha256.Sum256(b), nil
		}
	default:
		return func(_ E, payload []byte) ([32]byte, error) {
			return idempotency.PayloadSHA256(&message.Message{Payload: payload})
		}
	}
}

var (
	jsonMarshalerType = reflect.TypeFor[json.Marshaler]()
	textMarshalerType = reflect.TypeFor[encoding.TextMarshaler]()
)

// jsonVisible reports whether json.Marshal writes all of every value of t,
// so that two values it writes alike are equal: every field exported and
// written (no json:"-", no field hidden by another of the same name), no
// interface, channel, function or complex number anywhere, recursively. A
// MarshalJSON or MarshalText on the value counts as writing all of it; one
// on the pointer only does not (encoding/json calls it only for some
// values), nor does one that may be promoted from an embedded field, which
// would write that field alone.
func jsonVisible(t reflect.Type) bool { return visible(t, map[reflect.Type]bool{}) }

func visible(t reflect.Type, seen map[reflect.Type]bool) bool {
	if t.Implements(jsonMarshalerType) || t.Implements(textMarshalerType) {
		return t.Kind() != reflect.Struct || !embedsMarshaler(t, map[reflect.Type]bool{})
	}
	if reflect.PointerTo(t).Implements(jsonMarshalerType) || reflect.PointerTo(t).Implements(textMarshalerType) {
		return false
	}
	if seen[t] {
		return true // a recursive type: its other fields decide
	}
	seen[t] = true
	switch t.Kind() {
	case reflect.Bool, reflect.String, reflect.Float32, reflect.Float64,
		reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uintptr:
		return true
	case reflect.Pointer, reflect.Slice, reflect.Array:
		return visible(t.Elem(), seen)
	case reflect.Map:
		switch k := t.Key(); k.Kind() {
		case reflect.String, reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
			reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uintptr:
		default:
			if !k.Implements(textMarshalerType) {
				return false
			}
		}
		return visible(t.Elem(), seen)
	case reflect.Struct:
		names := map[string]bool{}
		return structVisible(t, names, seen, map[reflect.Type]bool{})
	}
	return false // an interface, a channel, a function, a complex number
}

// structVisible checks the fields encoding/json writes of struct t, the
// fields of its untagged embedded structs among them, collecting their
// names: a name seen twice hides one of the fields (or both).
func structVisible(t reflect.Type, names map[string]bool, seen, embedding map[reflect.Type]bool) bool {
	if embedding[t] {
		return false // embeds itself: encoding/json stops somewhere
	}
	embedding[t] = true
	defer delete(embedding, t)
	for f := range t.Fields() {
		tag := f.Tag.Get("json")
		if tag == "-" {
			return false
		}
		name, _, _ := strings.Cut(tag, ",")
		ft := f.Type
		if ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		if f.Anonymous && name == "" && ft.Kind() == reflect.Struct {
			if !structVisible(ft, names, seen, embedding) {
				return false
			}
			continue
		}
		if !f.IsExported() {
			return false
		}
		if name == "" {
			name = f.Name
		}
		if names[name] || !visible(f.Type, seen) {
			return false
		}
		names[name] = true
	}
	return true
}

// embedsMarshaler reports whether a struct type has an embedded field
// (at any depth) whose MarshalJSON or MarshalText it may have by promotion.
func embedsMarshaler(t reflect.Type, seen map[reflect.Type]bool) bool {
	if seen[t] {
		return false
	}
	seen[t] = true
	for f := range t.Fields() {
		if !f.Anonymous {
			continue
		}
		ft := f.Type
		if ft.Implements(jsonMarshalerType) || ft.Implements(textMarshalerType) ||
			reflect.PointerTo(ft).Implements(jsonMarshalerType) || reflect.PointerTo(ft).Implements(textMarshalerType) {
			return true
		}
		if ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		if ft.Kind() == reflect.Struct && embedsMarshaler(ft, seen) {
			return true
		}
	}
	return false
}

func (t Topic[E]) binding() (topicBinding, error) {
	var errs []error
	if t.Name == "" {
		errs = append(errs, errors.New("pipeline: a Topic has no Name"))
	}
	b := topicBinding{name: t.Name, dlq: t.DLQ, idNamespace: t.IDNamespace}
	if strings.Contains(t.IDNamespace, "\x00") {
		errs = append(errs, fmt.Errorf("pipeline: topic %s: IDNamespace must not contain a NUL byte (DeriveEventID separates it from the id with one)", t.Name))
	}
	if b.dlq == "" {
		b.dlq = t.Name + ".dlq"
	}
	if b.dlq == t.Name {
		errs = append(errs, fmt.Errorf("pipeline: topic %s: DLQ must differ from the topic", t.Name))
	}
	if t.Decode == nil {
		errs = append(errs, fmt.Errorf("pipeline: topic %s: Decode is required", t.Name))
	}
	if len(t.Groups) == 0 {
		errs = append(errs, fmt.Errorf("pipeline: topic %s: no consumer groups", t.Name))
	}
	fingerprint := fingerprinterOf[E]()
	decode := func(payload []byte) (decoded, error) {
		ev, err := t.Decode(payload)
		if err != nil {
			return decoded{}, err
		}
		d := decoded{id: ev.EventID(), value: ev}
		if d.fingerprint, err = fingerprint(ev, payload); err != nil {
			// This event's values cannot be written down (a time that
			// leaves the years 0000-9999 in UTC, values its MarshalJSON
			// refuses): the message's fault, dead-lettered with the
			// reason. Held, it would stop its partition for ever. A type
			// that refuses every event (a bug of its MarshalJSON)
			// dead-letters each, to be replayed once it is fixed; one that
			// panics is held, as a decoder that panics is.
			return decoded{}, fmt.Errorf("the event's values cannot be fingerprinted: %w", err)
		}
		return d, nil
	}
	seen := map[string]bool{}
	for _, g := range t.Groups {
		if g.Name == "" || (g.Handle == nil && g.HandleBatch == nil) {
			errs = append(errs, fmt.Errorf("pipeline: topic %s: every group needs a Name and a Handle or a HandleBatch", t.Name))
			continue
		}
		extra := t.Extra.then(g.Extra)
		if g.Batch.Size < 0 || g.Batch.MaxWait < 0 || g.Batch.Window < 0 || g.Batch.Concurrency < 0 {
			errs = append(errs, fmt.Errorf("pipeline: topic %s, group %s: Batch.Size, Batch.MaxWait, Batch.Window and Batch.Concurrency must not be negative", t.Name, g.Name))
		}
		switch {
		case g.Order != "" && g.Order != OrderPartition && g.Order != OrderKey:
			errs = append(errs, fmt.Errorf("pipeline: topic %s, group %s: Order %q: want %q or %q", t.Name, g.Name, g.Order, OrderPartition, OrderKey))
		case g.Order == OrderKey && g.HandleBatch != nil:
			errs = append(errs, fmt.Errorf("pipeline: topic %s, group %s: Order %q is for a per-event group; a batched group (HandleBatch) keeps its partitions' order in its batches", t.Name, g.Name, g.Order))
		case g.Concurrency < 0 || g.Window < 0:
			errs = append(errs, fmt.Errorf("pipeline: topic %s, group %s: Concurrency and Window must not be negative", t.Name, g.Name))
		case g.Order != OrderKey && (g.Concurrency != 0 || g.Window != 0):
			errs = append(errs, fmt.Errorf("pipeline: topic %s, group %s: Concurrency %d and Window %d need Order %q (a partition's messages run one at a time otherwise)",
				t.Name, g.Name, g.Concurrency, g.Window, OrderKey))
		}
		if seen[g.Name] {
			errs = append(errs, fmt.Errorf("pipeline: topic %s: group %s listed twice", t.Name, g.Name))
		}
		seen[g.Name] = true
		handle, handleBatch := g.Handle, g.HandleBatch
		if handle == nil {
			handle = func(ctx context.Context, tx pgx.Tx, ev E) error { return handleBatch(ctx, tx, []E{ev}) }
		}
		gb := groupBinding{
			name:   g.Name,
			db:     g.DB,
			tooOld: g.TooOld,
			extra:  extra,
			decode: decode,
			handle: func(ctx context.Context, tx pgx.Tx, ev any) error { return handle(ctx, tx, ev.(E)) },
			batch:  g.Batch,
		}
		if g.Order == OrderKey {
			gb.keyOrdered, gb.concurrency, gb.window = true, g.Concurrency, g.Window
			if gb.concurrency == 0 {
				gb.concurrency = DefaultConcurrency
			}
			if gb.window == 0 {
				gb.window = 4 * gb.concurrency
			}
		}
		if handleBatch != nil {
			gb.batch.setDefaults()
			gb.handleBatch = func(ctx context.Context, tx pgx.Tx, evs []any) error {
				typed := make([]E, len(evs))
				for i, ev := range evs {
					typed[i] = ev.(E)
				}
				return handleBatch(ctx, tx, typed)
			}
		}
		b.groups = append(b.groups, gb)
	}
	return b, errors.Join(errs...)
}
