package idempotency

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/once-dev/once/internal/durable"
	"github.com/once-dev/once/schema"
)

// claimSQL is the whole dedup decision (R-KFK-IDEM-2): one row inserted means
// first delivery; zero rows means another transaction holds or committed the
// claim. A concurrent claimer of the same key blocks on the unique index until
// the first transaction ends, then gets zero rows (or inserts, if the first
// rolled back).
//
// The first %s is the claim table's quoted, schema-qualified name
// (Config.Schema and Config.Table), fixed when the middleware is created; the
// second, the retention policy every process of that table agrees on
// (package retention), read with the claim so that a retention shortened
// while this process runs tightens its horizon from the next claim on.
//
// processed_at defaults to now(), the transaction's start on the database's
// clock: the dedup horizon is checked against it.
//
// The same statement makes the transaction's commit durable before it
// returns, whatever the server, database or role default: with
// synchronous_commit off, a commit returns before its WAL is flushed, the
// offset moves on, and a database crash then erases an effect whose message
// was acknowledged (package durable).
//
// It also bounds how long the server keeps the transaction open while idle
// ($4, Config.IdleInTransactionTimeout; NULL keeps the server's setting). A
// client that vanished behind a network black hole cannot tell the server it
// gave up: its backend would keep the claim's row lock (and any lock the
// handler took) until TCP keepalive notices, two hours by default, and the
// partition's next owner would wait on it all that time.
//
// Both bounds, and statement_timeout ($6, Config.TxStatementTimeout) for every
// statement of the transaction, are set for this transaction only: behind a
// transaction pooler (PgBouncer) a session setting would stay on a server
// connection that the next transaction of another client gets, and a
// setting in the connection's start-up packet is refused by the pooler.
var claimSQL = `INSERT INTO %s (event_id, consumer_group, payload_sha256, values_sha256)
SELECT $1, $2, $3, $7 FROM (SELECT ` + bounds + `) AS bounded
ON CONFLICT (event_id, consumer_group) DO NOTHING
RETURNING processed_at, (SELECT ` + schema.CoveredRetention("") + ` FROM %s WHERE claim_table = $5)`

// bounds is the select list that makes the claim's transaction durable and
// bounded (see claimSQL); $4 and $6 are milliseconds as text, or NULL for
// the server's setting.
const bounds = durable.RaiseSynchronousCommit + `,
  set_config('idle_in_transaction_session_timeout', coalesce($4::text, current_setting('idle_in_transaction_session_timeout')), true),
  set_config('statement_timeout', coalesce($6::text, current_setting('statement_timeout')), true)`

// storedHashSQL runs as its own statement, after the claim, on purpose: at
// READ COMMITTED it takes a fresh snapshot and so sees a claim committed while
// claimSQL waited, which a CTE sharing claimSQL's snapshot would not.
const storedHashSQL = `SELECT payload_sha256, values_sha256 FROM %s
WHERE event_id = $1 AND consumer_group = $2`

