// Package progress keeps one live status line on a terminal while a long
// command runs: a new phase shows at once, updates within a phase at most
// four times a second. It is safe for concurrent use; a nil writer makes
// every call a no-op.
package progress

import (
	"fmt"
	"io"
	"sync"
	"time"
)

// Line is one rewritable status line.
type Line struct {
	mu     sync.Mutex
	w      io.Writer
	start  time.Time
	last   time.Time
	format string
}

// New returns a line on w (stderr, usually); w may be nil.
func New(w io.Writer) *Line { return &Line{w: w, start: time.Now()} }

// Set replaces the line with the formatted text, prefixed by the time elapsed.
func (l *Line) Set(format string, args ...any) {
	if l.w == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if format == l.format && time.Since(l.last) < 250*time.Millisecond {
		return
	}
	l.last, l.format = time.Now(), format
	fmt.Fprintf(l.w, "\r\033[K[%5.1fs] %s", time.Since(l.start).Seconds(), fmt.Sprintf(format, args...))
}

// Done clears the line.
func (l *Line) Done() {
	if l.w == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	fmt.Fprint(l.w, "\r\033[K")
}
