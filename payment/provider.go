package payment

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/once-dev/once/orderevents"
	"github.com/once-dev/once/pgdb"
	"github.com/shopspring/decimal"
)

// Faults injected by the simulator. Rates are probabilities per request.
type Faults struct {
	// ResetAfterChargeRate: after charging (or refunding) and storing the
	// answer, drop the connection instead of replying. The client sees a
	// network error for money that moved; only a retry with the same key
	// learns the result.
	ResetAfterChargeRate float64
	// Error5xxRate: answer 503 before doing anything (not stored, as a load
	// balancer in front of a real provider would).
	Error5xxRate float64
	// StoredErrorRate: answer 500 from inside the charge and store that answer
	// under the key, as Stripe does; retries with the key replay it.
	StoredErrorRate float64
	// Latency added to every charge the provider executes (replays are fast),
	// spent holding the key, so it must stay below InFlightTimeout.
	Latency time.Duration
	// UnauthorizedRate: answer 401 invalid_api_key before anything happens,
	// as a provider does while the merchant's key is being rotated.
	UnauthorizedRate float64
}

// ProviderConfig configures a [Provider].
type ProviderConfig struct {
	// DB holds the simulator's state (schema payment_provider). Required.
	DB *pgxpool.Pool
	// KeyRetention is how long a key is remembered (Stripe: 24 hours). After
	// that the same key charges again. Default 24h.
	KeyRetention time.Duration
	// InFlightTimeout: a key whose first request died half-way (the simulator
	// crashed) is given to the next request after this long. A first request
	// that was only slow, and had not begun to execute when another request
	// took its key over, moves no money: it answers 409, and the other
	// executes. One that is executing holds its key's row, so a takeover
	// waits for it and replays its answer. Default 30s.
	InFlightTimeout time.Duration
	// DeclineAbove: amounts above it are declined with 402 card_declined.
	// Default 10000.
	DeclineAbove decimal.Decimal
	Faults       Faults
	Logger       *slog.Logger
}

// Provider is the payment provider simulator: an http.Handler with
//
//	POST /v1/charges   charge once per Idempotency-Key
//	POST /v1/refunds   refund (part of) a charge once per Idempotency-Key
//	GET  /v1/charges   the account's ledger: charges and refunds
//	GET  /healthz
//
// The account is the bearer token of the Authorization header ("acct_default"
// without one); keys, charges and refunds are scoped to it. Refusals carry a
// documented code ([CodeCardDeclined], [CodeChargeNotFound],
// [CodeRefundExceedsCharge], [CodeKeyReused]).
type Provider struct {
	cfg   ProviderConfig
	mux   *http.ServeMux
	stats struct{ charges, refunds, replays, resets, errors5xx, storedErrors, unauthorized atomic.Int64 }
}

// Stats counts what a [Provider] did since it was created.
type Stats struct {
	Charges      int64 // charges executed (each one a ledger row)
	Refunds      int64 // refunds executed (each one a ledger row)
	Replays      int64 // answers replayed from a stored key
	Resets       int64 // connections dropped after charging or refunding
	Errors5xx    int64 // injected 503s
	StoredErrors int64 // injected 500s stored under their key
	Unauthorized int64 // injected 401s
}

// Stats returns the counters.
func (p *Provider) Stats() Stats {
	return Stats{Charges: p.stats.charges.Load(), Refunds: p.stats.refunds.Load(), Replays: p.stats.replays.Load(), Resets: p.stats.resets.Load(),
		Errors5xx: p.stats.errors5xx.Load(), StoredErrors: p.stats.storedErrors.Load(), Unauthorized: p.stats.unauthorized.Load()}
}

