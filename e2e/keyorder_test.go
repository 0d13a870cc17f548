package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/orderevents"
	"github.com/once-dev/once/payment"
)

// callLog stands between the consumers and the provider simulator and logs
// every charge and refund billing makes: its Idempotency-Key (the event
// that makes it: a confirmation for a charge, a cancellation for a
// refund), when the request had arrived and when its answer had come back
// (or its caller had gone). Billing calls the provider inside the handler's
// run, so each call's interval lies inside a run of its event's handler:
// two calls that overlap are two runs at once, and a call that starts
// after another ended started in a run that began after it. It can also
// hold one order's charges (answer 503, as a provider in trouble would).
type callLog struct {
	srv   *httptest.Server
	proxy *httputil.ReverseProxy

	mu    sync.Mutex
	calls []providerCall

	holdOrder atomic.Value // string: the order id whose charges get a 503, "" for none
	held      atomic.Int64 // 503s answered for it
}

type providerCall struct {
	refund     bool
	event      string // its Idempotency-Key: the id of the event that made the call
	start, end time.Time
	status     int // the answer's; 0 if the caller went away first
}

type callKey struct{}

// logCalls puts a call log in front of the scenario's provider: the
// consumers started after it call the provider through it.
func (s *scenario) logCalls() *callLog {
	s.t.Helper()
	if s.providerURL == "" {
		s.providerURL = "http://" + testenv.FreeAddr(s.t)
	}
	target, err := url.Parse(s.providerURL)
	if err != nil {
		s.t.Fatal(err)
	}
	l := &callLog{proxy: httputil.NewSingleHostReverseProxy(target)}
	l.holdOrder.Store("")
	// The answer's time is taken when it is back from the provider, before
	// a byte of it reaches the caller: the interval stays inside the call.
	l.proxy.ModifyResponse = func(resp *http.Response) error {
		if c, ok := resp.Request.Context().Value(callKey{}).(*providerCall); ok {
			c.end, c.status = time.Now(), resp.StatusCode
		}
		return nil
	}
	l.proxy.ErrorHandler = func(w http.ResponseWriter, r *http.Request, err error) {
		if c, ok := r.Context().Value(callKey{}).(*providerCall); ok {
			c.end = time.Now()
		}
		w.WriteHeader(http.StatusBadGateway)
	}
	l.srv = httptest.NewServer(http.HandlerFunc(l.serve))
	s.t.Cleanup(l.srv.Close)
	s.calls = l
	return l
}

func (l *callLog) serve(w http.ResponseWriter, r *http.Request) {
	charge, refund := r.Method == http.MethodPost && r.URL.Path == "/v1/charges", r.Method == http.MethodPost && r.URL.Path == "/v1/refunds"
	if !charge && !refund {
		l.proxy.ServeHTTP(w, r)
		return
	}
	c := &providerCall{refund: refund, event: r.Header.Get(payment.HeaderIdempotencyKey), start: time.Now()}
	defer func() {
		if c.end.IsZero() {
			c.end = time.Now()
		}
		l.mu.Lock()
		l.calls = append(l.calls, *c)
		l.mu.Unlock()
	}()
	if hold := l.holdOrder.Load().(string); charge && hold != "" {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			return // the caller went away
		}
		var req struct {
			OrderID string `json:"order_id"`
		}
		if json.Unmarshal(body, &req) == nil && req.OrderID == hold {
			l.held.Add(1)
			c.end, c.status = time.Now(), http.StatusServiceUnavailable
			http.Error(w, `{"code":"unavailable","message":"staged by the e2e test: this order's charges wait"}`, http.StatusServiceUnavailable)
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
	}
	l.proxy.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), callKey{}, c)))
}

// hold makes every charge of order (its id as the provider sees it) answer
// 503 until it is called again with "".
func (l *callLog) hold(order string) { l.holdOrder.Store(order) }

func (l *callLog) url() string { return l.srv.URL }

func (l *callLog) snapshot() []providerCall {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.calls)
}

// paymentURL is where the consumers reach the provider.
func (s *scenario) paymentURL() string {
	if s.calls != nil {
		return s.calls.url()
	}
	return s.providerURL
}

// place is where a message is in Kafka.
type place struct {
	topic     string
	partition int32
	offset    int64
	key       string
	keyless   bool
}

// places reads the scenario's confirmations and cancellations back: each
// event id's copies, in offset order.
func (s *scenario) places() map[string][]place {
	s.t.Helper()
	out := map[string][]place{}
	for _, topic := range []string{s.topic, s.cancels} {
		for _, m := range testenv.ReadTopic(s.t, s.brokers, topic) {
			var ev struct {
				ID string `json:"event_id"`
			}
			if json.Unmarshal(m.Value, &ev) != nil || ev.ID == "" {
				continue // poison
			}
			out[ev.ID] = append(out[ev.ID], place{topic: topic, partition: m.Partition, offset: m.Offset, key: string(m.Key), keyless: m.Key == nil})
		}
	}
	for _, ps := range out {
		sort.Slice(ps, func(i, j int) bool { return ps[i].offset < ps[j].offset })
	}
	return out
}

