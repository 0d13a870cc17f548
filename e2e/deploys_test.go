package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/internal/testenv"
)

// Rows 21 to 23: deploys under load, as Kubernetes makes them (issue 30):
// a rolling restart of three instances, a kill -9 with an immediate
// restart, a scale-out from one instance to three and back. Each runs with
// static membership (every instance under an --instance-id of its own that
// survives its restarts, the session timeout docs/operating.md recommends
// for it) in key order and batched, and without it (no --instance-id,
// serve's default session timeout) in key order, side by side. The order
// service places orders at a steady rate through its outbox, the provider
// takes 20 ms a charge, the topics have twelve partitions. Every row ends
// with the usual invariants (none charged twice, none lost) and measures,
// from the claims' own times, how long its partitions waited (deployFigures):
// the figures are printed, not asserted (a performance target is reported,
// not a test's pass or fail), but the row fails unless they were taken.

const (
	// staticSessionTimeout and staticHeartbeat are what docs/operating.md
	// recommends with --instance-id: a session that covers a restart
	// (45s, Kafka's own client default since 3.0), and a heartbeat set
	// apart from it, short, since a member learns of a rebalance (an
	// instance added or removed) only at its next heartbeat.
	staticSessionTimeout = "45s"
	staticHeartbeat      = "1s"
	// dynamicSessionTimeout is serve's default, as a team runs without
	// --instance-id (the figures of main were taken with it).
	dynamicSessionTimeout = "10s"

	deployPartitions = 12
	// orderRate is the order service's orders per second during a row.
	orderRate = 40
	// warmUp is the steady load before a row's first fault, and after its
	// last.
	warmUp = 3 * time.Second
)

// membership is how a row's instances are members of their groups.
type membership struct {
	name   string
	static bool
}

var (
	static  = membership{"static", true}
	dynamic = membership{"dynamic", false}
)

// deployRows runs a deploy row with static membership in key order and
// batched, and without it in key order.
func deployRows(t *testing.T, run func(t *testing.T, m mode, ms membership)) {
	for _, c := range []struct {
		ms membership
		m  mode
	}{{static, keyOrder}, {static, batched}, {dynamic, keyOrder}} {
		t.Run(c.ms.name+"/"+strings.ReplaceAll(c.m.name, " ", "-"), func(t *testing.T) { run(t, c.m, c.ms) })
	}
}

// deploy is a deploy row's scenario: the order service, its instances by
// name, the load.
type deploy struct {
	*scenario
	ms      membership
	orders  *proc
	members map[string]*proc
	// faultAt ends the steady load before the first fault, whose gaps
	// are the normal ones.
	faultAt time.Time
}

func newDeploy(t *testing.T, name string, m mode, ms membership) *deploy {
	s := newScenario(t, name+", "+ms.name, deployPartitions)
	s.mode = m
	s.sessionTimeout = dynamicSessionTimeout
	if ms.static {
		s.sessionTimeout = staticSessionTimeout
	}
	s.logCalls() // counts the provider's 409s, and checks the order of the calls
	s.startProvider("--fault-latency", "20ms")
	d := &deploy{scenario: s, ms: ms, members: map[string]*proc{}}
	d.orders = s.startOrders()
	return d
}

// member starts the instance name (again), under its own identity if the
// row's members are static.
func (d *deploy) member(name string) *proc {
	d.t.Helper()
	var extra []string
	if d.ms.static {
		extra = []string{"--instance-id", name, "--heartbeat-interval", staticHeartbeat}
	}
	p := d.consumer(name, extra...)
	d.members[name] = p
	return p
}

// load places orders at orderRate, in bursts of ten (so that a partition
// has several waiting at once, and key order runs some side by side),
// until the returned function is called.
func (d *deploy) load() (stop func()) {
	done, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		tick := time.NewTicker(10 * time.Second / orderRate)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-done:
				return
			case <-tick.C:
			}
			for j := range 10 {
				d.placeOrder(d.orders, decimal.New(int64(100+(i*10+j)*13%9000), -2))
			}
		}
	}()
	var once sync.Once
	stop = func() { once.Do(func() { close(done); <-stopped }) }
	// A row that fails while the load runs kills its processes in the
	// scenario's cleanup; the load must stop first, or its next order, to
	// a service gone, fails a finished test (a panic that ends the whole
	// binary and hides the row's own failure). Cleanups run last added
	// first: this one before the scenario's.
	d.t.Cleanup(stop)
	return stop
}

