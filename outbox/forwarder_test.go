package outbox_test

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/outbox"
	"github.com/once-dev/once/pgdb"
	"github.com/once-dev/once/schema"
)

// stopMidPoll is the database as the forwarder sees it, with the commit of
// one of its polls held until the forwarder is told to stop: the stop lands
// between a poll's read and its commit, which a real stop hits now and then.
type stopMidPoll struct {
	pgdb.DB
	stop context.CancelFunc
	held atomic.Int64
}

func (s *stopMidPoll) BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error) {
	tx, err := s.DB.BeginTx(ctx, opts)
	return &heldCommit{Tx: tx, s: s}, err
}

type heldCommit struct {
	pgx.Tx
	s      *stopMidPoll
	polled bool
}

func (tx *heldCommit) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	tx.polled = true // the poll reads the outbox; setting up writes only
	return tx.Tx.Query(ctx, sql, args...)
}

func (tx *heldCommit) Commit(ctx context.Context) error {
	if tx.polled && tx.s.held.Add(1) == 1 {
		tx.s.stop()
		select {
		case <-ctx.Done(): // the poll's own context, which the stop ends
		case <-time.After(10 * time.Second):
		}
	}
	return tx.Tx.Commit(ctx)
}

type logSink struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logSink) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// Issue 28, item 8: the stop of a service whose outbox forwarder was
// polling logs no ERROR. watermill-sql logged "could not commit tx for
// querying message" at ERROR when the stop cancelled a poll's commit, at
// the clean stop of every service, an outbox or not.
func TestAStopMidPollLogsNoError(t *testing.T) {
	pool := testenv.Postgres(t)
	var logged logSink
	ob, err := outbox.New(schema.Config{}, slog.New(slog.NewJSONHandler(&logged, &slog.HandlerOptions{Level: slog.LevelDebug})))
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	db := &stopMidPoll{DB: pool, stop: stop}
	fw, err := ob.Forwarder(db, outbox.KafkaPublisher{Producer: testenv.Producer(t, testenv.Brokers(t))})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- fw.Run(ctx) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("the forwarder did not stop")
	}
	if db.held.Load() == 0 {
		t.Fatal("no poll reached its commit: the stop was not staged")
	}
	logged.mu.Lock()
	defer logged.mu.Unlock()
	dec := json.NewDecoder(&logged.b)
	for dec.More() {
		var line map[string]any
		if err := dec.Decode(&line); err != nil {
			t.Fatal(err)
		}
		if line["level"] == "ERROR" {
			t.Errorf("the stop logged an ERROR: %v", line)
		}
	}
}
