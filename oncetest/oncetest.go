// Package oncetest runs a team's topics the way the pipeline does, in the
// test's process, against a real PostgreSQL and without Kafka: each message
// sent goes through every group of its topic (the group's Extra middleware,
// the topic's Decode on the bytes, the claim or the group commit, the
// handler in the claim's transaction, the commit; a dead letter parked in
// the database; the events the handler publishes written to the outbox).
// Send an event twice and see that its effect happened once.
//
//	db := oncetest.NewDB(t) // a schema of this test's own; skips without DATABASE_URL
//	h := oncetest.New(t, oncetest.Config{DB: db.Pool, Tables: db.Tables, Topics: topics, Outgoing: outgoing})
//	h.RequireOnce("invoice.issued.v1", oncetest.JSON("key", ev)) // rolled back, processed, then a duplicate, in every group
//	got := oncetest.Published(t, h, "customer.billed.v1", decodeBilled)
//
// A handler that names its tables with their schema (as it must behind a
// transaction pooler, which keeps no search_path) takes the schema from its
// configuration, and the test gives it the test's own:
//
//	add := `UPDATE ` + pgx.Identifier{schema, "shipments"}.Sanitize() + ` SET parcels = parcels + $2 WHERE id = $1`
//	// production: schema from the service's configuration; a test: db.Schema
//
// docs/using.md ("Your own tables") shows the whole pattern, with the
// team's tables created once however many instances start together.
//
// What is Kafka's own (offsets, sessions, rebalances, forwarding the outbox
// and the parked dead letters) is not run here; the library's end-to-end
// tests cover it.
package oncetest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/outbox"
	"github.com/once-dev/once/pgdb"
	"github.com/once-dev/once/pipeline"
	"github.com/once-dev/once/retention"
	"github.com/once-dev/once/schema"
)

// TB is what the harness needs of a test: *testing.T and *testing.B are
// one.
type TB interface {
	Helper()
	Fatal(args ...any)
	Fatalf(format string, args ...any)
	Errorf(format string, args ...any)
	Skip(args ...any)
	Cleanup(func())
}

// DB is a database of one test's own: a schema made for it, dropped when
// the test ends, that holds the library's tables and comes first in the
// search_path of Pool's connections, so that the tables the test creates
// without naming a schema land in it too. A handler that names its schema
// (pgx.Identifier{schema, "shipments"}) is given Schema in the test, where
// production gives it its own from its configuration.
type DB struct {
	Pool   *pgxpool.Pool
	Schema string
	// Tables are the library's tables in Schema: give them to Config, and
	// to once.Config in a test that runs the whole service.
	Tables schema.Config
}

// NewDB connects to DATABASE_URL and makes the test's schema, with the
// library's tables migrated in it. Without DATABASE_URL the test is
// skipped, and fails instead when ONCE_REQUIRE_SERVICES is set: set it in
// CI, where a skipped test would pass green having tested nothing.
func NewDB(t TB) *DB {
	t.Helper()
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		if os.Getenv("ONCE_REQUIRE_SERVICES") != "" {
			t.Fatal("oncetest: DATABASE_URL is not set, but ONCE_REQUIRE_SERVICES is: the test's PostgreSQL is missing")
		}
		t.Skip("oncetest: DATABASE_URL is not set (a PostgreSQL the test may create schemas in); set ONCE_REQUIRE_SERVICES=1 to fail instead")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	name := "oncetest_" + strings.ReplaceAll(uuid.NewString(), "-", "")[:12]
	admin, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatalf("oncetest: DATABASE_URL: %v", err)
	}
	defer admin.Close()
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+name); err != nil {
		t.Fatalf("oncetest: create the test's schema: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if cleanup, err := pgxpool.New(ctx, url); err == nil {
			_, _ = cleanup.Exec(ctx, "DROP SCHEMA IF EXISTS "+name+" CASCADE")
			cleanup.Close()
		}
	})
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatalf("oncetest: DATABASE_URL: %v", err)
	}
	if pooled, err := pgdb.Pooled(ctx, admin); err == nil && pooled {
		t.Fatal("oncetest: DATABASE_URL points at a connection pooler; NewDB needs a direct connection (it isolates the test by search_path, which a transaction pooler does not keep)")
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = name + ",public"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("oncetest: connect: %v", err)
	}
	t.Cleanup(pool.Close)
	tables := schema.Config{Schema: name}
	if _, err := schema.Migrate(ctx, pool, tables); err != nil {
		t.Fatalf("oncetest: migrate the library's tables: %v", err)
	}
	return &DB{Pool: pool, Schema: name, Tables: tables}
}

