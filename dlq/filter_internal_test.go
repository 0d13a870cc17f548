package dlq

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"
)

// A ReasonSum selects the letters whose reason's first line is the one
// summed, however long, and no other; a filter without one keeps the
// progress group it had before the field existed (a replay resumes where
// it stopped), one with it has a group of its own.
func TestAReasonSumSelectsOneReason(t *testing.T) {
	long := strings.Repeat("décodage refusé: ", 30)
	f := Filter{ReasonSum: SumReason(long + "\nstack trace")}
	now := time.Now()
	for reason, want := range map[string]bool{long: true, "  " + long + "  \nother trace": true, long + " and more": false, "other": false, "": false} {
		if got := f.Matches(Entry{Reason: reason, EventTime: now}, now); got != want {
			t.Errorf("reason %.30q...: matched %v, want %v", reason, got, want)
		}
	}
	if f.IsZero() {
		t.Error("a filter with a ReasonSum is zero")
	}
	old := Filter{Topic: "t", Group: "g", Reason: regexp.MustCompile("^x$"), MinAge: time.Hour}
	sum := sha256.Sum256(fmt.Appendf(nil, "topic=%s group=%s reason=%s age=%s..%s", old.Topic, old.Group, old.Reason, old.MinAge, old.MaxAge))
	if got, want := progressGroup("replay", old), "replay.filter-"+hex.EncodeToString(sum[:6]); got != want {
		t.Errorf("progress group %s; the release before named it %s", got, want)
	}
	withSum := old
	withSum.ReasonSum = SumReason("x")
	if progressGroup("replay", withSum) == progressGroup("replay", old) {
		t.Error("a ReasonSum shares the progress group of the filter without it")
	}
}
