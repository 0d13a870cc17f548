package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/middleware/idempotency"
)

// recordBatch writes one effect row per claimed message, through the batch's
// transaction, and counts the messages it saw.
func recordBatch(group string, runs *atomic.Int64) idempotency.BatchHandler {
	return func(ctx context.Context, tx pgx.Tx, claimed []*message.Message) error {
		for _, msg := range claimed {
			runs.Add(1)
			id, _ := idempotency.PayloadEventID(msg)
			if _, err := tx.Exec(ctx, `INSERT INTO idempotency_test_effect (event_id, consumer_group) VALUES ($1, $2)`, id, group); err != nil {
				return err
			}
		}
		return nil
	}
}

func newEvents(t *testing.T, n int) ([]uuid.UUID, []*message.Message) {
	t.Helper()
	ids := make([]uuid.UUID, n)
	msgs := make([]*message.Message, n)
	for i := range n {
		ids[i], msgs[i] = newEvent(t)
	}
	return ids, msgs
}

func copies(msgs []*message.Message) []*message.Message {
	out := make([]*message.Message, len(msgs))
	for i, m := range msgs {
		out[i] = m.Copy()
		out[i].SetContext(context.Background())
	}
	return out
}

// A batch claims and handles its new events in one transaction; delivered
// again, every one is a duplicate and the handler sees none.
func TestBatchProcessesEachEventOnce(t *testing.T) {
	pool := setup(t)
	group := uniqueGroup(t, "g")
	var results []idempotency.Result
	var mu sync.Mutex
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group, OnResult: func(r idempotency.Result) {
		mu.Lock()
		results = append(results, r)
		mu.Unlock()
	}})
	ids, msgs := newEvents(t, 20)
	var runs atomic.Int64
	for i, err := range m.ProcessBatch(context.Background(), msgs, recordBatch(group, &runs)) {
		if err != nil {
			t.Fatalf("message %d: %v", i, err)
		}
	}
	for i, err := range m.ProcessBatch(context.Background(), copies(msgs), recordBatch(group, &runs)) {
		if err != nil {
			t.Fatalf("again, message %d: %v", i, err)
		}
	}
	if runs.Load() != 20 {
		t.Fatalf("the handler saw %d events, want 20", runs.Load())
	}
	for _, id := range ids {
		if effects(t, pool, id, group) != 1 || claims(t, pool, id, group) != 1 {
			t.Fatalf("event %s: %d effects, %d claims; want 1 each", id, effects(t, pool, id, group), claims(t, pool, id, group))
		}
	}
	var processed, duplicates int
	for _, r := range results {
		switch r.Outcome {
		case idempotency.Processed:
			processed++
		case idempotency.Duplicate:
			duplicates++
		}
	}
	if processed != 20 || duplicates != 20 {
		t.Fatalf("reported %d processed, %d duplicates; want 20 each", processed, duplicates)
	}
}

