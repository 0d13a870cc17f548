package idempotency_test

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/retention"
	"github.com/once-dev/once/schema"
)

// effects is a business table written only through the claim's transaction;
// its row count per (event, group) is the number of times the effect happened.
const createEffects = `CREATE TABLE IF NOT EXISTS idempotency_test_effect (
	event_id uuid NOT NULL, consumer_group text NOT NULL, at timestamptz NOT NULL DEFAULT now())`

func setup(t *testing.T) *pgxpool.Pool {
	t.Helper()
	pool := testenv.Postgres(t)
	if _, err := pool.Exec(context.Background(), createEffects); err != nil {
		t.Fatal(err)
	}
	return pool
}

// uniqueGroup keeps tests independent of each other and of earlier runs.
func uniqueGroup(t *testing.T, name string) string {
	return fmt.Sprintf("%s-%s-%s", t.Name(), name, uuid.NewString()[:8])
}

func newEvent(t *testing.T) (uuid.UUID, *message.Message) {
	t.Helper()
	id := uuid.Must(uuid.NewV7())
	return id, newMessage(id, `"amount":"10.00"`)
}

func newMessage(id uuid.UUID, extra string) *message.Message {
	msg := message.NewMessage(uuid.NewString(), []byte(fmt.Sprintf(`{"event_id":%q,%s}`, id, extra)))
	msg.SetContext(context.Background())
	return msg
}

// recordEffect is a handler that writes one effect row through the claim's transaction.
func recordEffect(group string, runs *atomic.Int64) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		runs.Add(1)
		tx, err := idempotency.TxFromContext(msg.Context())
		if err != nil {
			return nil, err
		}
		id, _ := idempotency.PayloadEventID(msg)
		_, err = tx.Exec(msg.Context(), `INSERT INTO idempotency_test_effect (event_id, consumer_group) VALUES ($1, $2)`, id, group)
		return nil, err
	}
}

func newMiddleware(t *testing.T, cfg idempotency.Config) *idempotency.Middleware {
	t.Helper()
	m, err := idempotency.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func count(t *testing.T, pool *pgxpool.Pool, query string, args ...any) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), query, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func effects(t *testing.T, pool *pgxpool.Pool, id uuid.UUID, group string) int {
	return count(t, pool, `SELECT count(*) FROM idempotency_test_effect WHERE event_id = $1 AND consumer_group = $2`, id, group)
}

func claims(t *testing.T, pool *pgxpool.Pool, id uuid.UUID, group string) int {
	return count(t, pool, `SELECT count(*) FROM processed_event WHERE event_id = $1 AND consumer_group = $2`, id, group)
}

func TestSameEventFiveTimesRunsOncePerGroup(t *testing.T) {
	pool := setup(t)
	id, msg := newEvent(t)
	for _, name := range []string{"billing", "analytics"} {
		group := uniqueGroup(t, name)
		var runs atomic.Int64
		var outcomes []idempotency.Outcome
		m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group,
			OnResult: func(r idempotency.Result) { outcomes = append(outcomes, r.Outcome) }})
		h := m.Middleware(recordEffect(group, &runs))
		for range 5 {
			if _, err := h(msg.Copy()); err != nil {
				t.Fatalf("%s: %v", group, err)
			}
		}
		if runs.Load() != 1 || effects(t, pool, id, group) != 1 || claims(t, pool, id, group) != 1 {
			t.Fatalf("%s: handler ran %d times, %d effects, %d claims; want 1 each",
				group, runs.Load(), effects(t, pool, id, group), claims(t, pool, id, group))
		}
		want := []idempotency.Outcome{idempotency.Processed, idempotency.Duplicate, idempotency.Duplicate, idempotency.Duplicate, idempotency.Duplicate}
		if fmt.Sprint(outcomes) != fmt.Sprint(want) {
			t.Fatalf("%s: outcomes %v, want %v", group, outcomes, want)
		}
	}
}

// Twenty workers claim one key at once. The handler holds its transaction
// open long enough that the others must block on the unique index, and then
// all of them must see the committed claim and skip.
func TestConcurrentClaimsRunHandlerOnce(t *testing.T) {
	for _, iso := range []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.RepeatableRead, pgx.Serializable} {
		t.Run(string(iso), func(t *testing.T) {
			pool := setup(t)
			group := uniqueGroup(t, "race")
			id, msg := newEvent(t)
			var runs atomic.Int64
			var mu sync.Mutex
			got := map[idempotency.Outcome]int{}
			m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group, IsoLevel: iso,
				OnResult: func(r idempotency.Result) { mu.Lock(); got[r.Outcome]++; mu.Unlock() }})
			inner := recordEffect(group, &runs)
			h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				time.Sleep(200 * time.Millisecond)
				return inner(msg)
			})
			start := make(chan struct{})
			var wg sync.WaitGroup
			errs := make(chan error, 20)
			for range 20 {
				wg.Go(func() {
					<-start
					if _, err := h(msg.Copy()); err != nil {
						errs <- err
					}
				})
			}
			close(start)
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Errorf("worker: %v", err)
			}
			if runs.Load() != 1 || effects(t, pool, id, group) != 1 {
				t.Fatalf("handler ran %d times with %d effects; want 1", runs.Load(), effects(t, pool, id, group))
			}
			if got[idempotency.Processed] != 1 || got[idempotency.Duplicate] != 19 {
				t.Fatalf("outcomes %v; want 1 processed, 19 duplicate", got)
			}
		})
	}
}

