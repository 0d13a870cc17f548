package migrations_test

import (
	"fmt"
	"os"
	"testing"

	"github.com/once-dev/once/internal/testenv"
)

// The migrations' tests turn row-level security on, make group roles'
// progress rows and leave outbox rows of no group: in a database of their
// own, so that no other package starts from that, and no other package's
// leftovers (outbox rows, dead letters of no group) meet these tests.
func TestMain(m *testing.M) {
	if err := testenv.UseOwnDatabase("migrations"); err != nil {
		fmt.Fprintln(os.Stderr, "migrations:", err)
		os.Exit(1)
	}
	os.Exit(m.Run())
}
