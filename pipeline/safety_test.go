package pipeline_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/internal/pipelinetest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/pipeline"
)

// startPipeline runs p until the test ends or stop is called; its error is
// the test's to judge.
func startPipeline(t *testing.T, p *pipeline.Pipeline) (stop func()) {
	t.Helper()
	stopped := pipelinetest.Start(t, p)
	return func() { _ = stopped() }
}

// Router-level middleware a team adds after New still runs outside the
// safety chain: never inside the claim's transaction, where a poison queue
// or a retry of its own would commit a claim without its effect.
func TestRouterMiddlewareAddedAfterNewStaysOutsideTheClaim(t *testing.T) {
	e := newEnv(t, 1)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	var fails atomic.Int64
	r := &recorder{group: uniqueGroup("late-mw"), fail: func(confirmed) error {
		if fails.Add(1) == 1 {
			return errors.New("a temporary failure")
		}
		return nil
	}}
	cfg := e.config(group(r))
	cfg.Router = router
	cfg.HoldBackoff = 10 * time.Millisecond
	p, err := pipeline.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	var sawTx, calls atomic.Int64
	poison, err := middleware.PoisonQueue(nopPublisher{}, "team-poison")
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			calls.Add(1)
			if _, err := idempotency.TxFromContext(msg.Context()); err == nil {
				sawTx.Add(1)
			}
			return h(msg)
		}
	}, poison)
	startPipeline(t, p)
	testenv.Publish(t, e.Prod, e.Topic, "k", payload(t, validEvent(t, "1.00")))
	testenv.Eventually(t, 30*time.Second, "the event processed", func() bool { return effects(t, e.Pool, r.group) == 1 })
	if sawTx.Load() != 0 || calls.Load() != 1 {
		t.Fatalf("the team's router middleware ran %d times, %d of them inside the claim's transaction; want once, outside", calls.Load(), sawTx.Load())
	}
}

type nopPublisher struct{}

func (nopPublisher) Publish(string, ...*message.Message) error { return nil }
func (nopPublisher) Close() error                              { return nil }

// A handler's rejection is committed with its dead letter: a dead-letter
// topic that does not exist yet loses nothing. The message is acknowledged,
// the letter waits in the database, and reaches the topic once it exists,
// exactly once.
func TestRejectionsDeadLetterSurvivesAMissingDeadLetterTopic(t *testing.T) {
	e := newEnv(t, 1)
	e.DLQ = e.Topic + ".later-dlq" // not created yet, and the broker creates nothing by itself
	declined := errors.New("card declined")
	var rejectedID uuid.UUID
	r := &recorder{group: uniqueGroup("rejects"), fail: func(ev confirmed) error {
		if ev.EventID() == rejectedID {
			return idempotency.RejectAfterCommit(declined)
		}
		return nil
	}}
	// The handler writes its effect only when it does not fail; a rejection
	// needs a committed record, so record through a wrapper.
	g := pipeline.Group[confirmed]{Name: r.group, Handle: func(ctx context.Context, tx pgx.Tx, ev confirmed) error {
		if ev.EventID() == rejectedID {
			if _, err := tx.Exec(ctx, `INSERT INTO pipeline_test_effect (event_id, consumer_group) VALUES ($1, $2)`, ev.EventID(), r.group); err != nil {
				return err
			}
		}
		return r.Handle(ctx, tx, ev)
	}}
	cfg := e.config(g)
	var deadLettered atomic.Int64
	cfg.Hooks.OnDeadLetter = func(pipeline.DeadLetter) { deadLettered.Add(1) }
	run(t, cfg)
	ev := validEvent(t, "9.00")
	rejectedID = ev.EventID()
	testenv.Publish(t, e.Prod, e.Topic, "k", payload(t, ev))
	after := validEvent(t, "1.00")
	testenv.Publish(t, e.Prod, e.Topic, "k", payload(t, after))
	testenv.Eventually(t, 30*time.Second, "the rejection committed and the partition moving on", func() bool {
		return effects(t, e.Pool, r.group) == 2 && deadLettered.Load() == 1
	})
	var parked int
	testenv.Eventually(t, 10*time.Second, "the letter parked, waiting for its topic", func() bool {
		_ = e.Pool.QueryRow(context.Background(), `SELECT count(*) FROM once_dead_letter WHERE topic = $1 AND attempts > 0`, e.DLQ).Scan(&parked)
		return parked == 1
	})
	if err := testenv.Admin(t, e.Brokers).CreateTopic(e.DLQ, &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1}, false); err != nil {
		t.Fatal(err)
	}
	reasons := readDLQ(t, e.Brokers, e.DLQ, 1)
	if got := reasons[string(payload(t, ev))]; !contains(got, "card declined") {
		t.Fatalf("dead letter reason %q, want the rejection", got)
	}
	testenv.Eventually(t, 30*time.Second, "the letter gone from the table", func() bool {
		_ = e.Pool.QueryRow(context.Background(), `SELECT count(*) FROM once_dead_letter WHERE topic = $1`, e.DLQ).Scan(&parked)
		return parked == 0
	})
	time.Sleep(time.Second)
	if n := testenv.MessageCount(t, e.Brokers, e.DLQ); n != 1 {
		t.Fatalf("%d dead letters in the topic, want exactly 1", n)
	}
}

