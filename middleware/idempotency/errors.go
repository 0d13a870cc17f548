package idempotency

import (
	"errors"

	"github.com/jackc/pgx/v5/pgconn"
)

var (
	// ErrNoTransaction is returned by [TxFromContext] when a handler runs
	// without the middleware in front of it.
	ErrNoTransaction = errors.New("idempotency: no transaction in context: the handler is not wrapped by idempotency.Middleware")

	// ErrInvalidKey means the message carries no usable dedup key. It is
	// permanent: no redelivery of the same bytes can fix it.
	ErrInvalidKey = errors.New("idempotency: invalid dedup key")

	// ErrPayloadMismatch means an event id was already processed with
	// different payload bytes: a producer reused an id, which is a bug on its
	// side, not a duplicate. It is permanent and the handler is not run.
	ErrPayloadMismatch = errors.New("idempotency: event id already processed with a different payload")

	// ErrTooOld means the event is older than the dedup horizon
	// (Config.MaxEventAge) and the policy is to reject it: its claim may
	// already be gone, so processing it could repeat an effect.
	ErrTooOld = errors.New("idempotency: event older than the dedup horizon")

	// ErrFromTheFuture means the event's id lies further ahead than
	// Config.MaxClockSkew: the producer's clock is wrong.
	ErrFromTheFuture = errors.New("idempotency: event id lies in the future beyond the clock skew bound")
)

// PermanentError marks an error that no retry can fix (a malformed event, a
// charge the provider refused for good). Routers should dead-letter such a
// message at once instead of retrying it. Create one with [Permanent].
type PermanentError struct{ Err error }

func (e *PermanentError) Error() string { return e.Err.Error() }
func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent reports true: see [IsPermanent].
func (e *PermanentError) Permanent() bool { return true }

// Permanent marks err as one that no retry can fix. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}

// RejectedError is what the middleware returns after a handler's
// [RejectAfterCommit]: the handler's record of the failure and the claim were
// committed, and the message must be dead-lettered with Err as the reason,
// unless DeadLettered says Config.RecordRejection already wrote the dead
// letter in that transaction.
type RejectedError struct {
	Err          error
	DeadLettered bool
}

func (e *RejectedError) Error() string { return e.Err.Error() }
func (e *RejectedError) Unwrap() error { return e.Err }

// Permanent reports true: a rejection is the handler's final verdict.
func (e *RejectedError) Permanent() bool { return true }

type rejectAfterCommit struct{ err error }

func (e rejectAfterCommit) Error() string { return e.err.Error() }
func (e rejectAfterCommit) Unwrap() error { return e.err }

// RejectAfterCommit is returned by a handler that has recorded, through the
// claim's transaction, that the event failed for good (a declined charge
// marked failed). The middleware commits those writes with the claim and then
// returns a [*RejectedError], so the router dead-letters the message, and
// any later delivery of the event is a duplicate that changes nothing.
func RejectAfterCommit(err error) error {
	if err == nil {
		return nil
	}
	return rejectAfterCommit{err}
}

// IsPermanent reports whether err says that no retry can fix it: the first
// error in its chain with a Permanent() bool method decides ([*PermanentError],
// [*RejectedError], or a type of another package, such as a payment
// provider's answer). Errors without such a method are not permanent.
func IsPermanent(err error) bool {
	var p interface{ Permanent() bool }
	return errors.As(err, &p) && p.Permanent()
}

// isSerializationFailure reports the errors a transaction gets when it lost a
// race it could not wait out: under REPEATABLE READ or SERIALIZABLE the losing
// claim of the same key fails with 40001 instead of returning zero rows.
func isSerializationFailure(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "40001" || pgErr.Code == "40P01")
}