// TxBeginner begins the transaction of one message. *pgxpool.Pool implements it.
type TxBeginner interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// Config configures a [Middleware]. The zero values of optional fields work.
type Config struct {
	// DB begins the transaction shared by the claim and the handler. Required.
	DB TxBeginner

	// ConsumerGroup is the second half of the dedup key: billing having
	// processed an event says nothing about analytics. Required.
	ConsumerGroup string

	// Key extracts the dedup key; it must be a UUIDv7. Default: [PayloadEventID].
	Key KeyFunc

	// Fingerprint is the SHA-256 of what the event says, in a canonical
	// form, stored with its claim beside the SHA-256 of the payload's bytes.
	// A later delivery under the same id is a duplicate when either matches
	// (the same bytes, or the same values in another byte form), and
	// [ErrPayloadMismatch] when neither does. The bytes' hash keeps a
	// redelivery a duplicate when the values' form changed in between (a
	// field added to the event's type, a rolling deploy); a claim from a
	// release that stored no fingerprint matches its bytes.
	//
	// Which byte forms are one value depends on the function. The default,
	// [PayloadSHA256], knows JSON and not the event's types: member order,
	// space, 12.5 or 12.50 or 1.25e1, Z or +00:00 for one instant are one
	// value, but the number 12.5 and the string "12.50" are two (a decimal
	// re-published the other way is a mismatch). [FingerprintWithDecimals]
	// names the members that are decimals, whichever way they are written.
	// Package pipeline fingerprints the decoded event, which knows its
	// types (see pipeline.Topic). An error fails the attempt, not
	// permanent (hold and retry) unless it is marked [Permanent]; the
	// functions of this package never fail. Default: [PayloadSHA256].
	Fingerprint func(msg *message.Message) ([32]byte, error)

	// Schema and Table name the claim table, created by package schema.
	// Defaults: schema.DefaultSchema and schema.DefaultClaimTable.
	Schema string
	Table  string

	// IsoLevel of the message transaction. Default: pgx.ReadCommitted, under
	// which a losing concurrent claim waits and then sees zero rows. Under
	// RepeatableRead or Serializable it fails with SQLSTATE 40001 instead; the
	// middleware then retries the whole attempt, which finds the winner's row.
	IsoLevel pgx.TxIsoLevel

	// SerializationRetries bounds those retries of 40001 and deadlocks.
	// Default: 10.
	SerializationRetries int

	// StatementTimeout bounds each of the middleware's own statements (begin,
	// claim, reading a claim) on the client's side: a database that went
	// silent (a network black hole) answers nothing and would hold an attempt
	// for as long as TCP does. Default: 30s.
	StatementTimeout time.Duration

	// TxStatementTimeout is the statement_timeout of every statement of the
	// claim's transaction on the server, the handler's included, set for
	// that transaction only (a pooler keeps no session setting). Default:
	// StatementTimeout. Negative: the server's own.
	TxStatementTimeout time.Duration

	// IdleInTransactionTimeout is how long the server lets the claim's
	// transaction sit idle (between the handler's statements) before it ends
	// the session and rolls the claim back: the only way a claim held by a
	// client the network lost is released before the server's TCP
	// keepalive, hours later. Set it above the longest pause a handler makes
	// inside its transaction (a payment call with its retries); pipeline
	// uses its AttemptTimeout plus StatementTimeout. Default: 5m. Negative:
	// the server's own setting.
	IdleInTransactionTimeout time.Duration

	// FinishTimeout bounds commit and rollback. They run on a context detached
	// from the message's, because Watermill cancels in-flight message contexts
	// when the router closes, and a commit cancelled half-way would turn a
	// finished handler into a redelivery. Default: 10s.
	FinishTimeout time.Duration

	// MaxEventAge is the dedup horizon: claims older than the retention of
	// the claim table may be gone, so a redelivery of an event whose id is
	// older than that could run again. TooOld decides what happens to such
	// an event. The horizon follows the retention recorded for the claim
	// table (package retention records it) minus MaxClockSkew, read with
	// every claim, so a retention shortened while this runs tightens it from
	// the next claim on; MaxEventAge, when set, may only make it shorter.
	// Default: 0, the recorded retention (no horizon while none is
	// recorded). Negative: no horizon at all, for effects where a rare
	// double is cheap.
	MaxEventAge time.Duration
	// TooOld is the policy for events beyond MaxEventAge. Default
	// [RejectTooOld], the only safe choice for money.
	TooOld TooOldPolicy
	// MaxClockSkew rejects events whose id lies further in the future than
	// this: a producer clock that far ahead would put the claim in a range
	// that ages out late and breaks the horizon arithmetic. Default:
	// [DefaultMaxClockSkew]. Negative: no bound.
	MaxClockSkew time.Duration
	// Now, if set, replaces the database's clock in the horizon checks, for
	// tests that move time. Default: the database's clock when the claim
	// was made (its processed_at), the same clock retention uses.
	Now func() time.Time

	// RecordRejection, if set, runs in the claim's transaction when the
	// handler returned [RejectAfterCommit], before the commit: write the
	// dead letter there, and it commits with the rejection, so that no crash
	// or failed publish after the commit can lose it (a redelivery is a
	// duplicate). An error rolls the attempt back. Default: none; the
	// returned [*RejectedError] then has DeadLettered false, and the router
	// must dead-letter it.
	RecordRejection func(ctx context.Context, tx pgx.Tx, msg *message.Message, reason error) error

	// OnResult, if set, is called once per message with what happened to it.
	OnResult func(Result)

	// Logger receives one line per failure, outage wait and payload mismatch.
	// Default: slog.Default().
	Logger *slog.Logger

	// LogAttrs, if set, adds attributes to those lines (partition, offset).
	LogAttrs func(msg *message.Message) []any
}

