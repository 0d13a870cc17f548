package idempotency

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/once-dev/once/schema"
)

// claimBatchSQL is claimSQL for many events at once: one statement, one
// transaction, one commit (a group commit). Keys are inserted in sorted
// order, so two batches that share keys (two instances during a rebalance)
// take their row locks in the same order and cannot deadlock.
//
// %s: the claim table, then the retention policy table (see claimSQL).
var claimBatchSQL = `INSERT INTO %s (event_id, consumer_group, payload_sha256, values_sha256)
SELECT u.k, $2, u.h, u.v FROM (SELECT ` + bounds + `) AS bounded,
  unnest($1::uuid[], $3::bytea[], $7::bytea[]) AS u(k, h, v)
ORDER BY u.k
ON CONFLICT (event_id, consumer_group) DO NOTHING
RETURNING event_id, processed_at, (SELECT ` + schema.CoveredRetention("") + ` FROM %s WHERE claim_table = $5)`

// storedHashesSQL reads the claims a batch did not insert, in a statement of
// its own for a fresh snapshot (see storedHashSQL).
const storedHashesSQL = `SELECT event_id, payload_sha256, values_sha256 FROM %s
WHERE consumer_group = $2 AND event_id = ANY($1)`

// ErrRunAlone is the result of a message whose batch could not decide it:
// the batch failed and rolled back (the handler's error, the database, an
// event outside the horizon), or the same event came twice in one batch.
// Run the message on its own through [Middleware.Middleware], which decides
// it as it decides every message: held, dead-lettered, or processed.
var ErrRunAlone = errors.New("idempotency: not decided in its batch; run the message on its own")

// BatchHandler handles the messages of a batch claimed for the first time,
// in batch order, inside the batch's transaction (also in ctx, see
// [TxFromContext]). It must not commit or roll back tx. Any error rolls the
// whole batch back.
type BatchHandler func(ctx context.Context, tx pgx.Tx, claimed []*message.Message) error

