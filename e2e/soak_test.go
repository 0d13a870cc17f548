package e2e

import (
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/once-dev/once/internal/testenv"
)

// 17. The chaos soak (ONCE_E2E_SOAK=1 only): for at least ten minutes
// (ONCE_E2E_SOAK_MINUTES), bursts of orders, cancellations and re-published
// events, and after each burst a fault drawn at random from the table's:
// a consumer killed -9 or stopped (a rebalance), PostgreSQL restarted,
// killed -9 or read-only, PgBouncer killed -9, a database black hole under
// one consumer, the provider killed, the Kafka broker killed -9. Four
// consumers side by side: per event and batched, directly, behind PgBouncer
// and behind a proxy. The invariants are checked once at the end, and every
// fault is counted in the log and the table.
func TestChaosSoak(t *testing.T) {
	if !*soak {
		t.Skip("the chaos soak runs with ONCE_E2E_SOAK=1 (ten minutes and more)")
	}
	minutes := 10
	if m := os.Getenv("ONCE_E2E_SOAK_MINUTES"); m != "" {
		fmt.Sscan(m, &minutes)
	}
	s := newScenario(t, "17 chaos soak", 6)
	for _, svc := range []string{"postgres", "pgbouncer", "kafka"} {
		s.requireDevService(svc)
	}
	s.startProvider()
	_, proxy := testenv.ProxiedPostgres(t, s.pool)
	pooled := os.Getenv("ONCE_PGBOUNCER_URL")
	// Every consumer in partition order, two of them with analytics batched
	// (the rows' batched mode), as the soak ran before key order.
	s.mode = mode{"partition order, two consumers batched", partitionOrder.flags}
	batch := []string{"--analytics-batch", "50"}
	type consumer struct {
		name  string
		env   []string
		extra []string
		p     *proc
	}
	consumers := []*consumer{
		{name: "direct-per-event"},
		{name: "direct-batched", extra: batch},
		{name: "pgbouncer-batched", env: []string{"DATABASE_URL=" + pooled}, extra: batch},
		{name: "proxied-per-event", env: []string{"DATABASE_URL=" + proxy.URL(os.Getenv("DATABASE_URL"))},
			extra: []string{"--db-statement-timeout", "15s", "--attempt-timeout", "30s"}},
	}
	start := func(c *consumer) { c.p = s.consumerEnv(c.name, c.env, c.extra...) }
	for _, c := range consumers {
		start(c)
	}
	restartDead := func() {
		for _, c := range consumers {
			if !c.p.running() {
				start(c)
				s.restarts++
			}
		}
	}
	pick := func() *consumer { return consumers[rand.IntN(len(consumers))] }
	faults := map[string]int{}
	table := []struct {
		name string
		do   func()
	}{
		{"consumer kill -9", func() {
			c := pick()
			c.p.kill()
			s.kills++
			time.Sleep(2 * time.Second)
			start(c)
			s.restarts++
		}},
		{"consumer stopped (rebalance)", func() {
			c := pick()
			c.p.stop(t)
			s.rebal++
			time.Sleep(3 * time.Second)
			start(c)
			s.rebal++
		}},
		{"postgres restart", func() {
			s.devService("postgres", "restart")
			s.restarts++
			s.pool = freshPool(t)
		}},
		{"postgres kill -9", func() {
			s.devService("postgres", "kill")
			s.kills++
			time.Sleep(time.Second)
			s.devService("postgres", "start")
			s.restarts++
			s.pool = freshPool(t)
		}},
		{"postgres read-only", func() {
			s.sql("ALTER SYSTEM SET default_transaction_read_only = on", "SELECT pg_reload_conf()")
			time.Sleep(8 * time.Second)
			s.sql("ALTER SYSTEM RESET default_transaction_read_only", "SELECT pg_reload_conf()")
		}},
		{"pgbouncer kill -9", func() {
			s.devService("pgbouncer", "kill")
			s.kills++
			time.Sleep(time.Second)
			s.devService("pgbouncer", "start")
			s.restarts++
		}},
		{"database black hole", func() {
			proxy.BlackHole(true)
			time.Sleep(10 * time.Second)
			proxy.BlackHole(false)
		}},
		{"provider killed", func() {
			s.provider.kill()
			s.kills++
			time.Sleep(2 * time.Second)
			s.startProvider()
			s.restarts++
		}},
		{"kafka broker kill -9", func() {
			s.devService("kafka", "kill")
			s.kills++
			time.Sleep(3 * time.Second)
			s.devService("kafka", "start")
			s.restarts++
			s.reconnectProducer()
		}},
	}
	t.Cleanup(func() {
		proxy.BlackHole(false)
		s.sql("ALTER SYSTEM RESET default_transaction_read_only", "SELECT pg_reload_conf()")
	})
	deadline := time.Now().Add(time.Duration(minutes) * time.Minute)
	for round := 1; time.Now().Before(deadline); round++ {
		burst := s.publish(60, 50*time.Millisecond)
		s.republish(burst[:6], round%2 == 0)
		s.cancel(burst[len(burst)-4:])
		f := table[rand.IntN(len(table))]
		t.Logf("round %d (%s left): %s", round, time.Until(deadline).Round(time.Second), f.name)
		f.do()
		faults[f.name]++
		restartDead()
		time.Sleep(time.Duration(5+rand.IntN(10)) * time.Second)
	}
	restartDead()
	s.verify(5 * time.Minute)
	names := make([]string, 0, len(faults))
	for name, n := range faults {
		names = append(names, fmt.Sprintf("%s: %d", name, n))
	}
	slices.Sort(names)
	t.Logf("faults over %d minutes: %s", minutes, strings.Join(names, ", "))
	for _, c := range consumers {
		s.stillRunning(c.p)
	}
}