// fault marks the end of the row's steady load: its first fault comes now.
func (d *deploy) fault() { d.faultAt = time.Now() }

// stable waits until the latest sessions of procs, in both groups, are of
// one generation and own every partition of the confirmations between
// them, each some; it returns each group's generation.
func (d *deploy) stable(procs ...*proc) map[string]float64 {
	d.t.Helper()
	gen := map[string]float64{}
	for _, g := range []string{billingGroup, analyticsGroup} {
		group := d.group(g)
		testenv.Eventually(d.t, 90*time.Second, fmt.Sprintf("%d instances share the partitions of %s", len(procs), group), func() bool {
			owned, gens := 0, map[float64]bool{}
			for _, p := range procs {
				ss := d.sessions(p, group)
				if len(ss) == 0 || len(ss[len(ss)-1].partitions) == 0 {
					return false
				}
				owned += len(ss[len(ss)-1].partitions)
				gens[ss[len(ss)-1].generation] = true
			}
			if len(gens) == 1 {
				for n := range gens {
					gen[g] = n
				}
			}
			return len(gens) == 1 && owned == int(d.parts)
		})
	}
	return gen
}

// sessionTimeoutOf is the session timeout the row's instances run with.
func sessionTimeoutOf(d *deploy) time.Duration {
	timeout, err := time.ParseDuration(d.sessionTimeout)
	if err != nil {
		d.t.Fatal(err)
	}
	return timeout
}

// ready waits until p's /readyz answers 200 (every group joined), as
// Kubernetes waits for a pod's readiness before it restarts the next.
func (d *deploy) ready(p *proc) {
	d.t.Helper()
	var url string
	testenv.Eventually(d.t, 60*time.Second, p.name+"'s operations endpoint answers /readyz", func() bool {
		if !p.running() {
			d.t.Fatalf("%s exited: %s", p.name, tail(p.log, 20))
		}
		if url == "" {
			for _, l := range logLinesOf(p, "operations endpoint") {
				url = strings.TrimSuffix(field(l, "metrics"), "/metrics") + "/readyz"
			}
			if url == "" {
				return false
			}
		}
		resp, err := http.Get(url)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
}

// sessionBegan is when p's first session of group began, by its log.
func (d *deploy) sessionBegan(p *proc, group string) time.Time {
	d.t.Helper()
	for _, l := range logLinesOf(p, "kafka: session began") {
		var line struct {
			Time  time.Time `json:"time"`
			Group string    `json:"consumer_group"`
		}
		if json.Unmarshal([]byte(l), &line) == nil && line.Group == group {
			return line.Time
		}
	}
	d.t.Fatalf("%s's log has no session of %s", p.name, group)
	return time.Time{}
}

// rebalances counts the generations of group's sessions after gen, over
// every process of the row.
func (d *deploy) rebalances(group string, gen float64) int {
	seen := map[float64]bool{}
	for _, p := range d.procs {
		for _, sess := range d.sessions(p, d.group(group)) {
			if sess.generation > gen {
				seen[sess.generation] = true
			}
		}
	}
	return len(seen)
}

// logLinesOf are the lines of p's log that contain text.
func logLinesOf(p *proc, text string) []string {
	var out []string
	b, _ := os.ReadFile(p.log)
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, text) {
			out = append(out, l)
		}
	}
	return out
}

// finish stops the load, waits for the groups to drain, takes the row's
// figures and verifies the invariants. kill, if any, is the member killed.
// A restart under the same identity within the session timeout is no
// rebalance (static members), without one it is (the comparison staged
// what it says): unless the row scales, finish checks which it was.
func (d *deploy) finish(stopLoad func(), gen map[string]float64, kill *killed, scales bool) {
	d.t.Helper()
	stopLoad()
	d.waitDrained(180 * time.Second)
	f := d.measure(kill)
	f.rebalances = d.rebalances(billingGroup, gen[billingGroup])
	if n := d.rebalances(analyticsGroup, gen[analyticsGroup]); !scales && d.ms.static && n > 0 {
		d.t.Errorf("%d rebalances of %s while static members restarted within the session timeout; want none", n, d.group(analyticsGroup))
	}
	d.rebal = f.rebalances
	d.gaps = f
	d.verify(180 * time.Second)
	switch {
	case scales && f.rebalances < 2:
		d.t.Errorf("%d rebalances of %s seen; want at least 2 (the instances joining, then leaving)", f.rebalances, d.group(billingGroup))
	case !scales && d.ms.static && f.rebalances > 0:
		d.t.Errorf("%d rebalances of %s while static members restarted within the session timeout; want none", f.rebalances, d.group(billingGroup))
	case !scales && !d.ms.static && f.rebalances == 0:
		d.t.Errorf("no rebalance of %s while dynamic members restarted: the comparison did not stage what it says", d.group(billingGroup))
	}
	d.t.Logf("%s: %s", d.row(), f)
}