func TestFailedAttemptLeavesNoClaimAndRetryRunsOnce(t *testing.T) {
	pool := setup(t)
	group := uniqueGroup(t, "g")
	id, msg := newEvent(t)
	var runs atomic.Int64
	inner := recordEffect(group, &runs)
	boom := errors.New("provider answered 503")
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group})
	h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if _, err := inner(msg); err != nil {
			return nil, err
		}
		if runs.Load() == 1 {
			return nil, boom // after the business write: both must roll back
		}
		return nil, nil
	})

	if _, err := h(msg.Copy()); !errors.Is(err, boom) {
		t.Fatalf("first attempt: got %v, want %v", err, boom)
	}
	if c, e := claims(t, pool, id, group), effects(t, pool, id, group); c != 0 || e != 0 {
		t.Fatalf("after failure: %d claims, %d effects; want none", c, e)
	}
	for range 3 {
		if _, err := h(msg.Copy()); err != nil {
			t.Fatal(err)
		}
	}
	if runs.Load() != 2 || effects(t, pool, id, group) != 1 || claims(t, pool, id, group) != 1 {
		t.Fatalf("handler ran %d times, %d effects, %d claims; want 2 runs, 1 effect, 1 claim",
			runs.Load(), effects(t, pool, id, group), claims(t, pool, id, group))
	}
}

func TestPanicRollsBackClaimAndPropagates(t *testing.T) {
	pool := setup(t)
	group := uniqueGroup(t, "g")
	id, msg := newEvent(t)
	var runs atomic.Int64
	inner := recordEffect(group, &runs)
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group})
	h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		_, _ = inner(msg)
		panic("handler bug")
	})
	func() {
		defer func() {
			if recover() == nil {
				t.Fatal("panic was swallowed; the recoverer further out must see it")
			}
		}()
		_, _ = h(msg)
	}()
	if c, e := claims(t, pool, id, group), effects(t, pool, id, group); c != 0 || e != 0 {
		t.Fatalf("after panic: %d claims, %d effects; want none", c, e)
	}
}

func TestSameIDDifferentPayloadIsPermanentAndSkipsHandler(t *testing.T) {
	pool := setup(t)
	group := uniqueGroup(t, "g")
	id := uuid.Must(uuid.NewV7())
	var runs atomic.Int64
	var last idempotency.Result
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group, OnResult: func(r idempotency.Result) { last = r }})
	h := m.Middleware(recordEffect(group, &runs))
	if _, err := h(newMessage(id, `"amount":"10.00"`)); err != nil {
		t.Fatal(err)
	}
	_, err := h(newMessage(id, `"amount":"99.00"`))
	if !errors.Is(err, idempotency.ErrPayloadMismatch) || !idempotency.IsPermanent(err) {
		t.Fatalf("got %v; want a permanent ErrPayloadMismatch", err)
	}
	if runs.Load() != 1 || last.Outcome != idempotency.PayloadMismatch {
		t.Fatalf("handler ran %d times, last outcome %v; want 1 and payload_mismatch", runs.Load(), last.Outcome)
	}
}

func TestInvalidKeysArePermanent(t *testing.T) {
	pool := setup(t)
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: uniqueGroup(t, "g")})
	h := m.Middleware(func(*message.Message) ([]*message.Message, error) {
		t.Fatal("handler must not run")
		return nil, nil
	})
	for name, payload := range map[string]string{
		"not json":   `{"event_id":`,
		"missing id": `{"amount":"1.00"}`,
		"not a uuid": `{"event_id":"order-17"}`,
		"uuid v4":    fmt.Sprintf(`{"event_id":%q}`, uuid.New()),
	} {
		msg := message.NewMessage("m", []byte(payload))
		_, err := h(msg)
		if !errors.Is(err, idempotency.ErrInvalidKey) || !idempotency.IsPermanent(err) {
			t.Errorf("%s: got %v; want a permanent ErrInvalidKey", name, err)
		}
	}
}

func TestTxFromContextOutsideMiddleware(t *testing.T) {
	if _, err := idempotency.TxFromContext(context.Background()); !errors.Is(err, idempotency.ErrNoTransaction) {
		t.Fatalf("got %v, want ErrNoTransaction", err)
	}
}

// Watermill cancels in-flight message contexts when the router closes. A
// handler that finished its work just then must still be committed.
func TestCommitSurvivesCancelledMessageContext(t *testing.T) {
	pool := setup(t)
	group := uniqueGroup(t, "g")
	id, msg := newEvent(t)
	ctx, cancel := context.WithCancel(context.Background())
	msg.SetContext(ctx)
	var runs atomic.Int64
	inner := recordEffect(group, &runs)
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group})
	h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		out, err := inner(msg)
		cancel() // the router closes while the handler returns
		return out, err
	})
	if _, err := h(msg); err != nil {
		t.Fatal(err)
	}
	if claims(t, pool, id, group) != 1 || effects(t, pool, id, group) != 1 {
		t.Fatal("the commit was lost to the cancelled message context")
	}
}

// While the database is unreachable an attempt fails with an error that is
// not permanent (the router holds the message, never dead-letters it) and
// leaves nothing behind; once it is back, the message is processed once.
func TestDatabaseOutageIsNotPermanentAndLeavesNothing(t *testing.T) {
	direct := setup(t)
	pool, proxy := testenv.ProxiedPostgres(t, direct)
	group := uniqueGroup(t, "g")
	id, msg := newEvent(t)
	var runs atomic.Int64
	var res idempotency.Result
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group, OnResult: func(r idempotency.Result) { res = r }})
	h := m.Middleware(recordEffect(group, &runs))

	proxy.Down(true)
	_, err := h(msg.Copy())
	if err == nil || idempotency.IsPermanent(err) || res.Outcome != idempotency.Failed || runs.Load() != 0 {
		t.Fatalf("got %v, result %+v, %d runs; want a failed attempt that is not permanent and never ran the handler", err, res, runs.Load())
	}
	proxy.Down(false)
	if _, err := h(msg.Copy()); err != nil {
		t.Fatalf("after the outage: %v", err)
	}
	if res.Outcome != idempotency.Processed || effects(t, direct, id, group) != 1 {
		t.Fatal("want exactly one effect after the outage")
	}
}