func (c *Config) setDefaults() {
	if c.Key == nil {
		c.Key = PayloadEventID
	}
	if c.Fingerprint == nil {
		c.Fingerprint = PayloadSHA256
	}
	if c.Schema == "" {
		c.Schema = schema.DefaultSchema
	}
	if c.Table == "" {
		c.Table = schema.DefaultClaimTable
	}
	if c.IsoLevel == "" {
		c.IsoLevel = pgx.ReadCommitted
	}
	if c.SerializationRetries == 0 {
		c.SerializationRetries = 10
	}
	if c.StatementTimeout == 0 {
		c.StatementTimeout = 30 * time.Second
	}
	if c.TxStatementTimeout == 0 {
		c.TxStatementTimeout = c.StatementTimeout
	}
	if c.FinishTimeout == 0 {
		c.FinishTimeout = 10 * time.Second
	}
	if c.IdleInTransactionTimeout == 0 {
		c.IdleInTransactionTimeout = 5 * time.Minute
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.MaxClockSkew == 0 {
		c.MaxClockSkew = DefaultMaxClockSkew
	}
	if c.TooOld == "" {
		c.TooOld = RejectTooOld
	}
}

// DefaultMaxClockSkew is how far ahead of the database's clock an event's id
// may lie: five minutes, well beyond a synchronised clock's drift.
const DefaultMaxClockSkew = 5 * time.Minute

// TooOldPolicy says what to do with an event older than the dedup horizon.
type TooOldPolicy string

const (
	// RejectTooOld fails the event with a permanent [ErrTooOld]: it is
	// dead-lettered with the reason, for a person to decide.
	RejectTooOld TooOldPolicy = "reject"
	// ProcessTooOld claims and processes it as usual, accepting that it may
	// have been processed before (for effects where a rare double is cheap).
	ProcessTooOld TooOldPolicy = "process"
)

// Validate reports every missing or impossible setting at once.
func (c Config) Validate() error {
	var errs []error
	if c.DB == nil {
		errs = append(errs, errors.New("idempotency: Config.DB is required"))
	}
	if c.ConsumerGroup == "" {
		errs = append(errs, errors.New("idempotency: Config.ConsumerGroup is required"))
	}
	if c.SerializationRetries < 0 {
		errs = append(errs, errors.New("idempotency: Config.SerializationRetries must not be negative"))
	}
	if c.FinishTimeout < 0 || c.StatementTimeout < 0 {
		errs = append(errs, errors.New("idempotency: Config.FinishTimeout and Config.StatementTimeout must not be negative"))
	}
	if c.TooOld != "" && c.TooOld != RejectTooOld && c.TooOld != ProcessTooOld {
		errs = append(errs, fmt.Errorf("idempotency: Config.TooOld %q: want %q or %q", c.TooOld, RejectTooOld, ProcessTooOld))
	}
	for setting, name := range map[string]string{"Config.Schema": c.Schema, "Config.Table": c.Table} {
		if name != "" {
			errs = append(errs, schema.CheckIdentifier("idempotency: "+setting, name))
		}
	}
	return errors.Join(errs...)
}

// Outcome is what the middleware did with one message.
type Outcome int

const (
	// Processed: first delivery; the handler ran and its transaction committed.
	Processed Outcome = iota + 1
	// Duplicate: already processed by this consumer group; the handler did not run.
	Duplicate
	// PayloadMismatch: the id was processed with other bytes; the handler did not run.
	PayloadMismatch
	// Failed: the key was invalid, or the attempt failed (the database, the
	// handler, the commit) and rolled back; nothing was written. Result.Err
	// says whether it is permanent.
	Failed
	// Rejected: the handler recorded a permanent failure with [RejectAfterCommit];
	// its writes and the claim committed, and the error is returned.
	Rejected
	// OutsideHorizon: the event's id is older than MaxEventAge (policy
	// reject) or further ahead than MaxClockSkew; nothing was written.
	OutsideHorizon
)

func (o Outcome) String() string {
	switch o {
	case Processed:
		return "processed"
	case Duplicate:
		return "duplicate"
	case PayloadMismatch:
		return "payload_mismatch"
	case Failed:
		return "failed"
	case Rejected:
		return "rejected"
	case OutsideHorizon:
		return "outside_horizon"
	}
	return fmt.Sprintf("Outcome(%d)", int(o))
}

// Result describes one pass of a message through the middleware.
type Result struct {
	Outcome       Outcome
	EventID       uuid.UUID // uuid.Nil when the key could not be read
	ConsumerGroup string
	Topic         string // the topic the message was consumed from, if known
	MessageUUID   string // the Watermill message's UUID (the pipeline's: topic/partition/offset)
	Duration      time.Duration
	Err           error // nil for Processed and Duplicate
	// The phases of the last attempt's transaction (its batch's, for a
	// message decided in a batch): begin and claim, the handler, the
	// commit. Zero for a phase the attempt did not reach.
	Claim, Handle, Commit time.Duration
	// AfterEffects are the external effects ([MarkExternalEffect]) that
	// earlier attempts of this delivery had when this attempt ran the
	// handler again: non-empty, the handler repeated calls whose effects
	// only their own idempotency (an Idempotency-Key equal to the event id)
	// keeps from happening twice. Nil otherwise.
	AfterEffects []string
}

// Middleware is the idempotent-consumer middleware of one consumer group.
// Create one per group with [New]; it is safe for concurrent use.
type Middleware struct {
	cfg        Config
	claimSQL   string
	idleLimit  *string // milliseconds, for set_config; nil keeps the server's
	stmtLimit  *string // the same for statement_timeout
	claimTable string  // the retention policy's key
	storedSQL  string
	// The same for a batch (ProcessBatch).
	claimBatchSQL, storedHashesSQL string
}

// New validates cfg and returns the middleware.
func New(cfg Config) (*Middleware, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	table := pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()
	policy := pgx.Identifier{cfg.Schema, "once_retention_policy"}.Sanitize()
	return &Middleware{cfg: cfg, claimSQL: fmt.Sprintf(claimSQL, table, policy), storedSQL: fmt.Sprintf(storedHashSQL, table),
		claimBatchSQL: fmt.Sprintf(claimBatchSQL, table, policy), storedHashesSQL: fmt.Sprintf(storedHashesSQL, table),
		idleLimit: milliseconds(cfg.IdleInTransactionTimeout), stmtLimit: milliseconds(cfg.TxStatementTimeout),
		claimTable: cfg.Schema + "." + cfg.Table}, nil
}

// milliseconds is d as a set_config value, or nil (the server's own
// setting) for a d that is not positive.
func milliseconds(d time.Duration) *string {
	if d <= 0 {
		return nil
	}
	ms := fmt.Sprint(max(d.Milliseconds(), 1))
	return &ms
}

// Middleware wraps h as described in the package documentation. Errors it
// returns are permanent ([IsPermanent]: an invalid key, [ErrPayloadMismatch],
// an event outside the dedup horizon, a [*RejectedError], what the handler
// marked [Permanent] or returned through [RejectAfterCommit]), or else the
// error of an attempt that rolled back and may pass when tried again (the
// database, its data errors (SQLSTATE class 22 and 23) included, the
// network, the handler's other failures, and anything after an external
// effect).
func (m *Middleware) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		start := time.Now()
		res := Result{ConsumerGroup: m.cfg.ConsumerGroup, Topic: message.SubscribeTopicFromCtx(msg.Context()), MessageUUID: msg.UUID}
		report := func(o Outcome, err error) {
			res.Outcome, res.Err, res.Duration = o, err, time.Since(start)
			if m.cfg.OnResult != nil {
				m.cfg.OnResult(res)
			}
		}

		key, err := m.cfg.Key(msg)
		if err == nil && (key.Version() != 7 || key.Variant() != uuid.RFC4122) {
			err = fmt.Errorf("%w: event_id %s is UUID version %d, want 7", ErrInvalidKey, key, key.Version())
		}
		if err != nil {
			err = Permanent(err)
			report(Failed, err)
			return nil, err
		}
		res.EventID = key
		sum, err := m.cfg.Fingerprint(msg)
		if err != nil {
			// The function's failure, not the message's, unless it
			// says so (Permanent): held until fixed.
			err = fmt.Errorf("idempotency: fingerprint of %s: %w", key, err)
			report(Failed, err)
			return nil, err
		}
		sums := fingerprintsOf(sum, msg)
		deliveryCtx, effects := effectsOf(msg.Context())
		orig := msg.Context()
		msg.SetContext(deliveryCtx)
		defer msg.SetContext(orig)

		for serializationRetries := 0; ; serializationRetries++ {
			outcome, produced, err := m.attempt(msg, h, key, sums, effects, &res)
			if err != nil && isSerializationFailure(err) && serializationRetries < m.cfg.SerializationRetries {
				continue
			}
			switch {
			case err == nil:
			case outcome == Rejected:
				m.log(msg, slog.LevelWarn, "rejected for good; recorded and committed", key, "err", err)
			case outcome == PayloadMismatch:
				m.log(msg, slog.LevelError, "event id reused with a different payload", key, "err", err)
			case outcome == 0:
				outcome = Failed
			}
			report(outcome, err)
			return produced, err
		}
	}
}

