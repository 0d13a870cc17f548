package payment

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/shopspring/decimal"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// HeaderIdempotencyKey carries the client's idempotency key.
const HeaderIdempotencyKey = "Idempotency-Key"

// HeaderReplayed is set by the provider on a response it replays from a
// stored earlier request with the same key.
const HeaderReplayed = "Idempotent-Replayed"

// ChargeRequest is what is charged. Build it only from the immutable event, so
// that every retry of one key sends the same bytes.
type ChargeRequest struct {
	OrderID  string
	Amount   decimal.Decimal
	Currency string
}

type chargeBody struct {
	OrderID  string `json:"order_id"`
	Amount   string `json:"amount"`
	Currency string `json:"currency"`
}

func (r ChargeRequest) body() ([]byte, error) {
	return json.Marshal(chargeBody{OrderID: r.OrderID, Amount: r.Amount.StringFixed(2), Currency: r.Currency})
}

// Charge is the provider's record of a successful charge.
type Charge struct {
	ID       string `json:"id"`
	OrderID  string `json:"order_id"`
	Amount   string `json:"amount"`
	Currency string `json:"currency"`
	Status   string `json:"status"`
	// Created is when the provider charged; a replay carries the same time.
	Created time.Time `json:"created_at"`
	// Replayed is true when the provider answered from a stored earlier
	// request with the same key: the charge happened once, before.
	Replayed bool `json:"-"`
}

// RefundRequest refunds (part of) a charge. Build it only from immutable
// records (the charge as recorded), so every retry of one key sends the same
// bytes.
type RefundRequest struct {
	ChargeID string
	Amount   decimal.Decimal
}

type refundBody struct {
	ChargeID string `json:"charge_id"`
	Amount   string `json:"amount"`
}

func (r RefundRequest) body() ([]byte, error) {
	return json.Marshal(refundBody{ChargeID: r.ChargeID, Amount: r.Amount.StringFixed(2)})
}

// Refund is the provider's record of a successful refund.
type Refund struct {
	ID       string    `json:"id"`
	ChargeID string    `json:"charge_id"`
	OrderID  string    `json:"order_id"`
	Amount   string    `json:"amount"`
	Currency string    `json:"currency"`
	Status   string    `json:"status"`
	Created  time.Time `json:"created_at"`
	Replayed bool      `json:"-"`
}

// The provider's documented refusal codes: its final answer for this
// request, which no retry with the same key can change.
const (
	CodeCardDeclined        = "card_declined"          // 402: the charge was declined
	CodeChargeNotFound      = "charge_not_found"       // 404: a refund of a charge the account does not have
	CodeRefundExceedsCharge = "refund_exceeds_charge"  // 422: more than what is left of the charge
	CodeKeyReused           = "idempotency_key_reused" // 422: the key was used with another request
	CodeInvalidAmount       = "invalid_amount"         // 400: not a positive amount in cents
)

var permanentCodes = map[string]bool{CodeCardDeclined: true, CodeChargeNotFound: true, CodeRefundExceedsCharge: true,
	CodeKeyReused: true, CodeInvalidAmount: true}

// Error is a non-success answer of the provider.
type Error struct {
	StatusCode int
	Code       string // the provider's error code, e.g. "card_declined"
	Message    string
	Replayed   bool // the provider replayed this answer from a stored request
}

func (e *Error) Error() string {
	replayed := ""
	if e.Replayed {
		replayed = ", replayed for this key"
	}
	return fmt.Sprintf("payment provider answered %d %s: %s%s", e.StatusCode, e.Code, e.Message, replayed)
}

// Permanent reports whether the answer is the provider's own final verdict
// on this request: a 402, one of its documented refusal codes, or a 5xx it
// stored for the key and replays. Everything else is the environment's
// fault and may pass on a retry with the same key: 401 and 403 (a rotated
// key), a 404 or 400 without the provider's code (a wrong base URL, a
// proxy), 408, 409 (in flight), 429 and the other 5xx.
func (e *Error) Permanent() bool {
	switch {
	case e.StatusCode >= 500:
		return e.Replayed
	case e.StatusCode == http.StatusPaymentRequired:
		return true
	}
	return e.StatusCode >= 400 && permanentCodes[e.Code]
}

// ErrKeyReused matches (errors.Is) a 422 for a key already used with a
// different request: the caller built two different charges from one event
// id, a producer bug that no retry can fix.
var ErrKeyReused = errors.New("payment: idempotency key reused with a different request")

func (e *Error) Is(target error) bool {
	return target == ErrKeyReused && e.Code == CodeKeyReused
}

