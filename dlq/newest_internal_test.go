package dlq

import (
	"testing"
	"time"
)

// List keeps the newest letters, and no more than twice its limit while it
// reads (review finding: it held every matching letter with its payload).
func TestNewestKeepsTheNewestInOrder(t *testing.T) {
	base := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	var entries []Entry
	for _, i := range []int{5, 1, 4, 2, 3} {
		entries = append(entries, Entry{Offset: int64(i), LetterAt: base.Add(time.Duration(i) * time.Minute)})
	}
	got := newest(entries, 3)
	if len(got) != 3 || got[0].Offset != 3 || got[1].Offset != 4 || got[2].Offset != 5 {
		t.Fatalf("newest 3 of 5: %+v; want offsets 3, 4, 5", got)
	}
	if cap(got) != 3 {
		t.Fatalf("kept a backing array of %d entries for 3", cap(got))
	}
}
