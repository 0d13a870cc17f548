package testenv

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/once-dev/once/pgdb"
)

// Intercepted is a real database whose transactions a test watches, to
// stage a fault at one precise point between two statements: OnQuery runs
// before each Query of a transaction, AfterExec after each Exec that
// succeeded, OnCommit before its Commit (queried: whether the transaction
// ran a Query). Any may be nil.
type Intercepted struct {
	pgdb.DB
	OnQuery   func(ctx context.Context, sql string)
	AfterExec func(ctx context.Context, sql string)
	OnCommit  func(ctx context.Context, queried bool)
}

func (d *Intercepted) BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error) {
	tx, err := d.DB.BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return &interceptedTx{Tx: tx, d: d}, nil
}

type interceptedTx struct {
	pgx.Tx
	d       *Intercepted
	queried bool
}

func (tx *interceptedTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	tx.queried = true
	if tx.d.OnQuery != nil {
		tx.d.OnQuery(ctx, sql)
	}
	return tx.Tx.Query(ctx, sql, args...)
}

func (tx *interceptedTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	tag, err := tx.Tx.Exec(ctx, sql, args...)
	if err == nil && tx.d.AfterExec != nil {
		tx.d.AfterExec(ctx, sql)
	}
	return tag, err
}

func (tx *interceptedTx) Commit(ctx context.Context) error {
	if tx.d.OnCommit != nil {
		tx.d.OnCommit(ctx, tx.queried)
	}
	return tx.Tx.Commit(ctx)
}
