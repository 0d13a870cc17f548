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
	"github.com/once-dev/once/payment"
)

// counters counts outcomes per consumer group and topic.
type counters struct {
	mu sync.Mutex
	n  map[string]int
}

func newCounters() *counters { return &counters{n: map[string]int{}} }

func (c *counters) add(group, topic, what string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.n[group+"|"+topic+"|"+what]++
}

func (c *counters) result(r idempotency.Result) { c.add(r.ConsumerGroup, r.Topic, r.Outcome.String()) }

func (c *counters) get(group, topic, what string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[group+"|"+topic+"|"+what]
}

// sum counts what over a group's topics.
func (c *counters) sum(group string, topics []string, what string) int {
	n := 0
	for _, t := range topics {
		n += c.get(group, t, what)
	}
	return n
}

// GroupFigures is what one consumer group did, over the topics it reads.
type GroupFigures struct {
	Name           string
	Topics         []string
	Deliveries     int // messages handed to the group's handler chains
	Processed      int // first deliveries whose transaction committed
	Duplicates     int // deliveries skipped by the claim
	Rejected       int // recorded as refused for good, then dead-lettered
	FailedAttempts int // attempts rolled back (and held, or dead-lettered)
	DeadLettered   int
	ClaimRows      int // rows in processed_event for the run's events
}

// Check is one invariant and whether it held.
type Check struct {
	What string
	OK   bool
	Got  string
}

