package e2e

import (
	"encoding/json"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/orderevents"
)

// seedpeer returns the style guide's Python (a venv with pydantic and
// aiokafka that dev/test.sh makes) and the directory of its scripts.
func seedpeer(t *testing.T) (python, dir string) {
	t.Helper()
	python, dir = os.Getenv("ONCE_SEEDPEER_PYTHON"), os.Getenv("ONCE_SEEDPEER_DIR")
	if python != "" && dir != "" {
		return python, dir
	}
	if os.Getenv("ONCE_REQUIRE_SERVICES") != "" {
		t.Fatal("ONCE_SEEDPEER_PYTHON and ONCE_SEEDPEER_DIR are not set, but ONCE_REQUIRE_SERVICES is: dev/test.sh makes the venv")
	}
	t.Skip("ONCE_SEEDPEER_PYTHON is not set: run the suite with dev/test.sh, which makes the style guide's Python venv")
	return "", ""
}

// produced is what produce.py prints.
type produced struct {
	Produced int    `json:"produced"`
	Distinct int    `json:"distinct"`
	Total    string `json:"total"`
}

// 0. Events published by the style guide's own model in Python (pydantic's
// OrderConfirmedMessage over an idempotent aiokafka producer, with
// re-published duplicates), the total amount both as the string pydantic
// writes and as a JSON number: both groups process every one, dead-letter
// none, and the usual invariants hold.
func TestGuidesPythonProducer(t *testing.T) {
	s := newScenario(t, "0 the guide's Python producer", 6)
	s.guidesProducer(scale(300), scale(100), "0.1", nil)
}

// 15. The same, with the consumers behind PgBouncer in transaction pooling
// (dev/pgbouncer.sh; the URL names default_query_exec_mode=exec), 25% of the
// events re-published: every statement of both groups goes through a server
// connection that is theirs for one transaction only. In each mode (in key
// order, each message in flight holds a server connection of its own), the
// order of billing's provider calls checked.
func TestGuidesProducerBehindPgBouncer(t *testing.T) {
	eachMode(t, allModes, func(t *testing.T, m mode) {
		s := behindPgBouncer(t, "15 behind PgBouncer", m)
		s.logCalls()
		s.guidesProducer(scale(300), scale(100), "0.25", nil)
	})
}

// 16. Behind PgBouncer, and PgBouncer killed with -9 while both groups work,
// then started again: every client and server connection is cut at once.
func TestPgBouncerKilled(t *testing.T) {
	eachMode(t, perEventAndBatched, func(t *testing.T, m mode) {
		s := behindPgBouncer(t, "16 PgBouncer kill -9", m)
		// A provider that takes 100ms: billing's transactions are open when
		// the pooler dies.
		s.providerFlags = []string{"--fault-latency", "100ms"}
		s.guidesProducer(scale(300), scale(100), "0.25", func() {
			s.waitClaims(billingGroup, 20, 60*time.Second)
			s.devService("pgbouncer", "kill")
			s.kills++
			time.Sleep(time.Second)
			s.devService("pgbouncer", "start")
			s.restarts++
		})
		if s.readOutcomes().held() == 0 {
			t.Error("no attempt was held while PgBouncer was down: the fault did not happen")
		}
	})
}

// behindPgBouncer is a scenario whose consumers reach the database through
// dev/pgbouncer.sh.
func behindPgBouncer(t *testing.T, name string, m mode) *scenario {
	s := newScenario(t, name, 6)
	s.mode = m
	s.requireDevService("pgbouncer")
	s.consumerDB = os.Getenv("ONCE_PGBOUNCER_URL")
	return s
}