// What a batch can prove stands: a reused id with other bytes is permanent
// for that message alone, an invalid key too. The same event twice in one
// batch is decided once, in the batch: its second copy is a duplicate of
// the first's claim, and a copy with other values a mismatch (it used to run
// on its own, and the batch committed the messages after it first).
func TestBatchDecidesEachMessageOnItsOwnMerits(t *testing.T) {
	pool := setup(t)
	group := uniqueGroup(t, "g")
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group})
	var runs atomic.Int64
	reusedID, reused := newEvent(t)
	if errs := m.ProcessBatch(context.Background(), []*message.Message{reused}, recordBatch(group, &runs)); errs[0] != nil {
		t.Fatal(errs[0])
	}
	freshID, fresh := newEvent(t)
	batch := []*message.Message{
		newMessage(reusedID, `"amount":"99.00"`),  // other bytes under a claimed id
		newMessage(uuid.New(), `"amount":"1.00"`), // not a UUIDv7
		fresh,
		fresh.Copy(),                           // the same event twice in the batch
		newMessage(freshID, `"amount":"7.00"`), // and once more, with other values
	}
	batch[3].SetContext(context.Background())
	errs := m.ProcessBatch(context.Background(), batch, recordBatch(group, &runs))
	if !errors.Is(errs[0], idempotency.ErrPayloadMismatch) || !idempotency.IsPermanent(errs[0]) {
		t.Errorf("reused id: %v; want a permanent ErrPayloadMismatch", errs[0])
	}
	if !errors.Is(errs[1], idempotency.ErrInvalidKey) || !idempotency.IsPermanent(errs[1]) {
		t.Errorf("UUIDv4: %v; want a permanent ErrInvalidKey", errs[1])
	}
	if errs[2] != nil || errs[3] != nil {
		t.Errorf("the same event twice: %v, %v; want the first processed, the second a duplicate", errs[2], errs[3])
	}
	if !errors.Is(errs[4], idempotency.ErrPayloadMismatch) || !idempotency.IsPermanent(errs[4]) {
		t.Errorf("its id with other values in the same batch: %v; want a permanent ErrPayloadMismatch", errs[4])
	}
	if effects(t, pool, freshID, group) != 1 || runs.Load() != 2 {
		t.Fatalf("%d effects of the fresh event, handler saw %d events; want 1 and 2", effects(t, pool, freshID, group), runs.Load())
	}
}

// A failing handler rolls the whole batch back: nothing of it is claimed or
// written, and every event it claimed is left to run on its own.
func TestAFailingBatchLeavesNothingAndEveryEventRunsAlone(t *testing.T) {
	pool := setup(t)
	group := uniqueGroup(t, "g")
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group})
	ids, msgs := newEvents(t, 5)
	var runs atomic.Int64
	errs := m.ProcessBatch(context.Background(), msgs, func(ctx context.Context, tx pgx.Tx, claimed []*message.Message) error {
		if err := recordBatch(group, &runs)(ctx, tx, claimed[:3]); err != nil {
			return err
		}
		return errors.New("the fourth event is bad")
	})
	if runs.Load() != 3 {
		t.Fatalf("the handler wrote %d events before failing, want 3: the failure is not staged", runs.Load())
	}
	for i, err := range errs {
		if !errors.Is(err, idempotency.ErrRunAlone) {
			t.Errorf("message %d: %v; want ErrRunAlone", i, err)
		}
		if claims(t, pool, ids[i], group) != 0 || effects(t, pool, ids[i], group) != 0 {
			t.Errorf("event %d left a claim or an effect behind", i)
		}
	}
	// On its own, each runs as usual.
	one := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group})
	for i, msg := range msgs {
		if _, err := one.Middleware(recordEffect(group, &runs))(msg.Copy()); err != nil {
			t.Fatalf("event %d on its own: %v", i, err)
		}
		if effects(t, pool, ids[i], group) != 1 {
			t.Fatalf("event %d: no effect after running on its own", i)
		}
	}
}

// An event outside the dedup horizon fails its batch, so that on its own
// it is refused with the reason while the others are processed.
func TestAnEventOutsideTheHorizonSendsItsBatchAlone(t *testing.T) {
	pool := setup(t)
	group := uniqueGroup(t, "g")
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group, MaxEventAge: time.Hour})
	ids, msgs := newEvents(t, 3)
	old := uuid.Must(uuid.NewV7())
	ms := time.Now().Add(-2 * time.Hour).UnixMilli()
	for i := range 6 {
		old[i] = byte(ms >> (40 - 8*i))
	}
	msgs = append(msgs, newMessage(old, `"amount":"1.00"`))
	var runs atomic.Int64
	errs := m.ProcessBatch(context.Background(), msgs, recordBatch(group, &runs))
	for i, err := range errs {
		if !errors.Is(err, idempotency.ErrRunAlone) {
			t.Fatalf("message %d: %v; want the batch sent to run alone", i, err)
		}
	}
	if runs.Load() != 0 || claims(t, pool, ids[0], group) != 0 {
		t.Fatal("the batch handled or claimed something although it held an event outside the horizon")
	}
	if _, err := m.Middleware(recordEffect(group, &runs))(msgs[3]); !errors.Is(err, idempotency.ErrTooOld) {
		t.Fatalf("the old event on its own: %v; want ErrTooOld", err)
	}
}