// NewProvider returns the simulator. Its tables come from the migrations.
func NewProvider(cfg ProviderConfig) (*Provider, error) {
	if cfg.DB == nil {
		return nil, errors.New("payment: ProviderConfig.DB is required")
	}
	if cfg.KeyRetention == 0 {
		cfg.KeyRetention = 24 * time.Hour
	}
	if cfg.InFlightTimeout == 0 {
		cfg.InFlightTimeout = 30 * time.Second
	}
	if cfg.DeclineAbove.IsZero() {
		cfg.DeclineAbove = decimal.NewFromInt(10000)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	for name, r := range map[string]float64{"ResetAfterChargeRate": cfg.Faults.ResetAfterChargeRate,
		"Error5xxRate": cfg.Faults.Error5xxRate, "StoredErrorRate": cfg.Faults.StoredErrorRate, "UnauthorizedRate": cfg.Faults.UnauthorizedRate} {
		if r < 0 || r > 1 {
			return nil, fmt.Errorf("payment: Faults.%s %v is not in [0, 1]", name, r)
		}
	}
	if cfg.KeyRetention < 0 || cfg.InFlightTimeout < 0 || cfg.Faults.Latency < 0 {
		return nil, errors.New("payment: durations must not be negative")
	}
	if cfg.Faults.Latency >= cfg.InFlightTimeout {
		// Every request would outlive its key: each retry takes the key over
		// and sends the request before it away with a 409, and nothing charges.
		return nil, fmt.Errorf("payment: Faults.Latency %v is not below InFlightTimeout %v: every request would lose its key before it executes",
			cfg.Faults.Latency, cfg.InFlightTimeout)
	}
	p := &Provider{cfg: cfg, mux: http.NewServeMux()}
	p.mux.HandleFunc("POST /v1/charges", func(w http.ResponseWriter, r *http.Request) {
		p.idempotent(w, r, "", p.executeCharge, &p.stats.charges)
	})
	p.mux.HandleFunc("POST /v1/refunds", func(w http.ResponseWriter, r *http.Request) {
		p.idempotent(w, r, "refund:", p.executeRefund, &p.stats.refunds)
	})
	p.mux.HandleFunc("GET /v1/charges", p.ledger)
	p.mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusNoContent) })
	return p, nil
}

func (p *Provider) ServeHTTP(w http.ResponseWriter, r *http.Request) { p.mux.ServeHTTP(w, r) }

