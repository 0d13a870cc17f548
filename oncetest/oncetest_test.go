package oncetest_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/oncetest"
	"github.com/once-dev/once/pipeline"
)

// issued is the tests' event; billed the follow-up its handler publishes.
type issued struct {
	ID       uuid.UUID `json:"event_id"`
	Customer int64     `json:"customer_id"`
	Cents    int64     `json:"amount_cents"`
}

func (e issued) EventID() uuid.UUID { return e.ID }

type billed struct {
	ID     uuid.UUID `json:"event_id"`
	Issued uuid.UUID `json:"issued_id"`
}

func (e billed) EventID() uuid.UUID { return e.ID }

func decodeIssued(b []byte) (issued, error) {
	var e issued
	if err := json.Unmarshal(b, &e); err != nil {
		return e, err
	}
	if e.ID.Version() != 7 {
		return e, errors.New("event_id: want a UUIDv7")
	}
	return e, nil
}

func decodeBilled(b []byte) (billed, error) {
	var e billed
	return e, json.Unmarshal(b, &e)
}

const topic = "invoice.issued.v1"

// service is a team's topic: a per-event group that records the invoice and
// publishes a follow-up, a batched group that sums amounts, and a team
// middleware on each.
type service struct {
	db                *oncetest.DB
	observed, inTx    atomic.Int64
	mu                sync.Mutex
	largestBatch      int
	batches           []pipeline.BatchDone // the pipeline's OnBatch, as a team's test sees them
	failNext          atomic.Bool
	writesOutsideTxOf func(context.Context, issued) error
}

func newService(t *testing.T) (*service, *oncetest.Harness) {
	return newServiceBatching(t, pipeline.Batch{Size: 50, MaxWait: 20 * time.Millisecond})
}