// The batch's commit is durable whatever the server's synchronous_commit,
// as a single claim's is.
func TestBatchTransactionIsDurableWhateverTheDefault(t *testing.T) {
	direct := setup(t)
	cfg := direct.Config().Copy()
	cfg.ConnConfig.RuntimeParams["synchronous_commit"] = "off"
	lax, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer lax.Close()
	m := newMiddleware(t, idempotency.Config{DB: lax, ConsumerGroup: uniqueGroup(t, "g")})
	_, msgs := newEvents(t, 3)
	var got string
	errs := m.ProcessBatch(context.Background(), msgs, func(ctx context.Context, tx pgx.Tx, _ []*message.Message) error {
		return tx.QueryRow(ctx, `SHOW synchronous_commit`).Scan(&got)
	})
	if errs[0] != nil || got != "local" {
		t.Fatalf("the batch ran with synchronous_commit %q (%v); want off raised to local", got, errs[0])
	}
}

// Two instances handling overlapping batches at once (a rebalance hands a
// partition over mid-batch) neither deadlock nor double an effect: keys are
// claimed in one order, and the loser of each key finds it claimed.
func TestOverlappingBatchesAtOnceProcessEachEventOnce(t *testing.T) {
	pool := setup(t)
	group := uniqueGroup(t, "g")
	ids, msgs := newEvents(t, 60)
	var runs atomic.Int64
	var wg sync.WaitGroup
	failures := make(chan error, 8)
	for w := range 8 {
		batch := copies(msgs)
		if w%2 == 1 {
			slices.Reverse(batch)
		}
		m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group})
		wg.Go(func() {
			for i, err := range m.ProcessBatch(context.Background(), batch, recordBatch(group, &runs)) {
				if err != nil {
					failures <- fmt.Errorf("worker %d, message %d: %w", w, i, err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(failures)
	for err := range failures {
		t.Error(err)
	}
	for _, id := range ids {
		if effects(t, pool, id, group) != 1 {
			t.Fatalf("event %s has %d effects, want 1", id, effects(t, pool, id, group))
		}
	}
	if runs.Load() != 60 {
		t.Fatalf("the handlers saw %d events, want 60", runs.Load())
	}
}

// Review finding: a duplicate proven in a batch that then rolled back (an
// event outside the horizon) was reported twice: as a duplicate by the
// batch, and again when sent to run alone. It is decided once, by the batch.
func TestADuplicateInARolledBackBatchIsDecidedOnce(t *testing.T) {
	pool := setup(t)
	group := uniqueGroup(t, "g")
	var reported []idempotency.Result
	var mu sync.Mutex
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group, MaxEventAge: time.Hour,
		OnResult: func(r idempotency.Result) { mu.Lock(); reported = append(reported, r); mu.Unlock() }})
	ids, msgs := newEvents(t, 2)
	var runs atomic.Int64
	if _, err := m.Middleware(recordEffect(group, &runs))(copies(msgs[:1])[0]); err != nil {
		t.Fatal(err)
	}
	old := uuid.Must(uuid.NewV7())
	ms := time.Now().Add(-2 * time.Hour).UnixMilli()
	for i := range 6 {
		old[i] = byte(ms >> (40 - 8*i))
	}
	batch := append(copies(msgs), newMessage(old, `"amount":"1.00"`))
	errs := m.ProcessBatch(context.Background(), batch, recordBatch(group, &runs))
	if errs[0] != nil || !errors.Is(errs[1], idempotency.ErrRunAlone) || !errors.Is(errs[2], idempotency.ErrRunAlone) {
		t.Fatalf("results %v; want the duplicate decided, the others sent to run alone", errs)
	}
	mu.Lock()
	defer mu.Unlock()
	dups := 0
	for _, r := range reported {
		if r.EventID == ids[0] && r.Outcome == idempotency.Duplicate {
			dups++
		}
	}
	if dups != 1 {
		t.Fatalf("the duplicate was reported %d times; want once", dups)
	}
}

// Two batches at once that lock the same rows in opposite orders deadlock:
// the one PostgreSQL cancels runs its events on their own, and says why
// (IsDeadlock), so that the router can count it and the log warn of it
// (review finding: logged at INFO only, as any failed batch).
func TestADeadlockedBatchSaysSo(t *testing.T) {
	pool := setup(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS idempotency_test_counter (k int PRIMARY KEY, n int NOT NULL);
		INSERT INTO idempotency_test_counter VALUES (1, 0), (2, 0) ON CONFLICT DO NOTHING`); err != nil {
		t.Fatal(err)
	}
	group := uniqueGroup(t, "g")
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group})
	var firstLocked sync.WaitGroup
	firstLocked.Add(2)
	lockInOrder := func(keys ...int) idempotency.BatchHandler {
		return func(ctx context.Context, tx pgx.Tx, _ []*message.Message) error {
			for i, k := range keys {
				if _, err := tx.Exec(ctx, `UPDATE idempotency_test_counter SET n = n + 1 WHERE k = $1`, k); err != nil {
					return err
				}
				if i == 0 {
					firstLocked.Done()
					firstLocked.Wait() // both hold their first row: the second lock deadlocks
				}
			}
			return nil
		}
	}
	_, a := newEvents(t, 2)
	_, b := newEvents(t, 2)
	results := make(chan []error, 2)
	go func() { results <- m.ProcessBatch(ctx, a, lockInOrder(1, 2)) }()
	go func() { results <- m.ProcessBatch(ctx, b, lockInOrder(2, 1)) }()
	deadlocked, committed := 0, 0
	for range 2 {
		errs := <-results
		switch {
		case errs[0] == nil && errs[1] == nil:
			committed++
		case errors.Is(errs[0], idempotency.ErrRunAlone) && idempotency.IsDeadlock(errs[0]) && idempotency.IsDeadlock(errs[1]):
			deadlocked++
		default:
			t.Fatalf("a batch returned %v", errs)
		}
	}
	if deadlocked != 1 || committed != 1 {
		t.Fatalf("%d batches deadlocked, %d committed; want 1 and 1", deadlocked, committed)
	}
}

// A batch that one event's permanent verdict failed returns ErrRunAlone for
// each of its events, and none of them is permanent: the innocent ones must
// not be dead-lettered by a router that asks IsPermanent first (review
// finding: the cause was wrapped, and its Permanent method showed through).
func TestAFailedBatchsEventsAreNotPermanent(t *testing.T) {
	pool := setup(t)
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: uniqueGroup(t, "g")})
	_, msgs := newEvents(t, 3)
	for i, err := range m.ProcessBatch(context.Background(), msgs, func(context.Context, pgx.Tx, []*message.Message) error {
		return idempotency.Permanent(errors.New("one bad event"))
	}) {
		if !errors.Is(err, idempotency.ErrRunAlone) || idempotency.IsPermanent(err) {
			t.Fatalf("event %d: %v (permanent %t); want ErrRunAlone, not permanent", i, err, idempotency.IsPermanent(err))
		}
	}
}

// delivered is a message as a router hands it out: with its delivery's
// record of external effects, which lasts across its attempts.
func delivered(msg *message.Message) *message.Message {
	msg.SetContext(idempotency.WithDelivery(context.Background()))
	return msg
}

// verdictAlone is a handler of one event that gives the event's own
// permanent verdict, as a declined card does.
func verdictAlone(*message.Message) ([]*message.Message, error) {
	return nil, idempotency.Permanent(errors.New("declined"))
}

// Issue 28, item 1: a batch that rolls back after one event's external
// effect holds that event only. The batch's other events keep their own
// verdicts: one that says permanent is dead-lettered, not held for ever
// behind a mark that was not its own (on main the only mark a batch had
// was the batch's, copied onto every event, and such an event was held at
// attempt 96 and more, its partition behind it).
func TestABatchsEffectMarksOnlyTheEventThatCausedIt(t *testing.T) {
	pool := setup(t)
	for _, how := range []struct {
		name string
		mark func(ctx context.Context, charged *message.Message, id uuid.UUID)
	}{
		{"by event id", func(ctx context.Context, _ *message.Message, id uuid.UUID) {
			idempotency.MarkExternalEffectOf(ctx, id, "charged")
		}},
		{"from the event's own context", func(_ context.Context, charged *message.Message, _ uuid.UUID) {
			idempotency.MarkExternalEffect(charged.Context(), "charged")
		}},
	} {
		t.Run(how.name, func(t *testing.T) {
			m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: uniqueGroup(t, "g")})
			chargedID, charged := newEvent(t)
			_, declined := newEvent(t)
			batch := []*message.Message{delivered(charged), delivered(declined)}
			errs := m.ProcessBatch(context.Background(), batch, func(ctx context.Context, _ pgx.Tx, claimed []*message.Message) error {
				how.mark(ctx, claimed[0], chargedID)
				return idempotency.Permanent(errors.New("the second event's verdict fails the batch"))
			})
			for i, err := range errs {
				if !errors.Is(err, idempotency.ErrRunAlone) {
					t.Fatalf("event %d: %v; want both sent to run alone", i, err)
				}
			}
			// Each on its own, with a handler that says permanent: the
			// charged event is held until its record commits, the other
			// is dead-lettered.
			if _, err := m.Middleware(verdictAlone)(charged); !errors.Is(err, idempotency.ErrAfterExternalEffect) || idempotency.IsPermanent(err) {
				t.Errorf("the charged event on its own: %v; want held after its effect", err)
			}
			if _, err := m.Middleware(verdictAlone)(declined); !idempotency.IsPermanent(err) || errors.Is(err, idempotency.ErrAfterExternalEffect) {
				t.Errorf("the other event on its own: %v; want its own permanent verdict", err)
			}
		})
	}
}

// Review finding: a message whose context had no record of its delivery's
// effects (a team's own router, which gives none) lost its batch's mark, and
// its own run dead-lettered it after the provider had charged. ProcessBatch
// gives such a message a record.
func TestABatchsEffectMarkNeedsNoRecordFromTheRouter(t *testing.T) {
	pool := setup(t)
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: uniqueGroup(t, "g")})
	chargedID, charged := newEvent(t)
	_, declined := newEvent(t)
	m.ProcessBatch(context.Background(), []*message.Message{charged, declined}, func(ctx context.Context, _ pgx.Tx, _ []*message.Message) error {
		idempotency.MarkExternalEffectOf(ctx, chargedID, "charged")
		return errors.New("rolled back")
	})
	if _, err := m.Middleware(verdictAlone)(charged); !errors.Is(err, idempotency.ErrAfterExternalEffect) || idempotency.IsPermanent(err) {
		t.Fatalf("the charged event on its own: %v; want held after its effect", err)
	}
	if _, err := m.Middleware(verdictAlone)(declined); !idempotency.IsPermanent(err) {
		t.Fatalf("the other event on its own: %v; want its own permanent verdict", err)
	}
}

// A mark of the whole batch, or of an id that is none of its events, cannot
// say which event moved money: every event of the batch is held after it,
// and no mark is lost.
func TestABatchWideEffectMarkHoldsEveryEvent(t *testing.T) {
	pool := setup(t)
	for _, how := range []struct {
		name string
		mark func(ctx context.Context)
	}{
		{"MarkExternalEffect", func(ctx context.Context) { idempotency.MarkExternalEffect(ctx, "sent") }},
		{"an id not in the batch", func(ctx context.Context) {
			idempotency.MarkExternalEffectOf(ctx, uuid.Must(uuid.NewV7()), "sent")
		}},
	} {
		t.Run(how.name, func(t *testing.T) {
			m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: uniqueGroup(t, "g")})
			_, msgs := newEvents(t, 2)
			for _, msg := range msgs {
				delivered(msg)
			}
			m.ProcessBatch(context.Background(), msgs, func(ctx context.Context, _ pgx.Tx, _ []*message.Message) error {
				how.mark(ctx)
				return errors.New("rolled back")
			})
			for i, msg := range msgs {
				if _, err := m.Middleware(verdictAlone)(msg); !errors.Is(err, idempotency.ErrAfterExternalEffect) {
					t.Errorf("event %d on its own: %v; want held after the batch's effect", i, err)
				}
			}
		})
	}
}

// Issue 28, item 2: a message a batch sends to run on its own is never
// overtaken by the messages after it. On main the batch committed them and
// the pipeline acknowledged them first, out of their partition's order.
func TestAMessageSentToRunAloneIsNeverOvertaken(t *testing.T) {
	pool := setup(t)
	t.Run("its claim was deleted while the batch read it", func(t *testing.T) {
		group := uniqueGroup(t, "g")
		redeliveredID, redelivered := newEvent(t)
		first := redelivered.Copy()
		first.SetContext(context.Background())
		if _, err := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group}).Middleware(recordEffect(group, new(atomic.Int64)))(first); err != nil {
			t.Fatal(err)
		}
		// A retention pass deletes the claim just before the batch reads
		// the claims it did not insert: the window between the two
		// statements, opened on purpose.
		var stolen atomic.Int64
		thief := &testenv.Intercepted{DB: pool, OnQuery: func(_ context.Context, sql string) {
			if !strings.HasPrefix(sql, "SELECT event_id, payload_sha256") {
				return
			}
			if _, err := pool.Exec(context.Background(), `DELETE FROM processed_event WHERE event_id = $1 AND consumer_group = $2`, redeliveredID, group); err != nil {
				t.Error(err)
			}
			stolen.Add(1)
		}}
		m := newMiddleware(t, idempotency.Config{DB: thief, ConsumerGroup: group})
		laterID, later := newEvent(t)
		var runs atomic.Int64
		errs := m.ProcessBatch(context.Background(), []*message.Message{redelivered, later}, recordBatch(group, &runs))
		if stolen.Load() != 1 {
			t.Fatalf("the claim was taken away %d times; want once", stolen.Load())
		}
		for i, err := range errs {
			if !errors.Is(err, idempotency.ErrRunAlone) {
				t.Errorf("message %d: %v; want it sent to run alone, in order", i, err)
			}
		}
		if n := claims(t, pool, laterID, group); n != 0 || runs.Load() != 0 {
			t.Fatalf("the later message: %d claims, handled %d times; want none before the first ran", n, runs.Load())
		}
	})
	t.Run("its fingerprint failed", func(t *testing.T) {
		group := uniqueGroup(t, "g")
		brokenID, broken := newEvent(t)
		m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group, Fingerprint: func(msg *message.Message) ([32]byte, error) {
			if id, _ := idempotency.PayloadEventID(msg); id == brokenID {
				return [32]byte{}, errors.New("a fingerprint that cannot be made")
			}
			return idempotency.PayloadSHA256(msg)
		}})
		laterID, later := newEvent(t)
		var runs atomic.Int64
		errs := m.ProcessBatch(context.Background(), []*message.Message{broken, later}, recordBatch(group, &runs))
		for i, err := range errs {
			if !errors.Is(err, idempotency.ErrRunAlone) {
				t.Errorf("message %d: %v; want it sent to run alone, in order", i, err)
			}
		}
		if n := claims(t, pool, laterID, group); n != 0 || runs.Load() != 0 {
			t.Fatalf("the later message: %d claims, handled %d times; want none before the first ran", n, runs.Load())
		}
	})
}
