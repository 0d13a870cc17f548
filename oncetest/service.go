package oncetest

import (
	"context"
	"time"

	"github.com/once-dev/once"
)

// Run runs svc, a whole service against real Kafka and PostgreSQL, until
// the test ends, and returns once it consumes; a start-up that fails, or a
// Run that ends with an error, fails the test.
func Run(t TB, svc *once.Service) {
	t.Helper()
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- svc.Run(ctx) }()
	t.Cleanup(func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("oncetest: Run: %v", err)
		}
	})
	select {
	case <-svc.Pipeline().Running():
	case err := <-done:
		done <- err // for the cleanup
		t.Fatalf("oncetest: the service stopped at start-up: %v", err)
	case <-time.After(60 * time.Second):
		t.Fatal("oncetest: the service did not start within 60s")
	}
}
