package demo_test

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/once-dev/once/internal/demo"
	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/internal/testenv"
)

// The demo, small: it must end in PASS with duplicates actually delivered
// and skipped in both groups, and the provider must have dropped connections
// after charging (so the second lock was exercised).
func TestDemoPasses(t *testing.T) {
	s, err := demo.Run(context.Background(), demo.Config{
		DB: reftest.Postgres(t), ProviderDB: reftest.Postgres(t), Brokers: testenv.Brokers(t),
		Orders: 400, DeclineShare: 0.02, ResetRate: 0.1,
	})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	s.Print(&out)
	t.Log("\n" + out.String())
	if !s.Pass() || !strings.Contains(out.String(), "PASS") {
		t.Fatal("the demo failed its checks")
	}
	if s.Billing.Duplicates == 0 || s.Analytics.Duplicates == 0 || s.ProviderStats.Resets == 0 || s.Declined == 0 {
		t.Fatalf("the run did not exercise every source of duplicates: %+v", s)
	}
}

// Every statement of the reference service (the order service and its
// outbox, billing with its charge intents and refunds, analytics, the
// provider simulator, the dead-letter replay) in each of pgx's query exec
// modes, directly and behind PgBouncer in transaction pooling: the demo,
// smaller, in each way, must pass.
func TestTheDemoPassesInEveryWay(t *testing.T) {
	for _, w := range testenv.EveryWay {
		t.Run(w.String(), func(t *testing.T) {
			s, err := demo.Run(context.Background(), demo.Config{
				DB: w.Pool(t), ProviderDB: w.Pool(t), Brokers: testenv.Brokers(t),
				Orders: 150, DeclineShare: 0.03, ResetRate: 0.1, CancelShare: 0.1,
			})
			if err != nil {
				t.Fatal(err)
			}
			if !s.Pass() {
				var out bytes.Buffer
				s.Print(&out)
				t.Fatalf("the demo failed its checks:\n%s", out.String())
			}
		})
	}
}
