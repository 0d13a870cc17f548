package metrics

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/once-dev/once/pipeline"
)

// The bookkeeping of lag reads, pure logic over the collectors (the reads
// of a real broker, paused, are cmd/app's TestReadinessFollowsASilentBroker):
// a partition that one read misses keeps its last lag, so that a failed
// read now and then does not reset OnceConsumerLagGrowing's 10 minutes;
// LagUnknownAfter misses in a row, or Kafka silent, make it unknown (no
// lag series, once_consumer_lag_unknown 1) while the other partitions of
// the group are still read, so that one readable partition does not hide
// an unreadable one; a partition assigned here and never read becomes
// unknown too; a read brings each back.
func TestLagUnknownPerPartitionAfterFailedReadsInARow(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := New(reg)
	if err != nil {
		t.Fatal(err)
	}
	// gathered: the value of name's series of partition part, and whether it has one.
	gathered := func(name, part string) (float64, bool) {
		families, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range families {
			if f.GetName() != name {
				continue
			}
			for _, s := range f.GetMetric() {
				for _, l := range s.GetLabel() {
					if l.GetName() == "partition" && l.GetValue() == part {
						return s.GetGauge().GetValue(), true
					}
				}
			}
		}
		return 0, false
	}
	lag := func(part int32, n int64) pipeline.PartitionLag {
		return pipeline.PartitionLag{Topic: "orders", Group: "billing", Partition: part, Lag: n}
	}
	assigned := []pipeline.PartitionLag{lag(0, 0), lag(1, 0), lag(2, 0)}
	// want: partition -> its lag, or -1 for unknown (no series, the unknown gauge 1).
	check := func(step string, want map[string]float64) {
		t.Helper()
		for part, w := range want {
			v, series := gathered("once_consumer_lag", part)
			unknown, _ := gathered("once_consumer_lag_unknown", part)
			switch {
			case w < 0 && (series || unknown != 1):
				t.Errorf("%s: partition %s: lag series %v (%v), unknown %v; want none, unknown 1", step, part, series, v, unknown)
			case w >= 0 && (!series || unknown != 0 || v != w):
				t.Errorf("%s: partition %s: lag series %v (%v), unknown %v; want lag %v, unknown 0", step, part, series, v, unknown, w)
			}
		}
	}
	read := func(silent bool, lags ...pipeline.PartitionLag) {
		m.lagMu.Lock()
		defer m.lagMu.Unlock()
		m.lagReadLocked(lags, silent, assigned)
	}

	read(false, lag(0, 100), lag(1, 50))
	check("both read", map[string]float64{"0": 100, "1": 50})
	read(false, lag(0, 101))
	check("partition 1 missed by one read", map[string]float64{"0": 101, "1": 50})
	for i := 2; i < LagUnknownAfter; i++ {
		read(false, lag(0, 100+int64(i)))
		check("partition 1 missed by reads in a row, fewer than LagUnknownAfter", map[string]float64{"0": 100 + float64(i), "1": 50})
	}
	read(false, lag(0, 200))
	check("partition 1 missed by LagUnknownAfter reads in a row, partition 0 read", map[string]float64{"0": 200, "1": -1, "2": -1})
	read(false, lag(0, 210), lag(1, 70), lag(2, 5))
	check("read again", map[string]float64{"0": 210, "1": 70, "2": 5})
	read(true)
	check("kafka silent", map[string]float64{"0": -1, "1": -1, "2": -1})
	read(false, lag(0, 1), lag(1, 2), lag(2, 3))
	check("kafka answers again", map[string]float64{"0": 1, "1": 2, "2": 3})
}
