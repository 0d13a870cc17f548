package idempotency

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/google/uuid"
)

// MarkExternalEffect records that the current attempt caused an effect
// outside the claim's transaction: a provider charged or refunded, an e-mail
// or a message left. Call it as soon as the effect is known to have happened.
//
// From then on nothing that attempt returns is permanent: the money has
// moved and only its record is missing, so the message is held and tried
// again until its record commits, never dead-lettered. An error marked
// [Permanent] after the mark (a write refused, a bug) is reported with
// [ErrAfterExternalEffect], as is every other error after it.
// [RejectAfterCommit] still dead-letters: its record commits with the claim
// first. The next attempt repeats the call;
// give the effect its own idempotency (an Idempotency-Key equal to the
// event id, R-KFK-IDEM-4) so that it happens once.
//
// The mark holds for every later attempt of the same delivery when the
// router gives each delivery a record of its own ([WithDelivery]; package
// pipeline does): the horizon no longer refuses it either, since its record
// must commit. Without one, it holds for the rest of this call.
//
// In a batch's handler ([Middleware.ProcessBatch]) it cannot tell which of
// the batch's events caused the effect, so it marks every one of them: if
// the batch rolls back, each runs on its own held after the effect, and an
// event's own permanent verdict is held with it. Say which event it was
// with [MarkExternalEffectOf].
//
// Outside the middleware (ctx carries no attempt) it does nothing.
func MarkExternalEffect(ctx context.Context, what string) {
	if b, ok := ctx.Value(batchKey{}).(*batchEffects); ok {
		b.markAll(what)
		return
	}
	if a, ok := ctx.Value(attemptKey{}).(*attemptEffects); ok {
		a.mark(what)
	}
}

// MarkExternalEffectOf is [MarkExternalEffect] for the event whose id is
// eventID. In a batch's handler it marks that event only: should the batch
// roll back, that event runs on its own held after the effect, and the
// batch's other events keep their own verdicts (a permanent one is
// dead-lettered). An id that is none of the batch's claimed events marks
// them all, as MarkExternalEffect does: a mark is never lost. For a handler
// of one event it is MarkExternalEffect.
func MarkExternalEffectOf(ctx context.Context, eventID uuid.UUID, what string) {
	if b, ok := ctx.Value(batchKey{}).(*batchEffects); ok {
		b.mark(eventID, what)
		return
	}
	MarkExternalEffect(ctx, what)
}

// WithDelivery returns ctx with a record of one delivery's external effects
// that lasts across its attempts: a router that tries a held message again
// calls it once per delivery, before the first attempt.
func WithDelivery(ctx context.Context) context.Context {
	return context.WithValue(ctx, attemptKey{}, &attemptEffects{})
}

// effectsOf is the delivery's record in ctx, or a new one for this call.
func effectsOf(ctx context.Context) (context.Context, *attemptEffects) {
	if a, ok := ctx.Value(attemptKey{}).(*attemptEffects); ok {
		return ctx, a
	}
	return withAttempt(ctx)
}

// ErrAfterExternalEffect is wrapped by the error of an attempt that failed,
// even for good, after [MarkExternalEffect]: it is not permanent, and the
// message is held until an attempt commits.
var ErrAfterExternalEffect = errors.New("idempotency: failed after an external effect; held until its record commits")

// attemptEffects is what one attempt did outside its transaction.
type attemptEffects struct {
	mu      sync.Mutex
	effects []string
}

type attemptKey struct{}

// batchEffects is what one batch's attempt did outside its transaction:
// marks for the whole batch, and marks for one of its events.
type batchEffects struct {
	mu      sync.Mutex
	claimed map[uuid.UUID]bool
	all     []string
	byEvent map[uuid.UUID][]string
}

type batchKey struct{}

func withBatch(ctx context.Context, claimed map[uuid.UUID]bool) (context.Context, *batchEffects) {
	b := &batchEffects{claimed: claimed, byEvent: map[uuid.UUID][]string{}}
	return context.WithValue(ctx, batchKey{}, b), b
}

func (b *batchEffects) markAll(what string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.all = append(b.all, what)
}

func (b *batchEffects) mark(id uuid.UUID, what string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.claimed[id] {
		b.all = append(b.all, what)
		return
	}
	b.byEvent[id] = append(b.byEvent[id], what)
}

// of is what happened for the event id: the batch's marks and its own.
func (b *batchEffects) of(id uuid.UUID) []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append(slices.Clone(b.all), b.byEvent[id]...)
}

func withAttempt(ctx context.Context) (context.Context, *attemptEffects) {
	a := &attemptEffects{}
	return context.WithValue(ctx, attemptKey{}, a), a
}

func (a *attemptEffects) mark(what string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.effects = append(a.effects, what)
}

func (a *attemptEffects) happened() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]string(nil), a.effects...)
}

// afterEffectError keeps a permanent verdict from dead-lettering a message
// whose attempt already had an effect outside the transaction.
type afterEffectError struct {
	effects []string
	err     error
}

func (e *afterEffectError) Error() string {
	return fmt.Sprintf("%v after %s: %v", ErrAfterExternalEffect, strings.Join(e.effects, ", "), e.err)
}

func (e *afterEffectError) Unwrap() []error { return []error{ErrAfterExternalEffect, e.err} }

// Permanent reports false: see [MarkExternalEffect]. It is found before any
// Permanent method of the error it wraps.
func (e *afterEffectError) Permanent() bool { return false }

// holdAfterEffect turns err into one that is not permanent, and says what
// happened before it, when the attempt had an effect outside its
// transaction.
func holdAfterEffect(a *attemptEffects, err error) error {
	if err == nil {
		return nil
	}
	effects := a.happened()
	if len(effects) == 0 {
		return err
	}
	return &afterEffectError{effects: effects, err: err}
}
