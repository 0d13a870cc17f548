// Package pgdb holds what every statement of the library needs to work
// where teams deploy PostgreSQL: directly, or behind a transaction pooler
// (PgBouncer in transaction mode, RDS Proxy, Supavisor, Neon's and Cloud
// SQL's poolers), in each of pgx's query exec modes.
//
// Behind such a pooler a server connection belongs to a client for one
// transaction only. A session setting, a session-level advisory lock or a
// named prepared statement stays behind on a connection the pooler then
// gives to someone else, and a statement sent in two round trips may reach
// two server connections. So the library sets what it needs per
// transaction (set_config(..., true)), takes turns through rows instead of
// advisory locks, and refuses at start-up the two exec modes that cannot
// work there ([CheckPooler]).
package pgdb

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Beginner begins transactions: a *pgxpool.Pool, a *pgx.Conn, a pgx.Tx
// (a savepoint).
type Beginner interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
}

// InTx runs f in a transaction of its own, committed when f returns nil.
func InTx(ctx context.Context, db Beginner, f func(pgx.Tx) error) error {
	return pgx.BeginTxFunc(ctx, db, pgx.TxOptions{}, f)
}

// InTxBounded is InTx with the transaction's idle time bounded by idle
// (see [BoundIdle]), for a transaction that writes.
func InTxBounded(ctx context.Context, db DB, idle time.Duration, f func(pgx.Tx) error) error {
	return InTx(ctx, IdleBounded{DB: db, Idle: idle}, f)
}

// IdleBounded is DB whose every transaction has its idle time bounded by
// Idle from its start (see [BoundIdle]): for code that begins its own
// transactions, such as watermill-sql's.
type IdleBounded struct {
	DB
	Idle time.Duration
}

func (d IdleBounded) BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error) {
	tx, err := d.DB.BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	if err := BoundIdle(ctx, tx, d.Idle); err != nil {
		_ = tx.Rollback(ctx)
		return nil, err
	}
	return tx, nil
}

// BoundIdle sets how long the server lets tx sit idle between its
// statements (idle_in_transaction_session_timeout), for tx only: behind a
// transaction pooler a session setting would stay on a server connection
// another client gets next, and the pooler refuses one in the start-up
// packet. A client that vanished behind a network black hole cannot tell
// the server it gave up: without a bound its backend keeps the
// transaction open until TCP keepalive notices, two hours by default,
// with every lock it took (a claim's row, a dead letter's source, a
// detach's lock on the whole claim table) and its transaction id, which
// holds back every outbox forwarder of the cluster (watermill-sql sends
// only rows older than the oldest transaction still running). Zero or
// less keeps the server's setting.
func BoundIdle(ctx context.Context, tx pgx.Tx, idle time.Duration) error {
	if idle <= 0 {
		return nil
	}
	if _, err := tx.Exec(ctx, `SELECT set_config('idle_in_transaction_session_timeout', $1, true)`, strconv.FormatInt(max(idle.Milliseconds(), 1), 10)); err != nil {
		return fmt.Errorf("pgdb: bound the transaction's idle time: %w", err)
	}
	return nil
}

// MaxIdleBound is the longest bound [BoundIdle] can set: the server's
// setting is in milliseconds, an int.
const MaxIdleBound = math.MaxInt32 * time.Millisecond

// ErrModeBehindPooler is the start-up refusal of a pgx query exec mode that
// cannot work behind a transaction pooler.
var ErrModeBehindPooler = errors.New("pgdb: a pgx query exec mode that cannot work behind a connection pooler")

// Pooled reports whether pool reaches PostgreSQL through a connection
// pooler: the process that answers (pg_backend_pid) is not the one the
// connection was told of when it connected (the backend key data, which a
// pooler makes up for its clients).
func Pooled(ctx context.Context, pool *pgxpool.Pool) (bool, error) {
	c, err := pool.Acquire(ctx)
	if err != nil {
		return false, err
	}
	defer c.Release()
	var pid uint32
	// The simple protocol: the probe must work in any mode behind any pooler.
	if err := InTx(ctx, c, func(tx pgx.Tx) error {
		return tx.QueryRow(ctx, "SELECT pg_backend_pid()", pgx.QueryExecModeSimpleProtocol).Scan(&pid)
	}); err != nil {
		return false, fmt.Errorf("pgdb: ask the server for its process: %w", err)
	}
	return pid != c.Conn().PgConn().PID(), nil
}

// CheckPooler refuses, behind a connection pooler, the two pgx query exec
// modes that cannot work there; setting names the URL's setting in the
// error. The others (exec, simple_protocol, cache_describe) send each
// statement in one round trip that names no prepared statement.
//
//   - cache_statement, pgx's default, prepares named statements on one
//     server connection and runs them later on whichever the pooler hands
//     out, where they do not exist (26000): every message would be held.
//     A URL that names it on purpose is let through (a pooler that keeps
//     prepared statements per client: PgBouncer 1.21+ with
//     max_prepared_statements, or session pooling).
//   - describe_exec describes a statement in one round trip and runs it in
//     a second, which may reach another server connection, whose unnamed
//     statement is another client's: an error (26000, 22P03, 08P01), or
//     another statement run with these parameters.
func CheckPooler(ctx context.Context, pool *pgxpool.Pool, setting string) error {
	cfg := pool.Config().ConnConfig
	mode := cfg.DefaultQueryExecMode
	explicit := strings.Contains(cfg.ConnString(), "default_query_exec_mode")
	if !(mode == pgx.QueryExecModeCacheStatement && !explicit) && mode != pgx.QueryExecModeDescribeExec {
		return nil
	}
	pooled, err := Pooled(ctx, pool)
	if err != nil || !pooled {
		return err
	}
	why := "cache_statement (pgx's default) keeps named prepared statements on server connections that the pooler hands to other clients"
	alternatively := "; a pooler that keeps prepared statements per client (PgBouncer 1.21+ with max_prepared_statements, session pooling) may name default_query_exec_mode=cache_statement on purpose"
	if mode == pgx.QueryExecModeDescribeExec {
		why = "describe_exec describes a statement in one round trip and runs it in another, which the pooler may send to another server connection"
		alternatively = ""
	}
	return fmt.Errorf("%w: %s reaches PostgreSQL through a connection pooler (the server process that answers is not the one "+
		"the connection was given), and pgx's query exec mode %s: set default_query_exec_mode=exec in %s (or simple_protocol, "+
		"or cache_describe)%s", ErrModeBehindPooler, setting, why, setting, alternatively)
}
