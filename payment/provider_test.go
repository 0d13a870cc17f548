package payment_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/payment"
)

// provider runs the simulator on a real loopback HTTP server and returns a
// client for a fresh merchant account, so tests never see each other's keys.
type provider struct {
	srv      *httptest.Server
	requests atomic.Int64
	account  string
}

func startProvider(t *testing.T, pool *pgxpool.Pool, cfg payment.ProviderConfig) *provider {
	t.Helper()
	cfg.DB = pool
	p, err := payment.NewProvider(cfg)
	if err != nil {
		t.Fatal(err)
	}
	pr := &provider{account: "acct_" + uuid.NewString()[:8]}
	pr.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		pr.requests.Add(1)
		p.ServeHTTP(w, r)
	}))
	t.Cleanup(pr.srv.Close)
	return pr
}

func (p *provider) client(t *testing.T, cfg payment.ClientConfig) *payment.Client {
	t.Helper()
	cfg.BaseURL = p.srv.URL
	if cfg.APIKey == "" {
		cfg.APIKey = p.account
	}
	if cfg.InitialBackoff == 0 {
		cfg.InitialBackoff = 5 * time.Millisecond
	}
	c, err := payment.NewClient(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func (p *provider) post(t *testing.T, key, body string) *http.Response {
	t.Helper()
	return p.postTo(t, "/v1/charges", key, body)
}

func (p *provider) postTo(t *testing.T, path, key, body string) *http.Response {
	t.Helper()
	resp, err := p.send(path, key, body)
	if err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	return resp
}

// send posts without a *testing.T, so that any goroutine may call it.
func (p *provider) send(path, key, body string) (*http.Response, error) {
	req, err := http.NewRequest(http.MethodPost, p.srv.URL+path, bytes.NewBufferString(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+p.account)
	if key != "" {
		req.Header.Set(payment.HeaderIdempotencyKey, key)
	}
	return http.DefaultClient.Do(req)
}

// pending is a request sent by sendAsync.
type pending struct {
	path string
	done chan struct{}
	resp *http.Response
	err  error
}

func (p *provider) sendAsync(path, key, body string) *pending {
	r := &pending{path: path, done: make(chan struct{})}
	go func() { defer close(r.done); r.resp, r.err = p.send(path, key, body) }()
	return r
}

// wait returns the request's answer, or fails the test from its own goroutine.
func (r *pending) wait(t *testing.T) *http.Response {
	t.Helper()
	<-r.done
	if r.err != nil {
		t.Fatalf("POST %s: %v", r.path, r.err)
	}
	t.Cleanup(func() { r.resp.Body.Close() })
	return r.resp
}

func ledger(t *testing.T, c *payment.Client) payment.Ledger {
	t.Helper()
	l, err := c.Ledger(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func chargeReq(amount string) payment.ChargeRequest {
	return payment.ChargeRequest{OrderID: uuid.NewString(), Amount: decimal.RequireFromString(amount), Currency: "EUR"}
}

func TestRepeatWithSameKeyReplaysAndChargesOnce(t *testing.T) {
	pool := reftest.Postgres(t)
	p := startProvider(t, pool, payment.ProviderConfig{})
	c := p.client(t, payment.ClientConfig{})
	key := uuid.Must(uuid.NewV7()).String()
	req := chargeReq("42.10")
	first, err := c.Charge(context.Background(), req, key)
	if err != nil {
		t.Fatal(err)
	}
	second, err := c.Charge(context.Background(), req, key)
	if err != nil {
		t.Fatal(err)
	}
	if first.ID != second.ID || first.Replayed || !second.Replayed {
		t.Fatalf("first %+v, second %+v; want the same charge, the second replayed", first, second)
	}
	if l := ledger(t, c); l.Count != 1 || l.Totals["EUR"] != "42.10" {
		t.Fatalf("ledger %+v; want one charge of 42.10", l)
	}
}

func TestSameKeyDifferentBodyIs422(t *testing.T) {
	pool := reftest.Postgres(t)
	p := startProvider(t, pool, payment.ProviderConfig{})
	c := p.client(t, payment.ClientConfig{})
	key := uuid.Must(uuid.NewV7()).String()
	if _, err := c.Charge(context.Background(), chargeReq("10.00"), key); err != nil {
		t.Fatal(err)
	}
	_, err := c.Charge(context.Background(), chargeReq("11.00"), key)
	if !errors.Is(err, payment.ErrKeyReused) || !payment.IsPermanent(err) {
		t.Fatalf("got %v; want a permanent ErrKeyReused", err)
	}
	if l := ledger(t, c); l.Count != 1 {
		t.Fatalf("ledger has %d charges, want 1", l.Count)
	}
}

func TestRequestWhileKeyInFlightIs409(t *testing.T) {
	pool := reftest.Postgres(t)
	p := startProvider(t, pool, payment.ProviderConfig{InFlightTimeout: time.Second, Faults: payment.Faults{Latency: 400 * time.Millisecond}})
	key := uuid.Must(uuid.NewV7()).String()
	body := `{"order_id":"o-1","amount":"5.00","currency":"EUR"}`
	first := p.sendAsync("/v1/charges", key, body)
	time.Sleep(100 * time.Millisecond) // the first request now holds the key
	if s := p.post(t, key, body).StatusCode; s != http.StatusConflict {
		t.Fatalf("request during the first one's processing answered %d, want 409", s)
	}
	if s := first.wait(t).StatusCode; s != http.StatusOK {
		t.Fatalf("first request answered %d, want 200", s)
	}

	// A key whose request never finished (the simulator crashed) stays in
	// flight until InFlightTimeout, then the next request takes it over.
	held := "held-" + key
	if _, err := pool.Exec(context.Background(), `INSERT INTO payment_provider.idempotency_key (account, key, request_sha256, state)
		VALUES ($1, $2, sha256($3::bytea), 'in_flight')`, p.account, held, []byte(body)); err != nil {
		t.Fatal(err)
	}
	if s := p.post(t, held, body).StatusCode; s != http.StatusConflict {
		t.Fatalf("abandoned key answered %d, want 409", s)
	}
	time.Sleep(1100 * time.Millisecond)
	if s := p.post(t, held, body).StatusCode; s != http.StatusOK {
		t.Fatalf("abandoned key after InFlightTimeout answered %d, want 200", s)
	}
	if l := ledger(t, p.client(t, payment.ClientConfig{})); l.Count != 2 {
		t.Fatalf("ledger has %d charges, want 2", l.Count)
	}
}

// A request that outlives its key's in-flight timeout before it executes
// loses the key to the request that takes it over; only that one moves the
// money, as at a real provider, even when the loser reaches its transaction
// first. Here the slow request is at an instance of the simulator with a
// long timeout and the takeover at one with a short timeout (two instances
// on one database). Without the fence both charged; without its locked_at
// the loser charged and the takeover was sent away.
func TestARequestThatOutlivedItsKeyDoesNotChargeBesideTheTakeover(t *testing.T) {
	pool := reftest.Postgres(t)
	for _, path := range []string{"/v1/charges", "/v1/refunds"} {
		t.Run(path, func(t *testing.T) {
			// The slow one executes at 2 s; the other takes the key over at
			// 1.4 s, past its 1 s timeout, and executes at 2.35 s.
			slow := startProvider(t, pool, payment.ProviderConfig{Faults: payment.Faults{Latency: 2 * time.Second}})
			quick := startProvider(t, pool, payment.ProviderConfig{InFlightTimeout: time.Second, Faults: payment.Faults{Latency: 950 * time.Millisecond}})
			quick.account = slow.account
			body := `{"order_id":"o-1","amount":"5.00","currency":"EUR"}`
			if path == "/v1/refunds" {
				ch, err := quick.client(t, payment.ClientConfig{}).Charge(context.Background(), chargeReq("9.00"), uuid.NewString())
				if err != nil {
					t.Fatal(err)
				}
				body = fmt.Sprintf(`{"charge_id":%q,"amount":"5.00"}`, ch.ID)
			}
			key := uuid.NewString()
			first := slow.sendAsync(path, key, body)
			time.Sleep(1400 * time.Millisecond)
			taken := quick.postTo(t, path, key, body)
			if taken.StatusCode != http.StatusOK || taken.Header.Get(payment.HeaderReplayed) != "" {
				t.Fatalf("the takeover answered %d (replayed %q), want a fresh 200: it did not take the key over", taken.StatusCode, taken.Header.Get(payment.HeaderReplayed))
			}
			if lost := first.wait(t); lost.StatusCode != http.StatusConflict {
				t.Fatalf("the request that lost its key answered %d, want 409", lost.StatusCode)
			}
			l := ledger(t, quick.client(t, payment.ClientConfig{}))
			if path == "/v1/charges" && l.Count != 1 || path == "/v1/refunds" && (l.RefundCount != 1 || l.RefundTotals["EUR"] != "5.00") {
				t.Fatalf("the ledger after one key's two requests: %+v; want one %s", l, path)
			}
			if again := slow.postTo(t, path, key, body); again.StatusCode != http.StatusOK || again.Header.Get(payment.HeaderReplayed) != "true" {
				t.Fatalf("a retry after both answered %d (replayed %q), want the stored 200", again.StatusCode, again.Header.Get(payment.HeaderReplayed))
			}
		})
	}
}

// A takeover that comes while the key's request is past its fence (a
// stalled insert, as on a loaded machine) waits for it and replays its
// answer: the fence's row lock. Without the lock both charged.
func TestATakeoverWhileTheRequestExecutesWaitsForItsAnswer(t *testing.T) {
	pool := reftest.Postgres(t)
	ctx := context.Background()
	const inFlight = 500 * time.Millisecond
	p := startProvider(t, pool, payment.ProviderConfig{InFlightTimeout: inFlight})
	stall, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer stall.Rollback(ctx)
	if _, err := stall.Exec(ctx, `LOCK TABLE payment_provider.charge IN SHARE ROW EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	key := uuid.NewString()
	body := `{"order_id":"o-1","amount":"5.00","currency":"EUR"}`
	first := p.sendAsync("/v1/charges", key, body)
	time.Sleep(inFlight + 600*time.Millisecond)
	takeover := p.sendAsync("/v1/charges", key, body)
	// The fault, proven before the outcome: the key is still in flight past
	// its timeout, and the takeover waits on the key's row.
	var state string
	var age time.Duration
	if err := pool.QueryRow(ctx, `SELECT state, now() - locked_at FROM payment_provider.idempotency_key WHERE account = $1 AND key = $2`, p.account, key).Scan(&state, &age); err != nil {
		t.Fatal(err)
	}
	if state != "in_flight" || age < inFlight {
		t.Fatalf("the first request is %s for %v; want in flight past %v", state, age, inFlight)
	}
	deadline := time.Now().Add(10 * time.Second)
	for waiting := 0; waiting == 0; {
		if time.Now().After(deadline) {
			t.Fatal("the takeover never waited on the key's row")
		}
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
WHERE wait_event_type = 'Lock' AND query LIKE 'UPDATE payment_provider.idempotency_key SET locked_at%'`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := stall.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if r := first.wait(t); r.StatusCode != http.StatusOK {
		t.Fatalf("the stalled request answered %d, want 200", r.StatusCode)
	}
	if r := takeover.wait(t); r.StatusCode != http.StatusOK || r.Header.Get(payment.HeaderReplayed) != "true" {
		t.Fatalf("the takeover answered %d (replayed %q), want the first request's stored 200", r.StatusCode, r.Header.Get(payment.HeaderReplayed))
	}
	if l := ledger(t, p.client(t, payment.ClientConfig{})); l.Count != 1 {
		t.Fatalf("%d charges under one key, want 1", l.Count)
	}
}

func TestALatencyThatOutlastsTheInFlightTimeoutIsRefused(t *testing.T) {
	_, err := payment.NewProvider(payment.ProviderConfig{DB: reftest.Postgres(t), InFlightTimeout: time.Second, Faults: payment.Faults{Latency: time.Second}})
	if err == nil || !strings.Contains(err.Error(), "Faults.Latency 1s") || !strings.Contains(err.Error(), "InFlightTimeout 1s") {
		t.Fatalf("got %v; want a refusal naming Faults.Latency and InFlightTimeout", err)
	}
}

func TestChargeWithoutKeyIs400(t *testing.T) {
	pool := reftest.Postgres(t)
	p := startProvider(t, pool, payment.ProviderConfig{})
	if resp := p.post(t, "", `{"order_id":"o","amount":"1.00","currency":"EUR"}`); resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("got %d, want 400", resp.StatusCode)
	}
	if l := ledger(t, p.client(t, payment.ClientConfig{})); l.Count != 0 {
		t.Fatal("a request without a key charged")
	}
}

func TestKeysExpireAfterRetention(t *testing.T) {
	pool := reftest.Postgres(t)
	p := startProvider(t, pool, payment.ProviderConfig{KeyRetention: time.Second})
	c := p.client(t, payment.ClientConfig{})
	key, req := uuid.Must(uuid.NewV7()).String(), chargeReq("3.00")
	for range 2 {
		if _, err := c.Charge(context.Background(), req, key); err != nil {
			t.Fatal(err)
		}
	}
	if n := ledger(t, c).Count; n != 1 {
		t.Fatalf("within retention: %d charges, want 1", n)
	}
	time.Sleep(1100 * time.Millisecond)
	if _, err := c.Charge(context.Background(), req, key); err != nil {
		t.Fatal(err)
	}
	if n := ledger(t, c).Count; n != 2 {
		t.Fatalf("after retention: %d charges, want 2 (the provider forgot the key)", n)
	}

	time.Sleep(1100 * time.Millisecond)
	sweeper, err := payment.NewProvider(payment.ProviderConfig{DB: pool, KeyRetention: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := sweeper.SweepKeys(context.Background()); err != nil || n < 1 {
		t.Fatalf("sweep deleted %d keys (%v); want the expired one", n, err)
	}
}

func TestStateSurvivesRestart(t *testing.T) {
	pool := reftest.Postgres(t)
	p := startProvider(t, pool, payment.ProviderConfig{})
	key, req := uuid.Must(uuid.NewV7()).String(), chargeReq("8.00")
	first, err := p.client(t, payment.ClientConfig{}).Charge(context.Background(), req, key)
	if err != nil {
		t.Fatal(err)
	}
	restarted := startProvider(t, pool, payment.ProviderConfig{})
	restarted.account = p.account
	again, err := restarted.client(t, payment.ClientConfig{}).Charge(context.Background(), req, key)
	if err != nil || again.ID != first.ID || !again.Replayed {
		t.Fatalf("after restart: %+v, %v; want a replay of %s", again, err, first.ID)
	}
}

// Reply-then-reset: the provider charges, then drops the connection. Without
// a retry the caller sees a network error; a retry with the same key gets the
// stored answer, and the ledger has one charge.
func TestResetAfterChargeIsRecoveredByTheSameKey(t *testing.T) {
	pool := reftest.Postgres(t)
	p := startProvider(t, pool, payment.ProviderConfig{Faults: payment.Faults{ResetAfterChargeRate: 1}})
	key, req := uuid.Must(uuid.NewV7()).String(), chargeReq("19.99")

	_, err := p.client(t, payment.ClientConfig{MaxAttempts: 1}).Charge(context.Background(), req, key)
	if err == nil || payment.IsPermanent(err) {
		t.Fatalf("got %v; want a non-permanent network error", err)
	}
	c := p.client(t, payment.ClientConfig{})
	ch, err := c.Charge(context.Background(), req, key)
	if err != nil || !ch.Replayed {
		t.Fatalf("retry: %+v, %v; want the replayed charge", ch, err)
	}
	if l := ledger(t, c); l.Count != 1 {
		t.Fatalf("ledger has %d charges, want 1", l.Count)
	}
}

func TestTransient5xxIsRetriedAndNotStored(t *testing.T) {
	pool := reftest.Postgres(t)
	p := startProvider(t, pool, payment.ProviderConfig{Faults: payment.Faults{Error5xxRate: 1}})
	c := p.client(t, payment.ClientConfig{MaxAttempts: 3})
	key, req := uuid.Must(uuid.NewV7()).String(), chargeReq("1.00")
	_, err := c.Charge(context.Background(), req, key)
	var perr *payment.Error
	if !errors.As(err, &perr) || perr.StatusCode != 503 || payment.IsPermanent(err) {
		t.Fatalf("got %v; want a retryable 503", err)
	}
	if n := p.requests.Load(); n != 3 {
		t.Fatalf("%d requests, want 3 (MaxAttempts)", n)
	}
	// Nothing was stored: the provider, healthy again, charges the key.
	healthy := startProvider(t, pool, payment.ProviderConfig{})
	healthy.account = p.account
	if _, err := healthy.client(t, payment.ClientConfig{}).Charge(context.Background(), req, key); err != nil {
		t.Fatal(err)
	}
}

func TestReplayedStored5xxIsSurfacedNotRetriedForever(t *testing.T) {
	pool := reftest.Postgres(t)
	p := startProvider(t, pool, payment.ProviderConfig{Faults: payment.Faults{StoredErrorRate: 1}})
	c := p.client(t, payment.ClientConfig{MaxAttempts: 10})
	_, err := c.Charge(context.Background(), chargeReq("1.00"), uuid.Must(uuid.NewV7()).String())
	var perr *payment.Error
	if !errors.As(err, &perr) || perr.StatusCode != 500 || !perr.Replayed || !payment.IsPermanent(err) {
		t.Fatalf("got %v; want a permanent replayed 500", err)
	}
	if n := p.requests.Load(); n != 2 {
		t.Fatalf("%d requests; want 2 (the original 500, then its replay stops the retries)", n)
	}
}

func TestDeclineIsPermanentAndNotRetried(t *testing.T) {
	pool := reftest.Postgres(t)
	p := startProvider(t, pool, payment.ProviderConfig{DeclineAbove: decimal.NewFromInt(100)})
	c := p.client(t, payment.ClientConfig{})
	_, err := c.Charge(context.Background(), chargeReq("100.01"), uuid.Must(uuid.NewV7()).String())
	var perr *payment.Error
	if !errors.As(err, &perr) || perr.Code != "card_declined" || !payment.IsPermanent(err) || p.requests.Load() != 1 {
		t.Fatalf("got %v after %d requests; want one permanent card_declined", err, p.requests.Load())
	}
}

// A slow provider outlasts the client's timeout. The provider finishes the
// charge anyway and stores it; the client's retries with the same key see 409
// while it is in flight, then the replayed charge.
func TestSlowProviderTimesOutAndRetries(t *testing.T) {
	pool := reftest.Postgres(t)
	p := startProvider(t, pool, payment.ProviderConfig{Faults: payment.Faults{Latency: 200 * time.Millisecond}})
	key, req := uuid.Must(uuid.NewV7()).String(), chargeReq("1.00")

	_, err := p.client(t, payment.ClientConfig{RequestTimeout: 50 * time.Millisecond, MaxAttempts: 2}).Charge(context.Background(), req, key)
	var perr *payment.Error
	if !errors.As(err, &perr) || perr.StatusCode != http.StatusConflict || payment.IsPermanent(err) {
		t.Fatalf("got %v; want a retryable 409 while the first attempt is still being processed", err)
	}
	c := p.client(t, payment.ClientConfig{RequestTimeout: 50 * time.Millisecond, MaxAttempts: 20, InitialBackoff: 20 * time.Millisecond})
	ch, err := c.Charge(context.Background(), req, key)
	if err != nil || !ch.Replayed {
		t.Fatalf("got %+v, %v; want the stored charge replayed", ch, err)
	}
	if l := ledger(t, c); l.Count != 1 {
		t.Fatalf("ledger has %d charges, want 1", l.Count)
	}
}

// Only the provider's own final verdicts are permanent: its 402, its
// documented refusal codes, a 5xx it stored for the key. A rotated API key
// (401, 403), a wrong base URL or a proxy (404 or 400 without the provider's
// code), a timeout (408): the environment's, retried with the same key.
func TestOnlyTheProvidersVerdictsArePermanent(t *testing.T) {
	for _, tc := range []struct {
		status    int
		body      string
		replayed  bool
		permanent bool
	}{
		{401, `{"code":"invalid_api_key","message":"rotated"}`, false, false},
		{403, `{"code":"forbidden","message":"no"}`, false, false},
		{404, `404 page not found`, false, false},
		{408, ``, false, false},
		{400, `<html>bad gateway config</html>`, false, false},
		{409, `{"code":"request_in_progress"}`, false, false},
		{429, `{"code":"rate_limited"}`, false, false},
		{503, `{"code":"unavailable"}`, false, false},
		{500, `{"code":"processing_error"}`, true, true},
		{402, `{"code":"card_declined","message":"declined"}`, false, true},
		{404, `{"code":"charge_not_found","message":"no charge"}`, false, true},
		{422, `{"code":"refund_exceeds_charge","message":"too much"}`, false, true},
		{422, `{"code":"idempotency_key_reused","message":"other body"}`, false, true},
	} {
		var requests atomic.Int64
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			requests.Add(1)
			if tc.replayed {
				w.Header().Set(payment.HeaderReplayed, "true")
			}
			w.WriteHeader(tc.status)
			_, _ = w.Write([]byte(tc.body))
		}))
		c, err := payment.NewClient(payment.ClientConfig{BaseURL: srv.URL, MaxAttempts: 3, InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.Charge(context.Background(), payment.ChargeRequest{OrderID: "1", Amount: decimal.NewFromInt(1), Currency: "EUR"}, "k")
		srv.Close()
		wantRequests := int64(3)
		if tc.permanent {
			wantRequests = 1
		}
		if err == nil || payment.IsPermanent(err) != tc.permanent || requests.Load() != wantRequests {
			t.Errorf("%d %s: err %v, permanent %v after %d requests; want permanent %v after %d", tc.status, tc.body, err,
				payment.IsPermanent(err), requests.Load(), tc.permanent, wantRequests)
		}
	}
}

// Refunds: once per key, never more than what is left of the charge, and a
// charge the account does not have is a refusal of its own.
func TestRefunds(t *testing.T) {
	pool := reftest.Postgres(t)
	p := startProvider(t, pool, payment.ProviderConfig{})
	c := p.client(t, payment.ClientConfig{})
	ctx := context.Background()
	ch, err := c.Charge(ctx, payment.ChargeRequest{OrderID: "77", Amount: decimal.RequireFromString("10.00"), Currency: "EUR"}, uuid.NewString())
	if err != nil {
		t.Fatal(err)
	}
	key := uuid.NewString()
	first, err := c.Refund(ctx, payment.RefundRequest{ChargeID: ch.ID, Amount: decimal.RequireFromString("6.00")}, key)
	if err != nil {
		t.Fatal(err)
	}
	again, err := c.Refund(ctx, payment.RefundRequest{ChargeID: ch.ID, Amount: decimal.RequireFromString("6.00")}, key)
	if err != nil || again.ID != first.ID || !again.Replayed {
		t.Fatalf("the same refund again: %+v, %v; want the stored answer", again, err)
	}
	_, err = c.Refund(ctx, payment.RefundRequest{ChargeID: ch.ID, Amount: decimal.RequireFromString("4.01")}, uuid.NewString())
	var perr *payment.Error
	if !errors.As(err, &perr) || perr.Code != payment.CodeRefundExceedsCharge || !payment.IsPermanent(err) {
		t.Fatalf("refunding more than is left: %v; want a permanent refund_exceeds_charge", err)
	}
	if _, err := c.Refund(ctx, payment.RefundRequest{ChargeID: ch.ID, Amount: decimal.RequireFromString("4.00")}, uuid.NewString()); err != nil {
		t.Fatalf("refunding the rest: %v", err)
	}
	_, err = c.Refund(ctx, payment.RefundRequest{ChargeID: "ch_nope", Amount: decimal.RequireFromString("1.00")}, uuid.NewString())
	if !errors.As(err, &perr) || perr.Code != payment.CodeChargeNotFound || !payment.IsPermanent(err) {
		t.Fatalf("refunding an unknown charge: %v; want a permanent charge_not_found", err)
	}
	l := ledger(t, c)
	if l.Count != 1 || l.RefundCount != 2 || l.RefundTotals["EUR"] != "10.00" || l.Totals["EUR"] != "10.00" {
		t.Fatalf("ledger %+v; want one charge of 10.00 and refunds totalling 10.00", l)
	}
}