// checkHorizon applies MaxEventAge and MaxClockSkew to the time in the id,
// at now on the database's clock.
func (m *Middleware) checkHorizon(key uuid.UUID, now time.Time, maxAge time.Duration) error {
	if maxAge == 0 && m.cfg.MaxClockSkew <= 0 {
		return nil
	}
	at := IDTime(key)
	if m.cfg.MaxClockSkew > 0 && at.After(now.Add(m.cfg.MaxClockSkew)) {
		return Permanent(fmt.Errorf("%w: event %s is from %s, more than %s ahead", ErrFromTheFuture, key, at.Format(time.RFC3339), m.cfg.MaxClockSkew))
	}
	if maxAge > 0 && m.cfg.TooOld == RejectTooOld && at.Before(now.Add(-maxAge)) {
		return Permanent(fmt.Errorf("%w: event %s is from %s, older than %s", ErrTooOld, key, at.Format(time.RFC3339), maxAge))
	}
	return nil
}

// IDTime is the time in a UUIDv7's first 48 bits, to the millisecond:
// when its producer made the event, which the dedup horizon judges.
func IDTime(id uuid.UUID) time.Time {
	ms := int64(id[0])<<40 | int64(id[1])<<32 | int64(id[2])<<24 | int64(id[3])<<16 | int64(id[4])<<8 | int64(id[5])
	return time.UnixMilli(ms)
}

