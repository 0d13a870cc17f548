package pipeline_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/pipeline"
)

// sessionLog counts the sessions a process's groups began ("kafka: session
// began", one line per rebalance it took part in).
type sessionLog struct {
	mu       sync.Mutex
	sessions int
}

func (l *sessionLog) Write(p []byte) (int, error) {
	var line struct{ Msg string }
	if json.Unmarshal(p, &line) == nil && line.Msg == "kafka: session began" {
		l.mu.Lock()
		l.sessions++
		l.mu.Unlock()
	}
	return len(p), nil
}

func (l *sessionLog) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.sessions
}

// Issue 30, item 1: with an InstanceID a process is a static member. Its
// restart within the session timeout takes its partitions back without a
// rebalance: the other member's session is never interrupted, and the
// restarted member's partitions wait only for it. A dynamic member's
// restart costs the others two rebalances.
func TestARestartUnderTheSameInstanceIDIsNoRebalance(t *testing.T) {
	for _, static := range []bool{true, false} {
		t.Run(map[bool]string{true: "static", false: "dynamic"}[static], func(t *testing.T) {
			e := newEnv(t, 4)
			r := &recorder{group: uniqueGroup("static")}
			instance := func(id string, log *sessionLog) pipeline.Config {
				cfg := e.config(group(r))
				cfg.SessionTimeout = 20 * time.Second
				if static {
					cfg.InstanceID = id
				}
				if log != nil {
					cfg.Logger = slog.New(slog.NewJSONHandler(log, nil))
				}
				return cfg
			}
			var other sessionLog
			b, err := pipeline.New(instance("instance-b", &other)) // first: the group's leader
			if err != nil {
				t.Fatal(err)
			}
			startPipeline(t, b)
			a, err := pipeline.New(instance("instance-a", nil))
			if err != nil {
				t.Fatal(err)
			}
			stopA := startPipeline(t, a)
			// Both in one session, each with its share (review: counting
			// b's sessions assumed b had one before a joined).
			testenv.Eventually(t, 30*time.Second, "both members in one session", func() bool {
				return len(b.Status()[0].Partitions) == 2 && len(a.Status()[0].Partitions) == 2
			})
			for i := range 20 {
				testenv.Publish(t, e.Prod, e.Topic, fmt.Sprint(i), payload(t, validEvent(t, "1.00")))
			}
			testenv.Eventually(t, 30*time.Second, "the first events processed", func() bool { return effects(t, e.Pool, r.group) == 20 })

			before := other.count()
			stopA() // a static member leaves nothing behind: as a crash, for the group
			run(t, instance("instance-a", nil))
			for i := range 20 {
				testenv.Publish(t, e.Prod, e.Topic, fmt.Sprint(i), payload(t, validEvent(t, "1.00")))
			}
			testenv.Eventually(t, time.Minute, "every event processed after the restart", func() bool { return effects(t, e.Pool, r.group) == 40 })
			time.Sleep(3 * time.Second) // a rebalance would have begun by now
			rebalances := other.count() - before
			if static && rebalances != 0 {
				t.Fatalf("the other member began %d sessions during the restart; want none (no rebalance)", rebalances)
			}
			if !static && rebalances < 1 {
				t.Fatalf("a dynamic member's restart made the other begin %d sessions; the comparison shows nothing", rebalances)
			}
			t.Logf("the other member began %d sessions during the restart", rebalances)
		})
	}
}

// Two processes given one InstanceID: the newer fences the older, whose Run
// stops with ErrFenced instead of rejoining every second.
func TestAFencedInstanceStopsSayingSo(t *testing.T) {
	e := newEnv(t, 2)
	r := &recorder{group: uniqueGroup("fenced")}
	cfg := e.config(group(r))
	cfg.InstanceID = "the-same-name"
	first, err := pipeline.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	done := make(chan error, 1)
	go func() { done <- first.Run(ctx) }()
	<-first.Running()
	testenv.Eventually(t, 30*time.Second, "the first instance joined", func() bool { return first.Status()[0].Joined })
	run(t, cfg) // the second, under the same name
	select {
	case err := <-done:
		if !errors.Is(err, pipeline.ErrFenced) {
			t.Fatalf("the fenced instance's Run: %v; want ErrFenced", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("the fenced instance did not stop within a minute")
	}
}