// A connection that breaks inside the handler rolls the attempt back with a
// non-permanent error; the next attempt processes the message once.
func TestConnectionLostInHandlerIsNotPermanent(t *testing.T) {
	direct := setup(t)
	pool, proxy := testenv.ProxiedPostgres(t, direct)
	group := uniqueGroup(t, "g")
	id, msg := newEvent(t)
	var runs atomic.Int64
	inner := recordEffect(group, &runs)
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group})
	h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if runs.Load() == 0 {
			proxy.Cut()
		}
		return inner(msg)
	})
	if _, err := h(msg.Copy()); err == nil || idempotency.IsPermanent(err) {
		t.Fatalf("got %v; want the connection loss reported as not permanent", err)
	}
	if claims(t, direct, id, group) != 0 {
		t.Fatal("the broken attempt left a claim")
	}
	if _, err := h(msg.Copy()); err != nil {
		t.Fatal(err)
	}
	if runs.Load() != 2 || effects(t, direct, id, group) != 1 {
		t.Fatalf("%d runs, %d effects; want 2 runs and 1 effect", runs.Load(), effects(t, direct, id, group))
	}
}

// A data error of the handler's statement (SQLSTATE class 22 or 23) is not
// the message's fault unless the handler says so: behind a pooler, in a
// driver mode, under a concurrent writer or before another consumer wrote a
// parent row, the same event passes later. It is held (not permanent), and
// rolled back with its claim; wrapped in Permanent by the handler, it is the
// handler's verdict.
func TestHandlerDataErrorIsHeldUnlessTheHandlerDecides(t *testing.T) {
	pool := setup(t)
	group := uniqueGroup(t, "g")
	id, msg := newEvent(t)
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group})
	for name, stmt := range map[string]string{
		"numeric overflow (22003)":     `SELECT 10::numeric(2,0) * 100::numeric(2,0)::numeric(2,0)`,
		"not null violation (23502)":   `INSERT INTO idempotency_test_effect (event_id, consumer_group) VALUES (NULL, 'x')`,
		"division by zero (22012)":     `SELECT 1/0`,
		"invalid text for int (22P02)": `SELECT 'seventeen'::int`,
		"missing table (42P01)":        `SELECT * FROM no_such_table_yet`,
	} {
		for _, verdict := range []bool{false, true} {
			_, err := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				tx, _ := idempotency.TxFromContext(msg.Context())
				_, err := tx.Exec(msg.Context(), stmt)
				if verdict {
					return nil, idempotency.Permanent(err)
				}
				return nil, err
			})(msg.Copy())
			var pgErr *pgconn.PgError
			if !errors.As(err, &pgErr) || idempotency.IsPermanent(err) != verdict {
				t.Errorf("%s, the handler's verdict %t: got %v (permanent %t); want the PostgreSQL error, permanent only as a verdict",
					name, verdict, err, idempotency.IsPermanent(err))
			}
		}
	}
	if claims(t, pool, id, group) != 0 {
		t.Fatal("a failed attempt left its claim")
	}
}

// Two consumers check, then insert the same row under READ COMMITTED: the
// loser's insert fails with 23505, a race of the environment. It is held,
// and its next attempt, which sees the winner's row, succeeds.
func TestAConcurrentInsertIsHeldNotDeadLettered(t *testing.T) {
	pool := setup(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS idempotency_test_customer (id bigint PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	customer := time.Now().UnixNano()
	group := uniqueGroup(t, "g")
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group})
	bothChecked := make(chan struct{}, 2)
	release := make(chan struct{})
	var collisions atomic.Int64
	upsertByHand := func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := idempotency.TxFromContext(msg.Context())
		var exists bool
		if err := tx.QueryRow(msg.Context(), `SELECT EXISTS (SELECT 1 FROM idempotency_test_customer WHERE id = $1)`, customer).Scan(&exists); err != nil {
			return nil, err
		}
		bothChecked <- struct{}{}
		<-release
		if !exists {
			if _, err := tx.Exec(msg.Context(), `INSERT INTO idempotency_test_customer (id) VALUES ($1)`, customer); err != nil {
				var pgErr *pgconn.PgError
				if errors.As(err, &pgErr) && pgErr.Code == "23505" {
					collisions.Add(1)
				}
				return nil, err
			}
		}
		return nil, nil
	}
	h := m.Middleware(upsertByHand)
	_, first := newEvent(t)
	_, second := newEvent(t)
	errs := make(chan error, 2)
	for _, msg := range []*message.Message{first, second} {
		go func() { _, err := h(msg.Copy()); errs <- err }()
	}
	<-bothChecked
	<-bothChecked
	close(release)
	var failed error
	for range 2 {
		if err := <-errs; err != nil {
			failed = err
		}
	}
	if collisions.Load() != 1 {
		t.Fatalf("%d unique violations; the race did not happen (want 1)", collisions.Load())
	}
	if idempotency.IsPermanent(failed) {
		t.Fatalf("the loser of a check-then-insert race: %v is permanent; want it held", failed)
	}
	bothChecked = make(chan struct{}, 2)
	for _, msg := range []*message.Message{first, second} {
		if _, err := h(msg.Copy()); err != nil {
			t.Fatalf("tried again: %v; want the loser processed and the winner a duplicate", err)
		}
	}
}