// 21. A rolling restart of three instances under load, as a Kubernetes
// rollout makes it: each in turn gets SIGTERM (and must exit 0), is started
// again under its own name, and the next waits until it is ready.
func TestRollingRestart(t *testing.T) {
	deployRows(t, func(t *testing.T, m mode, ms membership) {
		d := newDeploy(t, "21 rolling restart of 3", m, ms)
		names := []string{"consumer-0", "consumer-1", "consumer-2"}
		var procs []*proc
		for _, n := range names {
			procs = append(procs, d.member(n))
		}
		gen := d.stable(procs...)
		stop := d.load()
		time.Sleep(warmUp)
		d.fault()
		for _, n := range names {
			d.members[n].stop(t)
			d.ready(d.member(n))
			d.restarts++
		}
		procs = procs[:0]
		for _, n := range names {
			procs = append(procs, d.members[n])
		}
		d.stable(procs...)
		time.Sleep(warmUp)
		d.finish(stop, gen, nil, false)
	})
}

// killed is a member killed with -9 and started again: when, the
// partitions of the confirmations it owned in each group, and when the new
// process's sessions began.
type killed struct {
	at         time.Time
	partitions map[string][]int32 // by group
	rejoined   map[string]time.Time
}

// 22. kill -9 of one of three instances under load and its immediate
// restart under the same name, as a container's restart makes it.
func TestKillAndRestart(t *testing.T) {
	deployRows(t, func(t *testing.T, m mode, ms membership) {
		d := newDeploy(t, "22 kill -9 and restart", m, ms)
		procs := []*proc{d.member("consumer-0"), d.member("consumer-1"), d.member("consumer-2")}
		gen := d.stable(procs...)
		stop := d.load()
		time.Sleep(warmUp)
		victim := procs[1]
		k := &killed{partitions: map[string][]int32{}, rejoined: map[string]time.Time{}}
		for _, g := range []string{billingGroup, analyticsGroup} {
			ss := d.sessions(victim, d.group(g))
			k.partitions[g] = ss[len(ss)-1].partitions
		}
		d.fault()
		k.at = time.Now()
		victim.kill()
		d.kills++
		again := d.member(victim.name)
		d.restarts++
		d.ready(again)
		for _, g := range []string{billingGroup, analyticsGroup} {
			k.rejoined[g] = d.sessionBegan(again, d.group(g))
		}
		d.stable(procs[0], again, procs[2])
		time.Sleep(warmUp)
		d.finish(stop, gen, k, false)
	})
}

// 23. A group scaled out from one instance to three under load, and back
// to one: the two that leave get SIGTERM (and must exit 0); static members
// send no LeaveGroup, so they are then removed from both groups with app
// group remove-member, as docs/operating.md says to do after scaling in.
func TestScaleOutAndIn(t *testing.T) {
	deployRows(t, func(t *testing.T, m mode, ms membership) {
		d := newDeploy(t, "23 scale-out 1-3-1", m, ms)
		first := d.member("consumer-0")
		gen := d.stable(first)
		stop := d.load()
		time.Sleep(warmUp)
		d.fault()
		more := []*proc{d.member("consumer-1"), d.member("consumer-2")}
		d.stable(first, more[0], more[1])
		time.Sleep(warmUp)
		var wg sync.WaitGroup
		for _, p := range more {
			wg.Add(1)
			go func() { defer wg.Done(); p.stop(t) }()
		}
		wg.Wait()
		left := time.Now()
		if ms.static {
			for _, g := range []string{billingGroup, analyticsGroup} {
				rm := d.start("remove-member", "group", "remove-member", "--group", g, "--group-suffix", d.suffix,
					"--instance-id", more[0].name+","+more[1].name)
				<-rm.done
				if rm.err != nil {
					t.Fatalf("app group remove-member --group %s: %v\n%s", g, rm.err, tail(rm.log, 20))
				}
			}
		}
		d.stable(first)
		// Removed, the static members' partitions move at once; not
		// removed, only when their sessions expire: the remaining member
		// must have them well before that.
		if took, timeout := time.Since(left), sessionTimeoutOf(d); ms.static && took >= timeout/2 {
			t.Errorf("the remaining member had every partition %s after the others left; removed from the groups, they should have moved within a heartbeat or two, not near the session timeout (%s)", took.Round(time.Millisecond), timeout)
		}
		time.Sleep(warmUp)
		d.finish(stop, gen, nil, true)
	})
}