// Config is what a [Harness] runs: the Topics and Outgoing of the team's
// once.Config (or pipeline.Config), on DB.
type Config struct {
	// DB holds the library's tables (Tables names them) and the handlers'
	// tables: a [DB]'s Pool. Required.
	DB pgdb.DB
	// Tables names the library's tables. Default: package schema's
	// defaults; a [DB]'s Tables for a test schema.
	Tables schema.Config
	// Topics and their groups, as the service runs them. Required.
	Topics []pipeline.Binding
	// Outgoing topics the handlers publish to. Default: none.
	Outgoing []pipeline.OutgoingBinding
	// MaxEventAge and MaxClockSkew: as in pipeline.Config.
	MaxEventAge, MaxClockSkew time.Duration
	// Logger gets the pipeline's log lines (dead letters, holds, batches
	// run on their own). Default: warnings and errors to slog.Default().
	Logger *slog.Logger
	// Hooks are the pipeline's callbacks, as in once.Config: OnBatch, for
	// one, shows how a batched group's messages were batched. They run on
	// the pipeline's goroutines: record there and assert after Send (t.Fatal
	// in a hook ends a goroutine that is not the test's). A panic in one is
	// logged as in production, but for OnDelivered's, which crashes the
	// test binary.
	Hooks pipeline.Hooks
}

// Harness sends messages to the topics of a [Config]; see [New].
type Harness struct {
	t      TB
	cfg    Config
	local  *pipeline.Local
	outbox *outbox.Outbox
}

// New builds the topics' handler chains; it fails t on a configuration the
// pipeline would refuse. They stop when the test ends.
func New(t TB, cfg Config) *Harness {
	t.Helper()
	if cfg.DB == nil {
		t.Fatal("oncetest: Config.DB is required")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(warnings{slog.Default().Handler()})
	}
	// The dedup horizon as the front door's defaults make it: the claims'
	// retention is recorded where none is (a test's fixture older than it
	// is then refused, as in production), and one recorded is kept.
	rcfg := retention.Config{DB: cfg.DB, Tables: cfg.Tables, Retention: once.DefaultRetention}
	if err := retention.Agree(context.Background(), rcfg); err != nil && !errors.Is(err, retention.ErrRetentionDisagrees) {
		t.Fatalf("oncetest: record the claims' retention: %v", err)
	}
	local, err := pipeline.NewLocal(pipeline.Config{DB: cfg.DB, Tables: cfg.Tables, Topics: cfg.Topics, Outgoing: cfg.Outgoing, Logger: cfg.Logger,
		MaxEventAge: cfg.MaxEventAge, MaxClockSkew: cfg.MaxClockSkew, HoldBackoff: time.Millisecond, HoldMaxBackoff: time.Millisecond, Hooks: cfg.Hooks})
	if err != nil {
		t.Fatalf("oncetest: %v", err)
	}
	t.Cleanup(local.Close)
	box, err := outbox.New(cfg.Tables, nil)
	if err != nil {
		t.Fatalf("oncetest: %v", err)
	}
	return &Harness{t: t, cfg: cfg, local: local, outbox: box}
}

// warnings passes on what is at least a warning: a test's expected holds
// and batches run alone are the pipeline's information, not the test's.
type warnings struct{ slog.Handler }

func (w warnings) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= slog.LevelWarn && w.Handler.Enabled(ctx, l)
}

func (w warnings) WithAttrs(attrs []slog.Attr) slog.Handler {
	return warnings{w.Handler.WithAttrs(attrs)}
}

func (w warnings) WithGroup(name string) slog.Handler { return warnings{w.Handler.WithGroup(name)} }