// After an effect outside the transaction (the provider charged), nothing
// the attempt returns is permanent: neither a write the server refuses
// (22P02) nor the handler's own verdict. The message is held, and the effect
// is recorded once when a later attempt's write commits.
func TestNothingIsPermanentAfterAnExternalEffect(t *testing.T) {
	pool := setup(t)
	for _, verdict := range []bool{false, true} {
		t.Run(fmt.Sprintf("verdict=%t", verdict), func(t *testing.T) {
			group := uniqueGroup(t, "g")
			id, msg := newEvent(t)
			m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group})
			var charges, refused atomic.Int64
			writeFails := true
			h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				tx, _ := idempotency.TxFromContext(msg.Context())
				charges.Add(1) // the provider charged (under the event's key)
				idempotency.MarkExternalEffect(msg.Context(), "charged order 17")
				amount := "10.00"
				if writeFails {
					amount = "ten euros" // what a driver mode or a pooler can do to a value
				}
				_, err := tx.Exec(msg.Context(), `INSERT INTO idempotency_test_effect (event_id, consumer_group, at)
					SELECT $1, $2, now() + ($3::text::numeric * interval '0 second')`, id, group, amount)
				if err != nil {
					refused.Add(1)
					if verdict {
						return nil, idempotency.Permanent(err)
					}
				}
				return nil, err
			})
			_, err := h(msg.Copy())
			if refused.Load() != 1 {
				t.Fatalf("the write was refused %d times; want 1 (the fault did not happen)", refused.Load())
			}
			if err == nil || idempotency.IsPermanent(err) || !errors.Is(err, idempotency.ErrAfterExternalEffect) {
				t.Fatalf("after the charge: %v; want ErrAfterExternalEffect, not permanent", err)
			}
			var pgErr *pgconn.PgError
			if !errors.As(err, &pgErr) || pgErr.Code != "22P02" {
				t.Fatalf("the cause is lost: %v", err)
			}
			writeFails = false
			if _, err := h(msg.Copy()); err != nil {
				t.Fatalf("the next attempt: %v", err)
			}
			if _, err := h(msg.Copy()); err != nil {
				t.Fatalf("a redelivery: %v", err)
			}
			if effects(t, pool, id, group) != 1 || charges.Load() != 2 {
				t.Fatalf("%d recorded charges after %d provider calls; want 1 record (the second call is the provider's replay of its key)",
					effects(t, pool, id, group), charges.Load())
			}
		})
	}
	// Without the mark, a verdict is a verdict.
	group := uniqueGroup(t, "g")
	_, msg := newEvent(t)
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group})
	_, err := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		return nil, idempotency.Permanent(errors.New("declined"))
	})(msg.Copy())
	if !idempotency.IsPermanent(err) {
		t.Fatalf("a verdict without an effect: %v; want permanent", err)
	}
}

// A producer that publishes the same event again may write it in another
// byte form: members in another order, the time with another offset, a
// number with another scale. The claim compares canonical forms: the same
// values are a duplicate, other values under the id are a mismatch.
func TestARepublishedEventInAnotherByteFormIsADuplicate(t *testing.T) {
	pool := setup(t)
	group := uniqueGroup(t, "g")
	id := uuid.Must(uuid.NewV7())
	var runs atomic.Int64
	var outcomes []idempotency.Outcome
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group,
		OnResult: func(r idempotency.Result) { outcomes = append(outcomes, r.Outcome) }})
	h := m.Middleware(recordEffect(group, &runs))
	forms := []string{
		`{"event_id":"%s","occurred_at":"2026-12-02T15:08:21.123456Z","amount":12.5,"order":{"id":7,"lines":[1,2]}}`,
		`{"amount":12.50, "order":{"lines":[1,2],"id":7}, "occurred_at":"2026-12-02T15:08:21.123456+00:00", "event_id":"%s"}`,
		`{
  "occurred_at": "2026-12-02T17:08:21.123456+02:00",
  "amount": 1.250e1,
  "event_id": "%s",
  "order": {"id": 7.0, "lines": [1, 2]}
}`,
	}
	for _, f := range forms {
		msg := message.NewMessage(uuid.NewString(), []byte(fmt.Sprintf(f, id)))
		if _, err := h(msg); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
	}
	for _, other := range []string{
		`{"event_id":"%s","occurred_at":"2026-12-02T15:08:21.123456Z","amount":12.51,"order":{"id":7,"lines":[1,2]}}`,
		`{"event_id":"%s","occurred_at":"2026-12-02T15:08:21.123456+01:00","amount":12.5,"order":{"id":7,"lines":[1,2]}}`,
		`{"event_id":"%s","occurred_at":"2026-12-02T15:08:21.123456Z","amount":12.5,"order":{"id":7,"lines":[2,1]}}`,
		`{"event_id":"%s","occurred_at":"2026-12-02T15:08:21.123456Z","amount":"12.5","order":{"id":7,"lines":[1,2]}}`,
	} {
		msg := message.NewMessage(uuid.NewString(), []byte(fmt.Sprintf(other, id)))
		if _, err := h(msg); !errors.Is(err, idempotency.ErrPayloadMismatch) {
			t.Errorf("%s: %v; want ErrPayloadMismatch", other, err)
		}
	}
	want := []idempotency.Outcome{idempotency.Processed, idempotency.Duplicate, idempotency.Duplicate,
		idempotency.PayloadMismatch, idempotency.PayloadMismatch, idempotency.PayloadMismatch, idempotency.PayloadMismatch}
	if !slices.Equal(outcomes, want) || runs.Load() != 1 {
		t.Fatalf("outcomes %v, %d runs; want %v and 1", outcomes, runs.Load(), want)
	}
}