// newServiceBatching is newService with the totals group's batching.
func newServiceBatching(t *testing.T, batch pipeline.Batch) (*service, *oncetest.Harness) {
	testenv.Postgres(t) // the services, or the skip that names them
	s := &service{db: oncetest.NewDB(t)}
	ctx := context.Background()
	if _, err := s.db.Pool.Exec(ctx, `CREATE TABLE invoice (event_id uuid PRIMARY KEY, customer_id bigint NOT NULL);
		CREATE TABLE outside (event_id uuid NOT NULL);
		CREATE TABLE totals (customer_id bigint PRIMARY KEY, cents bigint NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	observe := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) { s.observed.Add(1); return h(msg) }
	}
	countInTx := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) { s.inTx.Add(1); return h(msg) }
	}
	record := func(ctx context.Context, tx pgx.Tx, ev issued) error {
		if s.failNext.CompareAndSwap(true, false) {
			return errors.New("the ledger service answered 503")
		}
		if ev.Cents < 0 {
			return idempotency.Permanent(errors.New("a negative invoice"))
		}
		if s.writesOutsideTxOf != nil {
			if err := s.writesOutsideTxOf(ctx, ev); err != nil {
				return err
			}
		}
		if _, err := tx.Exec(ctx, `INSERT INTO invoice VALUES ($1, $2)`, ev.ID, ev.Customer); err != nil {
			return err
		}
		id, err := pipeline.DerivedID(ctx, "customer.billed.v1", time.Unix(ev.ID.Time().UnixTime()))
		if err != nil {
			return err
		}
		return pipeline.Publish(ctx, tx, billed{ID: id, Issued: ev.ID})
	}
	sum := func(ctx context.Context, tx pgx.Tx, evs []issued) error {
		s.mu.Lock()
		s.largestBatch = max(s.largestBatch, len(evs))
		s.mu.Unlock()
		return addTotals(ctx, tx, evs)
	}
	onBatch := func(b pipeline.BatchDone) { s.mu.Lock(); s.batches = append(s.batches, b); s.mu.Unlock() }
	h := oncetest.New(t, oncetest.Config{DB: s.db.Pool, Tables: s.db.Tables, Hooks: pipeline.Hooks{OnBatch: onBatch},
		Outgoing: []pipeline.OutgoingBinding{pipeline.Outgoing[billed]{Name: "customer.billed.v1", Key: func(b billed) string { return b.Issued.String() }}},
		Topics: []pipeline.Binding{pipeline.Topic[issued]{Name: topic, Decode: decodeIssued, Groups: []pipeline.Group[issued]{
			{Name: "invoices", Handle: record, Extra: pipeline.Extra{Observe: []message.HandlerMiddleware{observe}}},
			{Name: "totals", HandleBatch: sum, Batch: batch,
				Extra: pipeline.Extra{InTx: []message.HandlerMiddleware{countInTx}}},
		}}}})
	return s, h
}

// addTotals is the totals group's batch: each customer's cents, added up.
func addTotals(ctx context.Context, tx pgx.Tx, evs []issued) error {
	for _, ev := range evs {
		if _, err := tx.Exec(ctx, `INSERT INTO totals VALUES ($1, $2)
			ON CONFLICT (customer_id) DO UPDATE SET cents = totals.cents + excluded.cents`, ev.Customer, ev.Cents); err != nil {
			return err
		}
	}
	return nil
}

func (s *service) count(t *testing.T, q string, args ...any) int64 {
	t.Helper()
	var n int64
	if err := s.db.Pool.QueryRow(context.Background(), q, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func newIssued(customer, cents int64) issued {
	return issued{ID: uuid.Must(uuid.NewV7()), Customer: customer, Cents: cents}
}

// RequireOnce: a rolled-back delivery, a processed one, a duplicate, in
// both groups; the effect and the follow-up once, each in the test's own
// schema.
func TestRequireOnceRunsEveryGroupOnce(t *testing.T) {
	s, h := newService(t)
	ev := newIssued(7, 1250)
	h.RequireOnce(topic, oncetest.JSON("k", ev))
	if n := s.count(t, `SELECT count(*) FROM invoice WHERE event_id = $1`, ev.ID); n != 1 {
		t.Fatalf("%d invoices, want 1", n)
	}
	if n := s.count(t, `SELECT cents FROM totals WHERE customer_id = 7`); n != 1250 {
		t.Fatalf("total %d, want 1250 once", n)
	}
	got := oncetest.Published(t, h, "customer.billed.v1", decodeBilled)
	if len(got) != 1 || got[0].Issued != ev.ID {
		t.Fatalf("published %+v; want one billed event for %s", got, ev.ID)
	}
	if m := h.PublishedMessages("customer.billed.v1"); m[0].Key != ev.ID.String() || m[0].ID != got[0].ID.String() {
		t.Fatalf("the follow-up's key %q and id %q; want the Outgoing's key and the derived id", m[0].Key, m[0].ID)
	}
	// Three deliveries: Observe ran on each; InTx once per batch, the
	// rolled-back one's batch and its run alone included.
	if s.observed.Load() != 3 || s.inTx.Load() < 2 {
		t.Fatalf("Observe ran %d times, InTx %d; want 3, and at least 2", s.observed.Load(), s.inTx.Load())
	}
	if s.db.Schema == "public" || s.count(t, `SELECT count(*) FROM `+s.db.Tables.Claims().Qualified+` WHERE event_id = $1`, ev.ID) != 2 {
		t.Fatalf("claims not in the test's schema %s", s.db.Schema)
	}
}

// The mistake the package exists to show: a handler that writes through
// the pool, outside the claim's transaction, leaves the rolled-back
// delivery's write behind.
func TestAWriteOutsideTheTransactionShows(t *testing.T) {
	s, h := newService(t)
	s.writesOutsideTxOf = func(ctx context.Context, ev issued) error {
		_, err := s.db.Pool.Exec(ctx, `INSERT INTO outside VALUES ($1)`, ev.ID)
		return err
	}
	ev := newIssued(8, 100)
	h.RequireOnce(topic, oncetest.JSON("k", ev))
	if in, out := s.count(t, `SELECT count(*) FROM invoice`), s.count(t, `SELECT count(*) FROM outside`); in != 1 || out != 2 {
		t.Fatalf("through tx %d, through the pool %d; want 1 and 2", in, out)
	}
}

// The topic's Decode runs on the bytes: a malformed message and an id that
// is not a UUIDv7 are dead-lettered by both groups, with the decoder's
// reason; a handler's permanent verdict by its group alone.
func TestWireBytesGoThroughTheTopicsDecode(t *testing.T) {
	s, h := newService(t)
	rs := h.Send(topic,
		oncetest.Message{Payload: []byte(`{"event_id":`)},
		oncetest.Message{Payload: []byte(`{"event_id":"` + uuid.NewString() + `","customer_id":1,"amount_cents":5}`)},
		oncetest.JSON("k", newIssued(9, -5)),
	)
	want := map[string][]oncetest.Outcome{
		"invoices": {oncetest.DeadLettered, oncetest.DeadLettered, oncetest.DeadLettered},
		"totals":   {oncetest.DeadLettered, oncetest.DeadLettered, oncetest.Processed},
	}
	for group, outcomes := range want {
		if got := rs.Of(group).Outcomes(); !slices.Equal(got, outcomes) {
			t.Fatalf("%s: %v; want %v (%+v)", group, got, outcomes, rs.Of(group))
		}
	}
	if r := rs.Of("invoices"); !strings.Contains(r[1].Reason, "want a UUIDv7") || !strings.Contains(r[2].Reason, "a negative invoice") {
		t.Fatalf("reasons %q, %q; want the decoder's and the handler's", r[1].Reason, r[2].Reason)
	}
	if n := s.count(t, `SELECT count(*) FROM `+s.db.Tables.DeadLettersTable().Qualified); n != 5 {
		t.Fatalf("%d dead letters parked, want 5", n)
	}
}

// A batched group gets a Send's messages at once: they share batches.
func TestABatchedGroupGetsItsBatch(t *testing.T) {
	s, h := newService(t)
	var evs []any
	for range 20 {
		evs = append(evs, newIssued(10, 1))
	}
	h.SendJSON(topic, evs...).Require(t, oncetest.Processed)
	// What a team's test sees through Config.Hooks: the batches, all of
	// them the totals group's, 20 messages between them, none run alone.
	var batched int
	for _, b := range s.batches {
		if b.Group != "totals" || b.RunAlone != 0 {
			t.Fatalf("OnBatch saw %+v; want the totals group's batches, none run alone", b)
		}
		batched += b.Size
	}
	if batched != 20 || len(s.batches) >= 20 {
		t.Fatalf("OnBatch saw %d batches of %d messages; want 20 messages in fewer batches", len(s.batches), batched)
	}
	if s.largestBatch < 2 || s.count(t, `SELECT cents FROM totals WHERE customer_id = 10`) != 20 {
		t.Fatalf("largest batch %d, total %d; want batches of more than one, and 20", s.largestBatch, s.count(t, `SELECT cents FROM totals WHERE customer_id = 10`))
	}
	h.SendJSON(topic, evs...).Require(t, oncetest.Duplicate)
}

// A failure that is not the message's own holds it, and the messages of
// its partition behind it wait; sent again, they pass.
func TestAHeldMessageHoldsThoseBehindIt(t *testing.T) {
	s, h := newService(t)
	first, second := newIssued(11, 1), newIssued(11, 2)
	s.failNext.Store(true)
	rs := h.SendJSON(topic, first, second).Of("invoices")
	if got := rs.Outcomes(); !slices.Equal(got, []oncetest.Outcome{oncetest.Held, oncetest.NotRun}) || !strings.Contains(rs[0].Reason, "503") {
		t.Fatalf("%+v; want the first held with its error, the second not run", rs)
	}
	h.SendJSON(topic, first, second).Of("invoices").Require(t, oncetest.Processed)
}

// Publish refuses an event whose id is not a UUIDv7 at the call, in the
// handler: its consumers would dead-letter it (review finding).
func TestPublishRefusesAnIDThatIsNotAUUIDv7(t *testing.T) {
	db := oncetest.NewDB(t)
	var published error
	h := oncetest.New(t, oncetest.Config{DB: db.Pool, Tables: db.Tables,
		Outgoing: []pipeline.OutgoingBinding{pipeline.Outgoing[billed]{Name: "customer.billed.v1", Key: func(b billed) string { return b.Issued.String() }}},
		Topics: []pipeline.Binding{pipeline.Topic[issued]{Name: topic, Decode: decodeIssued, Groups: []pipeline.Group[issued]{{Name: "g",
			Handle: func(ctx context.Context, tx pgx.Tx, ev issued) error {
				published = pipeline.Publish(ctx, tx, billed{ID: uuid.New(), Issued: ev.ID})
				return nil
			}}}}}})
	h.SendJSON(topic, newIssued(1, 1)).Require(t, oncetest.Processed)
	if published == nil || !strings.Contains(published.Error(), "not a UUIDv7") {
		t.Fatalf("Publish of a UUIDv4 id: %v; want it refused", published)
	}
}

// A second harness on the same database, as a test run again or another
// test makes: its dead letters are dead letters, not "processed" (review
// finding: offsets restarted at 0 and the dead-letter sources skipped them
// as dead-lettered before).
func TestASecondHarnessOnTheSameDatabaseStillDeadLetters(t *testing.T) {
	db := oncetest.NewDB(t)
	cfg := oncetest.Config{DB: db.Pool, Tables: db.Tables, Topics: []pipeline.Binding{pipeline.Topic[issued]{Name: topic, Decode: decodeIssued,
		Groups: []pipeline.Group[issued]{{Name: "g", Handle: func(context.Context, pgx.Tx, issued) error {
			return idempotency.Permanent(errors.New("still broken"))
		}}}}}}
	bad := oncetest.Message{Payload: []byte(`{"event_id":`)}
	for run := range 2 {
		h := oncetest.New(t, cfg)
		h.Send(topic, bad).Require(t, oncetest.DeadLettered)
		h.SendJSON(topic, newIssued(1, 1)).Require(t, oncetest.DeadLettered)
		_ = run
	}
}

// An event older than the claims' retention is refused as the front door's
// defaults refuse it (review finding: oncetest had no horizon).
func TestAnEventOlderThanTheRetentionIsRefused(t *testing.T) {
	_, h := newService(t)
	old := newIssued(1, 1)
	ms := uint64(time.Now().Add(-30 * 24 * time.Hour).UnixMilli())
	for i := range 6 {
		old.ID[i] = byte(ms >> (40 - 8*i))
	}
	rs := h.SendJSON(topic, old)
	for _, r := range rs {
		if r.Outcome != oncetest.DeadLettered || !strings.Contains(r.Reason, "older than the dedup horizon") {
			t.Fatalf("%+v; want the 30-day-old event refused by every group", rs)
		}
	}
}

// Two deliveries of one event at once, from two partitions: one ran the
// handler and one was a duplicate, each told apart (review finding:
// HandlerRan read a shared counter).
func TestConcurrentDeliveriesEachKnowWhetherTheHandlerRan(t *testing.T) {
	db := oncetest.NewDB(t)
	hh := oncetest.NewHandler(t, oncetest.HandlerConfig[issued]{DB: db.Pool, Tables: db.Tables, Decode: decodeIssued,
		Handle: func(context.Context, pgx.Tx, issued) error { time.Sleep(50 * time.Millisecond); return nil }})
	ev := newIssued(1, 1)
	var wg sync.WaitGroup
	ds := make([]oncetest.Delivery, 2)
	for i := range ds {
		wg.Go(func() { ds[i] = hh.Deliver(ev) })
	}
	wg.Wait()
	ran := 0
	for _, d := range ds {
		if d.HandlerRan {
			ran++
		}
	}
	if ran != 1 || hh.Runs() != 1 {
		t.Fatalf("deliveries %+v, runs %d; want the handler run in exactly one", ds, hh.Runs())
	}
}

// A Send and a SendRolledBack at once on a batched group: the rolled-back
// event is not committed by the other's batch (review finding). The batch
// waits to fill, so that the two would share it if Local let them.
func TestARolledBackSendSharesNoBatch(t *testing.T) {
	_, h := newServiceBatching(t, pipeline.Batch{Size: 50, MaxWait: 300 * time.Millisecond, WaitToFill: true})
	// Shared, the batch would roll back or commit by whichever came first:
	// several tries, so that the committing order is among them.
	for i := range int64(8) {
		a, b := newIssued(20+2*i, 1), newIssued(21+2*i, 1)
		var wg sync.WaitGroup
		var rolled oncetest.Results
		wg.Go(func() { h.SendJSON(topic, a) })
		wg.Go(func() { rolled = h.SendRolledBack(topic, oncetest.JSON("k", b)) })
		wg.Wait()
		if h.Claimed("totals", b.ID) || h.Claimed("invoices", b.ID) {
			t.Fatalf("try %d: the rolled-back event is claimed (%+v)", i, rolled)
		}
	}
}

// fatalT records a Fatal instead of ending a test, for a test of what
// oncetest refuses.
type fatalT struct {
	oncetest.TB
	msg string
}

func (f *fatalT) Fatal(args ...any)                 { f.msg = fmt.Sprint(args...); panic(f) }
func (f *fatalT) Fatalf(format string, args ...any) { f.msg = fmt.Sprintf(format, args...); panic(f) }

// NewDB behind a transaction pooler refuses with a reason, instead of a
// start-up error or a test that loses its isolation (review finding).
func TestNewDBBehindAPoolerSaysWhy(t *testing.T) {
	url := os.Getenv("ONCE_PGBOUNCER_URL")
	if url == "" {
		testenv.RequireDevService(t, "pgbouncer")
		t.Skip("ONCE_PGBOUNCER_URL is not set")
	}
	t.Setenv("DATABASE_URL", url)
	f := &fatalT{TB: t}
	func() {
		defer func() { _ = recover() }()
		oncetest.NewDB(f)
	}()
	if !strings.Contains(f.msg, "pooler") {
		t.Fatalf("NewDB behind PgBouncer: %q; want it refused, naming the pooler", f.msg)
	}
}

// A team's hook that panics (a metrics bug) is logged; what it reports
// stands: the batch's events are processed, the poison dead-lettered, and
// the harness's own results are whole.
func TestAPanickingHookStopsNothing(t *testing.T) {
	testenv.Postgres(t)
	db := oncetest.NewDB(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE totals (customer_id bigint PRIMARY KEY, cents bigint NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	var panics sync.Map // hook name → count of staged panics
	staged := func(name string) {
		n, _ := panics.LoadOrStore(name, new(atomic.Int64))
		n.(*atomic.Int64).Add(1)
		panic("a metrics hook's bug (staged): " + name)
	}
	h := oncetest.New(t, oncetest.Config{DB: db.Pool, Tables: db.Tables,
		Hooks: pipeline.Hooks{
			OnBatch:      func(pipeline.BatchDone) { staged("OnBatch") },
			OnResult:     func(idempotency.Result) { staged("OnResult") },
			OnDeadLetter: func(pipeline.DeadLetter) { staged("OnDeadLetter") },
			OnHeld:       func(pipeline.Held) { staged("OnHeld") },
		},
		Topics: []pipeline.Binding{pipeline.Topic[issued]{Name: topic, Decode: decodeIssued, Groups: []pipeline.Group[issued]{
			{Name: "totals", HandleBatch: addTotals, Batch: pipeline.Batch{Size: 50, MaxWait: 20 * time.Millisecond}},
			{Name: "unreachable", Handle: func(_ context.Context, _ pgx.Tx, ev issued) error {
				if ev.Customer == 99 {
					return errors.New("the database went away (staged)")
				}
				return nil
			}},
		}}}})
	var evs []oncetest.Message
	for range 5 {
		evs = append(evs, oncetest.JSON("k", newIssued(3, 2)))
	}
	h.Send(topic, evs...).Require(t, oncetest.Processed)
	h.Send(topic, oncetest.Message{Key: "k", Payload: []byte(`{"event_id":"not a uuid"}`)}).Require(t, oncetest.DeadLettered)
	for _, name := range []string{"OnBatch", "OnResult", "OnDeadLetter"} {
		if n, ok := panics.Load(name); !ok || n.(*atomic.Int64).Load() == 0 {
			t.Fatalf("the staged panic in %s never happened", name)
		}
	}
	var cents int64
	if err := db.Pool.QueryRow(ctx, `SELECT cents FROM totals WHERE customer_id = 3`).Scan(&cents); err != nil || cents != 10 {
		t.Fatalf("total %d (%v); want 10, every event once", cents, err)
	}
	h.Send(topic, evs...).Require(t, oncetest.Duplicate)
	// Held, with a panicking OnHeld: the harness still learns of the hold
	// (its own OnHeld ends the wait), or this Send would not return.
	held := h.Send(topic, oncetest.JSON("k", newIssued(99, 1))).Of("unreachable")
	held.Require(t, oncetest.Held)
	if n, ok := panics.Load("OnHeld"); !ok || n.(*atomic.Int64).Load() == 0 {
		t.Fatal("the staged panic in OnHeld never happened")
	}
}