// ProcessBatch claims msgs in one transaction, runs h once for those claimed
// for the first time, and commits: a group commit, which costs the database
// one commit for the batch instead of one per message. msgs are in their
// order of delivery. It returns one error per message, in msgs' order:
//
//   - nil: the message is done (processed in the committed batch, or a
//     duplicate, of an earlier claim or of its copy earlier in the batch);
//   - a permanent error: an invalid key, or [ErrPayloadMismatch];
//   - [ErrRunAlone] (a [*RunAloneError] with why the batch failed, when it
//     did): run the message through [Middleware.Middleware].
//
// A failing batch never decides a message it could not prove: one bad event
// costs its batch a rollback, and each of the batch's events is then run on
// its own. A message that must run on its own for a reason of its own (its
// Fingerprint failed; its claim was deleted while the batch read it) is
// never overtaken: the batch then commits none of its first claims, and
// they all run on their own, in order. OnResult is reported for every
// message decided here.
//
// In h, [MarkExternalEffectOf] says which event caused an effect outside
// the transaction: should the batch roll back, that event runs on its own
// held after the effect, and the others keep their own verdicts. The mark
// travels in the message's context: a message whose context has no record
// of its delivery's effects ([WithDelivery]) is given one here, so run the
// same *message.Message on its own afterwards.
func (m *Middleware) ProcessBatch(ctx context.Context, msgs []*message.Message, h BatchHandler) []error {
	start := time.Now()
	for _, msg := range msgs {
		if _, ok := msg.Context().Value(attemptKey{}).(*attemptEffects); !ok {
			// Without a record the mark would have nowhere to go, and the
			// event's own run could dead-letter it after the money moved.
			msg.SetContext(WithDelivery(msg.Context()))
		}
	}
	errs := make([]error, len(msgs))
	var claim, handle, commit time.Duration
	decided := make([]bool, len(msgs)) // reported: never run on its own too
	report := func(i int, key uuid.UUID, o Outcome, err error) {
		errs[i], decided[i] = err, true
		if m.cfg.OnResult != nil {
			m.cfg.OnResult(Result{Outcome: o, EventID: key, ConsumerGroup: m.cfg.ConsumerGroup,
				Topic: message.SubscribeTopicFromCtx(msgs[i].Context()), MessageUUID: msgs[i].UUID, Duration: time.Since(start), Err: err,
				Claim: claim, Handle: handle, Commit: commit})
		}
	}

	keys := make([]uuid.UUID, len(msgs))
	sums := make([]fingerprints, len(msgs))
	first := map[uuid.UUID]int{} // a key's first message in the batch
	var copies []int             // later messages of a key already in the batch
	mustRunAlone := false
	var batchKeys []uuid.UUID
	var batchSums, batchValues [][]byte
	for i, msg := range msgs {
		key, err := m.cfg.Key(msg)
		if err == nil && (key.Version() != 7 || key.Variant() != uuid.RFC4122) {
			err = fmt.Errorf("%w: event_id %s is UUID version %d, want 7", ErrInvalidKey, key, key.Version())
		}
		if err != nil {
			report(i, uuid.Nil, Failed, Permanent(err))
			continue
		}
		sum, err := m.cfg.Fingerprint(msg)
		if err != nil {
			// Not the message's fault (see Middleware): its own run holds it.
			errs[i], mustRunAlone = ErrRunAlone, true
			continue
		}
		keys[i], sums[i] = key, fingerprintsOf(sum, msg)
		if _, seen := first[key]; seen {
			// The same event twice in one batch: its first copy's claim
			// decides this one too.
			copies = append(copies, i)
			continue
		}
		first[key] = i
		batchKeys = append(batchKeys, key)
		batchSums = append(batchSums, sums[i].raw)
		batchValues = append(batchValues, sums[i].values)
	}
	// runAlone sends every message the batch has not decided to run on its
	// own, with why (nil: a reason of the message's own).
	runAlone := func(cause error) []error {
		var alone error = ErrRunAlone
		if cause != nil {
			alone = &RunAloneError{Cause: cause}
		}
		for _, i := range first {
			if !decided[i] {
				errs[i] = alone
			}
		}
		for _, i := range copies {
			if !decided[i] {
				errs[i] = alone
			}
		}
		return errs
	}
	if len(batchKeys) == 0 {
		return errs
	}
	if mustRunAlone {
		// Committing the others could commit a message of its partition
		// before it.
		return runAlone(nil)
	}
	// decideCopy decides a later copy of a key from the claim its first copy
	// found or made.
	decideCopy := func(i int, storedRaw, storedValues []byte) {
		if !sums[i].match(storedRaw, storedValues) {
			err := Permanent(fmt.Errorf("%w: event %s, consumer group %s", ErrPayloadMismatch, keys[i], m.cfg.ConsumerGroup))
			m.log(msgs[i], slog.LevelError, "event id reused with a different payload", keys[i], "err", err)
			report(i, keys[i], PayloadMismatch, err)
			return
		}
		report(i, keys[i], Duplicate, nil)
	}

	stmtCtx, cancel := context.WithTimeout(ctx, m.cfg.StatementTimeout)
	defer cancel()
	tx, err := m.cfg.DB.BeginTx(stmtCtx, pgx.TxOptions{IsoLevel: m.cfg.IsoLevel})
	if err != nil {
		m.cfg.Logger.Warn("batch: begin failed; its messages run on their own", "consumer_group", m.cfg.ConsumerGroup, "messages", len(msgs), "err", err)
		return runAlone(nil)
	}
	committed, committedOK := false, false
	defer func() {
		if !committed {
			m.rollback(ctx, tx)
		}
	}()

	rows, err := tx.Query(stmtCtx, m.claimBatchSQL, uuidParams(batchKeys), m.cfg.ConsumerGroup, batchSums, m.idleLimit, m.claimTable, m.stmtLimit, batchValues)
	if err != nil {
		m.cfg.Logger.Warn("batch: claim failed; its messages run on their own", "consumer_group", m.cfg.ConsumerGroup, "messages", len(msgs), "err", err)
		return runAlone(nil)
	}
	claimedAt := make(map[uuid.UUID]time.Time, len(batchKeys))
	// pgtype targets: a uuid.UUID is scanned through its sql.Scanner, as
	// text, and a *int64 is allocated again for every row.
	var retentionSeconds pgtype.Int8
	for rows.Next() {
		var key pgtype.UUID
		var at time.Time
		if err := rows.Scan(&key, &at, &retentionSeconds); err != nil {
			rows.Close()
			return runAlone(nil)
		}
		claimedAt[key.Bytes] = at
	}
	if rows.Err() != nil {
		m.cfg.Logger.Warn("batch: claim failed; its messages run on their own", "consumer_group", m.cfg.ConsumerGroup, "messages", len(msgs), "err", rows.Err())
		return runAlone(nil)
	}
	claim = time.Since(start)

	// Claimed before: a duplicate whatever its age, or another payload.
	var unclaimed []uuid.UUID
	for _, key := range batchKeys {
		if _, ok := claimedAt[key]; !ok {
			unclaimed = append(unclaimed, key)
		}
	}
	if len(unclaimed) > 0 {
		stored := map[uuid.UUID]fingerprints{}
		rows, err := tx.Query(stmtCtx, m.storedHashesSQL, uuidParams(unclaimed), m.cfg.ConsumerGroup)
		if err != nil {
			return runAlone(nil)
		}
		for rows.Next() {
			var key pgtype.UUID
			var f fingerprints
			if err := rows.Scan(&key, &f.raw, &f.values); err != nil {
				rows.Close()
				return runAlone(nil)
			}
			stored[key.Bytes] = f
		}
		if rows.Err() != nil {
			return runAlone(nil)
		}
		for _, key := range unclaimed {
			if _, ok := stored[key]; !ok {
				// Not inserted and not there: a claim deleted in between
				// (retention). The message's own run decides it, and
				// nothing after it may commit first.
				return runAlone(nil)
			}
		}
		for _, key := range unclaimed {
			i, f := first[key], stored[key]
			if !sums[i].match(f.raw, f.values) {
				err := Permanent(fmt.Errorf("%w: event %s, consumer group %s", ErrPayloadMismatch, key, m.cfg.ConsumerGroup))
				m.log(msgs[i], slog.LevelError, "event id reused with a different payload", key, "err", err)
				report(i, key, PayloadMismatch, err)
			} else {
				report(i, key, Duplicate, nil)
			}
		}
		for _, i := range copies {
			if f, ok := stored[keys[i]]; ok {
				decideCopy(i, f.raw, f.values)
			}
		}
	}

	// First claims: the horizon, as for a message on its own. An event
	// outside it fails the batch; on its own it is dead-lettered, and the
	// others are processed.
	maxAge := m.maxAge(retentionSeconds)
	var claimed []*message.Message
	var claimedIdx []int
	claimedKeys := map[uuid.UUID]bool{}
	for i, msg := range msgs {
		if errs[i] != nil || decided[i] || first[keys[i]] != i {
			continue
		}
		at, ok := claimedAt[keys[i]]
		if !ok {
			continue
		}
		if m.cfg.Now != nil {
			at = m.cfg.Now()
		}
		if m.checkHorizon(keys[i], at, maxAge) != nil {
			return runAlone(nil)
		}
		claimed = append(claimed, msg)
		claimedIdx = append(claimedIdx, i)
		claimedKeys[keys[i]] = true
	}

	if len(claimed) > 0 {
		handling := time.Now()
		handlerCtx, batchEffects := withBatch(ContextWithTx(ctx, tx), claimedKeys)
		defer func() {
			// The batch rolled back after an effect outside it: the event
			// that caused it (each of them, for a mark of the whole batch)
			// carries the mark into its own run, where nothing is permanent
			// until its record commits.
			if committedOK {
				return
			}
			for _, i := range claimedIdx {
				if a, ok := msgs[i].Context().Value(attemptKey{}).(*attemptEffects); ok {
					for _, what := range batchEffects.of(keys[i]) {
						a.mark(what)
					}
				}
			}
		}()
		err := runBatchHandler(handlerCtx, tx, claimed, h)
		handle = time.Since(handling)
		if err != nil {
			if isSerializationFailure(err) {
				// Two batches at once (Concurrency, or two instances) that
				// lock shared rows in different orders: a handler that
				// sorts its writes by key never meets this.
				m.cfg.Logger.Warn("batch: the handler deadlocked with another transaction; its messages run on their own (lock rows in key order in the batch handler)",
					"consumer_group", m.cfg.ConsumerGroup, "messages", len(msgs), "claimed", len(claimed), "err", err)
			} else {
				m.cfg.Logger.Info("batch: the handler failed; its messages run on their own", "consumer_group", m.cfg.ConsumerGroup,
					"messages", len(msgs), "claimed", len(claimed), "err", err)
			}
			return runAlone(err)
		}
	}
	finishCtx, finish := m.finishContext(ctx)
	defer finish()
	committed = true
	committing := time.Now()
	err = tx.Commit(finishCtx)
	commit = time.Since(committing)
	if err != nil {
		// Whether it took effect is unknown; each message's own run finds
		// its claim or makes it.
		m.cfg.Logger.Warn("batch: commit failed; its messages run on their own", "consumer_group", m.cfg.ConsumerGroup, "messages", len(msgs), "err", err)
		return runAlone(err)
	}
	committedOK = true
	for _, i := range claimedIdx {
		report(i, keys[i], Processed, nil)
	}
	for _, i := range copies {
		if j := first[keys[i]]; !decided[i] && claimedKeys[keys[i]] {
			decideCopy(i, sums[j].raw, sums[j].values)
		}
	}
	return runAlone(nil) // a copy of a key nothing decided (none, as the batch stands)
}