// A claim made before fingerprints were canonical holds the SHA-256 of the
// payload's bytes: a redelivery of those very bytes is still a duplicate.
func TestAClaimStoredWithTheBytesHashStillMatches(t *testing.T) {
	pool := setup(t)
	group := uniqueGroup(t, "g")
	id, msg := newEvent(t)
	raw := sha256.Sum256(msg.Payload)
	if _, err := pool.Exec(context.Background(), `INSERT INTO processed_event (event_id, consumer_group, payload_sha256) VALUES ($1, $2, $3)`,
		id, group, raw[:]); err != nil {
		t.Fatal(err)
	}
	var outcome idempotency.Outcome
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group, OnResult: func(r idempotency.Result) { outcome = r.Outcome }})
	var runs atomic.Int64
	if _, err := m.Middleware(recordEffect(group, &runs))(msg.Copy()); err != nil || outcome != idempotency.Duplicate {
		t.Fatalf("%v, outcome %v; want a duplicate", err, outcome)
	}
}

// A handler that records a permanent failure keeps that record and the claim,
// and the error still reaches the router; a redelivery is a duplicate.
func TestRejectAfterCommitKeepsTheRecordAndReportsTheError(t *testing.T) {
	pool := setup(t)
	group := uniqueGroup(t, "g")
	id, msg := newEvent(t)
	var runs atomic.Int64
	inner := recordEffect(group, &runs)
	declined := errors.New("card declined")
	var outcomes []idempotency.Outcome
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group,
		OnResult: func(r idempotency.Result) { outcomes = append(outcomes, r.Outcome) }})
	h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if _, err := inner(msg); err != nil {
			return nil, err
		}
		return nil, idempotency.RejectAfterCommit(declined)
	})
	_, err := h(msg.Copy())
	if !errors.Is(err, declined) || !idempotency.IsPermanent(err) {
		t.Fatalf("got %v; want the permanent rejection", err)
	}
	if _, err := h(msg.Copy()); err != nil {
		t.Fatalf("redelivery: %v", err)
	}
	if claims(t, pool, id, group) != 1 || effects(t, pool, id, group) != 1 || runs.Load() != 1 {
		t.Fatal("want the failure record and the claim kept, and the handler run once")
	}
	if fmt.Sprint(outcomes) != fmt.Sprint([]idempotency.Outcome{idempotency.Rejected, idempotency.Duplicate}) {
		t.Fatalf("outcomes %v", outcomes)
	}
}

// A handler's own errors are not permanent unless they say so: a network
// error of an HTTP call is held by the router, not dead-lettered; an error
// with a Permanent() bool method decides for itself.
func TestHandlerErrorsArePermanentOnlyWhenTheySaySo(t *testing.T) {
	pool := setup(t)
	var res idempotency.Result
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: uniqueGroup(t, "g"),
		OnResult: func(r idempotency.Result) { res = r }})
	netErr := &net.OpError{Op: "read", Net: "tcp", Err: errors.New("connection reset by peer")}
	for _, tc := range []struct {
		err       error
		permanent bool
	}{
		{fmt.Errorf("charge: %w", netErr), false},
		{fmt.Errorf("charge: %w", verdict{false}), false},
		{fmt.Errorf("charge: %w", verdict{true}), true},
		{idempotency.Permanent(verdict{false}), true}, // the outermost verdict wins
	} {
		_, msg := newEvent(t)
		_, err := m.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, tc.err })(msg)
		if !errors.Is(err, tc.err) || idempotency.IsPermanent(err) != tc.permanent || res.Outcome != idempotency.Failed {
			t.Errorf("%v: got %v (permanent %v), outcome %v; want permanent %v", tc.err, err, idempotency.IsPermanent(err), res.Outcome, tc.permanent)
		}
	}
}

// verdict is an error of another package that knows whether it is permanent.
type verdict struct{ permanent bool }

func (v verdict) Error() string   { return fmt.Sprintf("verdict (permanent %v)", v.permanent) }
func (v verdict) Permanent() bool { return v.permanent }

// A commit must be durable before its message is acknowledged, whatever the
// server, database or role default: the claim raises synchronous_commit
// "off" to "local" for its transaction, and leaves a stronger setting alone.
func TestClaimTransactionIsDurableWhateverTheDefault(t *testing.T) {
	direct := setup(t)
	for server, want := range map[string]string{"off": "local", "local": "local", "on": "on", "remote_apply": "remote_apply"} {
		cfg := direct.Config().Copy()
		cfg.ConnConfig.RuntimeParams["synchronous_commit"] = server
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		var got string
		m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: uniqueGroup(t, "g")})
		_, msg := newEvent(t)
		_, err = m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			tx, _ := idempotency.TxFromContext(msg.Context())
			return nil, tx.QueryRow(msg.Context(), `SHOW synchronous_commit`).Scan(&got)
		})(msg)
		if err != nil || got != want {
			t.Errorf("server default %s: the claim's transaction ran with %q (%v), want %q", server, got, err, want)
		}
		var after string
		if err := pool.QueryRow(context.Background(), `SHOW synchronous_commit`).Scan(&after); err != nil || after != server {
			t.Errorf("server default %s: the session kept %q after the transaction, want it untouched", server, after)
		}
		pool.Close()
	}
}