// A team that runs its own router and stops it: the message in flight fails
// with the cancelled context, and that is the shutdown's error, not the
// message's: it is neither dead-lettered nor acknowledged.
func TestShutdownOfATeamsRouterDeadLettersNothing(t *testing.T) {
	e := newEnv(t, 1)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan struct{}, 1)
	g := pipeline.Group[confirmed]{Name: uniqueGroup("team-router"), Handle: func(ctx context.Context, tx pgx.Tx, ev confirmed) error {
		select {
		case started <- struct{}{}:
		default:
		}
		<-ctx.Done()
		return ctx.Err()
	}}
	cfg := e.config(g)
	cfg.Router = router
	var deadLetters atomic.Int64
	cfg.Hooks.OnDeadLetter = func(pipeline.DeadLetter) { deadLetters.Add(1) }
	p, err := pipeline.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop := startPipeline(t, p)
	testenv.Publish(t, e.Prod, e.Topic, "k", payload(t, validEvent(t, "1.00")))
	select {
	case <-started:
	case <-time.After(30 * time.Second):
		t.Fatal("the handler never started")
	}
	stop()
	if deadLetters.Load() != 0 {
		t.Fatalf("%d valid events dead-lettered at shutdown", deadLetters.Load())
	}
	if off := testenv.CommittedOffsets(t, testenv.Admin(t, e.Brokers), g.Name, e.Topic)[0]; off > 0 {
		t.Fatalf("offset %d committed for a message that was never processed", off)
	}
}

// Messages returned by an Observe or BeforeClaim middleware after the claim
// committed are dropped (and logged); the partition moves on instead of
// redelivering a duplicate that returns them again, forever.
func TestMessagesReturnedOutsideTheClaimDoNotStickThePartition(t *testing.T) {
	e := newEnv(t, 1)
	r := &recorder{group: uniqueGroup("returns-outside")}
	g := group(r)
	g.Extra.BeforeClaim = []message.HandlerMiddleware{func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			if _, err := h(msg); err != nil {
				return nil, err
			}
			return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte("{}"))}, nil
		}
	}}
	var seen pipelinetest.Outcomes
	cfg := e.config(g)
	cfg.Hooks.OnResult = seen.Record
	run(t, cfg)
	for range 2 {
		testenv.Publish(t, e.Prod, e.Topic, "k", payload(t, validEvent(t, "1.00")))
	}
	testenv.Eventually(t, 30*time.Second, "both events processed", func() bool { return effects(t, e.Pool, r.group) == 2 })
	time.Sleep(time.Second)
	if d := seen.Get(r.group, idempotency.Duplicate); d != 0 {
		t.Fatalf("%d duplicates: the first message was redelivered", d)
	}
}

// A bad setting of a group is reported by New at once, and a team's router
// is never closed by the pipeline.
func TestLateConfigErrorsAreCaughtUpFrontAndTheTeamsRouterStaysOpen(t *testing.T) {
	e := newEnv(t, 1)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r := &recorder{group: uniqueGroup("bad")}
	g := group(r)
	g.TooOld = "bogus"
	cfg := e.config(g)
	cfg.Router = router
	start := time.Now()
	if _, err := pipeline.New(cfg); err == nil || !contains(err.Error(), `TooOld "bogus"`) {
		t.Fatalf("got %v; want TooOld named", err)
	}
	if time.Since(start) > time.Second || router.IsClosed() {
		t.Fatalf("New took %s and closed the team's router: %v", time.Since(start), router.IsClosed())
	}
}