// SweepKeys deletes keys older than the retention, in batches, and returns
// how many. Expired keys are already ignored on use; this keeps the table small.
func (p *Provider) SweepKeys(ctx context.Context) (int64, error) {
	var total int64
	for {
		tag, err := p.cfg.DB.Exec(ctx, sweepKeysSQL, p.cfg.KeyRetention.Seconds())
		if err != nil {
			return total, fmt.Errorf("payment: sweep keys: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < 5000 {
			return total, nil
		}
	}
}

const (
	expireKeySQL = `DELETE FROM payment_provider.idempotency_key
WHERE account = $1 AND key = $2 AND created_at < now() - make_interval(secs => $3)`
	claimKeySQL = `INSERT INTO payment_provider.idempotency_key (account, key, request_sha256, state)
VALUES ($1, $2, $3, 'in_flight') ON CONFLICT (account, key) DO NOTHING RETURNING locked_at`
	takeOverKeySQL = `UPDATE payment_provider.idempotency_key SET locked_at = clock_timestamp()
WHERE account = $1 AND key = $2 AND state = 'in_flight' AND request_sha256 = $3
  AND locked_at < now() - make_interval(secs => $4)
RETURNING locked_at`
	// A request executes only while it still holds its key: its locked_at
	// is the fence. The row lock keeps a takeover out until the answer is
	// stored, and a takeover that came first has moved locked_at on.
	holdKeySQL = `SELECT 1 FROM payment_provider.idempotency_key
WHERE account = $1 AND key = $2 AND state = 'in_flight' AND locked_at = $3 FOR UPDATE`
	readKeySQL = `SELECT request_sha256, state, response_status, response_body
FROM payment_provider.idempotency_key WHERE account = $1 AND key = $2`
	insertChargeSQL = `INSERT INTO payment_provider.charge (charge_id, account, idempotency_key, order_id, amount, currency)
VALUES ($1, $2, $3, $4, $5, $6) RETURNING created_at`
	// The charge row is locked so that two refunds of one charge are
	// checked against each other's amounts.
	lockChargeSQL = `SELECT c.order_id, c.amount, c.currency,
  coalesce((SELECT sum(r.amount) FROM payment_provider.refund r WHERE r.charge_id = c.charge_id), 0)
FROM payment_provider.charge c WHERE c.account = $1 AND c.charge_id = $2 FOR UPDATE`
	insertRefundSQL = `INSERT INTO payment_provider.refund (refund_id, account, idempotency_key, charge_id, order_id, amount, currency)
VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING created_at`
	storeAnswerSQL = `UPDATE payment_provider.idempotency_key
SET state = 'done', response_status = $3, response_body = $4 WHERE account = $1 AND key = $2`
	releaseKeySQL = `DELETE FROM payment_provider.idempotency_key WHERE account = $1 AND key = $2 AND state = 'in_flight' AND locked_at = $3`
	sweepKeysSQL  = `DELETE FROM payment_provider.idempotency_key WHERE ctid IN (
SELECT ctid FROM payment_provider.idempotency_key WHERE created_at < now() - make_interval(secs => $1) LIMIT 5000)`
	ledgerSQL = `SELECT charge_id, idempotency_key, order_id, amount, currency, created_at
FROM payment_provider.charge WHERE account = $1 ORDER BY created_at, charge_id`
	refundLedgerSQL = `SELECT refund_id, idempotency_key, charge_id, order_id, amount, currency, created_at
FROM payment_provider.refund WHERE account = $1 ORDER BY created_at, refund_id`
)

type problem struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func account(r *http.Request) string {
	if token, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok && token != "" {
		return token
	}
	return "acct_default"
}

// operation validates body and, in tx, moves the money; it returns the
// answer to store under the request's key in the same transaction, so a
// stored success always has its ledger row and vice versa.
type operation func(ctx context.Context, tx pgx.Tx, acct, key string, body []byte) (status int, answer any, err error)

// errKeyTakenOver: the request held its key so long (past InFlightTimeout)
// that another request took it over; only that one may move the money.
var errKeyTakenOver = errors.New("payment: the idempotency key was taken over by a later request")

// idempotent runs op once per (account, key): a repeat with the same body
// gets the stored answer, another body 422, a repeat while the first runs 409.
// scope keeps one key's charge and refund apart; executed counts what moved money.
func (p *Provider) idempotent(w http.ResponseWriter, r *http.Request, scope string, op operation, executed *atomic.Int64) {
	ctx := r.Context()
	acct := account(r)
	key := r.Header.Get(HeaderIdempotencyKey)
	if key == "" {
		writeJSON(w, http.StatusBadRequest, problem{"idempotency_key_missing", "this request requires an Idempotency-Key header"})
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, 64<<10))
	if err != nil {
		writeJSON(w, http.StatusBadRequest, problem{"bad_request", "cannot read body"})
		return
	}
	if rand.Float64() < p.cfg.Faults.UnauthorizedRate {
		p.stats.unauthorized.Add(1)
		writeJSON(w, http.StatusUnauthorized, problem{"invalid_api_key", "injected fault: the API key is not valid (being rotated)"})
		return
	}
	if rand.Float64() < p.cfg.Faults.Error5xxRate {
		p.stats.errors5xx.Add(1)
		writeJSON(w, http.StatusServiceUnavailable, problem{"unavailable", "injected fault: try again"})
		return
	}
	sum := sha256.Sum256(append([]byte(scope), body...))

	lockedAt, owned, err := p.claimKey(ctx, acct, key, sum[:])
	if err != nil {
		p.cfg.Logger.Error("payment provider: claim key", "err", err)
		writeJSON(w, http.StatusInternalServerError, problem{"internal", "storage unavailable"})
		return
	}
	if !owned {
		p.answerExisting(w, r, acct, key, sum[:])
		return
	}

	// Once a request owns its key, it runs to the end even if the client
	// gave up (timed out, disconnected), as at a real provider: the result is
	// stored for the client's retry with the same key. The latency is spent
	// holding the key, so a retry meanwhile gets 409.
	ctx = context.WithoutCancel(ctx)
	if d := p.cfg.Faults.Latency; d > 0 {
		time.Sleep(d)
	}
	status, answer, err := p.execute(ctx, acct, key, lockedAt, body, op)
	switch {
	case errors.Is(err, errKeyTakenOver):
		p.cfg.Logger.Warn("payment provider: a request outlived its key's in-flight timeout; the request that took the key over executes instead",
			"path", r.URL.Path, "key", key, "in_flight_timeout", p.cfg.InFlightTimeout)
		writeJSON(w, http.StatusConflict, problem{"request_in_progress", "a request with this Idempotency-Key is still being processed"})
		return
	case err != nil:
		p.cfg.Logger.Error("payment provider: execute", "path", r.URL.Path, "err", err)
		// Nothing moved or was stored: free the key for the retry, unless
		// another request has taken it over meanwhile.
		_, _ = p.cfg.DB.Exec(ctx, releaseKeySQL, acct, key, lockedAt)
		writeJSON(w, http.StatusInternalServerError, problem{"internal", "storage unavailable"})
		return
	}
	if status == http.StatusInternalServerError {
		p.stats.storedErrors.Add(1)
	}
	if status == http.StatusOK {
		executed.Add(1)
		if rand.Float64() < p.cfg.Faults.ResetAfterChargeRate {
			p.stats.resets.Add(1)
			dropConnection(w)
			return
		}
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(answer)
}

// execute runs op and stores its answer under the key in one transaction,
// provided the request still holds the key it claimed at lockedAt.
func (p *Provider) execute(ctx context.Context, acct, key string, lockedAt time.Time, body []byte, op operation) (status int, answer []byte, err error) {
	err = pgdb.InTxBounded(ctx, p.cfg.DB, idleBound, func(tx pgx.Tx) error {
		var held int
		if err := tx.QueryRow(ctx, holdKeySQL, acct, key, lockedAt).Scan(&held); errors.Is(err, pgx.ErrNoRows) {
			return errKeyTakenOver
		} else if err != nil {
			return err
		}
		var resp any
		var err error
		if status, resp, err = op(ctx, tx, acct, key, body); err != nil {
			return err
		}
		if answer, err = json.Marshal(resp); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, storeAnswerSQL, acct, key, status, answer)
		return err
	})
	return status, answer, err
}

