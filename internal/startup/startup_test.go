package startup

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"syscall"
	"testing"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5/pgconn"
)

// Only a broker that cannot be reached or is still starting is waited for;
// anything that names another cause stops start-up at once.
func TestKafkaUnavailableIsOnlyTheBrokersNotBeingThereYet(t *testing.T) {
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"connection refused", sarama.Wrap(sarama.ErrOutOfBrokers, refused), true},
		{"connection reset", fmt.Errorf("kafka admin on [h:1]: %w", sarama.Wrap(sarama.ErrOutOfBrokers, os.NewSyscallError("read", syscall.ECONNRESET))), true},
		// sarama keeps no cause for a broker that refused the SASL
		// mechanism, and a TLS client on a plaintext listener reads EOF:
		// settings to fix, not brokers to wait for (review findings).
		{"out of brokers, no cause", sarama.Wrap(sarama.ErrOutOfBrokers), false},
		{"closed during the handshake", fmt.Errorf("kafka admin on [h:1]: %w", sarama.Wrap(sarama.ErrOutOfBrokers, io.EOF)), false},
		{"offsets loading", fmt.Errorf("create topic t: %w", sarama.ErrOffsetsLoadInProgress), true},
		{"topics and groups still loading", errors.Join(fmt.Errorf("topic a: %w", sarama.ErrUnknownTopicOrPartition),
			fmt.Errorf("consumer group g: %w", sarama.ErrOffsetsLoadInProgress)), true},
		{"a refused permission among them", errors.Join(fmt.Errorf("topic a: %w", sarama.ErrUnknownTopicOrPartition),
			errors.New("User:svc is not authorized on topic b: it needs READ and DESCRIBE")), false},
		{"a refused password", sarama.Wrap(sarama.ErrOutOfBrokers, sarama.Wrap(sarama.ErrSASLAuthenticationFailed,
			errors.New("Authentication failed during authentication due to invalid credentials with SASL mechanism SCRAM-SHA-512"))), false},
		{"a topic not authorized", fmt.Errorf("create topic t: %w", sarama.ErrTopicAuthorizationFailed), false},
		{"a bad setting", sarama.ConfigurationError("Net.SASL.User must not be empty"), false},
		{"something else", errors.New("boom"), false},
	} {
		if got := KafkaUnavailable(tc.err); got != tc.want {
			t.Errorf("%s (%v): %v, want %v", tc.name, tc.err, got, tc.want)
		}
	}
}

// Stopped while starting, serve exits cleanly only when the stop is all its
// error says: a permission refused at that moment still fails the run
// (review finding: any error that came with the stop was swallowed).
// signalCause is the cause signal.NotifyContext gives its context, as
// main's does on SIGTERM (SIGUSR1 here, sent to this process).
func signalCause(t *testing.T) error {
	t.Helper()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGUSR1)
	defer stop()
	if err := syscall.Kill(os.Getpid(), syscall.SIGUSR1); err != nil {
		t.Fatal(err)
	}
	<-ctx.Done()
	return context.Cause(ctx)
}

