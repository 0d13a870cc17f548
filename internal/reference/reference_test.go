package reference

import (
	"testing"
	"time"

	"github.com/once-dev/once"
)

// Billing's horizon follows its too-old policy: with process a confirmation
// past the horizon is still processed, so its cancellation must wait for
// it, not be dead-lettered as never to be settled (review finding).
func TestBillingsHorizonFollowsItsTooOldPolicy(t *testing.T) {
	oc := once.Config{Retention: 168 * time.Hour, MaxClockSkew: 5 * time.Minute}
	if got := billingHorizon(oc, once.RejectTooOld); got != 168*time.Hour-5*time.Minute {
		t.Fatalf("reject: horizon %s, want the retention minus the skew", got)
	}
	if got := billingHorizon(oc, once.ProcessTooOld); got != 0 {
		t.Fatalf("process: horizon %s, want 0 (a cancellation waits for its confirmation)", got)
	}
	if got := billingHorizon(once.Config{}, ""); got != once.DefaultRetention-once.DefaultMaxClockSkew {
		t.Fatalf("defaults: horizon %s, want the default retention minus the default skew", got)
	}
}