// claimKey reports whether this request owns the key and must execute it,
// and the key's locked_at, which fences its execution.
func (p *Provider) claimKey(ctx context.Context, acct, key string, sum []byte) (lockedAt time.Time, owned bool, err error) {
	if _, err := p.cfg.DB.Exec(ctx, expireKeySQL, acct, key, p.cfg.KeyRetention.Seconds()); err != nil {
		return time.Time{}, false, err
	}
	err = p.cfg.DB.QueryRow(ctx, claimKeySQL, acct, key, sum).Scan(&lockedAt)
	if !errors.Is(err, pgx.ErrNoRows) {
		return lockedAt, err == nil, err
	}
	err = p.cfg.DB.QueryRow(ctx, takeOverKeySQL, acct, key, sum, p.cfg.InFlightTimeout.Seconds()).Scan(&lockedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return time.Time{}, false, nil
	}
	return lockedAt, err == nil, err
}

func (p *Provider) answerExisting(w http.ResponseWriter, r *http.Request, acct, key string, sum []byte) {
	var stored []byte
	var state string
	var status *int32
	var answer []byte
	err := p.cfg.DB.QueryRow(r.Context(), readKeySQL, acct, key).Scan(&stored, &state, &status, &answer)
	switch {
	case errors.Is(err, pgx.ErrNoRows): // expired between our two statements: the client retries
		writeJSON(w, http.StatusConflict, problem{"request_in_progress", "retry"})
	case err != nil:
		writeJSON(w, http.StatusInternalServerError, problem{"internal", "storage unavailable"})
	case !bytes.Equal(stored, sum):
		writeJSON(w, http.StatusUnprocessableEntity, problem{CodeKeyReused,
			"this Idempotency-Key was used with a different request body"})
	case state == "in_flight":
		writeJSON(w, http.StatusConflict, problem{"request_in_progress",
			"a request with this Idempotency-Key is still being processed"})
	default:
		p.stats.replays.Add(1)
		w.Header().Set(HeaderReplayed, "true")
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(int(*status))
		_, _ = w.Write(answer)
	}
}

