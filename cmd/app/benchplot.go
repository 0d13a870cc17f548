package main

import (
	"fmt"
	"image/color"
	"os"
	"path/filepath"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
	"gonum.org/v1/plot/vg/vgsvg"
)

// benchPlot is what app bench --plot draws: throughput and p99 by
// partitions (the sweep), and latency by offered load, for P and PB.
type benchPlot struct {
	sweep   []plotSweep
	offered []plotRate
}

type plotSweep struct {
	partitions int32
	p, pb      benchFigures
}

type plotRate struct {
	rate  int
	p, pb benchFigures
}

var (
	colorP  = color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff}
	colorPB = color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff}
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
		lat.Title.Text, lat.X.Label.Text, lat.Y.Label.Text = "Latency by offered load", "offered events/s", "ms"
		for _, v := range []struct {
			name string
			c    color.Color
			pick func(plotRate) benchFigures
		}{{"P", colorP, func(r plotRate) benchFigures { return r.p }}, {"PB", colorPB, func(r plotRate) benchFigures { return r.pb }}} {
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
		charts = append(charts, lat)
	}
	if len(charts) == 0 {
		return fmt.Errorf("nothing to draw: run a sweep or an offered load")
	}
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
