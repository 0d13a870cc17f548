package main

import (
	"fmt"
	"image/color"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
	"gonum.org/v1/plot/vg/vgsvg"
)

// benchPlot is what app bench --plot draws: throughput and p99 by
// partitions (the sweep), and latency (p50, p99) by offered load, for P
// and PB, with the database's own (L2, L2B) at the same loads.
type benchPlot struct {
	sweep   []plotSweep
	offered []plotRate
}

type plotSweep struct {
	partitions int32
	p, pb      benchFigures
}

type plotRate struct {
	rate           int
	p, pb, l2, l2b benchFigures
}

var (
	colorP   = color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff}
	colorPB  = color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff}
	colorL2  = color.RGBA{R: 0x7f, G: 0x7f, B: 0x7f, A: 0xff}
	colorL2B = color.RGBA{R: 0xbc, G: 0xbd, B: 0x22, A: 0xff}
)

// save draws the three charts side by side into path, as SVG or PNG by its
// extension.
func (b benchPlot) save(path string) error {
	var charts []*plot.Plot
	if len(b.sweep) > 0 {
		rate, p99 := plot.New(), plot.New()
		rate.Title.Text, rate.X.Label.Text, rate.Y.Label.Text = "Throughput by partitions", "partitions", "events/s"
		p99.Title.Text, p99.X.Label.Text, p99.Y.Label.Text = "p99 latency by partitions", "partitions", "ms"
		for _, v := range []struct {
			name string
			c    color.Color
			pick func(plotSweep) benchFigures
		}{{"P", colorP, func(s plotSweep) benchFigures { return s.p }}, {"PB", colorPB, func(s plotSweep) benchFigures { return s.pb }}} {
			var r, l plotter.XYs
			for _, s := range b.sweep {
				f := v.pick(s)
				if f.Skipped != "" {
					continue
				}
				r = append(r, plotter.XY{X: float64(s.partitions), Y: f.rate()})
				l = append(l, plotter.XY{X: float64(s.partitions), Y: f.P99ms})
			}
			if err := addLine(rate, v.name, v.c, r); err != nil {
				return err
			}
			if err := addLine(p99, v.name, v.c, l); err != nil {
				return err
			}
		}
		charts = append(charts, rate, p99)
	}
	if len(b.offered) > 0 {
		lat := plot.New()
		lat.Title.Text, lat.X.Label.Text, lat.Y.Label.Text = "Latency by offered load", "offered events/s", "ms (log)"
		// p50s of a few ms beside p99s of tens: a linear axis flattens
		// the first.
		lat.Y.Scale, lat.Y.Tick.Marker = plot.LogScale{}, plot.LogTicks{Prec: -1}
		for _, v := range []struct {
			name string
			c    color.Color
			pick func(plotRate) benchFigures
		}{{"P", colorP, func(r plotRate) benchFigures { return r.p }}, {"PB", colorPB, func(r plotRate) benchFigures { return r.pb }},
			// The database's own latency at the same load: what is left
			// to remove is between it and P, PB.
			{"L2", colorL2, func(r plotRate) benchFigures { return r.l2 }}, {"L2B", colorL2B, func(r plotRate) benchFigures { return r.l2b }}} {
			var p50, p99 plotter.XYs
			for _, r := range b.offered {
				f := v.pick(r)
				if f.Skipped != "" {
					continue
				}
				p50 = append(p50, plotter.XY{X: float64(r.rate), Y: f.P50ms})
				p99 = append(p99, plotter.XY{X: float64(r.rate), Y: f.P99ms})
			}
			if err := addLine(lat, v.name+" p50", v.c, p50, vg.Points(2), vg.Points(2)); err != nil {
				return err
			}
			if err := addLine(lat, v.name+" p99", v.c, p99); err != nil {
				return err
			}
		}
		// Room above the lines for the legend: eight entries would hide
		// the p99s otherwise.
		lat.Y.Max *= 8
		lat.Legend.Left, lat.Legend.Top = true, true
		charts = append(charts, lat)
	}
	if len(charts) == 0 {
		return fmt.Errorf("nothing to draw: run a sweep or an offered load")
	}
	return saveCharts(path, charts)
}

// saveCharts draws charts side by side into path, as SVG or PNG by its
// extension.
func saveCharts(path string, charts []*plot.Plot) error {
	const w, h = 5 * vg.Inch, 3.6 * vg.Inch
	var canvas vg.CanvasWriterTo
	width := vg.Length(len(charts)) * w
	switch {
	case filepath.Ext(path) == ".png":
		canvas = vgimg.PngCanvas{Canvas: vgimg.New(width, h)}
	default:
		canvas = vgsvg.New(width, h)
	}
	dc := draw.New(canvas)
	tiles := draw.Tiles{Rows: 1, Cols: len(charts), PadX: vg.Millimeter * 4}
	for i, c := range charts {
		c.Legend.Top = true
		c.Add(plotter.NewGrid())
		c.Draw(tiles.At(dc, i, 0))
	}
	return writeCanvas(path, canvas)
}