// executeCharge validates body and charges.
func (p *Provider) executeCharge(ctx context.Context, tx pgx.Tx, acct, key string, body []byte) (int, any, error) {
	var req chargeBody
	if json.Unmarshal(body, &req) != nil {
		return http.StatusBadRequest, problem{"bad_request", "body is not a charge"}, nil
	}
	if req.OrderID == "" || !orderevents.IsCurrencyCode(req.Currency) {
		return http.StatusBadRequest, problem{"bad_request", "order_id and a 3-letter currency are required"}, nil
	}
	amount, err := decimal.NewFromString(req.Amount)
	switch {
	case err != nil || !amount.IsPositive() || amount.Exponent() < -2:
		return http.StatusBadRequest, problem{CodeInvalidAmount, fmt.Sprintf("amount %q is not a positive decimal with at most 2 fraction digits", req.Amount)}, nil
	case amount.GreaterThan(p.cfg.DeclineAbove):
		return http.StatusPaymentRequired, problem{CodeCardDeclined, "the card was declined"}, nil
	case rand.Float64() < p.cfg.Faults.StoredErrorRate:
		return http.StatusInternalServerError, problem{"processing_error", "injected fault, stored under this key"}, nil
	}
	id := "ch_" + strings.ReplaceAll(uuid.Must(uuid.NewV7()).String(), "-", "")
	var created time.Time
	if err := tx.QueryRow(ctx, insertChargeSQL, id, acct, key, req.OrderID, amount, req.Currency).Scan(&created); err != nil {
		return 0, nil, err
	}
	return http.StatusOK, Charge{ID: id, OrderID: req.OrderID, Amount: amount.StringFixed(2), Currency: req.Currency, Status: "succeeded", Created: created.UTC()}, nil
}

// executeRefund refunds (part of) a charge of the account: never more than
// what is left of it, and only a charge that exists.
func (p *Provider) executeRefund(ctx context.Context, tx pgx.Tx, acct, key string, body []byte) (int, any, error) {
	var req refundBody
	if json.Unmarshal(body, &req) != nil || req.ChargeID == "" {
		return http.StatusBadRequest, problem{"bad_request", "body is not a refund: charge_id and amount are required"}, nil
	}
	amount, err := decimal.NewFromString(req.Amount)
	if err != nil || !amount.IsPositive() || amount.Exponent() < -2 {
		return http.StatusBadRequest, problem{CodeInvalidAmount, fmt.Sprintf("amount %q is not a positive decimal with at most 2 fraction digits", req.Amount)}, nil
	}
	var orderID, currency string
	var charged, refundedSoFar decimal.Decimal
	err = tx.QueryRow(ctx, lockChargeSQL, acct, req.ChargeID).Scan(&orderID, &charged, &currency, &refundedSoFar)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return http.StatusNotFound, problem{CodeChargeNotFound, fmt.Sprintf("no charge %s in this account", req.ChargeID)}, nil
	case err != nil:
		return 0, nil, err
	case refundedSoFar.Add(amount).GreaterThan(charged):
		return http.StatusUnprocessableEntity, problem{CodeRefundExceedsCharge,
			fmt.Sprintf("refund of %s exceeds what is left of charge %s (%s of %s)", amount.StringFixed(2), req.ChargeID, charged.Sub(refundedSoFar).StringFixed(2), charged.StringFixed(2))}, nil
	}
	id := "re_" + strings.ReplaceAll(uuid.Must(uuid.NewV7()).String(), "-", "")
	var created time.Time
	if err := tx.QueryRow(ctx, insertRefundSQL, id, acct, key, req.ChargeID, orderID, amount, currency).Scan(&created); err != nil {
		return 0, nil, err
	}
	return http.StatusOK, Refund{ID: id, ChargeID: req.ChargeID, OrderID: orderID, Amount: amount.StringFixed(2), Currency: currency, Status: "succeeded", Created: created.UTC()}, nil
}

