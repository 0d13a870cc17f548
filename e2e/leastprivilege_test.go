package e2e

import (
	"bufio"
	"context"
	"fmt"
	"math"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/internal/testenv"
)

// 24. Least privilege, a database per group: the reference service set up
// as docs/operating.md's section "Least privilege" says, step by step (the
// steps are numbered as there): 1. a database for billing and one for
// analytics; 2. the owner runs app migrate with --group-database; 3. login
// roles billing_svc and analytics_svc granted their group roles; 4. each
// group's app serve under its login role, on its database, through
// PgBouncer, with --no-migrate and --maintenance-interval 0; 5. app
// maintain, the only retention, as the owner with --metrics-file (twice, as
// cron ticks); 6. Forget under billing_svc. The order service's load; 0
// double charges, 0 lost. At the end the services' /metrics and maintain's
// file are evaluated by the alert rules (promtool test rules): none fires;
// and, the control, without maintain's file OnceRetentionFailing does.
func TestLeastPrivilegeDatabasePerGroup(t *testing.T) {
	s := newScenario(t, "24 least privilege, a database per group", 6)
	ctx := context.Background()
	// Login roles the development cluster trusts and its PgBouncer admits
	// (dev/pgbouncer.sh lists billing_svc and analytics_svc).
	s.requireDevService("postgres")
	s.requireDevService("pgbouncer")
	owner := os.Getenv("DATABASE_URL")
	bouncer := testenv.Where{Pooled: true, Mode: pgx.QueryExecModeExec}.URL(t)
	promtool := promtoolPath(t)

	// 1. Databases (this row's own names; the cluster's superuser "once"
	// stands for once_owner).
	names := map[string]string{billingGroup: "once_e2e_billing", analyticsGroup: "once_e2e_analytics"}
	s.dbs = map[string]*pgxpool.Pool{billingGroup: testenv.OtherPostgres(t, names[billingGroup]), analyticsGroup: testenv.OtherPostgres(t, names[analyticsGroup])}
	groupDBs := "billing=" + testenv.URLAs(owner, "once", names[billingGroup]) + ";analytics=" + testenv.URLAs(owner, "once", names[analyticsGroup])

	// 2. The owner migrates every database.
	s.runToEnd("migrate", []string{"DATABASE_URL=" + owner}, "migrate", "--group-database", groupDBs)

	// 3. Login roles, granted their group roles.
	testenv.LoginRole(t, s.pool, "billing_svc", "once_billing")
	testenv.LoginRole(t, s.pool, "analytics_svc", "once_analytics")

	// 4. Services under their roles, through PgBouncer, migrating nothing,
	// no retention of their own.
	s.startProvider()
	orders := s.startOrders()
	billing := s.serveAs("billing", testenv.URLAs(bouncer, "billing_svc", names[billingGroup]))
	analytics := s.serveAs("analytics", testenv.URLAs(bouncer, "analytics_svc", names[analyticsGroup]))

	// 5. app maintain as the cron job: a tick during the load, one after.
	metricsFile := filepath.Join(s.dir, "once_maintain.prom")
	maintain := func() {
		s.runToEnd("maintain", []string{"DATABASE_URL=" + owner}, "maintain", "--group-database", groupDBs, "--metrics-file", metricsFile)
	}
	n := scale(200)
	for i := range n {
		s.placeOrder(orders, decimal.New(int64(100+i*37%9000), -2))
		if i == n/2 {
			maintain()
		}
		time.Sleep(10 * time.Millisecond)
	}
	s.verify(120 * time.Second)
	maintain()
	// Claims landed in today's partition, which migrate made, not in the
	// default one.
	for g, db := range s.dbs {
		var inDefault int
		if err := db.QueryRow(ctx, `SELECT count(*) FROM processed_event_default WHERE consumer_group = $1`, s.group(g)).Scan(&inDefault); err != nil || inDefault != 0 {
			t.Errorf("%s: %d claims in the default partition (%v); want them in the daily partitions app migrate made", g, inDefault, err)
		}
	}

	// 6. Forget, under the group's own role.
	var claimed uuid.UUID
	if err := s.dbOf(billingGroup).QueryRow(ctx, `SELECT event_id FROM processed_event WHERE consumer_group = $1 LIMIT 1`, s.group(billingGroup)).Scan(&claimed); err != nil {
		t.Fatal(err)
	}
	s.runToEnd("forget", []string{"DATABASE_URL=" + testenv.URLAs(bouncer, "billing_svc", names[billingGroup])},
		"inbox", "forget", claimed.String(), "--group", s.group(billingGroup), "--force")

	// The alerts over what Prometheus would scrape: the services' /metrics,
	// read after two of their watch passes over the drained groups, and
	// maintain's file (node_exporter's textfile collector).
	time.Sleep(2 * watchInterval)
	scraped := map[string]string{"billing": scrape(t, billing), "analytics": scrape(t, analytics)}
	file, err := os.ReadFile(metricsFile)
	if err != nil {
		t.Fatal(err)
	}
	rules := filepath.Join(repoRoot, "ops", "prometheus", "once.rules.yml")
	test := alertTest(t, rules, scraped, string(file), time.Now())
	path := filepath.Join(s.dir, "alerts.test.yml")
	if err := os.WriteFile(path, []byte(test), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(promtool, "test", "rules", path).CombinedOutput(); err != nil {
		t.Errorf("promtool test rules over the scraped metrics (%s): %v\n%s", path, err, out)
	}
	s.stillRunning(billing, analytics, orders)
}

// watchInterval is the services' --watch-interval: their lag and joined
// gauges follow the groups within it.
const watchInterval = time.Second

// serveAs starts app serve for one group, as step 4 of "Least privilege"
// has it, with the scenario's isolation flags.
func (s *scenario) serveAs(group, databaseURL string) *proc {
	s.t.Helper()
	p := s.startEnv(group, []string{"DATABASE_URL=" + databaseURL, "PAYMENT_API_KEY=" + s.account},
		"serve", "--groups", group, "--no-migrate", "--maintenance-interval", "0",
		"--topic-suffix", s.suffix, "--group-suffix", s.suffix, "--partitions", fmt.Sprint(s.parts), "--payment-url", s.paymentURL(),
		"--session-timeout", "6s", "--ops-listen", "127.0.0.1:0", "--watch-interval", watchInterval.String(), "--log-level", "debug", "--log-format", "json")
	return p
}

// runToEnd runs an app command and fails the test unless it exits 0.
func (s *scenario) runToEnd(name string, env []string, args ...string) {
	s.t.Helper()
	p := s.startEnv(name, env, args...)
	select {
	case <-p.done:
	case <-time.After(2 * time.Minute):
		p.kill()
	}
	if p.err != nil {
		s.t.Fatalf("app %s: %v\n%s", strings.Join(args, " "), p.err, tail(p.log, 30))
	}
}

// scrape reads p's /metrics once its operations endpoint is up.
func scrape(t *testing.T, p *proc) string {
	t.Helper()
	var url string
	for _, l := range logLinesOf(p, "operations endpoint") {
		url = field(l, "metrics")
	}
	if url == "" {
		t.Fatalf("%s logged no operations endpoint: %s", p.name, tail(p.log, 20))
	}
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var b strings.Builder
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		b.WriteString(sc.Text() + "\n")
	}
	return b.String()
}

