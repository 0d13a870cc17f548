package reference_test

import (
	"log/slog"
	"math/rand/v2"
	"os"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/internal/pipelinetest"
	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/orderevents"
	"github.com/once-dev/once/pipeline"
)

// env is a topic of the reference service's order.confirmed events, its
// dead-letter topic, and the test database with the service's tables.
type env struct{ *pipelinetest.Env }

func newEnv(t *testing.T, partitions int32) *env {
	t.Helper()
	return &env{pipelinetest.NewEnv(t, reftest.Postgres(t), partitions)}
}

func (e *env) config(groups ...pipeline.Group[orderevents.Confirmed]) pipeline.Config {
	return pipeline.Config{Brokers: e.Brokers, DB: e.Pool,
		Topics: []pipeline.Binding{pipeline.Topic[orderevents.Confirmed]{Name: e.Topic, DLQ: e.DLQ, Decode: orderevents.DecodeConfirmed, Groups: groups}},
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
}

func validEvent(t testing.TB, amount string) orderevents.Confirmed {
	t.Helper()
	ev, err := orderevents.NewConfirmed(uuid.Must(uuid.NewV7()), time.Now(), 1+rand.Int64N(1<<62), 1+rand.Int64N(1000), decimal.RequireFromString(amount))
	if err != nil {
		t.Fatal(err)
	}
	return ev
}

func payload(t testing.TB, ev orderevents.Confirmed) []byte {
	t.Helper()
	b, err := ev.MarshalJSON()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// eachMode runs test with the analytics group per event and batched.
func eachMode(t *testing.T, test func(t *testing.T, batched bool)) {
	t.Run("per-event", func(t *testing.T) { test(t, false) })
	t.Run("batched", func(t *testing.T) { test(t, true) })
}
