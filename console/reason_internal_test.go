package console

import (
	"regexp"
	"strings"
	"testing"
)

// A group's link selects exactly its letters, however long their reason
// (review finding: the shortened heading became the pattern, which matched
// none of them, and a prefix matched other groups).
func TestAReasonGroupsPatternSelectsItsLettersOnly(t *testing.T) {
	long := strings.Repeat("décodage refusé: ", 30) // 510 runes, multi-byte
	reasons := []string{long + "\nstack trace", "  " + long + "  ", long + " and more", "other"}
	re := regexp.MustCompile(reasonPattern(firstLine(reasons[0])))
	for i, want := range []bool{true, true, false, false} {
		if got := re.MatchString(reasons[i]); got != want {
			t.Errorf("reason %d: matched %v, want %v", i, got, want)
		}
	}
	if h := shortened(firstLine(long)); len([]rune(h)) != 201 || !strings.HasSuffix(h, "…") {
		t.Errorf("heading %q: want 200 runes and an ellipsis", h)
	}
}
