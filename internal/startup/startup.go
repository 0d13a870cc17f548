// Package startup holds what a service waits for while it starts, and what
// it refuses at once: brokers that cannot be reached or are still starting
// are waited for, and so is a database that cannot answer yet; refused
// credentials, permissions, or a table never migrated stop start-up with
// their reason.
package startup

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/IBM/sarama"
	"github.com/cenkalti/backoff/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// ForKafka runs step, a start-up step that talks to Kafka (what names it in
// the log). A step that fails only because the brokers cannot be reached or
// are still starting is tried again with backoff, a line saying so each
// time, for up to timeout (each step its own); any other failure (refused
// credentials, a missing permission, a bad setting) ends it at once. setting
// names the timeout's setting in the error. A timeout of 0 tries once.
func ForKafka(ctx context.Context, log *slog.Logger, timeout time.Duration, setting, what string, step func() error) error {
	if timeout == 0 {
		return step()
	}
	exp := backoff.NewExponentialBackOff()
	exp.MaxInterval = 5 * time.Second
	_, err := backoff.Retry(ctx, func() (struct{}, error) {
		err := step()
		if err != nil && !KafkaUnavailable(err) {
			return struct{}{}, backoff.Permanent(err)
		}
		return struct{}{}, err
	}, backoff.WithBackOff(exp), backoff.WithMaxElapsedTime(timeout), backoff.WithNotify(func(err error, next time.Duration) {
		log.Warn("waiting for Kafka", "step", what, "retry_in", next.Round(time.Millisecond), "err", err)
	}))
	if err != nil && KafkaUnavailable(err) {
		return fmt.Errorf("%w (waited up to %s %s)", err, setting, timeout)
	}
	return err
}

// ForDatabase runs step, a start-up step that asks a database, until it
// succeeds: a database that cannot answer yet (read-only during a
// failover, restarting, unreachable, hanging up) is waited for, as a claim
// would be; a refusal no wait clears (DatabaseRefused, or final(err)) ends
// it at once with its reason. A stop during the wait returns the stop, with
// what was waited for in its text.
func ForDatabase(ctx context.Context, log *slog.Logger, what string, final func(error) bool, step func() error) error {
	exp := backoff.NewExponentialBackOff()
	exp.MaxInterval = 10 * time.Second
	var last error
	_, err := backoff.Retry(ctx, func() (struct{}, error) {
		err := step()
		if err == nil || DatabaseRefused(err) || (final != nil && final(err)) {
			return struct{}{}, backoff.Permanent(err)
		}
		if last == nil || ctx.Err() == nil {
			last = err
		}
		if ctx.Err() != nil {
			// Stopped during the attempt (a database shutting down with
			// us answers the same moment): the stop is the error.
			return struct{}{}, backoff.Permanent(context.Cause(ctx))
		}
		log.Warn("waiting for the database", "step", what, "err", err)
		return struct{}{}, err
	}, backoff.WithBackOff(exp), backoff.WithMaxElapsedTime(0))
	if err != nil && ctx.Err() != nil && last != nil && OnlyTheStop(err) {
		// What was waited for is said, not wrapped: the stop is clean.
		err = fmt.Errorf("%w (while waiting for the database: %v)", err, last)
	}
	return err
}

// DatabaseRefused reports whether the database refused in a way no wait
// clears: credentials, a permission, a database, schema or table that is not
// there (a setting to fix, or migrations not applied). Every cause must be
// one: with several hosts, one refusing while another is down is a failover
// to wait for. Anything else a database answers at start-up (read-only,
// starting, restarting, hanging up, a pooler that cannot reach it) is
// waited for.
func DatabaseRefused(err error) bool {
	return EveryCause(err, func(cause error) bool {
		var pg *pgconn.PgError
		if !errors.As(cause, &pg) {
			return false
		}
		return strings.HasPrefix(pg.Code, "28") || // invalid authorization: credentials, pg_hba
			strings.HasPrefix(pg.Code, "42") || // access rule violation: a permission, an undefined table
			pg.Code == "3D000" || pg.Code == "3F000" // no such database, no such schema
	})
}

// KafkaUnavailable reports whether err says only that the brokers could not
// be reached or are not ready yet: every error it joins or wraps ends in a
// network failure or in one of the broker states a restart or an election
// passes through. An error that says anything else (authentication,
// authorization, configuration) is not one.
func KafkaUnavailable(err error) bool {
	return EveryCause(err, brokerNotThereYet)
}

// OnlyTheStop reports whether err says only that start-up was interrupted
// by the stop while it waited: every cause is the cancellation, or a broker
// not there yet (a connection timeout included: what start-up waits
// through). A refused permission found meanwhile is not.
func OnlyTheStop(err error) bool {
	return EveryCause(err, func(cause error) bool {
		return errors.Is(cause, context.Canceled) || brokerNotThereYet(cause)
	})
}

// EveryCause reports whether ok holds for every error at the end of err's
// chains (what it joins or wraps, down to errors that wrap nothing).
func EveryCause(err error, ok func(cause error) bool) bool {
	if joined, isJoined := err.(interface{ Unwrap() []error }); isJoined {
		errs := joined.Unwrap()
		for _, e := range errs {
			if !EveryCause(e, ok) {
				return false
			}
		}
		return len(errs) > 0
	}
	if inner := errors.Unwrap(err); inner != nil {
		return EveryCause(inner, ok)
	}
	return ok(err)
}

// brokerNotThereYet is a cause of KafkaUnavailable: a network failure, or a
// broker state that a restart passes through.
func brokerNotThereYet(err error) bool {
	var kerr sarama.KError
	if errors.As(err, &kerr) {
		return slices.Contains(kafkaStarting, kerr)
	}
	// Not io.EOF, nor an ErrOutOfBrokers without a cause: that is what a TLS
	// client on a plaintext listener sees, and what sarama leaves of a SASL
	// mechanism the broker refuses.
	var netErr net.Error
	return errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) || (errors.As(err, &netErr) && netErr.Timeout())
}

// kafkaStarting are the broker answers of a cluster that is starting,
// restarting or moving leaders: each passes by itself.
var kafkaStarting = []sarama.KError{
	sarama.ErrUnknownTopicOrPartition, sarama.ErrLeaderNotAvailable, sarama.ErrNotLeaderForPartition, sarama.ErrRequestTimedOut,
	sarama.ErrBrokerNotAvailable, sarama.ErrReplicaNotAvailable, sarama.ErrNetworkException, sarama.ErrOffsetsLoadInProgress,
	sarama.ErrConsumerCoordinatorNotAvailable, sarama.ErrNotCoordinatorForConsumer, sarama.ErrNotController,
}