func TestOnlyTheStopIsACleanStopAtStartUp(t *testing.T) {
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
	dialCanceled := &net.OpError{Op: "dial", Net: "tcp", Err: context.Canceled}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, dialErr := (&net.Dialer{}).DialContext(ctx, "tcp", "127.0.0.1:1")
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"the backoff's cancellation", fmt.Errorf("KAFKA_BROKERS: %w", context.Canceled), true},
		{"a dial cancelled by the stop", fmt.Errorf("DATABASE_URL: %w", dialCanceled), true},
		{"the standard library's cancelled dial", fmt.Errorf("DATABASE_URL: %w", dialErr), true},
		{"a broker still unreachable", fmt.Errorf("KAFKA_BROKERS: %w", sarama.Wrap(sarama.ErrOutOfBrokers, refused)), true},
		{"a permission found before the stop", fmt.Errorf("KAFKA_BROKERS: %w", errors.Join(
			errors.New("User:svc is not authorized on topic b: it needs READ and DESCRIBE"), context.Canceled)), false},
		// A database that times out is one not there yet: start-up waits
		// for it, so a stop then is clean.
		{"a connection timeout", fmt.Errorf("DATABASE_URL: %w", context.DeadlineExceeded), true},
		// A refusal that came with the stop (review finding: a refused
		// permission on the retention policy exited 0).
		{"a refused permission with the stop", fmt.Errorf("--dedup-retention: %w", errors.Join(
			&pgconn.PgError{Code: "42501", Message: "permission denied for table once_retention_policy"}, context.Canceled)), false},
		{"the retention wait's stop, saying what it waited for", fmt.Errorf("DATABASE_URL: checking the recorded retention: %w",
			fmt.Errorf("%w (while waiting for the database: %v)", context.Canceled, io.ErrUnexpectedEOF)), true},
		{"the stop as SIGTERM makes it", fmt.Errorf("KAFKA_BROKERS: %w", signalCause(t)), true},
		{"a refused principal at the stop", fmt.Errorf("KAFKA_BROKERS: %w", sarama.ErrClusterAuthorizationFailed), false},
		{"a refused password at the stop", fmt.Errorf("DATABASE_URL: %w", errors.Join(
			&pgconn.PgError{Code: "28P01", Message: "password authentication failed for user \"once\""}, context.Canceled)), false},
	} {
		if got := OnlyTheStop(tc.err); got != tc.want {
			t.Errorf("%s (%v): %v, want %v", tc.name, tc.err, got, tc.want)
		}
	}
}

// What the retention wait stops at: refusals no wait clears. Everything
// else a database answers at start-up is waited for, including how pgx
// reports a server killed mid-query (unexpected EOF), a standby refused by
// target_session_attrs, a name that does not resolve yet, and a pooler's
// 08P01 (review finding: those stopped start-up during a failover).
func TestDatabaseRefusedIsOnlyARefusalNoWaitClears(t *testing.T) {
	pg := func(code string) error {
		return fmt.Errorf("retention: read the retention: %w", &pgconn.PgError{Code: code})
	}
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"permission denied", pg("42501"), true},
		{"table missing (never migrated)", pg("42P01"), true},
		{"password refused", pg("28P01"), true},
		{"no pg_hba entry", pg("28000"), true},
		{"no such database", pg("3D000"), true},
		{"no such schema", pg("3F000"), true},
		{"every host refusing", fmt.Errorf("failed to connect: %w", errors.Join(pg("28000"), pg("28P01"))), true},
		// With several hosts, one refusing while another is down is a
		// failover (review finding: the first PgError decided).
		{"one host refusing, the other down", fmt.Errorf("failed to connect: %w", errors.Join(pg("28000"), refused)), false},
		{"one host starting, the other refusing", fmt.Errorf("failed to connect: %w", errors.Join(pg("57P03"), pg("28000"))), false},
		{"read-only (failover)", pg("25006"), false},
		{"starting up", pg("57P03"), false},
		{"too many connections", pg("53300"), false},
		{"a pooler that cannot reach the server", pg("08P01"), false},
		{"killed mid-query", fmt.Errorf("retention: read the retention: %w", io.ErrUnexpectedEOF), false},
		{"a standby refused by target_session_attrs", fmt.Errorf("failed to connect: %w", pgconn.ErrStandbyConnection), false},
		{"a name that does not resolve yet", fmt.Errorf("failed to connect: %w", &net.DNSError{Err: "no such host", Name: "db-0.db", IsNotFound: true}), false},
		{"connection refused", fmt.Errorf("failed to connect: %w", refused), false},
		{"connect timeout", fmt.Errorf("failed to connect: %w", context.DeadlineExceeded), false},
	} {
		if got := DatabaseRefused(tc.err); got != tc.want {
			t.Errorf("%s (%v): %v, want %v", tc.name, tc.err, got, tc.want)
		}
	}
}
