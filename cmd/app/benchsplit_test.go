package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/internal/testenv"
)

// An offered-load run of app bench splits each event's latency into
// production to the broker's append, the append to delivery to the group,
// delivery to the claim's commit, and the claim's commit to the offset's
// commit, on real Kafka and PostgreSQL. Per event, the first three parts add
// up to the latency the offered-load table counts (within the broker's
// millisecond, the coarsest clock of the four), every part is the span
// between its two instants and none is negative beyond that millisecond;
// and the figures printed (each part's, the whole's in both tables) are the
// percentiles of those very events: the parts and the whole cannot drift
// apart.
func TestTheOfferedLoadSplitAddsUpPerEvent(t *testing.T) {
	pool := reftest.Postgres(t)
	brokers := testenv.Brokers(t)
	t.Setenv("ONCE_TEST_BINARY_IS_APP", "1")
	const rate, events = 200, 400
	split := filepath.Join(t.TempDir(), "split.jsonl")
	out, err := runApp(t, "bench", "--kafka-brokers", strings.Join(brokers, ","), "--database-url", pool.Config().ConnString(),
		"--events", "1000", "--partitions", "3", "--only", "P,PB", "--sweep", "", "--rate", fmt.Sprint(rate), "--rate-events", fmt.Sprint(events),
		"--split-file", split)
	if err != nil {
		t.Fatalf("app bench: %v\n%s", err, out)
	}
	if strings.Contains(out, "skipped") {
		t.Fatalf("a measurement was skipped:\n%s", out)
	}
	printed := printedSplit(t, out, rate)
	offered := printedOffered(t, out, rate)
	for i, variant := range []string{"P", "PB"} {
		evs := readSplitFile(t, filepath.Join(filepath.Dir(split), fmt.Sprintf("split.%s.%d.jsonl", variant, rate)))
		if len(evs) != events {
			t.Fatalf("%s: %d events in the split file, want %d", variant, len(evs), events)
		}
		seen := map[partitionOffset]bool{}
		var worst time.Duration
		for _, e := range evs {
			at := partitionOffset{e.Partition, e.Offset}
			if seen[at] {
				t.Fatalf("%s: event %v twice", variant, at)
			}
			seen[at] = true
			instants := []time.Time{e.Produced, e.Appended, e.Delivered, e.Committed, e.OffsetCommitted}
			if len(e.Parts) != len(splitParts) {
				t.Fatalf("%s: event %v has %d parts, want %d", variant, at, len(e.Parts), len(splitParts))
			}
			for j, part := range e.Parts {
				if instants[j].IsZero() || instants[j+1].IsZero() {
					t.Fatalf("%s: event %v lacks an instant: %+v", variant, at, e)
				}
				if part != instants[j+1].Sub(instants[j]) {
					t.Errorf("%s: event %v: %s is %v, not the span between its instants (%v)", variant, at, splitParts[j], part, instants[j+1].Sub(instants[j]))
				}
				// The broker's append and offset commit are to the ms.
				if part < -time.Millisecond {
					t.Errorf("%s: event %v: %s is %v, negative beyond the broker's millisecond", variant, at, splitParts[j], part)
				}
			}
			off := e.Parts[0] + e.Parts[1] + e.Parts[2] - e.Latency
			worst = max(worst, off, -off)
			if off > time.Millisecond || off < -time.Millisecond {
				t.Errorf("%s: event %v: its parts add up to %v, its latency is %v", variant, at, e.Parts[0]+e.Parts[1]+e.Parts[2], e.Latency)
			}
		}
		t.Logf("%s: %d events, parts and latency at most %v apart", variant, len(evs), worst)

		// The printed figures are these events' percentiles.
		for j, name := range splitParts {
			ds := make([]time.Duration, len(evs))
			for k, e := range evs {
				ds[k] = e.Parts[j]
			}
			if got, want := printed[variant+" "+name], fmtPercentiles(percentiles(ds)); got != want {
				t.Errorf("%s %s: printed %q, the events' percentiles are %q", variant, name, got, want)
			}
		}
		ds := make([]time.Duration, len(evs))
		for k, e := range evs {
			ds[k] = e.Latency
		}
		whole := fmtPercentiles(percentiles(ds))
		if got := printed[variant+" whole: production -> claim's commit"]; got != whole {
			t.Errorf("%s: the split's whole printed %q, the events' latencies' percentiles are %q", variant, got, whole)
		}
		if got := strings.Join(offered[3*i:3*i+3], " "); got != whole {
			t.Errorf("%s: the offered-load table printed %q, the events' latencies' percentiles are %q", variant, got, whole)
		}
	}
}