// addLine adds a line with points named name in c to p; dashes, if any,
// make it dashed.
func addLine(p *plot.Plot, name string, c color.Color, xys plotter.XYs, dashes ...vg.Length) error {
	if len(xys) == 0 {
		return nil
	}
	l, pts, err := plotter.NewLinePoints(xys)
	if err != nil {
		return err
	}
	l.Color, pts.Color, l.Dashes = c, c, dashes
	p.Add(l, pts)
	p.Legend.Add(name, l, pts)
	return nil
}

func writeCanvas(path string, canvas vg.CanvasWriterTo) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := canvas.WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// waitPlot is the waiting handler's picture: events/s by N in key order,
// per partition count, beside partition order's events/s and the ceiling
// min(N, pool) / latency; a chart per variant (W, WB).
type waitPlot struct {
	latency time.Duration
	pool    int
	rows    []waitRow
}

func (r *waitReport) plot() waitPlot { return waitPlot{latency: r.latency, pool: r.pool, rows: r.rows} }

// waitPlotPath is the waiting handler's picture beside --plot's:
// docs/bench.png gives docs/bench-wait.png.
func waitPlotPath(plotPath string) string {
	ext := filepath.Ext(plotPath)
	return strings.TrimSuffix(plotPath, ext) + "-wait" + ext
}

// One colour per partition count, in the order they come.
var waitColors = []color.Color{colorP, colorPB, color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff}, color.RGBA{R: 0x94, G: 0x67, B: 0xbd, A: 0xff}}

func (w waitPlot) save(path string) error {
	titles := map[string]string{"W": "W: a %s wait in the claim's transaction", "WB": "WB: billing, the provider answering in %s"}
	var charts []*plot.Plot
	for _, v := range []string{"W", "WB"} {
		var rows []waitRow
		for _, r := range w.rows {
			if r.variant == v && r.f.Skipped == "" {
				rows = append(rows, r)
			}
		}
		if len(rows) == 0 {
			continue
		}
		p := plot.New()
		p.Title.Text, p.X.Label.Text, p.Y.Label.Text = fmt.Sprintf(titles[v], w.latency), "N (Concurrency), key order", "events/s"
		var ns []int
		var parts []int32
		for _, r := range rows {
			if r.key && !slices.Contains(ns, r.n) {
				ns = append(ns, r.n)
			}
			if !slices.Contains(parts, r.partitions) {
				parts = append(parts, r.partitions)
			}
		}
		slices.Sort(ns)
		if len(ns) == 0 {
			continue
		}
		lo, hi := float64(ns[0]), float64(ns[len(ns)-1])
		var ceiling plotter.XYs
		for _, n := range ns {
			ceiling = append(ceiling, plotter.XY{X: float64(n), Y: float64(min(n, w.pool)) / w.latency.Seconds()})
		}
		if err := addLine(p, fmt.Sprintf("ceiling min(N, %d) / %s", w.pool, w.latency), color.Gray{Y: 0x80}, ceiling, vg.Points(4), vg.Points(3)); err != nil {
			return err
		}
		for i, part := range parts {
			c := waitColors[i%len(waitColors)]
			var key plotter.XYs
			for _, r := range rows {
				switch {
				case r.partitions != part:
				case r.key:
					key = append(key, plotter.XY{X: float64(r.n), Y: r.f.rate()})
				default:
					// Partition order has no N: its events/s across the axis.
					if err := addLine(p, partitionsLabel(part)+", partition order", c, plotter.XYs{{X: lo, Y: r.f.rate()}, {X: hi, Y: r.f.rate()}}, vg.Points(2), vg.Points(2)); err != nil {
						return err
					}
				}
			}
			slices.SortFunc(key, func(a, b plotter.XY) int { return int(a.X - b.X) })
			if err := addLine(p, partitionsLabel(part)+", key order", c, key); err != nil {
				return err
			}
		}
		p.X.Min, p.Y.Min = 0, 0
		p.Legend.Left = true
		charts = append(charts, p)
	}
	if len(charts) == 0 {
		return fmt.Errorf("nothing to draw: no run of W or WB")
	}
	return saveCharts(path, charts)
}

func partitionsLabel(p int32) string {
	if p == 1 {
		return "1 partition"
	}
	return fmt.Sprintf("%d partitions", p)
}