// Every failure of the database that is not about the message's values holds
// the message: a read-only database (a failover), a full disk, no memory, too
// many connections, an administrator's shutdown, a crash, a statement or lock
// timeout.
func TestDatabaseFailuresAreNotPermanent(t *testing.T) {
	pool := setup(t)
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: uniqueGroup(t, "g")})
	for _, code := range []string{"25006", "53100", "53200", "53300", "57P01", "57P02", "57P03", "57014", "55P03", "08006", "40001", "40P01", "42P01"} {
		_, msg := newEvent(t)
		_, err := m.Middleware(func(*message.Message) ([]*message.Message, error) {
			return nil, fmt.Errorf("handler: %w", &pgconn.PgError{Code: code, Message: "simulated"})
		})(msg)
		if err == nil || idempotency.IsPermanent(err) {
			t.Errorf("SQLSTATE %s: got %v; want an error that is not permanent", code, err)
		}
	}
	// And for real: a read-only transaction refuses the claim itself (25006).
	cfg := pool.Config().Copy()
	cfg.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
	ro, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	_, msg := newEvent(t)
	_, err = newMiddleware(t, idempotency.Config{DB: ro, ConsumerGroup: uniqueGroup(t, "g")}).Middleware(recordEffect("x", new(atomic.Int64)))(msg)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "25006" || idempotency.IsPermanent(err) {
		t.Fatalf("read-only database: %v; want SQLSTATE 25006, not permanent", err)
	}
	// A closed pool is the environment's too.
	ro.Close()
	_, msg = newEvent(t)
	_, err = newMiddleware(t, idempotency.Config{DB: ro, ConsumerGroup: uniqueGroup(t, "g")}).Middleware(recordEffect("x", new(atomic.Int64)))(msg)
	if err == nil || idempotency.IsPermanent(err) {
		t.Fatalf("closed pool: %v; want an error that is not permanent", err)
	}
}

// A database that accepts a connection and then answers nothing holds an
// attempt no longer than the statement timeout.
func TestSilentDatabaseIsBoundedByTheStatementTimeout(t *testing.T) {
	direct := setup(t)
	pool, proxy := testenv.ProxiedPostgres(t, direct)
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: uniqueGroup(t, "g"), StatementTimeout: 300 * time.Millisecond})
	// A connection first, then silence on it.
	if err := pool.Ping(context.Background()); err != nil {
		t.Fatal(err)
	}
	proxy.BlackHole(true)
	defer proxy.BlackHole(false)
	_, msg := newEvent(t)
	start := time.Now()
	_, err := m.Middleware(recordEffect("x", new(atomic.Int64)))(msg)
	if err == nil || idempotency.IsPermanent(err) || time.Since(start) > 5*time.Second {
		t.Fatalf("got %v after %s; want a non-permanent error within about the 300ms statement timeout", err, time.Since(start))
	}
	if !proxy.Swallowed() {
		t.Fatal("the black hole swallowed nothing: the fault did not happen")
	}
}

// A consumer the network lost in the middle of its transaction cannot tell
// the server it gave up (the black hole drops its close too). The server
// must end that transaction itself, soon, or the claim it holds blocks the
// partition's next owner until TCP keepalive notices, hours later.
func TestAClaimLeftByALostClientIsReleased(t *testing.T) {
	direct := setup(t)
	lost, proxy := testenv.ProxiedPostgres(t, direct)
	group := uniqueGroup(t, "g")
	_, msg := newEvent(t)
	ctx, cancel := context.WithCancel(context.Background())
	msg.SetContext(ctx)
	a := newMiddleware(t, idempotency.Config{DB: lost, ConsumerGroup: group, StatementTimeout: time.Second,
		FinishTimeout: time.Second, IdleInTransactionTimeout: 3 * time.Second})
	var backend int32
	done := make(chan error, 1)
	go func() {
		_, err := a.Middleware(func(m *message.Message) ([]*message.Message, error) {
			tx, _ := idempotency.TxFromContext(m.Context())
			if err := tx.QueryRow(m.Context(), "SELECT pg_backend_pid()").Scan(&backend); err != nil {
				return nil, err
			}
			proxy.BlackHole(true) // mid-handler, e.g. while calling a provider
			<-m.Context().Done()  // the partition is revoked
			return nil, m.Context().Err()
		})(msg)
		done <- err
	}()
	time.Sleep(300 * time.Millisecond)
	cancel()
	var state string
	if err := direct.QueryRow(context.Background(), `SELECT state FROM pg_stat_activity WHERE pid = $1`, backend).Scan(&state); err != nil || state != "idle in transaction" {
		t.Fatalf("the lost client's backend: %q, %v; want it idle in transaction, holding the claim", state, err)
	}
	start := time.Now()
	if err := <-done; err == nil {
		t.Fatal("the lost attempt succeeded")
	}
	t.Logf("the lost attempt gave up after %s", time.Since(start).Round(time.Millisecond))
	if !proxy.Swallowed() {
		t.Fatal("the black hole swallowed nothing: the fault did not happen")
	}

	// The partition's next owner, on a healthy network, gets the message.
	b := newMiddleware(t, idempotency.Config{DB: direct, ConsumerGroup: group, StatementTimeout: 500 * time.Millisecond})
	var runs atomic.Int64
	var err error
	for attempt := 0; attempt < 20 && runs.Load() == 0; attempt++ {
		_, err = b.Middleware(recordEffect(group, &runs))(msg.Copy())
		if err != nil && idempotency.IsPermanent(err) {
			t.Fatalf("waiting behind a lost claim is the environment's fault, not the message's: %v", err)
		}
	}
	if runs.Load() != 1 {
		t.Fatalf("the next owner never ran the handler (last error %v): the lost client's transaction still holds the claim", err)
	}
	t.Logf("the next owner ran it %s after the loss", time.Since(start).Round(time.Millisecond))
	proxy.Cut() // else closing the lost pool waits out pgx's 15 s goodbye into the black hole
}

