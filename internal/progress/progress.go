// Package progress keeps one live status line on a terminal while a long
// command runs: a new phase shows at once, updates within a phase at most
// four times a second. It is safe for concurrent use; a nil writer, or one
// that is not a terminal, makes every call a no-op: the line rewrites
// itself with control codes, which a pipe or a file would keep as they are.
package progress

import (
	"fmt"
	"io"
	"os"
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

// New returns a line on w (stderr, usually) when w is a terminal; on
// anything else (nil, a pipe, a file, a buffer) a line that writes nothing.
func New(w io.Writer) *Line {
	if !Terminal(w) {
		w = nil
	}
	return &Line{w: w, start: time.Now()}
}

// Terminal reports whether w is a terminal (a character device).
func Terminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok || f == nil {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

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
