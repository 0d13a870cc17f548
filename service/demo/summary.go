package demo

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/service/payment"
)

// counters counts outcomes per consumer group.
type counters struct {
	mu sync.Mutex
	n  map[string]map[string]int
}

func newCounters() *counters { return &counters{n: map[string]map[string]int{}} }

func (c *counters) add(group, what string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n[group] == nil {
		c.n[group] = map[string]int{}
	}
	c.n[group][what]++
}

func (c *counters) result(r idempotency.Result) { c.add(r.ConsumerGroup, r.Outcome.String()) }

func (c *counters) get(group, what string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[group][what]
}

// GroupFigures is what one consumer group did.
type GroupFigures struct {
	Name            string
	Deliveries      int // messages handed to the group's handler chain
	Processed       int // first deliveries whose transaction committed
	Duplicates      int // deliveries skipped by the claim
	Rejected        int // recorded as refused for good, then dead-lettered
	FailedAttempts  int // attempts rolled back and retried
	DeadLettered    int
	ClaimRows       int // rows in processed_event for the run's events
	PoisonDelivered int
}

// Check is one invariant and whether it held.
type Check struct {
	What string
	OK   bool
	Got  string
}

// Summary is what a demo run did and found.
type Summary struct {
	Run             string
	Topic           string
	Elapsed         time.Duration
	Orders          int
	Declined        int
	Republished     int
	PoisonSent      int
	DLQReplay       dlq.Report
	Billing         GroupFigures
	Analytics       GroupFigures
	ProviderCharges int
	ProviderStats   payment.Stats
	DoubleCharged   int
	ChargedTotal    decimal.Decimal
	ChargeableTotal decimal.Decimal
	OrderedTotal    decimal.Decimal
	AnalyticsTotal  decimal.Decimal
	AnalyticsOrders int
	FailedPayments  int
	Checks          []Check
}

// Pass reports whether every check held.
func (s Summary) Pass() bool {
	for _, c := range s.Checks {
		if !c.OK {
			return false
		}
	}
	return len(s.Checks) > 0
}

func (r *run) group(name string) GroupFigures {
	g := GroupFigures{Name: name}
	g.Processed = r.counts.get(name, idempotency.Processed.String())
	g.Duplicates = r.counts.get(name, idempotency.Duplicate.String())
	g.Rejected = r.counts.get(name, idempotency.Rejected.String())
	g.FailedAttempts = r.counts.get(name, idempotency.Failed.String())
	g.DeadLettered = r.counts.get(name, "dead_lettered")
	g.Deliveries = r.counts.get(name, "delivered")
	return g
}

func (r *run) summarize(ctx context.Context, republished int, replay dlq.Report, elapsed time.Duration) (Summary, error) {
	s := Summary{Run: r.id, Topic: r.topic, Elapsed: elapsed, Orders: len(r.events), Republished: republished,
		PoisonSent: r.counts.get("", "poison_sent"), DLQReplay: replay,
		Billing: r.group(r.groups[0]), Analytics: r.group(r.groups[1])}

	chargeable := map[string]decimal.Decimal{}
	ids := make([]uuid.UUID, 0, len(r.events))
	for _, ev := range r.events {
		ids = append(ids, ev.EventID())
		s.OrderedTotal = s.OrderedTotal.Add(ev.TotalAmount())
		if ev.TotalAmount().GreaterThan(declineAbove) {
			s.Declined++
			continue
		}
		chargeable[strconv.FormatInt(ev.OrderID(), 10)] = ev.TotalAmount()
		s.ChargeableTotal = s.ChargeableTotal.Add(ev.TotalAmount())
	}

	ledger, err := r.client.Ledger(ctx)
	if err != nil {
		return s, err
	}
	perOrder := map[string]int{}
	unexpected := 0
	for _, c := range ledger.Charges {
		perOrder[c.OrderID]++
		amount, _ := decimal.NewFromString(c.Amount)
		s.ChargedTotal = s.ChargedTotal.Add(amount)
		if want, ok := chargeable[c.OrderID]; !ok || !want.Equal(amount) {
			unexpected++
		}
	}
	s.ProviderCharges = ledger.Count
	s.ProviderStats = r.provider.Stats()
	missing := 0
	for o := range chargeable {
		switch n := perOrder[o]; {
		case n == 0:
			missing++
		case n > 1:
			s.DoubleCharged++
		}
	}

	db := r.cfg.DB
	var charged int
	if err := db.QueryRow(ctx, `SELECT count(*) FILTER (WHERE status = 'charged'), count(*) FILTER (WHERE status = 'failed')
		FROM billing.payments WHERE event_id = ANY($1)`, ids).Scan(&charged, &s.FailedPayments); err != nil {
		return s, fmt.Errorf("demo: read payments: %w", err)
	}
	if err := db.QueryRow(ctx, `SELECT coalesce(sum(revenue), 0), coalesce(sum(order_count), 0)
		FROM analytics.customer_daily_revenue WHERE customer_id = ANY($1)`, r.customers).Scan(&s.AnalyticsTotal, &s.AnalyticsOrders); err != nil {
		return s, fmt.Errorf("demo: read analytics: %w", err)
	}
	for _, g := range []*GroupFigures{&s.Billing, &s.Analytics} {
		if err := db.QueryRow(ctx, `SELECT count(*) FROM processed_event WHERE consumer_group = $1 AND event_id = ANY($2)`, g.Name, ids).Scan(&g.ClaimRows); err != nil {
			return s, fmt.Errorf("demo: read claims: %w", err)
		}
	}

	check := func(what string, ok bool, format string, args ...any) {
		s.Checks = append(s.Checks, Check{What: what, OK: ok, Got: fmt.Sprintf(format, args...)})
	}
	check("every chargeable order charged exactly once at the provider",
		missing == 0 && s.DoubleCharged == 0 && unexpected == 0 && ledger.Count == len(chargeable),
		"%d charges for %d orders: %d missing, %d doubled, %d unexpected", ledger.Count, len(chargeable), missing, s.DoubleCharged, unexpected)
	check("charged total equals the chargeable ordered total", s.ChargedTotal.Equal(s.ChargeableTotal),
		"%s vs %s", s.ChargedTotal.StringFixed(2), s.ChargeableTotal.StringFixed(2))
	check("billing recorded each order once", charged == len(chargeable) && s.FailedPayments == s.Declined,
		"%d charged, %d failed (declined orders: %d)", charged, s.FailedPayments, s.Declined)
	check("analytics counted every order exactly once", s.AnalyticsTotal.Equal(s.OrderedTotal) && s.AnalyticsOrders == s.Orders,
		"%s over %d orders vs %s over %d", s.AnalyticsTotal.StringFixed(2), s.AnalyticsOrders, s.OrderedTotal.StringFixed(2), s.Orders)
	check("one claim per event and group", s.Billing.ClaimRows == s.Orders && s.Analytics.ClaimRows == s.Orders,
		"billing %d, analytics %d, events %d", s.Billing.ClaimRows, s.Analytics.ClaimRows, s.Orders)
	check("duplicates were delivered and skipped in both groups", s.Billing.Duplicates > 0 && s.Analytics.Duplicates > 0,
		"billing %d, analytics %d", s.Billing.Duplicates, s.Analytics.Duplicates)
	check("every poison message dead-lettered by both groups",
		s.Billing.DeadLettered >= s.PoisonSent+s.Declined && s.Analytics.DeadLettered >= s.PoisonSent,
		"billing %d, analytics %d dead letters for %d poison messages and %d declined", s.Billing.DeadLettered, s.Analytics.DeadLettered, s.PoisonSent, s.Declined)
	return s, nil
}