// attempt runs one transaction: claim, then either skip or run the handler and
// commit. The deferred rollback also covers a panicking handler, so a panic
// leaves no claim behind before it unwinds to the recoverer.
func (m *Middleware) attempt(msg *message.Message, h message.HandlerFunc, key uuid.UUID, sums fingerprints, effects *attemptEffects, res *Result) (_ Outcome, _ []*message.Message, err error) {
	res.Claim, res.Handle, res.Commit, res.AfterEffects = 0, 0, 0, nil
	began := time.Now()
	msgCtx := msg.Context()
	stmtCtx, cancel := context.WithTimeout(msgCtx, m.cfg.StatementTimeout)
	defer cancel()
	tx, err := m.cfg.DB.BeginTx(stmtCtx, pgx.TxOptions{IsoLevel: m.cfg.IsoLevel})
	if err != nil {
		return 0, nil, fmt.Errorf("idempotency: begin transaction: %w", err)
	}
	done := false
	defer func() {
		if !done {
			m.rollback(msgCtx, tx)
		}
	}()

	var claimedAt time.Time
	var retentionSeconds pgtype.Int8
	stmtCtx, cancel = context.WithTimeout(msgCtx, m.cfg.StatementTimeout)
	defer cancel()
	err = tx.QueryRow(stmtCtx, m.claimSQL, uuidParam(key), m.cfg.ConsumerGroup, sums.raw, m.idleLimit, m.claimTable, m.stmtLimit, sums.values).Scan(&claimedAt, &retentionSeconds)
	res.Claim = time.Since(began)
	if errors.Is(err, pgx.ErrNoRows) {
		var storedRaw, storedValues []byte
		if err := tx.QueryRow(stmtCtx, m.storedSQL, uuidParam(key), m.cfg.ConsumerGroup).Scan(&storedRaw, &storedValues); err != nil {
			return 0, nil, fmt.Errorf("idempotency: read claim %s for %s: %w", key, m.cfg.ConsumerGroup, err)
		}
		if !sums.match(storedRaw, storedValues) {
			return PayloadMismatch, nil, Permanent(fmt.Errorf("%w: event %s, consumer group %s", ErrPayloadMismatch, key, m.cfg.ConsumerGroup))
		}
		// Claimed before: a duplicate, whatever its age.
		return Duplicate, nil, nil
	}
	if err != nil {
		return 0, nil, fmt.Errorf("idempotency: claim %s for %s: %w", key, m.cfg.ConsumerGroup, err)
	}
	// A first claim: checked on every attempt, so a wait of any length
	// cannot carry an event past the horizon unnoticed.
	if m.cfg.Now != nil {
		claimedAt = m.cfg.Now()
	}
	if err := m.checkHorizon(key, claimedAt, m.maxAge(retentionSeconds)); err != nil {
		if happened := effects.happened(); len(happened) > 0 {
			// An earlier attempt of this delivery moved money or sent a
			// message: its record must commit, however old the event.
			m.log(msg, slog.LevelWarn, "outside the dedup horizon, but an earlier attempt had an external effect: processed so that its record commits", key,
				"effects", happened, "horizon", err)
		} else {
			return OutsideHorizon, nil, err
		}
	}

	if before := effects.happened(); len(before) > 0 {
		// The handler runs again after an effect it may repeat: only that
		// effect's own idempotency (an Idempotency-Key) keeps it from
		// happening twice, which an operator should be able to see.
		res.AfterEffects = before
		m.log(msg, slog.LevelWarn, "running the handler again after an external effect of an earlier attempt; the effect's own idempotency key must keep it from happening twice", key,
			"effects", before)
	}
	msg.SetContext(ContextWithTx(msgCtx, tx))
	handling := time.Now()
	produced, err := func() ([]*message.Message, error) {
		defer msg.SetContext(msgCtx) // the transaction must not outlive this attempt
		return h(msg)
	}()
	res.Handle = time.Since(handling)
	var rejected rejectAfterCommit
	isRejection := errors.As(err, &rejected)
	if err != nil && !isRejection {
		// A database error is the message's fault only when the handler
		// made it a verdict (Permanent): a constraint or a value the
		// server refused (class 22, 23) comes from a pooler, a driver
		// mode, a concurrent writer or a parent row not written yet as
		// often as from the event. And after an effect outside the
		// transaction, nothing is permanent.
		return Failed, nil, holdAfterEffect(effects, err)
	}

	if isRejection && m.cfg.RecordRejection != nil {
		if err := m.cfg.RecordRejection(msgCtx, tx, msg, rejected.err); err != nil {
			return Failed, nil, fmt.Errorf("idempotency: record the rejection of %s for %s: %w", key, m.cfg.ConsumerGroup, err)
		}
	}
	ctx, cancel := m.finishContext(msgCtx)
	defer cancel()
	done = true
	committing := time.Now()
	err = tx.Commit(ctx)
	res.Commit = time.Since(committing)
	if err != nil {
		// Whether a commit that lost its connection took effect is unknown;
		// either way the next attempt decides correctly: it finds the claim
		// (skip) or does not (process).
		return Failed, nil, fmt.Errorf("idempotency: commit %s for %s: %w", key, m.cfg.ConsumerGroup, err)
	}
	if isRejection {
		return Rejected, nil, &RejectedError{Err: rejected.err, DeadLettered: m.cfg.RecordRejection != nil}
	}
	return Processed, produced, nil
}