// IsPermanent reports whether err is a provider answer that no retry can change.
// Network errors and timeouts are never permanent.
func IsPermanent(err error) bool {
	var e *Error
	return errors.As(err, &e) && e.Permanent()
}

// ClientConfig configures a [Client]. Zero values of optional fields work.
type ClientConfig struct {
	// BaseURL of the provider, e.g. http://127.0.0.1:18080. Required.
	BaseURL string
	// APIKey identifies the merchant account; idempotency keys are scoped to it.
	APIKey string
	// HTTPClient. Default: a client without its own timeout (RequestTimeout bounds each attempt).
	HTTPClient *http.Client
	// RequestTimeout bounds each attempt. Default 5s.
	RequestTimeout time.Duration
	// MaxAttempts in one Charge call, the first included. Default 5.
	MaxAttempts int
	// InitialBackoff doubles per attempt up to MaxBackoff. Defaults 100ms, 2s.
	InitialBackoff time.Duration
	MaxBackoff     time.Duration
	// OnAttempt is told of every HTTP attempt (for metrics). Default: none.
	OnAttempt func(Attempt)
}

// Attempt describes one HTTP attempt of a [Client]: the parameters of
// [ClientConfig.OnAttempt].
type Attempt struct {
	Path     string // "/v1/charges", "/v1/refunds"
	Duration time.Duration
	// Outcome: "ok", "replayed" (a stored answer for the key), "declined"
	// (the provider's permanent verdict), "retryable" (an answer worth
	// another try: 5xx, 401, 409, 429...), "network" (no answer).
	Outcome string
	Status  int // 0 without an answer
}

func (c *ClientConfig) setDefaults() {
	if c.HTTPClient == nil {
		c.HTTPClient = &http.Client{}
	}
	if c.RequestTimeout == 0 {
		c.RequestTimeout = 5 * time.Second
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = 5
	}
	if c.InitialBackoff == 0 {
		c.InitialBackoff = 100 * time.Millisecond
	}
	if c.MaxBackoff == 0 {
		c.MaxBackoff = 2 * time.Second
	}
}

// Validate reports the first missing or impossible setting.
func (c ClientConfig) Validate() error {
	switch {
	case c.BaseURL == "":
		return errors.New("payment: ClientConfig.BaseURL is required")
	case !strings.HasPrefix(c.BaseURL, "http://") && !strings.HasPrefix(c.BaseURL, "https://"):
		return fmt.Errorf("payment: ClientConfig.BaseURL %q is not an http(s) URL", c.BaseURL)
	case c.RequestTimeout < 0, c.MaxAttempts < 1, c.InitialBackoff < 0, c.MaxBackoff < c.InitialBackoff:
		return errors.New("payment: timeouts must be positive, MaxAttempts at least 1, MaxBackoff >= InitialBackoff")
	}
	return nil
}

// Client charges through the provider. It is safe for concurrent use.
type Client struct {
	cfg ClientConfig
}

// NewClient validates cfg and returns a client.
func NewClient(cfg ClientConfig) (*Client, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.BaseURL = strings.TrimRight(cfg.BaseURL, "/")
	return &Client{cfg: cfg}, nil
}

// Charge charges req once per idempotencyKey. It retries what may succeed on a
// later try (everything but the provider's final verdicts, see
// [Error.Permanent]) with the same key and body; its error is an [*Error]
// for a provider answer, or the last network error. Check [IsPermanent] to
// tell a refusal from a failure to get through.
func (c *Client) Charge(ctx context.Context, req ChargeRequest, idempotencyKey string) (Charge, error) {
	body, err := req.body()
	if err != nil {
		return Charge{}, fmt.Errorf("payment: encode charge: %w", err)
	}
	var ch Charge
	ch.Replayed, err = c.post(ctx, "/v1/charges", body, idempotencyKey, &ch)
	return ch, err
}

// Refund refunds req once per idempotencyKey, retrying as [Client.Charge] does.
func (c *Client) Refund(ctx context.Context, req RefundRequest, idempotencyKey string) (Refund, error) {
	body, err := req.body()
	if err != nil {
		return Refund{}, fmt.Errorf("payment: encode refund: %w", err)
	}
	var re Refund
	re.Replayed, err = c.post(ctx, "/v1/refunds", body, idempotencyKey, &re)
	return re, err
}