// Message is a Kafka message as a producer sent it.
type Message struct {
	Key     string
	Payload []byte
	Headers map[string]string
}

// JSON is a message whose payload is v's encoding/json bytes (its
// MarshalJSON, if it has one). It panics if v cannot be encoded, as a
// test's own event always can.
func JSON(key string, v any) Message {
	b, err := json.Marshal(v)
	if err != nil {
		panic(fmt.Sprintf("oncetest: JSON of %T: %v", v, err))
	}
	return Message{Key: key, Payload: b}
}

// Outcome is what one group did with one message.
type Outcome string

const (
	// Processed: the handler ran and its transaction, with the claim,
	// committed.
	Processed Outcome = "processed"
	// Duplicate: the event was claimed before; the handler did not run.
	Duplicate Outcome = "duplicate"
	// DeadLettered: the message is the cause (bad bytes, a reused id, the
	// handler's permanent verdict); its dead letter is parked.
	DeadLettered Outcome = "dead-lettered"
	// Held: an attempt failed for a reason that is not the message's own
	// and rolled back; the pipeline would try it again.
	Held Outcome = "held"
	// NotRun: a message before it in the same Send was held, and it waited.
	NotRun Outcome = "not run"
	// Skipped: acknowledged with nothing claimed, dead-lettered or held: a
	// team's BeforeClaim middleware returned without calling on.
	Skipped Outcome = "skipped"
)

// Result is what one group did with one message.
type Result struct {
	Group   string
	Outcome Outcome
	// Reason is the dead letter's reason, or the held attempt's error.
	Reason string
	// EventID is the claim's event id; uuid.Nil when the message never
	// reached the claim.
	EventID uuid.UUID
}

// Results are a Send's results, group by group, each group's in the order
// of the messages.
type Results []Result

// Of are group's results.
func (rs Results) Of(group string) Results {
	var out Results
	for _, r := range rs {
		if r.Group == group {
			out = append(out, r)
		}
	}
	return out
}

// Outcomes are the results' outcomes, in order.
func (rs Results) Outcomes() []Outcome {
	out := make([]Outcome, len(rs))
	for i, r := range rs {
		out[i] = r.Outcome
	}
	return out
}

// Require fails t unless every result has outcome want.
func (rs Results) Require(t TB, want Outcome) {
	t.Helper()
	for _, r := range rs {
		if r.Outcome != want {
			t.Fatalf("oncetest: group %s: %s (%s); want %s", r.Group, r.Outcome, r.Reason, want)
		}
	}
}

// Send delivers msgs, in this order, to every group of topic, as the
// consecutive messages of one partition, and returns what each group did.
// A batched group gets them all at once, so that they can share a batch.
func (h *Harness) Send(topic string, msgs ...Message) Results {
	h.t.Helper()
	return h.send(topic, false, msgs)
}

// SendJSON sends each event as [JSON] with an empty key.
func (h *Harness) SendJSON(topic string, events ...any) Results {
	h.t.Helper()
	msgs := make([]Message, len(events))
	for i, ev := range events {
		msgs[i] = JSON("", ev)
	}
	return h.send(topic, false, msgs)
}

// SendRolledBack sends msgs as Send does, but every transaction rolls back
// after its handler returned, as a crash before the commit would: each
// group's first message is held and those behind it are not run, and only
// the handler's effects outside its transaction remain (which is what this
// shows: there should be none). It runs alone: no concurrent Send shares
// its batches.
func (h *Harness) SendRolledBack(topic string, msgs ...Message) Results {
	h.t.Helper()
	return h.send(topic, true, msgs)
}