// A retention shortened while consumers run (app maintain --set-retention)
// drops claims at once; a consumer started with the longer one must judge
// first claims by the recorded retention from then on, or it would process
// again an event whose claim was just dropped.
func TestARecordedShorterRetentionTightensTheHorizon(t *testing.T) {
	pool := setup(t)
	ctx := context.Background()
	names := schema.Config{Schema: "idem_ret_" + strings.ReplaceAll(uuid.NewString()[:8], "-", ""), ClaimTable: "claims"}
	if _, err := schema.Migrate(ctx, pool, names); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA "+names.Schema+" CASCADE") })
	group := uniqueGroup(t, "g")
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group, Schema: names.Schema, Table: names.ClaimTable,
		MaxEventAge: 7 * 24 * time.Hour, MaxClockSkew: 5 * time.Minute})
	fiveDaysOld := func() *message.Message {
		id, err := uuid.NewV7()
		if err != nil {
			t.Fatal(err)
		}
		ms := time.Now().Add(-5 * 24 * time.Hour).UnixMilli()
		for i := range 6 {
			id[i] = byte(ms >> (40 - 8*i))
		}
		return newMessage(id, `"amount":"1.00"`)
	}
	// Per event, a first claim outside the horizon is too old; in a batch
	// it sends the batch to run alone, where it is found too old.
	alone := func() error {
		_, err := m.Middleware(recordEffect(group, new(atomic.Int64)))(fiveDaysOld())
		return err
	}
	batched := func() error {
		return m.ProcessBatch(ctx, []*message.Message{fiveDaysOld()}, recordBatch(group, new(atomic.Int64)))[0]
	}
	for name, deliver := range map[string]func() error{"per event": alone, "batched": batched} {
		if err := deliver(); err != nil {
			t.Fatalf("%s: five days old under a week's retention: %v", name, err)
		}
	}
	rcfg := retention.Config{DB: pool, Tables: names, Retention: 3 * 24 * time.Hour}
	if err := retention.SetRetention(ctx, rcfg); err != nil {
		t.Fatal(err)
	}
	if err := alone(); !errors.Is(err, idempotency.ErrTooOld) {
		t.Fatalf("per event: five days old after the retention became three days: %v; want ErrTooOld", err)
	}
	// Batched, the horizon sends it to run alone, having handled nothing,
	// and alone it is too old: not any failure that also answers
	// ErrRunAlone (review finding).
	var runs atomic.Int64
	msg := fiveDaysOld()
	if err := m.ProcessBatch(ctx, []*message.Message{msg}, recordBatch(group, &runs))[0]; !errors.Is(err, idempotency.ErrRunAlone) {
		t.Fatalf("batched: five days old after the retention became three days: %v; want ErrRunAlone", err)
	}
	if runs.Load() != 0 {
		t.Fatalf("batched: the handler ran for %d events outside the horizon", runs.Load())
	}
	if _, err := m.Middleware(recordEffect(group, new(atomic.Int64)))(msg); !errors.Is(err, idempotency.ErrTooOld) {
		t.Fatalf("the batch's event on its own: %v; want ErrTooOld", err)
	}
}

// An event already claimed is a duplicate whatever its age: an offset reset
// that redelivers a week of old events must not dead-letter them as too old.
// Only a first claim is judged against the horizon.
func TestAnOldDuplicateIsADuplicateNotTooOld(t *testing.T) {
	pool := setup(t)
	group := uniqueGroup(t, "g")
	id, msg := newEvent(t)
	now := time.Now()
	var res idempotency.Result
	deliver := func(at time.Time) error {
		m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group, MaxEventAge: 7 * 24 * time.Hour,
			Now: func() time.Time { return at }, OnResult: func(r idempotency.Result) { res = r }})
		_, err := m.Middleware(recordEffect(group, new(atomic.Int64)))(msg.Copy())
		return err
	}
	if err := deliver(now); err != nil || res.Outcome != idempotency.Processed {
		t.Fatalf("first delivery: %v %v", res.Outcome, err)
	}
	if err := deliver(now.Add(30 * 24 * time.Hour)); err != nil || res.Outcome != idempotency.Duplicate {
		t.Fatalf("a month later, still claimed: %v %v; want a duplicate", res.Outcome, err)
	}
	other, fresh := newEvent(t)
	_ = other
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group, MaxEventAge: 7 * 24 * time.Hour,
		Now: func() time.Time { return now.Add(30 * 24 * time.Hour) }})
	if _, err := m.Middleware(recordEffect(group, new(atomic.Int64)))(fresh); !errors.Is(err, idempotency.ErrTooOld) {
		t.Fatalf("an unclaimed event a month old: %v; want ErrTooOld", err)
	}
	if claims(t, pool, id, group) != 1 {
		t.Fatal("the claim is gone")
	}
}

