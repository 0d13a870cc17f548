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
	// Replayed is true when the provider answered from a stored earlier
	// request with the same key: the charge happened once, before.
	Replayed bool `json:"-"`
}

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

// Permanent reports whether no retry with the same key can change the
// answer: any 4xx but 409 (in flight) and 429 (rate limited), and a 5xx the
// provider stored for the key and now replays.
func (e *Error) Permanent() bool {
	switch {
	case e.StatusCode == http.StatusConflict, e.StatusCode == http.StatusTooManyRequests:
		return false
	case e.StatusCode >= 500:
		return e.Replayed
	}
	return e.StatusCode >= 400
}

// ErrKeyReused matches (errors.Is) a 422 for a key already used with a
// different request: the caller built two different charges from one event
// id, a producer bug that no retry can fix.
var ErrKeyReused = errors.New("payment: idempotency key reused with a different request")

func (e *Error) Is(target error) bool {
	return target == ErrKeyReused && e.StatusCode == http.StatusUnprocessableEntity
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
// later try (network errors, timeouts, 409, 429, 5xx) with the same key and
// body; its error is an [*Error] for a provider answer, or the last network
// error. Check [IsPermanent] to tell a refusal from a failure to get through.
func (c *Client) Charge(ctx context.Context, req ChargeRequest, idempotencyKey string) (Charge, error) {
	if idempotencyKey == "" {
		return Charge{}, errors.New("payment: charge without an idempotency key")
	}
	body, err := req.body()
	if err != nil {
		return Charge{}, fmt.Errorf("payment: encode charge: %w", err)
	}
	exp := backoff.NewExponentialBackOff()
	exp.InitialInterval, exp.MaxInterval = c.cfg.InitialBackoff, c.cfg.MaxBackoff
	return backoff.Retry(ctx, func() (Charge, error) {
		ch, err := c.attempt(ctx, body, idempotencyKey)
		var perr *Error
		if errors.As(err, &perr) {
			if perr.Permanent() {
				return ch, backoff.Permanent(err)
			}
		}
		return ch, err
	}, backoff.WithBackOff(exp), backoff.WithMaxTries(uint(c.cfg.MaxAttempts)), backoff.WithMaxElapsedTime(0))
}

func (c *Client) attempt(ctx context.Context, body []byte, key string) (Charge, error) {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.RequestTimeout)
	defer cancel()
	r, err := http.NewRequestWithContext(ctx, http.MethodPost, c.cfg.BaseURL+"/v1/charges", bytes.NewReader(body))
	if err != nil {
		return Charge{}, backoff.Permanent(fmt.Errorf("payment: build request: %w", err))
	}
	r.Header.Set("Content-Type", "application/json")
	r.Header.Set(HeaderIdempotencyKey, key)
	if c.cfg.APIKey != "" {
		r.Header.Set("Authorization", "Bearer "+c.cfg.APIKey)
	}
	resp, err := c.cfg.HTTPClient.Do(r)
	if err != nil {
		return Charge{}, fmt.Errorf("payment: charge %s: %w", key, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return Charge{}, fmt.Errorf("payment: charge %s: read answer: %w", key, err)
	}
	replayed := resp.Header.Get(HeaderReplayed) == "true"
	if resp.StatusCode/100 == 2 {
		var ch Charge
		if err := json.Unmarshal(raw, &ch); err != nil {
			return Charge{}, fmt.Errorf("payment: charge %s: undecodable success answer: %w", key, err)
		}
		ch.Replayed = replayed
		return ch, nil
	}
	var problem struct {
		Code    string `json:"code"`
		Message string `json:"message"`
	}
	_ = json.Unmarshal(raw, &problem) // a proxy's HTML error page still has a status
	perr := &Error{StatusCode: resp.StatusCode, Code: problem.Code, Message: problem.Message, Replayed: replayed}
	if resp.StatusCode == http.StatusTooManyRequests {
		if s, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil && s > 0 {
			return Charge{}, errors.Join(perr, backoff.RetryAfter(s))
		}
	}
	return Charge{}, perr
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