// When its router stops by itself (a team closes it), Run returns: its
// dead-letter drainers and outbox forwarders stop with it.
func TestRunReturnsWhenTheRouterStops(t *testing.T) {
	e := newEnv(t, 1)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	cfg := e.config(group(&recorder{group: uniqueGroup("router-stops")}))
	cfg.Router = router
	p, err := pipeline.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- p.Run(context.Background()) }()
	<-p.Running()
	if err := router.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		t.Fatal("Run still blocked 15s after its router stopped")
	}
}

// A Watermill Timeout a team puts in the Observe slot may end the message
// context; the message is then given back and delivered again with a fresh
// one, not held forever on a context that fails every attempt.
//
// In batched mode the message's failed batch sends it to run on its own
// after the team's timeout ended its context (review finding: it then went
// from one attempt to the next at once, forever, each on the dead context).
func TestATimeoutInObserveDoesNotHoldTheMessageForever(t *testing.T) {
	eachMode(t, func(t *testing.T, m handlerMode) {
		e := newEnv(t, 1)
		var slow atomic.Bool
		slow.Store(true)
		r := &recorder{group: uniqueGroup("observe-timeout"), fail: func(confirmed) error {
			if slow.CompareAndSwap(true, false) {
				time.Sleep(300 * time.Millisecond) // past the team's 200ms timeout, once
				return errors.New("too slow")
			}
			return nil
		}}
		g := m.group(r)
		g.Extra.Observe = []message.HandlerMiddleware{middleware.Timeout(200 * time.Millisecond)}
		cfg := e.config(g)
		cfg.HoldBackoff = 10 * time.Millisecond
		run(t, cfg)
		testenv.Publish(t, e.Prod, e.Topic, "k", payload(t, validEvent(t, "1.00")))
		testenv.Eventually(t, 30*time.Second, "the event processed after its timed-out attempt", func() bool { return effects(t, e.Pool, r.group) == 1 })
		if slow.Load() {
			t.Fatal("no attempt outlasted the team's timeout: the fault did not happen")
		}
	})
}

// CheckAccess stopped midway returns what it found before the stop with the
// stop itself, so that its caller still sees a refused permission (review
// finding: the stop replaced the errors). A missing topic stands in for one
// here: permissions need the secured broker.
func TestCheckAccessStoppedMidwayKeepsWhatItFound(t *testing.T) {
	e := newEnv(t, 1)
	missing := e.Topic + ".missing"
	r := &recorder{group: uniqueGroup("access")}
	cfg := e.config()
	cfg.Topics = []pipeline.Binding{pipeline.Topic[confirmed]{Name: missing, DLQ: e.DLQ, Decode: decodeConfirmed, Groups: []pipeline.Group[confirmed]{group(r)}}}
	cfg.CloseTimeout = 20 * time.Second
	p, err := pipeline.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		// A pipeline that never ran has nothing to wait for: Watermill's
		// router waited its whole CloseTimeout for handlers never started.
		closing := time.Now()
		if err := p.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		if took := time.Since(closing); took > cfg.CloseTimeout/2 {
			t.Errorf("Close of a pipeline that never ran took %s; it waited for handlers never started", took.Round(time.Millisecond))
		}
		if err := p.Run(context.Background()); err == nil || !contains(err.Error(), "Run after Close") {
			t.Errorf("Run after Close: %v; want the pipeline's refusal", err)
		}
	}()
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // stopped before the consumer groups are asked about
	err = p.CheckAccess(ctx)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("CheckAccess after the stop: %v; want the stop among its errors", err)
	}
	if !contains(err.Error(), missing) {
		t.Fatalf("CheckAccess after the stop: %v; want the missing topic %s named too", err, missing)
	}
}