func (h *Harness) send(topic string, rollBack bool, msgs []Message) Results {
	h.t.Helper()
	lm := make([]pipeline.LocalMessage, len(msgs))
	for i, m := range msgs {
		lm[i] = pipeline.LocalMessage{Key: m.Key, Payload: m.Payload, Headers: m.Headers}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	deliver := h.local.Deliver
	if rollBack {
		deliver = h.local.DeliverRolledBack
	}
	got, err := deliver(ctx, topic, lm...)
	if err != nil {
		h.t.Fatalf("oncetest: send to %s: %v", topic, err)
	}
	out := make(Results, len(got))
	for i, r := range got {
		out[i] = result(r)
	}
	return out
}

func result(r pipeline.LocalResult) Result {
	res := Result{Group: r.Group, EventID: r.Claim.EventID}
	switch {
	case r.DeadLetter != nil:
		res.Outcome, res.Reason = DeadLettered, r.DeadLetter.Reason
	case r.Held != nil:
		res.Outcome, res.Reason = Held, r.Held.Err.Error()
	case r.NotRun:
		res.Outcome = NotRun
	case r.Err != nil:
		// Not reached by the pipeline's own chain; a team's Observe
		// middleware may return an error the router would retry.
		res.Outcome, res.Reason = Held, r.Err.Error()
	case r.Claim.Outcome == idempotency.Duplicate:
		res.Outcome = Duplicate
	case r.Claim.Outcome == idempotency.Processed:
		res.Outcome = Processed
	default:
		res.Outcome = Skipped
	}
	return res
}

// RequireOnce checks the guarantee for msg on topic, in every group: a
// delivery whose transaction rolls back after the handler ran leaves no
// claim; the next delivery is processed (or dead-lettered, as a handler's
// rejection is); a redelivery is a duplicate whose handler does not run.
// Assert afterwards that the handler's effect happened once.
func (h *Harness) RequireOnce(topic string, msg Message) {
	h.t.Helper()
	for _, r := range h.SendRolledBack(topic, msg) {
		if r.Outcome != Held && r.Outcome != DeadLettered {
			h.t.Fatalf("oncetest: group %s, a delivery rolled back after its handler: %s; want it held", r.Group, r.Outcome)
		}
		if r.Outcome == Held && r.EventID != uuid.Nil && h.Claimed(r.Group, r.EventID) {
			h.t.Fatalf("oncetest: group %s: the rolled-back delivery left a claim of %s", r.Group, r.EventID)
		}
	}
	for _, r := range h.Send(topic, msg) {
		if r.Outcome != Processed && r.Outcome != DeadLettered {
			h.t.Fatalf("oncetest: group %s, the delivery after the rollback: %s (%s); want processed or dead-lettered", r.Group, r.Outcome, r.Reason)
		}
	}
	for _, r := range h.Send(topic, msg) {
		if r.Outcome != Duplicate && r.Outcome != DeadLettered {
			h.t.Fatalf("oncetest: group %s, the redelivery: %s (%s); want a duplicate", r.Group, r.Outcome, r.Reason)
		}
	}
}

// Claimed reports whether group's claim of the event id is committed.
func (h *Harness) Claimed(group string, id uuid.UUID) bool {
	h.t.Helper()
	var n int
	q := "SELECT count(*) FROM " + h.cfg.Tables.Claims().Qualified + " WHERE event_id = $1 AND consumer_group = $2"
	if err := h.cfg.DB.QueryRow(context.Background(), q, id, group).Scan(&n); err != nil {
		h.t.Fatalf("oncetest: read the claim: %v", err)
	}
	return n > 0
}

// PublishedMessages are the messages for topic that the handlers'
// committed transactions wrote to the outbox, in order.
func (h *Harness) PublishedMessages(topic string) []outbox.Message {
	h.t.Helper()
	msgs, err := h.outbox.Written(context.Background(), h.cfg.DB, topic)
	if err != nil {
		h.t.Fatalf("oncetest: %v", err)
	}
	return msgs
}

// Published are the events for topic that the handlers' committed
// transactions published, decoded by decode, in order.
func Published[E any](t TB, h *Harness, topic string, decode func([]byte) (E, error)) []E {
	t.Helper()
	msgs := h.PublishedMessages(topic)
	out := make([]E, 0, len(msgs))
	for _, m := range msgs {
		ev, err := decode(m.Payload)
		if err != nil {
			t.Fatalf("oncetest: an event published to %s does not decode: %v: %s", topic, err, m.Payload)
		}
		out = append(out, ev)
	}
	return out
}
