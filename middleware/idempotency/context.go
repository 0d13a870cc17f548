package idempotency

import (
	"context"

	"github.com/jackc/pgx/v5"
)

type txKey struct{}

// TxFromContext returns the transaction that holds the current message's
// claim. Every write that must happen once per event goes through it; the
// middleware commits or rolls it back, so a handler must not.
// It returns [ErrNoTransaction] outside the middleware.
func TxFromContext(ctx context.Context) (pgx.Tx, error) {
	tx, ok := ctx.Value(txKey{}).(pgx.Tx)
	if !ok || tx == nil {
		return nil, ErrNoTransaction
	}
	return tx, nil
}

// ContextWithTx returns ctx carrying tx, for tests of handlers that run
// without the middleware.
func ContextWithTx(ctx context.Context, tx pgx.Tx) context.Context {
	return context.WithValue(ctx, txKey{}, tx)
}
