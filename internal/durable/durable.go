// Package durable holds the SQL that makes a transaction's commit durable
// before the commit returns, whatever the server, database or role default.
//
// With synchronous_commit off, a commit returns before its WAL is flushed:
// a message acknowledged after it points past a row that a database crash
// then erases. Every write the acknowledgement relies on (the claim, a
// parked dead letter, a charge intent) raises the setting for its own
// transaction.
package durable

// RaiseSynchronousCommit is a SQL expression for a statement's FROM list or
// select list: it raises synchronous_commit from "off" to "local" for the
// current transaction only (set_config's is_local) and leaves every stronger
// setting (on, remote_write, remote_apply) as it is. Riding on a statement
// that runs anyway costs no round trip.
const RaiseSynchronousCommit = `set_config('synchronous_commit',
    CASE current_setting('synchronous_commit') WHEN 'off' THEN 'local' ELSE current_setting('synchronous_commit') END, true)`
