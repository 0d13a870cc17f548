package e2e

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"text/tabwriter"

	"github.com/once-dev/once/internal/testenv"
)

var soak = flag.Bool("e2e.soak", os.Getenv("ONCE_E2E_SOAK") != "", "run the longer soak variant of every scenario (or set ONCE_E2E_SOAK=1)")

var (
	appBinary string
	repoRoot  string
)

func TestMain(m *testing.M) {
	flag.Parse()
	if err := testenv.UseOwnDatabase("e2e"); err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		os.Exit(1)
	}
	_, file, _, _ := runtime.Caller(0)
	repoRoot = filepath.Dir(filepath.Dir(file))
	dir, err := os.MkdirTemp("", "once-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	appBinary = filepath.Join(dir, "app")
	if os.Getenv("DATABASE_URL") != "" && os.Getenv("KAFKA_BROKERS") != "" {
		build := exec.Command("go", "build", "-o", appBinary, "./cmd/app")
		build.Dir, build.Stdout, build.Stderr = repoRoot, os.Stderr, os.Stderr
		if err := build.Run(); err != nil {
			fmt.Fprintln(os.Stderr, "e2e: build app:", err)
			os.Exit(1)
		}
	}
	code := m.Run()
	printResults()
	os.RemoveAll(dir)
	os.Exit(code)
}

// result is one row of the table the suite prints.
type result struct {
	Scenario               string
	Events                 int
	Deliveries             int
	Duplicates             int
	Kills, Restarts, Rebal int
	Charges, DoubleCharges int
	Refunds, DoubleRefunds int
	Lost                   int
	Pass                   bool
	// Gaps: the pauses of a deploy row's partitions (rows 21 to 23).
	Gaps *deployFigures
}

var (
	resultsMu sync.Mutex
	results   []result
)

func record(r result) {
	resultsMu.Lock()
	defer resultsMu.Unlock()
	results = append(results, r)
}

func printResults() {
	resultsMu.Lock()
	defer resultsMu.Unlock()
	if len(results) == 0 {
		return
	}
	// Scenarios are named "N what": order by N, so 10 follows 9.
	number := func(name string) int {
		n, _ := strconv.Atoi(strings.Fields(name + " x")[0])
		return n
	}
	sort.SliceStable(results, func(i, j int) bool { return number(results[i].Scenario) < number(results[j].Scenario) })
	var b strings.Builder
	w := tabwriter.NewWriter(&b, 0, 0, 1, ' ', tabwriter.Debug)
	fmt.Fprintln(w, "scenario\tevents\tdeliveries\tduplicates skipped\tkills\trestarts\trebalances\tcharges\trefunds\tdouble charges\tdouble refunds\tlost\tlongest gap s\tpaused partition-s\tresult\t")
	var figures []string
	for _, r := range results {
		verdict := "PASS"
		if !r.Pass {
			verdict = "FAIL"
		}
		longest, paused := "-", "-"
		if r.Gaps != nil {
			longest, paused = r.Gaps.columns()
			figures = append(figures, r.Scenario+": "+r.Gaps.String())
		}
		fmt.Fprintf(w, "%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%s\t%s\t%s\t\n", r.Scenario, r.Events, r.Deliveries, r.Duplicates,
			r.Kills, r.Restarts, r.Rebal, r.Charges, r.Refunds, r.DoubleCharges, r.DoubleRefunds, r.Lost, longest, paused, verdict)
	}
	w.Flush()
	table := fmt.Sprintf("e2e results\n%s", b.String())
	if len(figures) > 0 {
		// The deploy rows' own figures (docs/e2e.md, "Gaps").
		table += "\ndeploy rows: billing / analytics on order.confirmed\n" + strings.Join(figures, "\n") + "\n"
	}
	fmt.Fprintf(os.Stdout, "\n%s\n", table)
	// go test hides a passing package's output; dev/test.sh shows this file.
	if path := os.Getenv("ONCE_E2E_RESULTS"); path != "" {
		_ = os.WriteFile(path, []byte(table), 0o644)
	}
}
