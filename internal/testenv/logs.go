package testenv

import (
	"bytes"
	"encoding/json"
	"slices"
	"strings"
	"sync"
	"testing"
)

// Logs is a log sink that several goroutines write to while a test reads
// it.
type Logs struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *Logs) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *Logs) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// JSONLines are the lines of a JSON log written to l whose level is one of
// levels (every line when none is given).
func (l *Logs) JSONLines(t testing.TB, levels ...string) []map[string]any {
	t.Helper()
	var out []map[string]any
	dec := json.NewDecoder(strings.NewReader(l.String()))
	for dec.More() {
		var line map[string]any
		if err := dec.Decode(&line); err != nil {
			t.Fatalf("a line of the log is not JSON: %v\n%s", err, l.String())
		}
		if level, _ := line["level"].(string); len(levels) == 0 || slices.Contains(levels, level) {
			out = append(out, line)
		}
	}
	return out
}