// A split needs the broker's append time: on a topic whose records carry
// the producer's (CreateTime, Kafka's default), bench-run says so, naming
// the setting, instead of splitting wrong; and --split asks for
// --from-produce.
func TestTheSplitRefusesATopicWithoutTheBrokersAppendTime(t *testing.T) {
	pool := reftest.Postgres(t)
	brokers := testenv.Brokers(t)
	topic := testenv.Topic(t, brokers, 1)
	args := []string{"bench-run", "--variant", "P", "--topic", topic, "--group", "bench-split-" + uuid.NewString()[:8], "--events", "1",
		"--kafka-brokers", strings.Join(brokers, ","), "--database-url", pool.Config().ConnString()}
	out, err := runApp(t, append(args, "--from-produce", "--split")...)
	if err == nil || !strings.Contains(err.Error(), "message.timestamp.type is not LogAppendTime") {
		t.Fatalf("--split on a CreateTime topic: %v, want an error naming message.timestamp.type\n%s", err, out)
	}
	if _, err := runApp(t, append(args, "--split")...); err == nil || !strings.Contains(err.Error(), "--split needs --from-produce") {
		t.Fatalf("--split without --from-produce: %v", err)
	}
	// A folder that is not there is said before the measurement, not after it.
	missing := filepath.Join(t.TempDir(), "nowhere", "split.jsonl")
	if _, err := runApp(t, "bench", "--kafka-brokers", strings.Join(brokers, ","), "--database-url", pool.Config().ConnString(),
		"--rate", "100", "--split-file", missing); err == nil || !strings.Contains(err.Error(), "--split-file "+missing+": its folder") {
		t.Fatalf("app bench --split-file in a missing folder: %v, want an error naming --split-file", err)
	}
}

func fmtPercentiles(p50, p99, p999 float64) string {
	return fmt.Sprintf("%.2f %.2f %.2f", p50, p99, p999)
}

// printedSplit reads the split's rows of rate from app bench's output:
// "variant part" to "p50 p99 p99.9".
func printedSplit(t *testing.T, out string, rate int) map[string]string {
	t.Helper()
	rows := map[string]string{}
	for _, l := range strings.Split(out, "\n") {
		f := strings.Fields(l)
		if len(f) < 6 || f[0] != fmt.Sprint(rate) || (f[1] != "P" && f[1] != "PB") {
			continue
		}
		n := len(f)
		rows[f[1]+" "+strings.Join(f[2:n-3], " ")] = strings.Join(f[n-3:], " ")
	}
	if len(rows) != 2*(len(splitParts)+1) {
		t.Fatalf("%d rows of the split at %d events/s, want %d:\n%s", len(rows), rate, 2*(len(splitParts)+1), out)
	}
	return rows
}

// printedOffered reads the offered-load table's row of rate: P's p50, p99,
// p99.9, then PB's (then PB's CPU, and L2's and L2B's p50 and p99).
func printedOffered(t *testing.T, out string, rate int) []string {
	t.Helper()
	for _, l := range strings.Split(out, "\n") {
		if f := strings.Fields(l); len(f) == 12 && f[0] == fmt.Sprint(rate) {
			for i, v := range f[8:] {
				if ms, err := strconv.ParseFloat(v, 64); err != nil || ms <= 0 {
					t.Errorf("the database's own latency at %d events/s, column %d: %q, want a positive figure", rate, 9+i, v)
				}
			}
			return f[1:7]
		}
	}
	t.Fatalf("no offered-load row of %d events/s:\n%s", rate, out)
	return nil
}

func readSplitFile(t *testing.T, path string) []eventTimes {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var evs []eventTimes
	s := bufio.NewScanner(f)
	for s.Scan() {
		var e eventTimes
		if err := json.Unmarshal(s.Bytes(), &e); err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		evs = append(evs, e)
	}
	if err := s.Err(); err != nil {
		t.Fatal(err)
	}
	return evs
}