func (m *Middleware) finishContext(msgCtx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(msgCtx), m.cfg.FinishTimeout)
}

func (m *Middleware) rollback(msgCtx context.Context, tx pgx.Tx) {
	ctx, cancel := m.finishContext(msgCtx)
	defer cancel()
	// A failed rollback leaves nothing behind: PostgreSQL aborts the
	// transaction when the connection goes, and pgx closes such a connection.
	_ = tx.Rollback(ctx)
}

func (m *Middleware) log(msg *message.Message, level slog.Level, text string, key uuid.UUID, attrs ...any) {
	attrs = append(attrs, "event_id", key, "consumer_group", m.cfg.ConsumerGroup,
		"topic", message.SubscribeTopicFromCtx(msg.Context()))
	if m.cfg.LogAttrs != nil {
		attrs = append(attrs, m.cfg.LogAttrs(msg)...)
	}
	m.cfg.Logger.Log(msg.Context(), level, text, attrs...)
}

// maxAge is the oldest a first claim may be: MaxEventAge, and no older than
// the recorded retention (retentionSeconds, NULL when none is recorded)
// keeps claims, whatever this process was started with.
func (m *Middleware) maxAge(retentionSeconds pgtype.Int8) time.Duration {
	if m.cfg.MaxEventAge < 0 {
		return 0
	}
	if !retentionSeconds.Valid {
		return m.cfg.MaxEventAge
	}
	byRetention := max(time.Duration(retentionSeconds.Int64)*time.Second-max(m.cfg.MaxClockSkew, 0), time.Second)
	if m.cfg.MaxEventAge == 0 {
		return byRetention
	}
	return min(m.cfg.MaxEventAge, byRetention)
}

// uuidParam is an event id as a statement parameter. pgx encodes a
// pgtype.UUID with its uuid codec directly, in every query exec mode; a
// uuid.UUID would go through its driver.Valuer (a failed binary plan and a
// parse per statement, a measurable cost per event), and a bare [16]byte
// has no text encoding for the modes that do not ask the server for
// parameter types (exec, simple_protocol: what PgBouncer in transaction
// mode needs), where every claim would fail.
func uuidParam(id uuid.UUID) pgtype.UUID { return pgtype.UUID{Bytes: id, Valid: true} }

func uuidParams(ids []uuid.UUID) []pgtype.UUID {
	out := make([]pgtype.UUID, len(ids))
	for i, id := range ids {
		out[i] = uuidParam(id)
	}
	return out
}