// A message whose dead letter cannot be written is held, and shows as held
// in the status (and once_held_messages) until the letter is written.
func TestAMessageWhoseDeadLetterCannotBeWrittenShowsAsHeld(t *testing.T) {
	e := newEnv(t, 1)
	fn := "fail_letters_" + uuid.NewString()[:8]
	ctx := context.Background()
	// The staged fault: writing this test's letters fails, and counts.
	if _, err := e.Pool.Exec(ctx, `CREATE SEQUENCE `+fn+`_tries;
CREATE FUNCTION `+fn+`() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.topic = '`+e.DLQ+`' THEN
    PERFORM nextval('`+fn+`_tries');
    RAISE EXCEPTION 'staged: the dead letter cannot be written';
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER `+fn+` BEFORE INSERT ON once_dead_letter FOR EACH ROW EXECUTE FUNCTION `+fn+`()`); err != nil {
		t.Fatal(err)
	}
	dropTrigger := func() {
		_, _ = e.Pool.Exec(ctx, `DROP TRIGGER IF EXISTS `+fn+` ON once_dead_letter`)
	}
	t.Cleanup(func() {
		dropTrigger()
		_, _ = e.Pool.Exec(ctx, `DROP FUNCTION IF EXISTS `+fn+`(); DROP SEQUENCE IF EXISTS `+fn+`_tries`)
	})
	r := &recorder{group: uniqueGroup("unparkable")}
	var deadLetters, heldHooks, heldLongest atomic.Int64
	cfg := e.config(group(r))
	cfg.HoldBackoff = 20 * time.Millisecond
	cfg.HoldMaxBackoff = 100 * time.Millisecond
	cfg.Hooks.OnDeadLetter = func(pipeline.DeadLetter) { deadLetters.Add(1) }
	cfg.Hooks.OnHeld = func(h pipeline.Held) {
		if strings.Contains(h.Err.Error(), "write the dead letter") {
			heldHooks.Add(1)
			if int64(h.Since) > heldLongest.Load() {
				heldLongest.Store(int64(h.Since))
			}
		}
	}
	p, err := pipeline.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	startPipeline(t, p)
	held := func() int {
		n := 0
		for _, s := range p.Status() {
			if s.Group == r.group {
				n += s.Held
			}
		}
		return n
	}
	testenv.Publish(t, e.Prod, e.Topic, "k", []byte(`{"event_id": "broken`))
	tries := func() int64 {
		var n int64
		_ = e.Pool.QueryRow(ctx, `SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM `+fn+`_tries`).Scan(&n)
		return n
	}
	testenv.Eventually(t, 30*time.Second, "the dead letter's write failing twice", func() bool { return tries() >= 2 })
	if got := held(); got != 1 || heldHooks.Load() == 0 {
		t.Fatalf("while its dead letter cannot be written: %d messages held, OnHeld told %d times; want 1, and told (review finding: the hook never was)", got, heldHooks.Load())
	}
	if deadLetters.Load() != 0 {
		t.Fatal("dead-lettered while its letter could not be written")
	}
	testenv.Eventually(t, 10*time.Second, "OnHeld told a second try", func() bool { return heldHooks.Load() >= 2 })
	if time.Duration(heldLongest.Load()) < cfg.HoldBackoff/2 {
		t.Fatalf("OnHeld's Since after %d tries is %v; want the time held (review finding: it was always 0)", heldHooks.Load(), time.Duration(heldLongest.Load()))
	}
	dropTrigger()
	testenv.Eventually(t, 30*time.Second, "the dead letter written", func() bool { return deadLetters.Load() == 1 })
	testenv.Eventually(t, 10*time.Second, "nothing held once the letter is written", func() bool { return held() == 0 })
}

// A second Run is refused and leaves the first running: its deferred Close
// would have stopped the first (review finding).
func TestASecondRunLeavesTheFirstRunning(t *testing.T) {
	e := newEnv(t, 1)
	r := &recorder{group: uniqueGroup("second-run")}
	p, err := pipeline.New(e.config(group(r)))
	if err != nil {
		t.Fatal(err)
	}
	startPipeline(t, p)
	if err := p.Run(context.Background()); err == nil || !contains(err.Error(), "a second Run") {
		t.Fatalf("second Run: %v; want the pipeline's refusal", err)
	}
	testenv.Publish(t, e.Prod, e.Topic, "k", payload(t, validEvent(t, "1.00")))
	testenv.Eventually(t, 30*time.Second, "the first Run still processing", func() bool { return effects(t, e.Pool, r.group) == 1 })
}
