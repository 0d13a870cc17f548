package oncetest_test

import (
	"fmt"
	"testing"

	"github.com/once-dev/once/oncetest"
)

// recordingTB is a test as NewDB sees it, recording whether it was
// skipped or failed (both stop the test: a panic here stands for
// runtime.Goexit).
type recordingTB struct {
	testing.TB
	skipped, failed string
}

type stopped struct{}

func (r *recordingTB) Helper()           {}
func (r *recordingTB) Skip(args ...any)  { r.skipped = fmt.Sprint(args...); panic(stopped{}) }
func (r *recordingTB) Fatal(args ...any) { r.failed = fmt.Sprint(args...); panic(stopped{}) }
func (r *recordingTB) Fatalf(f string, args ...any) {
	r.failed = fmt.Sprintf(f, args...)
	panic(stopped{})
}
func (r *recordingTB) Errorf(f string, args ...any) { r.failed = fmt.Sprintf(f, args...) }
func (r *recordingTB) Cleanup(func())               {}

func newDBWith(tb *recordingTB) {
	defer func() {
		if p := recover(); p != nil {
			if _, ok := p.(stopped); !ok {
				panic(p)
			}
		}
	}()
	oncetest.NewDB(tb)
}

// A newcomer's finding: without DATABASE_URL every oncetest test skipped
// and `go test` printed ok, having tested nothing; a CI that sets
// ONCE_REQUIRE_SERVICES now fails instead.
func TestNewDBFailsWithoutADatabaseWhenServicesAreRequired(t *testing.T) {
	t.Setenv("DATABASE_URL", "")
	t.Setenv("ONCE_REQUIRE_SERVICES", "")
	skipped := &recordingTB{}
	newDBWith(skipped)
	if skipped.skipped == "" || skipped.failed != "" {
		t.Fatalf("without DATABASE_URL: skipped %q, failed %q; want a skip", skipped.skipped, skipped.failed)
	}
	t.Setenv("ONCE_REQUIRE_SERVICES", "1")
	required := &recordingTB{}
	newDBWith(required)
	if required.failed == "" || required.skipped != "" {
		t.Fatalf("without DATABASE_URL, services required: skipped %q, failed %q; want a failure", required.skipped, required.failed)
	}
}