// orderFigures is what the call log's check saw.
type orderFigures struct {
	calls int
	// sequenced: calls of a key that followed a call of an earlier event
	// of the same key (the key's order checked).
	sequenced int
	// concurrent: pairs of calls of one partition, of different keys, that
	// overlapped (key order ran; 0 in partition order).
	concurrent int
	// keyless: calls of messages without a key, checked against every call
	// of their partition.
	keyless int
	// unplaced: calls whose event has copies in more than one partition or
	// under more than one key (a producer re-publishing under another key):
	// the copy that made the call is not known, so they are not checked.
	unplaced int
}

// verifyOrder checks the order of billing's provider calls, per topic,
// partition and Kafka key, against where each event is in Kafka: a key's
// calls never overlap and come in its offset order; a call of a message
// without a key overlaps no call of its partition, the calls of every
// message before it ended before it started and those of every message
// after it started after it ended; in partition order, no two calls of a
// partition overlap at all. Every violation fails the test.
func (s *scenario) verifyOrder() orderFigures {
	t := s.t
	t.Helper()
	places := s.places()
	type placed struct {
		providerCall
		place
	}
	byPartition := map[string][]placed{}
	var f orderFigures
	for _, c := range s.calls.snapshot() {
		ps := places[c.event]
		if len(ps) == 0 {
			t.Errorf("a provider call under Idempotency-Key %q, which no event of the scenario has", c.event)
			continue
		}
		f.calls++
		first := ps[0]
		if slices.ContainsFunc(ps, func(p place) bool {
			return p.topic != first.topic || p.partition != first.partition || p.key != first.key || p.keyless != first.keyless
		}) {
			f.unplaced++
			continue
		}
		// Copies under one key: the first runs first (the others wait for
		// it) and makes every call; the others are skipped by its claim.
		q := first.topic + "/" + fmt.Sprint(first.partition)
		byPartition[q] = append(byPartition[q], placed{c, first})
	}
	var bad []string
	for q, calls := range byPartition {
		sort.Slice(calls, func(i, j int) bool { return calls[i].start.Before(calls[j].start) })
		lastOfKey := map[string]placed{}
		for i, c := range calls {
			if prev, ok := lastOfKey[c.key]; ok && !c.keyless {
				switch {
				case prev.end.After(c.start):
					bad = append(bad, fmt.Sprintf("%s key %q: the call of offset %d (%s) began %s before the call of offset %d (%s) ended",
						q, c.key, c.offset, c.event, prev.end.Sub(c.start), prev.offset, prev.event))
				case c.offset < prev.offset:
					bad = append(bad, fmt.Sprintf("%s key %q: offset %d called after offset %d", q, c.key, c.offset, prev.offset))
				case c.offset > prev.offset:
					f.sequenced++
				}
			}
			if !c.keyless {
				lastOfKey[c.key] = c
			}
			for _, o := range calls[i+1:] {
				if !o.start.Before(c.end) {
					break // sorted by start: no later call overlaps c
				}
				switch {
				case o.offset == c.offset:
					bad = append(bad, fmt.Sprintf("%s: two calls of offset %d at once", q, c.offset))
				case c.keyless || o.keyless:
					bad = append(bad, fmt.Sprintf("%s: a call of offset %d ran beside one of offset %d, without a key", q, c.offset, o.offset))
				case s.mode.name != keyOrder.name:
					bad = append(bad, fmt.Sprintf("%s, %s: the calls of offsets %d and %d overlapped", q, s.mode, c.offset, o.offset))
				case c.key != o.key:
					f.concurrent++
				}
			}
			if c.keyless {
				f.keyless++
				for _, o := range calls {
					if o.offset < c.offset && o.end.After(c.start) || o.offset > c.offset && o.start.Before(c.end) {
						bad = append(bad, fmt.Sprintf("%s: offset %d ran out of order with offset %d, without a key", q, o.offset, c.offset))
					}
				}
			}
		}
	}
	if len(bad) > 0 {
		t.Errorf("%d violations of the order in billing's provider calls, e.g.:\n%s", len(bad), strings.Join(bad[:min(len(bad), 10)], "\n"))
	}
	if s.mode.name == keyOrder.name && f.concurrent == 0 {
		t.Errorf("key order: no two calls of different keys of one partition overlapped in %d calls; the concurrency did not happen", f.calls)
	}
	// What the check needs to mean anything: keys with many events, and
	// messages without a key, where the scenario publishes them.
	if s.keyByCustomer && f.sequenced == 0 {
		t.Errorf("no key had two of its events' calls in %d calls: its order was never checked", f.calls)
	}
	if s.keylessEvery > 0 && f.keyless == 0 {
		t.Errorf("no call of a message without a key in %d calls: their order was never checked", f.calls)
	}
	t.Logf("call log: %+v", f)
	return f
}