// Claims work in every query exec mode of pgx, directly and behind
// PgBouncer in transaction pooling: exec and simple_protocol (what such a
// pooler needs) do not ask the server for the parameters' types, and a
// parameter pgx cannot encode as text there would fail every claim, holding
// every partition for good (review finding).
func TestClaimsWorkInEveryQueryExecMode(t *testing.T) {
	base := setup(t)
	for _, where := range testenv.EveryWay {
		t.Run(where.String(), func(t *testing.T) {
			pool := where.Pool(t)
			group := uniqueGroup(t, "g")
			var outcomes []idempotency.Outcome
			var mu sync.Mutex
			m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group, OnResult: func(r idempotency.Result) {
				mu.Lock()
				outcomes = append(outcomes, r.Outcome)
				mu.Unlock()
			}})
			var runs atomic.Int64
			h := m.Middleware(recordEffect(group, &runs))

			id, msg := newEvent(t)
			for range 2 {
				if _, err := h(msg.Copy()); err != nil {
					t.Fatalf("per event: %v", err)
				}
			}
			if _, err := h(newMessage(id, `"amount":"99.00"`)); !errors.Is(err, idempotency.ErrPayloadMismatch) {
				t.Fatalf("the same id with other bytes: %v, want ErrPayloadMismatch", err)
			}

			ids, msgs := newEvents(t, 3)
			for i, err := range m.ProcessBatch(context.Background(), msgs, recordBatch(group, &runs)) {
				if err != nil {
					t.Fatalf("batch, message %d: %v", i, err)
				}
			}
			for i, err := range m.ProcessBatch(context.Background(), copies(msgs), recordBatch(group, &runs)) {
				if err != nil {
					t.Fatalf("batch again, message %d: %v", i, err)
				}
			}
			want := []idempotency.Outcome{idempotency.Processed, idempotency.Duplicate, idempotency.PayloadMismatch,
				idempotency.Processed, idempotency.Processed, idempotency.Processed,
				idempotency.Duplicate, idempotency.Duplicate, idempotency.Duplicate}
			if !slices.Equal(outcomes, want) || runs.Load() != 4 {
				t.Fatalf("outcomes %v, handler runs %d; want %v and 4", outcomes, runs.Load(), want)
			}
			for _, id := range append(ids, id) {
				if n := effects(t, base, id, group); n != 1 {
					t.Fatalf("event %s: %d effects, want 1", id, n)
				}
			}
		})
	}
}

// A held delivery whose earlier attempt had an external effect is processed
// when a later attempt finds it past the dedup horizon: its record must
// commit (review finding: the horizon dead-lettered it as too old while the
// money had moved). A router gives each delivery its record (WithDelivery).
func TestAnEffectOutlastsTheHorizonAcrossAttempts(t *testing.T) {
	pool := setup(t)
	group := uniqueGroup(t, "g")
	id, msg := newEvent(t)
	now := time.Now()
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group, MaxEventAge: time.Hour, Now: func() time.Time { return now }})
	var runs atomic.Int64
	writeFails := true
	h := m.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if runs.Add(1) == 1 {
			idempotency.MarkExternalEffect(msg.Context(), "charged")
		}
		if writeFails {
			return nil, errors.New("the record's write failed")
		}
		return recordEffect(group, new(atomic.Int64))(msg)
	})
	msg.SetContext(idempotency.WithDelivery(context.Background()))
	if _, err := h(msg); !errors.Is(err, idempotency.ErrAfterExternalEffect) {
		t.Fatalf("first attempt: %v; want held after the effect", err)
	}
	now = now.Add(2 * time.Hour) // the hold outlasted the horizon
	writeFails = false
	if _, err := h(msg); err != nil {
		t.Fatalf("the next attempt of the delivery, past the horizon: %v; want it processed", err)
	}
	if effects(t, pool, id, group) != 1 {
		t.Fatal("the record did not commit")
	}
	// A new delivery of an event past the horizon, without an effect, is refused.
	_, fresh := newEvent(t)
	if _, err := h(fresh); !errors.Is(err, idempotency.ErrTooOld) {
		t.Fatalf("an event past the horizon, no effect: %v; want ErrTooOld", err)
	}
}

// The same bytes delivered again are a duplicate even when the consumer's
// fingerprint of their values changed in between (a field added to its
// event type, a rolling deploy); other bytes with the same values are a
// duplicate too; other bytes with other values are a mismatch.
func TestTheBytesOrTheValuesMakeADuplicate(t *testing.T) {
	pool := setup(t)
	group := uniqueGroup(t, "g")
	id := uuid.Must(uuid.NewV7())
	version := byte(1)
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group,
		Fingerprint: func(msg *message.Message) ([32]byte, error) {
			c, err := idempotency.CanonicalJSON(msg.Payload)
			return sha256.Sum256(append(c, version)), err
		}})
	var runs atomic.Int64
	h := m.Middleware(recordEffect(group, &runs))
	first := newMessage(id, `"amount":12.5`)
	if _, err := h(first.Copy()); err != nil {
		t.Fatal(err)
	}
	version = 2 // the consumer's type changed: every fingerprint differs now
	if _, err := h(first.Copy()); err != nil {
		t.Fatalf("the same bytes after the fingerprint changed: %v; want a duplicate", err)
	}
	version = 1
	if _, err := h(newMessage(id, `"amount": 12.50`)); err != nil {
		t.Fatalf("the same values in other bytes: %v; want a duplicate", err)
	}
	if _, err := h(newMessage(id, `"amount":13`)); !errors.Is(err, idempotency.ErrPayloadMismatch) {
		t.Fatalf("other values: %v; want ErrPayloadMismatch", err)
	}
	if runs.Load() != 1 {
		t.Fatalf("%d runs, want 1", runs.Load())
	}
}

// The handler's statements run under the transaction's statement timeout,
// not the claim's own bound (review finding: the claim's 30s became every
// handler statement's).
func TestTheTransactionsStatementTimeoutBoundsTheHandler(t *testing.T) {
	pool := setup(t)
	sleep := func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := idempotency.TxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), `SELECT pg_sleep(0.6)`)
		return nil, err
	}
	long := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: uniqueGroup(t, "g"), StatementTimeout: 300 * time.Millisecond, TxStatementTimeout: 5 * time.Second})
	if _, msg := newEvent(t); true {
		if _, err := long.Middleware(sleep)(msg); err != nil {
			t.Fatalf("a 600ms statement under a 5s transaction bound: %v", err)
		}
	}
	short := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: uniqueGroup(t, "g"), TxStatementTimeout: 200 * time.Millisecond})
	_, msg := newEvent(t)
	_, err := short.Middleware(sleep)(msg)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "57014" || idempotency.IsPermanent(err) {
		t.Fatalf("a 600ms statement under a 200ms transaction bound: %v; want 57014, held", err)
	}
}