// Print writes the summary table.
func (s Summary) Print(w io.Writer) {
	fmt.Fprintf(w, "demo run %s on topic %s, %s\n\n", s.Run, s.Topic, s.Elapsed.Round(100*time.Millisecond))
	t := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(t, "orders confirmed\t%d\t\n", s.Orders)
	fmt.Fprintf(t, "  priced above the decline limit\t%d\t\n", s.Declined)
	fmt.Fprintf(t, "events re-published by a producer\t%d\t\n", s.Republished)
	fmt.Fprintf(t, "poison messages injected\t%d\t\n", s.PoisonSent)
	fmt.Fprintf(t, "dead letters replayed\t%d\t\n", s.DLQReplay.Replayed)
	t.Flush()
	fmt.Fprintln(w)
	t = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(t, "\tbilling\tanalytics\t")
	row := func(name string, f func(GroupFigures) int) {
		fmt.Fprintf(t, "%s\t%d\t%d\t\n", name, f(s.Billing), f(s.Analytics))
	}
	row("deliveries", func(g GroupFigures) int { return g.Deliveries })
	row("processed (first delivery)", func(g GroupFigures) int { return g.Processed })
	row("duplicates skipped", func(g GroupFigures) int { return g.Duplicates })
	row("refused for good (declined)", func(g GroupFigures) int { return g.Rejected })
	row("attempts rolled back and retried", func(g GroupFigures) int { return g.FailedAttempts })
	row("dead-lettered", func(g GroupFigures) int { return g.DeadLettered })
	row("claims in processed_event", func(g GroupFigures) int { return g.ClaimRows })
	t.Flush()
	fmt.Fprintln(w)
	t = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(t, "provider charges\t%d\t\n", s.ProviderCharges)
	fmt.Fprintf(t, "  connections dropped after charging\t%d\t\n", s.ProviderStats.Resets)
	fmt.Fprintf(t, "  answers replayed for a known key\t%d\t\n", s.ProviderStats.Replays)
	fmt.Fprintf(t, "charged total\t%s\t\n", s.ChargedTotal.StringFixed(2))
	fmt.Fprintf(t, "ordered total (chargeable)\t%s\t\n", s.ChargeableTotal.StringFixed(2))
	fmt.Fprintf(t, "ordered total (all)\t%s\t\n", s.OrderedTotal.StringFixed(2))
	fmt.Fprintf(t, "analytics total\t%s\t\n", s.AnalyticsTotal.StringFixed(2))
	t.Flush()
	fmt.Fprintln(w)
	for _, c := range s.Checks {
		mark := "ok  "
		if !c.OK {
			mark = "FAIL"
		}
		fmt.Fprintf(w, "%s %s (%s)\n", mark, c.What, c.Got)
	}
	verdict := "PASS: every order charged exactly once and counted exactly once"
	if !s.Pass() {
		verdict = "FAIL: " + strings.Join(failed(s.Checks), "; ")
	}
	fmt.Fprintf(w, "\n%s\n", verdict)
}

func failed(checks []Check) []string {
	var out []string
	for _, c := range checks {
		if !c.OK {
			out = append(out, c.What)
		}
	}
	return out
}