// post sends body to path with the key until the provider answers for good
// or the attempts are spent, and decodes a success into out.
func (c *Client) post(ctx context.Context, path string, body []byte, key string, out any) (replayed bool, err error) {
	if key == "" {
		return false, fmt.Errorf("payment: %s without an idempotency key", path)
	}
	exp := backoff.NewExponentialBackOff()
	exp.InitialInterval, exp.MaxInterval = c.cfg.InitialBackoff, c.cfg.MaxBackoff
	return backoff.Retry(ctx, func() (bool, error) {
		replayed, err := c.attempt(ctx, path, body, key, out)
		var perr *Error
		if errors.As(err, &perr) && perr.Permanent() {
			return replayed, backoff.Permanent(err)
		}
		return replayed, err
	}, backoff.WithBackOff(exp), backoff.WithMaxTries(uint(c.cfg.MaxAttempts)), backoff.WithMaxElapsedTime(0))
}

func (c *Client) attempt(ctx context.Context, path string, body []byte, key string, out any) (replayed bool, err error) {
	if c.cfg.OnAttempt != nil {
		start := time.Now()
		defer func() {
			a := Attempt{Path: path, Duration: time.Since(start), Outcome: "network"}
			var perr *Error
			switch {
			case err == nil && replayed:
				a.Outcome = "replayed"
			case err == nil:
				a.Outcome = "ok"
			case errors.As(err, &perr):
				a.Status, a.Outcome = perr.StatusCode, "retryable"
				if perr.Permanent() {
					a.Outcome = "declined"
				}
			}
			c.cfg.OnAttempt(a)
		}()
	}
	ctx, cancel := context.WithTimeout(ctx, c.cfg.RequestTimeout)
	defer cancel()
	r, err := http.NewRequestWithContext(ctx, http.MethodPost, c.cfg.BaseURL+path, bytes.NewReader(body))
	if err != nil {
		return false, backoff.Permanent(fmt.Errorf("payment: build request: %w", err))
	}
	ctx, span := otel.Tracer("github.com/once-dev/once/payment").Start(ctx, "POST "+path, trace.WithSpanKind(trace.SpanKindClient))
	defer span.End()
	r = r.WithContext(ctx)
	otel.GetTextMapPropagator().Inject(ctx, propagation.HeaderCarrier(r.Header))
	r.Header.Set("Content-Type", "application/json")
	r.Header.Set(HeaderIdempotencyKey, key)
	if c.cfg.APIKey != "" {
		r.Header.Set("Authorization", "Bearer "+c.cfg.APIKey)
	}
	resp, err := c.cfg.HTTPClient.Do(r)
	if err != nil {
		return false, fmt.Errorf("payment: POST %s %s: %w", path, key, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return false, fmt.Errorf("payment: POST %s %s: read answer: %w", path, key, err)
	}
	replayed = resp.Header.Get(HeaderReplayed) == "true"
	if resp.StatusCode/100 == 2 {
		if err := json.Unmarshal(raw, out); err != nil {
			// A 2xx we cannot read: a proxy's page, or a provider upgrade.
			// Money may have moved; the retry with the key learns it.
			return false, fmt.Errorf("payment: POST %s %s: undecodable success answer: %w", path, key, err)
		}
		return replayed, nil
	}
	var problem struct {
		Code    string `json:"code"`
		Message string `json:"message"`
	}
	_ = json.Unmarshal(raw, &problem) // a proxy's HTML error page still has a status
	perr := &Error{StatusCode: resp.StatusCode, Code: problem.Code, Message: problem.Message, Replayed: replayed}
	if resp.StatusCode == http.StatusTooManyRequests {
		if s, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil && s > 0 {
			return false, errors.Join(perr, backoff.RetryAfter(s))
		}
	}
	return false, perr
}

// Ledger fetches the account's ledger from the provider.
func (c *Client) Ledger(ctx context.Context) (Ledger, error) {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.RequestTimeout)
	defer cancel()
	r, err := http.NewRequestWithContext(ctx, http.MethodGet, c.cfg.BaseURL+"/v1/charges", nil)
	if err != nil {
		return Ledger{}, err
	}
	if c.cfg.APIKey != "" {
		r.Header.Set("Authorization", "Bearer "+c.cfg.APIKey)
	}
	resp, err := c.cfg.HTTPClient.Do(r)
	if err != nil {
		return Ledger{}, fmt.Errorf("payment: ledger: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return Ledger{}, fmt.Errorf("payment: ledger: status %d", resp.StatusCode)
	}
	var l Ledger
	if err := json.NewDecoder(resp.Body).Decode(&l); err != nil {
		return Ledger{}, fmt.Errorf("payment: ledger: %w", err)
	}
	return l, nil
}