// dropConnection closes the TCP connection without an answer, with a reset
// rather than an orderly close where the platform allows.
func dropConnection(w http.ResponseWriter) {
	hj, ok := w.(http.Hijacker)
	if !ok {
		panic(http.ErrAbortHandler)
	}
	conn, _, err := hj.Hijack()
	if err != nil {
		panic(http.ErrAbortHandler)
	}
	if tcp, ok := conn.(*net.TCPConn); ok {
		_ = tcp.SetLinger(0)
	}
	_ = conn.Close()
}

// LedgerEntry is one charge in the ledger.
type LedgerEntry struct {
	ChargeID       string    `json:"charge_id"`
	IdempotencyKey string    `json:"idempotency_key"`
	OrderID        string    `json:"order_id"`
	Amount         string    `json:"amount"`
	Currency       string    `json:"currency"`
	CreatedAt      time.Time `json:"created_at"`
}

// RefundEntry is one refund in the ledger.
type RefundEntry struct {
	RefundID       string    `json:"refund_id"`
	IdempotencyKey string    `json:"idempotency_key"`
	ChargeID       string    `json:"charge_id"`
	OrderID        string    `json:"order_id"`
	Amount         string    `json:"amount"`
	Currency       string    `json:"currency"`
	CreatedAt      time.Time `json:"created_at"`
}

// Ledger is the answer of GET /v1/charges: the account's charges and refunds.
type Ledger struct {
	Charges      []LedgerEntry     `json:"charges"`
	Count        int               `json:"count"`
	Totals       map[string]string `json:"totals"` // charged, per currency
	Refunds      []RefundEntry     `json:"refunds"`
	RefundCount  int               `json:"refund_count"`
	RefundTotals map[string]string `json:"refund_totals"` // refunded, per currency
}

func (p *Provider) ledger(w http.ResponseWriter, r *http.Request) {
	l, err := p.readLedger(r.Context(), account(r))
	if err != nil {
		writeJSON(w, http.StatusInternalServerError, problem{"internal", err.Error()})
		return
	}
	writeJSON(w, http.StatusOK, l)
}

func (p *Provider) readLedger(ctx context.Context, acct string) (Ledger, error) {
	l := Ledger{Charges: []LedgerEntry{}, Totals: map[string]string{}, Refunds: []RefundEntry{}, RefundTotals: map[string]string{}}
	rows, err := p.cfg.DB.Query(ctx, ledgerSQL, acct)
	if err != nil {
		return l, err
	}
	totals := map[string]decimal.Decimal{}
	for rows.Next() {
		var e LedgerEntry
		var amount decimal.Decimal
		if err := rows.Scan(&e.ChargeID, &e.IdempotencyKey, &e.OrderID, &amount, &e.Currency, &e.CreatedAt); err != nil {
			rows.Close()
			return l, err
		}
		e.Amount = amount.StringFixed(2)
		totals[e.Currency] = totals[e.Currency].Add(amount)
		l.Charges = append(l.Charges, e)
	}
	if err := rows.Err(); err != nil {
		return l, err
	}
	rows, err = p.cfg.DB.Query(ctx, refundLedgerSQL, acct)
	if err != nil {
		return l, err
	}
	refunds := map[string]decimal.Decimal{}
	for rows.Next() {
		var e RefundEntry
		var amount decimal.Decimal
		if err := rows.Scan(&e.RefundID, &e.IdempotencyKey, &e.ChargeID, &e.OrderID, &amount, &e.Currency, &e.CreatedAt); err != nil {
			rows.Close()
			return l, err
		}
		e.Amount = amount.StringFixed(2)
		refunds[e.Currency] = refunds[e.Currency].Add(amount)
		l.Refunds = append(l.Refunds, e)
	}
	if err := rows.Err(); err != nil {
		return l, err
	}
	l.Count, l.RefundCount = len(l.Charges), len(l.Refunds)
	for c, t := range totals {
		l.Totals[c] = t.StringFixed(2)
	}
	for c, t := range refunds {
		l.RefundTotals[c] = t.StringFixed(2)
	}
	return l, nil
}

// idleBound is how long the server lets a request's transaction sit idle:
// it runs its statements back to back, and one whose client vanished
// behind a network black hole must not keep its locks, or its transaction
// id (which holds back every outbox forwarder of the cluster), for long.
const idleBound = 30 * time.Second