// 20. A held key (key order): one order's charges answered 503 for as long
// as the test holds them, on a one-partition topic whose confirmations are
// keyed by six customers in turn. The held confirmation holds its key, not
// the partition: the other keys' confirmations behind it are charged until
// the window (four times --concurrency past it) is full, its own key's wait
// uncharged, nothing past the window is handed out, and billing's committed
// offset stands at the held confirmation the whole time (read while it is
// held). Released, everything is charged, the held key's confirmations in
// their order after it.
func TestAHeldKey(t *testing.T) {
	s := newScenario(t, "20 a held key", 1)
	s.mode, s.keyByCustomer = keyOrder, true
	const keys, perKey, heldAt = 6, 10, 2 * 6 // key 0's third confirmation
	const window = 4 * keyConcurrency
	s.customers = s.customers[:keys]
	calls := s.logCalls()
	s.startProvider()
	var events []orderevents.Confirmed
	for i := range keys * perKey {
		ev := s.newEvent(decimal.New(int64(100+i), -2))
		if i == heldAt {
			calls.hold(fmt.Sprint(ev.OrderID()))
		}
		s.sendEvent(ev, &s.events)
		events = append(events, ev)
	}
	// While it is held: every confirmation before it, and those of the
	// other keys within the window after it.
	var want, waiting []uuid.UUID
	for off, ev := range events {
		switch {
		case off < heldAt || off < heldAt+window && off%keys != heldAt%keys:
			want = append(want, ev.EventID())
		default:
			waiting = append(waiting, ev.EventID())
		}
	}
	s.consumer("consumer-a")

	billing := s.group(billingGroup)
	admin := testenv.AdminOn(t, s.brokers)
	var committed []int64
	commitPoint := func() int64 {
		off, ok := testenv.CommittedOffsets(t, admin, billing, s.topic)[0]
		if !ok {
			off = -1
		}
		committed = append(committed, off)
		return off
	}
	charged := func(ids []uuid.UUID) int {
		var n int
		if err := s.pool.QueryRow(context.Background(), `SELECT count(*) FROM billing.payments WHERE event_id = ANY($1) AND status = 'charged'`, ids).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	for deadline := time.Now().Add(90 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		n, off := charged(want), commitPoint()
		if off > heldAt {
			t.Fatalf("billing committed offset %d while offset %d was held", off, heldAt)
		}
		if n == len(want) && off == heldAt {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("within 90 s of the hold: %d of the %d confirmations around the held key charged, billing's commit point at %d; want all, at %d",
				n, len(want), off, heldAt)
		}
	}
	// The fault happened: the held charge was refused, and held, again and
	// again, while the others went on.
	if n := calls.held.Load(); n < 2 {
		t.Fatalf("the held order's charge was answered 503 %d times; want it held (at least twice)", n)
	}
	// Nothing more runs while the window is full, and the commit point does
	// not pass the held confirmation (three commit intervals).
	for range 15 {
		time.Sleep(200 * time.Millisecond)
		commitPoint()
	}
	if n := charged(waiting); n != 0 {
		t.Errorf("%d confirmations of the held key or past the window charged while it was held; want none", n)
	}
	for _, c := range calls.snapshot() {
		if slices.Contains(waiting, uuid.MustParse(c.event)) && c.event != events[heldAt].EventID().String() {
			t.Errorf("the provider was called for %s, which waits behind the held key or the window", c.event)
		}
	}
	for _, off := range committed {
		if off > heldAt {
			t.Fatalf("billing committed offset %d while offset %d was held (reads: %v)", off, heldAt, committed)
		}
	}
	t.Logf("held: %d answers 503, %d confirmations charged around it, commit point read %d times, at most %d", calls.held.Load(), len(want), len(committed), slices.Max(committed))

	calls.hold("")
	s.verify(120 * time.Second)
	f := calls.snapshot()
	var last time.Time // when the held charge went through
	for _, c := range f {
		if c.event == events[heldAt].EventID().String() && c.status/100 == 2 && c.end.After(last) {
			last = c.end
		}
	}
	if last.IsZero() {
		t.Fatal("the held order was never charged after its release")
	}
	// The held key's confirmations after it: charged, after it.
	for off := heldAt + keys; off < len(events); off += keys {
		for _, c := range f {
			if c.event == events[off].EventID().String() && c.start.Before(last) {
				t.Errorf("offset %d of the held key was charged before the held one was", off)
			}
		}
	}
	if o := s.readOutcomes(); o.held() == 0 {
		t.Error("billing's log shows no attempt held: the fault did not happen")
	}
}
