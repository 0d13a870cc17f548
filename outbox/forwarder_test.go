package outbox_test

import (
	"context"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/outbox"
	"github.com/once-dev/once/schema"
)

// Issue 28, item 8: the stop of a service whose outbox forwarder was
// polling logs no ERROR. watermill-sql logged "could not commit tx for
// querying message" at ERROR when the stop cancelled a poll's commit, at
// the clean stop of every service, an outbox or not.
func TestAStopMidPollLogsNoError(t *testing.T) {
	pool := testenv.Postgres(t)
	var logged testenv.Logs
	ob, err := outbox.New(schema.Config{}, slog.New(slog.NewJSONHandler(&logged, &slog.HandlerOptions{Level: slog.LevelDebug})))
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	// The commit of one poll (a transaction that read the outbox; setting
	// up writes only) is held until the forwarder is told to stop: the
	// stop lands between a poll's read and its commit, which a real stop
	// hits now and then.
	var held atomic.Int64
	db := &testenv.Intercepted{DB: pool, OnCommit: func(ctx context.Context, polled bool) {
		if polled && held.Add(1) == 1 {
			stop()
			select {
			case <-ctx.Done(): // the poll's own context, which the stop ends
			case <-time.After(10 * time.Second):
			}
		}
	}}
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
	if held.Load() == 0 {
		t.Fatal("no poll reached its commit: the stop was not staged")
	}
	for _, line := range logged.JSONLines(t, "ERROR") {
		t.Errorf("the stop logged an ERROR: %v", line)
	}
}