// claimed is one confirmation as a group saw it: the partition it was
// published to, when (its first copy's Kafka timestamp), and when the
// group claimed it (its claim's processed_at).
type claimed struct {
	partition          int32
	published, claimed time.Time
}

// published is where and when a confirmation was published (its first
// copy), read from the topic itself.
type published struct {
	partition int32
	at        time.Time
}

func (s *scenario) publishedConfirmations() map[uuid.UUID]published {
	s.t.Helper()
	placed := map[uuid.UUID]published{}
	for _, m := range testenv.ReadTopic(s.t, s.brokers, s.topic) {
		var ev struct {
			ID uuid.UUID `json:"event_id"`
		}
		if json.Unmarshal(m.Value, &ev) != nil {
			continue
		}
		if w, ok := placed[ev.ID]; !ok || m.Timestamp.Before(w.at) {
			placed[ev.ID] = published{m.Partition, m.Timestamp}
		}
	}
	return placed
}

// claimsOf reads group's claims of the confirmations placed.
func (s *scenario) claimsOf(group string, placed map[uuid.UUID]published) []claimed {
	s.t.Helper()
	ids := make([]uuid.UUID, 0, len(placed))
	for id := range placed {
		ids = append(ids, id)
	}
	rows, err := s.pool.Query(context.Background(), `SELECT event_id, processed_at FROM processed_event WHERE consumer_group = $1 AND event_id = ANY($2)`,
		s.group(group), ids)
	if err != nil {
		s.t.Fatal(err)
	}
	defer rows.Close()
	var out []claimed
	for rows.Next() {
		var id uuid.UUID
		var at time.Time
		if err := rows.Scan(&id, &at); err != nil {
			s.t.Fatal(err)
		}
		out = append(out, claimed{partition: placed[id].partition, published: placed[id].at, claimed: at})
	}
	if err := rows.Err(); err != nil {
		s.t.Fatal(err)
	}
	return out
}

// gap is the waiting part of the time between two consecutive commits of
// claims (of a partition, or of a group): from the later of the first
// commit and the publishing of the earliest event still unclaimed after
// it, to the second commit.
type gap struct {
	partition int32 // -1: the group's, any partition
	from, to  time.Time
}

func (g gap) length() time.Duration { return g.to.Sub(g.from) }

// waitingGaps are the gaps of evs (one partition's, or a group's) during
// which an event waited: between each two consecutive claim times, the
// time an event published before the second, and claimed at it or after,
// waited for it.
func waitingGaps(partition int32, evs []claimed) []gap {
	evs = slices.Clone(evs)
	sort.Slice(evs, func(i, j int) bool { return evs[i].claimed.Before(evs[j].claimed) })
	// earliest[i]: the earliest publish time of evs[i:].
	earliest := make([]time.Time, len(evs)+1)
	for i := len(evs) - 1; i >= 0; i-- {
		earliest[i] = evs[i].published
		if i+1 < len(evs) && earliest[i+1].Before(earliest[i]) {
			earliest[i] = earliest[i+1]
		}
	}
	var out []gap
	for i := 1; i < len(evs); i++ {
		prev, next := evs[i-1].claimed, evs[i].claimed
		if !next.After(prev) {
			continue // one commit (a batch), or two at once
		}
		from := prev
		if earliest[i].After(from) {
			from = earliest[i]
		}
		if next.After(from) {
			out = append(out, gap{partition: partition, from: from, to: next})
		}
	}
	return out
}

// groupGaps are one group's figures of a row.
type groupGaps struct {
	claims, gaps int
	longest      gap           // of any partition
	group        gap           // of the group: no partition committed
	normal       time.Duration // the normal gap (see measure)
	paused       time.Duration // partition-seconds beyond the normal gap
	killed       time.Duration // row 22: the killed member's partitions' longest gap
}

// deployFigures are what a deploy row measured.
type deployFigures struct {
	billing, analytics groupGaps
	restart            time.Duration // row 22: from the kill to the restarted member's billing session
	conflicts          int           // the provider's 409 answers (a key in flight)
	rebalances         int
}

