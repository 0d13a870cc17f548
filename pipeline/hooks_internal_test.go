package pipeline

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/middleware/idempotency"
)

type hookEvent struct{ id uuid.UUID }

func (e hookEvent) EventID() uuid.UUID { return e.id }

// A pipeline's hooks, as New builds them, log a panic and go on; OnDelivered
// alone passes its panic on, to the chain's recoverer that holds the message.
func TestThePipelinesHooksLogAPanicAndGoOn(t *testing.T) {
	var logged bytes.Buffer
	panics := 0
	stage := func() { panics++; panic("a metrics hook's bug (staged)") }
	cfg := Config{Brokers: []string{"local.invalid:9092"}, DB: (*pgxpool.Pool)(nil), // nothing connects
		Logger: slog.New(slog.NewTextHandler(&logged, nil)),
		Topics: []Binding{Topic[hookEvent]{Name: "t", Decode: func([]byte) (hookEvent, error) { return hookEvent{}, nil },
			Groups: []Group[hookEvent]{{Name: "g", Handle: func(context.Context, pgx.Tx, hookEvent) error { return nil }}}}},
		Hooks: Hooks{
			OnResult: func(idempotency.Result) { stage() }, OnHeld: func(Held) { stage() }, OnDeadLetter: func(DeadLetter) { stage() },
			OnForwarded: func(Forwarded) { stage() }, OnBatch: func(BatchDone) { stage() }, OnDelivered: func(Delivery) { stage() },
		}}
	p, _, err := newPipeline(cfg, false)
	if err != nil {
		t.Fatal(err)
	}
	h := p.cfg.Hooks
	h.OnResult(idempotency.Result{})
	h.OnHeld(Held{})
	h.OnDeadLetter(DeadLetter{})
	h.OnForwarded(Forwarded{})
	h.OnBatch(BatchDone{})
	if panics != 5 || strings.Count(logged.String(), "a hook panicked") != 5 {
		t.Fatalf("%d staged panics, %d logged; want 5 and 5:\n%s", panics, strings.Count(logged.String(), "a hook panicked"), logged.String())
	}
	defer func() {
		if recover() == nil {
			t.Fatal("OnDelivered's panic was swallowed; the chain's recoverer must hold its message")
		}
	}()
	h.OnDelivered(Delivery{})
}

// Composed hooks all run when one panics (a team's bug beside the metrics,
// as metrics.Attach composes them), and the panic is passed on after them.
func TestAComposedHookThatPanicsLeavesTheOthersRunning(t *testing.T) {
	var teams, metrics int
	team := Hooks{OnBatch: func(BatchDone) { teams++; panic("a team's bug (staged)") },
		OnDelivered: func(Delivery) { teams++; panic("a team's bug (staged)") }}
	counting := Hooks{OnBatch: func(BatchDone) { metrics++ }, OnDelivered: func(Delivery) { metrics++ }}
	h := ComposeHooks(team, counting)
	passedOn := func(call func()) (r any) {
		defer func() { r = recover() }()
		call()
		return nil
	}
	if r := passedOn(func() { h.OnDelivered(Delivery{}) }); r == nil || !strings.Contains(fmt.Sprint(r), "a team's bug") {
		t.Fatalf("OnDelivered passed on %v; want the team's panic", r)
	}
	var logged bytes.Buffer
	guarded := h.recovering(slog.New(slog.NewJSONHandler(&logged, nil)))
	if r := passedOn(func() { guarded.OnBatch(BatchDone{}) }); r != nil {
		t.Fatalf("the pipeline's OnBatch passed on %v; want it logged", r)
	}
	if teams != 2 || metrics != 2 {
		t.Fatalf("the team's hooks ran %d times, the metrics' %d; want 2 and 2", teams, metrics)
	}
	// The log has the team's panic and the team's hook in its stack, not the
	// composer's re-panic alone.
	if !strings.Contains(logged.String(), `"panic":"a team's bug (staged)"`) || !strings.Contains(logged.String(), "TestAComposedHookThatPanicsLeavesTheOthersRunning.func1") {
		t.Fatalf("the panic's value or the hook's stack is not in the log: %s", logged.String())
	}
}
