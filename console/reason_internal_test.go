package console

import (
	"strings"
	"testing"
)

// A reason group's heading is its first line, shortened to 200 runes
// (the group's link selects the letters by the whole first line's sum:
// dlq's TestAReasonSumSelectsOneReason).
func TestAReasonGroupsHeadingIsItsFirstLineShortened(t *testing.T) {
	long := strings.Repeat("décodage refusé: ", 30) // 510 runes, multi-byte
	if h := shortened(firstLine("  " + long + "\nstack trace")); len([]rune(h)) != 201 || !strings.HasSuffix(h, "…") || !strings.HasPrefix(h, "décodage") {
		t.Errorf("heading %q: want 200 runes and an ellipsis", h)
	}
}