// measure takes the row's figures from the claims (see docs/e2e.md,
// "Gaps"), and fails the test unless they could be taken: every partition
// claimed in both groups, with gaps between its commits.
func (d *deploy) measure(k *killed) *deployFigures {
	d.t.Helper()
	f := &deployFigures{}
	placed := d.publishedConfirmations()
	for _, g := range []struct {
		name string
		out  *groupGaps
	}{{billingGroup, &f.billing}, {analyticsGroup, &f.analytics}} {
		evs := d.claimsOf(g.name, placed)
		byPartition := map[int32][]claimed{}
		for _, e := range evs {
			byPartition[e.partition] = append(byPartition[e.partition], e)
		}
		if len(byPartition) != int(d.parts) {
			d.t.Fatalf("%s claimed confirmations of %d partitions of %d: the gaps cannot be measured", g.name, len(byPartition), d.parts)
		}
		var all []gap
		for p, pe := range byPartition {
			gs := waitingGaps(p, pe)
			if len(gs) == 0 {
				d.t.Fatalf("%s: partition %d has no gap between commits while events waited (%d claims): nothing measured", g.name, p, len(pe))
			}
			all = append(all, gs...)
		}
		out := g.out
		out.claims, out.gaps = len(evs), len(all)
		for _, x := range all {
			if x.to.Before(d.faultAt) {
				out.normal = max(out.normal, x.length())
			}
		}
		if out.normal == 0 {
			d.t.Fatalf("%s: no gap before the first fault: the normal gap was not measured", g.name)
		}
		for _, x := range all {
			if x.length() > out.longest.length() {
				out.longest = x
			}
			out.paused += max(0, x.length()-out.normal)
		}
		if k != nil {
			out.killed = acrossTheKill(all, k.partitions[g.name], k.at)
		}
		for _, x := range waitingGaps(-1, evs) {
			if x.length() > out.group.length() {
				out.group = x
			}
		}
	}
	if k != nil {
		f.restart = k.rejoined[billingGroup].Sub(k.at)
		if len(k.partitions[billingGroup]) == 0 || f.billing.killed == 0 {
			d.t.Fatalf("the killed member owned billing's partitions %v, none of which was claimed after the kill: nothing measured", k.partitions[billingGroup])
		}
	}
	for _, c := range d.calls.snapshot() {
		if c.status == http.StatusConflict {
			f.conflicts++
		}
	}
	return f
}

// acrossTheKill is the longest, over the partitions the killed member
// owned, of the gap that ended at the partition's first commit after the
// kill: what an event of it waited for the restarted member (or for
// whoever took the partition). That gap exists for every such partition
// claimed after the kill, whenever its next event was published: one
// published after the restarted member's session began waited too, if it
// came before the member consumed.
func acrossTheKill(gaps []gap, partitions []int32, kill time.Time) time.Duration {
	var longest time.Duration
	for _, p := range partitions {
		var first *gap
		for i, x := range gaps {
			if x.partition == p && x.to.After(kill) && (first == nil || x.to.Before(first.to)) {
				first = &gaps[i]
			}
		}
		if first != nil {
			longest = max(longest, first.length())
		}
	}
	return longest
}

func secs(d time.Duration) string { return fmt.Sprintf("%.2f", d.Seconds()) }

// columns are the row's figures in the results table: billing's / analytics'.
func (f *deployFigures) columns() (longest, paused string) {
	return secs(f.billing.longest.length()) + "/" + secs(f.analytics.longest.length()),
		fmt.Sprintf("%.1f/%.1f", f.billing.paused.Seconds(), f.analytics.paused.Seconds())
}

func (f *deployFigures) String() string {
	var b strings.Builder
	for _, g := range []struct {
		name string
		g    groupGaps
	}{{"billing", f.billing}, {"analytics", f.analytics}} {
		fmt.Fprintf(&b, "%s: longest gap %s s (partition %d), the group's %s s, paused %.1f partition-s beyond a normal gap of %s s (%d claims, %d gaps)",
			g.name, secs(g.g.longest.length()), g.g.longest.partition, secs(g.g.group.length()), g.g.paused.Seconds(), secs(g.g.normal), g.g.claims, g.g.gaps)
		if f.restart > 0 {
			fmt.Fprintf(&b, ", the killed member's partitions %s s", secs(g.g.killed))
		}
		b.WriteString("; ")
	}
	if f.restart > 0 {
		fmt.Fprintf(&b, "restart %s s (kill to billing's session); ", secs(f.restart))
	}
	fmt.Fprintf(&b, "%d provider 409s, %d rebalances", f.conflicts, f.rebalances)
	return b.String()
}