// evalAt is when promtool evaluates the rules: the scrape's moment on the
// test's own timeline, which starts at 0, four hours after it began.
const evalAt = 4 * time.Hour

// alertTest is a promtool rule test of rules over the scraped samples, each
// held from the timeline's start to evalAt: no alert of rules may fire.
// Timestamps (…_timestamp_seconds) move with the timeline, scrapedAt to
// evalAt; 0 (never) stays 0. A second group, the control, has the
// services' samples alone: OnceRetentionFailing must fire, four hours
// after the timeline's start, so that the first group's silence is
// maintain's file's doing.
func alertTest(t *testing.T, rules string, services map[string]string, maintain string, scrapedAt time.Time) string {
	t.Helper()
	b, err := os.ReadFile(rules)
	if err != nil {
		t.Fatal(err)
	}
	var alerts []string
	for _, m := range regexp.MustCompile(`(?m)^\s*- alert: (\S+)`).FindAllStringSubmatch(string(b), -1) {
		alerts = append(alerts, m[1])
	}
	if len(alerts) == 0 {
		t.Fatalf("no alert in %s", rules)
	}
	steps := int(evalAt / time.Minute)
	series := func(instance, text string) []string {
		var out []string
		for _, line := range strings.Split(text, "\n") {
			if line == "" || strings.HasPrefix(line, "#") {
				continue
			}
			i := strings.LastIndexByte(line, ' ')
			name, value := line[:i], line[i+1:]
			v, err := strconv.ParseFloat(value, 64)
			if err != nil || math.IsNaN(v) || math.IsInf(v, 0) {
				continue
			}
			metric, labels, _ := strings.Cut(name, "{")
			if strings.HasSuffix(metric, "_timestamp_seconds") && v > 0 {
				v = v - float64(scrapedAt.UnixNano())/1e9 + evalAt.Seconds()
			}
			labels = strings.TrimSuffix(labels, "}")
			if labels != "" {
				labels += ","
			}
			sel := fmt.Sprintf(`%s{%sinstance="%s"}`, metric, labels, instance)
			out = append(out, fmt.Sprintf("      - series: '%s'\n        values: '%s+0x%d'\n",
				strings.ReplaceAll(sel, "'", "''"), strconv.FormatFloat(v, 'f', -1, 64), steps))
		}
		return out
	}
	var all, servicesOnly []string
	for _, instance := range sortedKeys(services) {
		servicesOnly = append(servicesOnly, series(instance, services[instance])...)
	}
	all = append(append(all, servicesOnly...), series("maintain", maintain)...)
	if len(series("maintain", maintain)) != 1 {
		t.Fatalf("maintain's file holds no last success:\n%s", maintain)
	}
	var w strings.Builder
	fmt.Fprintf(&w, "rule_files:\n  - %s\nevaluation_interval: 1m\ntests:\n", rules)
	fmt.Fprintf(&w, "  - name: the least-privilege row's metrics fire no alert\n    interval: 1m\n    input_series:\n%s    alert_rule_test:\n", strings.Join(all, ""))
	for _, a := range alerts {
		fmt.Fprintf(&w, "      - eval_time: %s\n        alertname: %s\n        exp_alerts: []\n", promDuration(evalAt), a)
	}
	fmt.Fprintf(&w, "  - name: without maintain's file the retention alert fires\n    interval: 1m\n    input_series:\n%s    alert_rule_test:\n", strings.Join(servicesOnly, ""))
	fmt.Fprintf(&w, "      - eval_time: %s\n        alertname: OnceRetentionFailing\n        exp_alerts:\n          - exp_labels: {severity: warning}\n"+
		"            exp_annotations:\n              summary: \"no retention pass succeeded for 4h 0m 0s\"\n", promDuration(evalAt))
	return w.String()
}

func promDuration(d time.Duration) string { return fmt.Sprintf("%dm", int(d/time.Minute)) }

func sortedKeys(m map[string]string) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// promtoolPath is dev/promtool.sh's promtool (the one on PATH, or Debian's
// unpacked into .dev).
func promtoolPath(t *testing.T) string {
	t.Helper()
	out, err := exec.Command(filepath.Join(repoRoot, "dev", "promtool.sh")).Output()
	p := strings.TrimSpace(string(out))
	if err != nil || p == "" {
		t.Fatalf("no promtool (dev/promtool.sh): %v", err)
	}
	return p
}