// runBatchHandler runs h, a panic included: the batch rolls back and each
// event runs on its own, where the router's recoverer turns the same panic
// into an error that holds that one event. Unrecovered, it would end the
// process, and again at every restart.
func runBatchHandler(ctx context.Context, tx pgx.Tx, claimed []*message.Message, h BatchHandler) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("idempotency: the batch handler panicked: %v\n%s", r, debug.Stack())
		}
	}()
	return h(ctx, tx, claimed)
}

// RunAloneError is [ErrRunAlone] with why the batch failed (its Cause). It
// is never permanent, whatever its cause: the event that failed the batch
// decides its own fate when it runs on its own, and the others are innocent.
type RunAloneError struct {
	Cause error
}

func (e *RunAloneError) Error() string { return fmt.Sprintf("%v: %v", ErrRunAlone, e.Cause) }

// Unwrap is ErrRunAlone only: the cause stays out of errors.Is and
// errors.As, so that a permanent cause never makes the message permanent.
func (e *RunAloneError) Unwrap() error { return ErrRunAlone }

// IsDeadlock reports whether err is PostgreSQL's deadlock (40P01) or
// serialization failure (40001), or a [RunAloneError] whose batch failed with
// one: a conflict with another transaction that the same work passes when
// tried again.
func IsDeadlock(err error) bool {
	var r *RunAloneError
	if errors.As(err, &r) {
		err = r.Cause
	}
	return isSerializationFailure(err)
}
