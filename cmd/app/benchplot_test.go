package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The picture has its three charts, in SVG and PNG, from figures alone.
func TestBenchPlotDrawsTheSweepAndTheOfferedLoads(t *testing.T) {
	f := func(rate, p99 float64) benchFigures {
		return benchFigures{Events: int(rate), Seconds: 1, P50ms: p99 / 4, P99ms: p99}
	}
	b := benchPlot{
		sweep:   []plotSweep{{1, f(900, 3), f(5000, 9)}, {12, f(3000, 8), f(25000, 40)}},
		offered: []plotRate{{500, f(500, 4), f(500, 6), f(500, 2), f(500, 3)}, {1000, f(1000, 5), f(1000, 9), f(1000, 2.5), f(1000, 4)}},
	}
	dir := t.TempDir()
	svg := filepath.Join(dir, "bench.svg")
	if err := b.save(svg); err != nil {
		t.Fatal(err)
	}
	out, _ := os.ReadFile(svg)
	for _, want := range []string{"Throughput by partitions", "p99 latency by partitions", "Latency by offered load", "PB p99", "L2 p99", "L2B p50"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("the SVG has no %q", want)
		}
	}
	png := filepath.Join(dir, "bench.png")
	if err := b.save(png); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(png); err != nil || st.Size() < 1000 {
		t.Fatalf("the PNG: %v, %v", st, err)
	}
	if err := (benchPlot{}).save(svg); err == nil {
		t.Fatal("an empty picture was drawn")
	}
}

// The waiting handler's picture has a chart per variant, with key order by
// N, partition order and the ceiling, from figures alone.
func TestWaitPlotDrawsEventsPerSecondByN(t *testing.T) {
	f := func(rate float64) benchFigures { return benchFigures{Events: int(rate), Seconds: 1} }
	w := waitPlot{latency: 50 * time.Millisecond, pool: 40, rows: []waitRow{
		{variant: "W", partitions: 6, f: f(115)},
		{variant: "W", partitions: 6, key: true, n: 4, f: f(78)},
		{variant: "W", partitions: 6, key: true, n: 40, f: f(760)},
		{variant: "WB", partitions: 1, f: f(19)},
		{variant: "WB", partitions: 1, key: true, n: 40, f: f(600)},
	}}
	dir := t.TempDir()
	svg := filepath.Join(dir, "bench-wait.svg")
	if err := w.save(svg); err != nil {
		t.Fatal(err)
	}
	out, _ := os.ReadFile(svg)
	for _, want := range []string{"W: a 50ms wait", "WB: billing", "ceiling min(N, 40) / 50ms", "6 partitions, key order", "1 partition, partition order"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("the SVG has no %q", want)
		}
	}
	if got := waitPlotPath("docs/bench.png"); got != "docs/bench-wait.png" {
		t.Errorf("waitPlotPath: %s", got)
	}
	if err := (waitPlot{latency: time.Millisecond}).save(svg); err == nil {
		t.Fatal("an empty picture was drawn")
	}
}