// Summary is what a demo run did and found.
type Summary struct {
	Run         string
	Topic       string
	Elapsed     time.Duration
	Orders      int
	Declined    int
	Republished int
	PoisonSent  int
	DLQReplay   dlq.Report

	Cancelled           int // order.cancelled.v1 events
	CancelledBeforePaid int // orders billing never charged because their cancellation came first
	Refunds             int // refunds billing recorded

	Billing   GroupFigures
	Analytics GroupFigures

	ProviderCharges int
	ProviderRefunds int
	ProviderStats   payment.Stats
	DoubleCharged   int
	DoubleRefunded  int

	ChargedTotal    decimal.Decimal // at the provider
	RefundedTotal   decimal.Decimal // at the provider
	OurCharged      decimal.Decimal // billing's charged payments
	OurRefunded     decimal.Decimal // billing's refunds
	ChargeableTotal decimal.Decimal
	OrderedTotal    decimal.Decimal
	AnalyticsTotal  decimal.Decimal
	AnalyticsRefund decimal.Decimal
	AnalyticsOrders int

	PaymentEvents   int // distinct payment events billing published (outbox)
	Forwarded       int // outbox publishes to Kafka (a crash would add repeats)
	AppliedCharges  int // payment.charged.v1 applied by analytics
	AppliedFailures int
	AppliedRefunds  int
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

func (r *run) group(name string, topics ...string) GroupFigures {
	return GroupFigures{
		Name:           name,
		Topics:         topics,
		Processed:      r.counts.sum(name, topics, idempotency.Processed.String()),
		Duplicates:     r.counts.sum(name, topics, idempotency.Duplicate.String()),
		Rejected:       r.counts.sum(name, topics, idempotency.Rejected.String()),
		FailedAttempts: r.counts.sum(name, topics, idempotency.Failed.String()),
		DeadLettered:   r.counts.sum(name, topics, "dead_lettered"),
		Deliveries:     r.counts.sum(name, topics, "delivered"),
	}
}

func (r *run) summarize(ctx context.Context, republished int, replay dlq.Report, elapsed time.Duration) (Summary, error) {
	s := Summary{Run: r.id, Topic: r.confirmed, Elapsed: elapsed, Orders: len(r.events), Republished: republished,
		PoisonSent: r.counts.get("", "", "poison_sent"), DLQReplay: replay, Cancelled: len(r.cancels),
		Billing: r.group(r.billing, r.confirmed, r.cancelled), Analytics: r.group(r.analytics, r.confirmed, r.payments),
		Forwarded: r.counts.get("", r.payments, "forwarded")}
	db := r.cfg.DB

	amountOf := map[string]decimal.Decimal{}
	ids := make([]uuid.UUID, 0, len(r.events))
	orderIDs := make([]int64, 0, len(r.events))
	var pricedAbove []string
	for _, ev := range r.events {
		ids = append(ids, ev.EventID())
		orderIDs = append(orderIDs, ev.OrderID())
		s.OrderedTotal = s.OrderedTotal.Add(ev.TotalAmount())
		if ev.TotalAmount().GreaterThan(declineAbove) {
			pricedAbove = append(pricedAbove, strconv.FormatInt(ev.OrderID(), 10))
			continue
		}
		amountOf[strconv.FormatInt(ev.OrderID(), 10)] = ev.TotalAmount()
	}
	cancelIDs := make([]uuid.UUID, 0, len(r.cancels))
	for _, c := range r.cancels {
		cancelIDs = append(cancelIDs, c.EventID())
	}

	// Billing's records.
	var charged int
	if err := db.QueryRow(ctx, `SELECT count(*) FILTER (WHERE status = 'charged'), count(*) FILTER (WHERE status = 'failed'),
		count(*) FILTER (WHERE status = 'cancelled'), coalesce(sum(amount) FILTER (WHERE status = 'charged'), 0)
		FROM billing.payments WHERE event_id = ANY($1::uuid[])`, texts(ids)).Scan(&charged, &s.FailedPayments, &s.CancelledBeforePaid, &s.OurCharged); err != nil {
		return s, fmt.Errorf("demo: read payments: %w", err)
	}
	if err := db.QueryRow(ctx, `SELECT count(*), coalesce(sum(amount), 0) FROM billing.refunds WHERE event_id = ANY($1::uuid[])`, texts(cancelIDs)).
		Scan(&s.Refunds, &s.OurRefunded); err != nil {
		return s, fmt.Errorf("demo: read refunds: %w", err)
	}
	notCharged := map[string]bool{} // cancelled before the charge
	rows, err := db.Query(ctx, `SELECT order_id FROM billing.payments WHERE event_id = ANY($1::uuid[]) AND status = 'cancelled'`, texts(ids))
	if err != nil {
		return s, err
	}
	for rows.Next() {
		var id int64
		_ = rows.Scan(&id)
		notCharged[strconv.FormatInt(id, 10)] = true
	}
	rows.Close()
	// An order cancelled before its charge never reaches the provider,
	// whatever its price: it is declined only when it was tried.
	for _, o := range pricedAbove {
		if !notCharged[o] {
			s.Declined++
		}
	}
	cancelledOrders := map[string]bool{}
	for _, c := range r.cancels {
		cancelledOrders[strconv.FormatInt(c.OrderID(), 10)] = true
	}

	// The provider's ledger.
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
		if want, ok := amountOf[c.OrderID]; !ok || !want.Equal(amount) || notCharged[c.OrderID] {
			unexpected++
		}
	}
	refundsPerOrder := map[string]int{}
	badRefunds := 0
	for _, rf := range ledger.Refunds {
		refundsPerOrder[rf.OrderID]++
		amount, _ := decimal.NewFromString(rf.Amount)
		s.RefundedTotal = s.RefundedTotal.Add(amount)
		if perOrder[rf.OrderID] != 1 || !cancelledOrders[rf.OrderID] || !amountOf[rf.OrderID].Equal(amount) {
			badRefunds++ // a refund without its charge, of an order nobody cancelled, or not in full
		}
	}
	s.ProviderCharges, s.ProviderRefunds = ledger.Count, ledger.RefundCount
	s.ProviderStats = r.provider.Stats()
	missing, missingRefunds := 0, 0
	for o := range amountOf {
		switch n := perOrder[o]; {
		case notCharged[o]:
			// cancelled first: must not be charged (counted as unexpected above)
		case n == 0:
			missing++
		case n > 1:
			s.DoubleCharged++
		}
		if cancelledOrders[o] && perOrder[o] == 1 && refundsPerOrder[o] == 0 {
			missingRefunds++
		}
		if refundsPerOrder[o] > 1 {
			s.DoubleRefunded++
		}
	}
	chargeable := 0
	for o := range amountOf {
		if notCharged[o] {
			continue
		}
		chargeable++
		s.ChargeableTotal = s.ChargeableTotal.Add(amountOf[o])
	}

	// Analytics.
	if err := db.QueryRow(ctx, `SELECT coalesce(sum(revenue), 0), coalesce(sum(order_count), 0), coalesce(sum(refunded), 0)
		FROM analytics.customer_daily_revenue WHERE customer_id = ANY($1)`, r.customers).Scan(&s.AnalyticsTotal, &s.AnalyticsOrders, &s.AnalyticsRefund); err != nil {
		return s, fmt.Errorf("demo: read analytics: %w", err)
	}
	var appliedTotal decimal.Decimal
	if err := db.QueryRow(ctx, `SELECT coalesce(sum(charged_count), 0), coalesce(sum(charged_total), 0), coalesce(sum(failed_count), 0)
		FROM analytics.customer_daily_payments WHERE customer_id = ANY($1)`, r.customers).Scan(&s.AppliedCharges, &appliedTotal, &s.AppliedFailures); err != nil {
		return s, fmt.Errorf("demo: read analytics payments: %w", err)
	}
	if err := db.QueryRow(ctx, `SELECT coalesce(sum(refund_count), 0) FROM analytics.customer_daily_revenue WHERE customer_id = ANY($1)`, r.customers).
		Scan(&s.AppliedRefunds); err != nil {
		return s, err
	}

	// Claims: billing claims confirmations and cancellations; analytics
	// confirmations and payment events.
	if err := db.QueryRow(ctx, `SELECT count(*) FROM processed_event WHERE consumer_group = $1 AND event_id = ANY($2::uuid[])`,
		r.billing, texts(append(append([]uuid.UUID(nil), ids...), cancelIDs...))).Scan(&s.Billing.ClaimRows); err != nil {
		return s, err
	}
	if err := db.QueryRow(ctx, `SELECT count(*) FROM processed_event WHERE consumer_group = $1 AND event_id = ANY($2::uuid[])`,
		r.analytics, texts(ids)).Scan(&s.Analytics.ClaimRows); err != nil {
		return s, err
	}
	// Billing recorded the id of every payment event it published: the
	// analytics claims of exactly those.
	var paymentIDs []uuid.UUID
	rows, err = db.Query(ctx, `SELECT payment_event_id FROM billing.payments WHERE event_id = ANY($1::uuid[]) AND payment_event_id IS NOT NULL
		UNION ALL SELECT payment_event_id FROM billing.refunds WHERE event_id = ANY($2::uuid[]) AND payment_event_id IS NOT NULL`, texts(ids), texts(cancelIDs))
	if err != nil {
		return s, err
	}
	for rows.Next() {
		var id uuid.UUID
		_ = rows.Scan(&id)
		paymentIDs = append(paymentIDs, id)
	}
	rows.Close()
	var paymentClaims int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM processed_event WHERE consumer_group = $1 AND event_id = ANY($2::uuid[])`,
		r.analytics, texts(paymentIDs)).Scan(&paymentClaims); err != nil {
		return s, err
	}
	s.PaymentEvents = len(paymentIDs)

	check := func(what string, ok bool, format string, args ...any) {
		s.Checks = append(s.Checks, Check{What: what, OK: ok, Got: fmt.Sprintf(format, args...)})
	}
	check("every chargeable order charged exactly once at the provider, none cancelled before its charge",
		missing == 0 && s.DoubleCharged == 0 && unexpected == 0 && ledger.Count == chargeable,
		"%d charges for %d orders: %d missing, %d doubled, %d unexpected", ledger.Count, chargeable, missing, s.DoubleCharged, unexpected)
	check("every cancelled charge refunded exactly once, in full, and no refund without its charge",
		missingRefunds == 0 && s.DoubleRefunded == 0 && badRefunds == 0 && s.Refunds == ledger.RefundCount,
		"%d refunds: %d missing, %d doubled, %d without a charge or not in full; billing recorded %d", ledger.RefundCount, missingRefunds, s.DoubleRefunded, badRefunds, s.Refunds)
	check("the provider's ledger balances against ours, to the cent",
		s.ChargedTotal.Sub(s.RefundedTotal).Equal(s.OurCharged.Sub(s.OurRefunded)) && s.ChargedTotal.Equal(s.OurCharged),
		"provider %s - %s = %s, billing %s - %s = %s", s.ChargedTotal.StringFixed(2), s.RefundedTotal.StringFixed(2), s.ChargedTotal.Sub(s.RefundedTotal).StringFixed(2),
		s.OurCharged.StringFixed(2), s.OurRefunded.StringFixed(2), s.OurCharged.Sub(s.OurRefunded).StringFixed(2))
	check("billing recorded each order once", charged+s.FailedPayments+s.CancelledBeforePaid == s.Orders && s.FailedPayments == s.Declined && charged == ledger.Count,
		"%d charged, %d failed (declined orders: %d), %d cancelled before the charge, of %d", charged, s.FailedPayments, s.Declined, s.CancelledBeforePaid, s.Orders)
	check("analytics counted every order exactly once, and every refund", s.AnalyticsTotal.Equal(s.OrderedTotal) && s.AnalyticsOrders == s.Orders && s.AnalyticsRefund.Equal(s.RefundedTotal),
		"%s over %d orders vs %s over %d; refunded %s vs %s", s.AnalyticsTotal.StringFixed(2), s.AnalyticsOrders, s.OrderedTotal.StringFixed(2), s.Orders,
		s.AnalyticsRefund.StringFixed(2), s.RefundedTotal.StringFixed(2))
	check("every payment event billing published applied exactly once by analytics",
		s.AppliedCharges == ledger.Count && appliedTotal.Equal(s.ChargedTotal) && s.AppliedFailures == s.FailedPayments && s.AppliedRefunds == s.Refunds &&
			paymentClaims == s.PaymentEvents,
		// Forwarded is informational: any process forwarding the same
		// database's outbox (a second instance, a test beside the demo)
		// moves some of these rows; analytics' claims prove they all arrived.
		"charged %d/%d (%s), failed %d/%d, refunded %d/%d; %d claims for %d events, %d forwarded by this process",
		s.AppliedCharges, ledger.Count, appliedTotal.StringFixed(2), s.AppliedFailures, s.FailedPayments, s.AppliedRefunds, s.Refunds, paymentClaims, s.PaymentEvents, s.Forwarded)
	check("one claim per event and group", s.Billing.ClaimRows == s.Orders+s.Cancelled && s.Analytics.ClaimRows == s.Orders,
		"billing %d (orders and cancellations: %d), analytics %d (orders: %d)", s.Billing.ClaimRows, s.Orders+s.Cancelled, s.Analytics.ClaimRows, s.Orders)
	check("orders were cancelled, and charged ones refunded", s.Cancelled > 0 && s.Refunds > 0,
		"%d cancellations: %d before their charge, %d refunded", s.Cancelled, s.CancelledBeforePaid, s.Refunds)
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
	fmt.Fprintf(t, "  declined by the provider (priced above its limit)\t%d\t\n", s.Declined)
	fmt.Fprintf(t, "orders cancelled\t%d\t\n", s.Cancelled)
	fmt.Fprintf(t, "  before their charge (never charged)\t%d\t\n", s.CancelledBeforePaid)
	fmt.Fprintf(t, "  after their charge (refunded)\t%d\t\n", s.Refunds)
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
	row("attempts rolled back", func(g GroupFigures) int { return g.FailedAttempts })
	row("dead-lettered", func(g GroupFigures) int { return g.DeadLettered })
	row("claims in processed_event", func(g GroupFigures) int { return g.ClaimRows })
	t.Flush()
	fmt.Fprintln(w)
	t = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(t, "\tprovider\tbilling\t")
	fmt.Fprintf(t, "charges\t%d\t%d\t\n", s.ProviderCharges, s.ProviderCharges)
	fmt.Fprintf(t, "refunds\t%d\t%d\t\n", s.ProviderRefunds, s.Refunds)
	fmt.Fprintf(t, "charged total\t%s\t%s\t\n", s.ChargedTotal.StringFixed(2), s.OurCharged.StringFixed(2))
	fmt.Fprintf(t, "refunded total\t%s\t%s\t\n", s.RefundedTotal.StringFixed(2), s.OurRefunded.StringFixed(2))
	fmt.Fprintf(t, "net\t%s\t%s\t\n", s.ChargedTotal.Sub(s.RefundedTotal).StringFixed(2), s.OurCharged.Sub(s.OurRefunded).StringFixed(2))
	t.Flush()
	fmt.Fprintln(w)
	t = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(t, "connections dropped after charging or refunding\t%d\t\n", s.ProviderStats.Resets)
	fmt.Fprintf(t, "answers replayed for a known key\t%d\t\n", s.ProviderStats.Replays)
	fmt.Fprintf(t, "payment events published (outbox)\t%d\t\n", s.PaymentEvents)
	fmt.Fprintf(t, "  applied by analytics: charged, failed, refunded\t%d, %d, %d\t\n", s.AppliedCharges, s.AppliedFailures, s.AppliedRefunds)
	fmt.Fprintf(t, "ordered total (all)\t%s\t\n", s.OrderedTotal.StringFixed(2))
	fmt.Fprintf(t, "analytics revenue, refunded\t%s, %s\t\n", s.AnalyticsTotal.StringFixed(2), s.AnalyticsRefund.StringFixed(2))
	t.Flush()
	fmt.Fprintln(w)
	for _, c := range s.Checks {
		mark := "ok  "
		if !c.OK {
			mark = "FAIL"
		}
		fmt.Fprintf(w, "%s %s (%s)\n", mark, c.What, c.Got)
	}
	verdict := "PASS: every order charged exactly once, every cancellation refunded once, every event counted exactly once"
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

// texts are ids as text, cast to uuid[] by the statement: pgx's exec and
// simple_protocol modes (behind a pooler) have no text encoding for a
// []uuid.UUID.
func texts(ids []uuid.UUID) []string {
	out := make([]string, len(ids))
	for i, id := range ids {
		out[i] = id.String()
	}
	return out
}
