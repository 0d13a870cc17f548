package main

import (
	"encoding/json"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/once-dev/once/metrics"
)

// namesRecorder is a registry that remembers the names of what it registers.
type namesRecorder struct {
	*prometheus.Registry
	names map[string]bool
}

var fqName = regexp.MustCompile(`fqName: "([a-z_:]+)"`)

func (r namesRecorder) Register(c prometheus.Collector) error {
	ch := make(chan *prometheus.Desc, 64)
	go func() { c.Describe(ch); close(ch) }()
	for d := range ch {
		if m := fqName.FindStringSubmatch(d.String()); m != nil {
			r.names[m[1]] = true
		}
	}
	return r.Registry.Register(c)
}

func (r namesRecorder) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}

// exportedNames are the metric names a serving process exports: once's,
// the payment client's and Watermill's.
func exportedNames(t *testing.T) map[string]bool {
	t.Helper()
	o, err := newOps(opsSettings{})
	if err != nil {
		t.Fatal(err)
	}
	rec := namesRecorder{Registry: prometheus.NewRegistry(), names: map[string]bool{}}
	if _, err = metrics.New(rec); err != nil {
		t.Fatal(err)
	}
	rec.MustRegister(o.payments, o.payTime)
	// Watermill registers its collectors when a handler is decorated; its
	// names are fixed in its source (components/metrics).
	for _, n := range []string{"once_watermill_handler_execution_time_seconds", "once_watermill_subscriber_messages_received_total", "once_watermill_publish_time_seconds"} {
		rec.names[n] = true
	}
	return rec.names
}

var metricRef = regexp.MustCompile(`\bonce_[a-z_]+`)

// used lists the once_ metrics an expression names, without the series
// suffixes of histograms.
func used(expr string) []string {
	var out []string
	for _, m := range metricRef.FindAllString(expr, -1) {
		for _, suffix := range []string{"_bucket", "_sum", "_count"} {
			if strings.HasSuffix(m, suffix) && !strings.HasSuffix(m, "_total") {
				m = strings.TrimSuffix(m, suffix)
			}
		}
		out = append(out, m)
	}
	return out
}

// The dashboard loads as Grafana JSON, every panel queries, every metric it
// and the alert rules name is one the process exports, and every metric of
// once's own is on the dashboard.
func TestDashboardAndRulesUseExportedMetrics(t *testing.T) {
	exported := exportedNames(t)
	raw, err := os.ReadFile("../../ops/grafana/once-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Title  string `json:"title"`
		UID    string `json:"uid"`
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatalf("dashboard: %v", err)
	}
	if dash.Title == "" || dash.UID == "" || len(dash.Panels) < 10 {
		t.Fatalf("dashboard: title %q uid %q, %d panels", dash.Title, dash.UID, len(dash.Panels))
	}
	onDashboard := map[string]bool{}
	for _, p := range dash.Panels {
		if len(p.Targets) == 0 {
			t.Errorf("panel %q queries nothing", p.Title)
		}
		for _, tg := range p.Targets {
			names := used(tg.Expr)
			if len(names) == 0 {
				t.Errorf("panel %q: %q names no once metric", p.Title, tg.Expr)
			}
			for _, n := range names {
				onDashboard[n] = true
				if !exported[n] {
					t.Errorf("panel %q: %s is not exported", p.Title, n)
				}
			}
		}
	}
	for n := range exported {
		if strings.HasPrefix(n, "once_") && !strings.HasPrefix(n, "once_watermill_") && !onDashboard[n] {
			t.Errorf("%s is exported but on no panel", n)
		}
	}
	rules, err := os.ReadFile("../../ops/prometheus/once.rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	inRules := used(string(rules))
	if len(inRules) == 0 {
		t.Fatal("the rules name no metric")
	}
	for _, n := range inRules {
		if !exported[n] {
			t.Errorf("rules: %s is not exported", n)
		}
	}
	if !slices.Contains(inRules, "once_consumer_lag") {
		t.Error("no rule watches the lag")
	}
}

// The alert rules are valid and pass their unit tests (promtool, from
// Debian's prometheus package; dev/promtool.sh fetches it).
func TestAlertRules(t *testing.T) {
	out, err := exec.Command("../../dev/promtool.sh").Output()
	promtool := strings.TrimSpace(string(out))
	if err != nil || promtool == "" {
		if os.Getenv("ONCE_REQUIRE_SERVICES") != "" {
			t.Fatalf("no promtool: %v", err)
		}
		t.Skipf("no promtool: %v", err)
	}
	for _, args := range [][]string{{"check", "rules", "once.rules.yml"}, {"test", "rules", "once.rules.test.yml"}} {
		cmd := exec.Command(promtool, args...)
		cmd.Dir = "../../ops/prometheus"
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		if !strings.Contains(string(out), "SUCCESS") {
			t.Fatalf("promtool %s said no SUCCESS:\n%s", strings.Join(args, " "), out)
		}
	}
}

// The console shows payloads: it is refused on an ops listener another
// host can reach, naming both settings.
func TestTheConsoleNeedsALoopbackOpsListener(t *testing.T) {
	for listen, ok := range map[string]bool{"127.0.0.1:9464": true, "localhost:9464": true, "[::1]:9464": true, "0.0.0.0:9464": false, ":9464": false} {
		err := (&opsSettings{OpsListen: listen, WatchInterval: time.Second, BrokerTimeout: 15 * time.Second, Console: true}).Validate()
		if ok != (err == nil) || (err != nil && (!strings.Contains(err.Error(), "--console (ONCE_CONSOLE)") || !strings.Contains(err.Error(), "--ops-listen (ONCE_OPS_LISTEN)"))) {
			t.Errorf("--console with --ops-listen %s: %v", listen, err)
		}
	}
}