// guidesProducer publishes events with the guide's own Python producer
// (strings, then numbers, as amounts; dupRate of them re-published), runs
// during while both groups work on them, and verifies. Every event must be
// processed by both groups and none dead-lettered.
func (s *scenario) guidesProducer(asStrings, asNumbers int, dupRate string, during func()) {
	t := s.t
	t.Helper()
	python, dir := seedpeer(t)
	s.startProvider(s.providerFlags...)
	customers := make([]int64, 97) // produce.py's customer ids: 1 + order_id % 97
	for i := range customers {
		customers[i] = int64(i + 1)
	}
	s.useCustomers(customers)
	a, b := s.consumer("consumer-a"), s.consumer("consumer-b")

	var want []produced
	firstOrder := 1_000_000_000 + rand.Int64N(1<<50)
	for _, run := range []struct {
		format string
		n      int
	}{{"seed", asStrings}, {"seed-number", asNumbers}} {
		cmd := exec.Command(python, filepath.Join(dir, "produce.py"), "--brokers", s.brokers[0], "--topic", s.topic,
			"-n", strconv.Itoa(run.n), "--dup-rate", dupRate, "--first-order", strconv.FormatInt(firstOrder, 10), "--format", run.format)
		firstOrder += int64(run.n)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("produce.py --format %s: %v\n%s", run.format, err, stderrOf(err))
		}
		var p produced
		if err := json.Unmarshal(out, &p); err != nil {
			t.Fatalf("produce.py printed %q: %v", out, err)
		}
		want = append(want, p)
	}
	if during != nil {
		during()
	}

	// What the Python side published, read back and decoded by our contract:
	// the scenario's events, for the checks.
	all := 0
	total := decimal.Zero
	for _, p := range want {
		all += p.Produced
		total = total.Add(decimal.RequireFromString(p.Total))
	}
	seen := map[string]bool{}
	for _, m := range s.readTopic(all) {
		ev, err := orderevents.DecodeConfirmed(m.Value)
		if err != nil {
			t.Fatalf("our decoder refuses what pydantic wrote: %v\n%s", err, m.Value)
		}
		if !seen[ev.EventID().String()] {
			seen[ev.EventID().String()] = true
			s.events = append(s.events, ev)
		}
	}
	sum := decimal.Zero
	for _, ev := range s.events {
		sum = sum.Add(ev.TotalAmount())
	}
	if len(s.events) != want[0].Distinct+want[1].Distinct || !sum.Equal(total) {
		t.Fatalf("read %d distinct events totalling %s; produce.py says %d totalling %s",
			len(s.events), sum, want[0].Distinct+want[1].Distinct, total)
	}
	s.verify(180 * time.Second)

	o := s.readOutcomes()
	for _, g := range []string{s.group(billingGroup), s.group(analyticsGroup)} {
		if n := o.byTopic[g+"|"+s.topic+"|processed"]; n != len(s.events) {
			// Under a fault, a commit that took effect may have lost its
			// answer (the connection cut under it): the next attempt finds
			// the claim and skips the event. Every other event was processed.
			processed, skipped := map[string]bool{}, map[string]bool{}
			for _, id := range o.ids[g]["processed"] {
				processed[id] = true
			}
			for _, id := range o.ids[g]["duplicate"] {
				skipped[id] = true
			}
			lostAnswers := 0
			for _, ev := range s.events {
				id := ev.EventID().String()
				if !processed[id] && skipped[id] && during != nil {
					lostAnswers++
				}
			}
			if n+lostAnswers != len(s.events) {
				t.Errorf("%s processed %d of the guide's events (and %d whose commit's answer the fault cut), want %d", g, n, lostAnswers, len(s.events))
			} else {
				t.Logf("%s: %d commits took effect although their answer was lost to the fault; their next attempts skipped the events", g, lostAnswers)
			}
		}
		// At least what produce.py re-published; a rebalance while the
		// consumers joined may redeliver more.
		if d := o.byTopic[g+"|"+s.topic+"|duplicate"]; d < all-len(s.events) {
			t.Errorf("%s skipped %d duplicates, want at least %d (produce.py re-published that many)", g, d, all-len(s.events))
		}
	}
	if n := o.deadLettered(); n != 0 {
		t.Errorf("%d messages dead-lettered; the guide's events must all be accepted", n)
	}
	a.stop(t)
	b.stop(t)
}

// readTopic reads n messages of the scenario's topic, from every partition.
func (s *scenario) readTopic(n int) []*sarama.ConsumerMessage {
	s.t.Helper()
	c, err := sarama.NewConsumer(s.brokers, nil)
	if err != nil {
		s.t.Fatal(err)
	}
	defer c.Close()
	partitions, err := c.Partitions(s.topic)
	if err != nil {
		s.t.Fatal(err)
	}
	msgs := make(chan *sarama.ConsumerMessage)
	for _, p := range partitions {
		pc, err := c.ConsumePartition(s.topic, p, sarama.OffsetOldest)
		if err != nil {
			s.t.Fatal(err)
		}
		defer pc.Close()
		go func() {
			for m := range pc.Messages() {
				msgs <- m
			}
		}()
	}
	var out []*sarama.ConsumerMessage
	for len(out) < n {
		select {
		case m := <-msgs:
			out = append(out, m)
		case <-time.After(30 * time.Second):
			s.t.Fatalf("read %d of %d messages from %s", len(out), n, s.topic)
		}
	}
	return out
}

func stderrOf(err error) string {
	if ee, ok := err.(*exec.ExitError); ok {
		return string(ee.Stderr)
	}
	return ""
}
