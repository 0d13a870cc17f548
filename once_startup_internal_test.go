package once

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/once-dev/once/internal/startup"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/retention"
)

// The retention wait waits only for a database that cannot answer yet: a
// refused permission on the policy (a group role that may not record it)
// stops start-up at once with its reason (review finding: it was retried
// forever, and a stop then exited 0). A stop during a real wait is clean,
// and says what it waited for. (It tests the front door's own wait, not a
// copy of it: review finding.)
func TestTheRetentionWaitWaitsOnlyForADatabaseNotThereYet(t *testing.T) {
	ctx := context.Background()
	admin := testenv.Postgres(t)
	wait := func(t *testing.T, pool *pgxpool.Pool, stopWhenWaiting bool) (error, string) {
		var logs testenv.Logs
		log := slog.New(slog.NewTextHandler(&logs, nil))
		waitCtx, stop := context.WithCancel(ctx)
		defer stop()
		done := make(chan error, 1)
		go func() {
			done <- awaitRecordedRetention(waitCtx, log, retention.Config{DB: pool, Retention: 7 * 24 * time.Hour})
		}()
		if stopWhenWaiting {
			testenv.Eventually(t, 30*time.Second, "the wait for the retention policy", func() bool {
				return strings.Contains(logs.String(), "waiting for the database")
			})
			stop() // what SIGTERM does to serve's context
		}
		select {
		case err := <-done:
			return err, logs.String()
		case <-time.After(30 * time.Second):
			t.Fatalf("the retention wait did not return within 30s\n%s", logs.String())
			return nil, ""
		}
	}

	t.Run("a refused permission stops start-up", func(t *testing.T) {
		role := "once_test_nopolicy_" + uuid.NewString()[:8]
		if _, err := admin.Exec(ctx, "CREATE ROLE "+role+" NOLOGIN"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _, _ = admin.Exec(context.Background(), "DROP ROLE IF EXISTS "+role) })
		pool := testenv.PoolAs(t, admin, role) // may not read once_retention_policy
		err, logs := wait(t, pool, false)
		var pg *pgconn.PgError
		if !errors.As(err, &pg) || pg.Code != "42501" || !strings.Contains(err.Error(), "once_retention_policy") {
			t.Fatalf("%v; want the refused permission on once_retention_policy (42501)", err)
		}
		if strings.Contains(logs, "waiting for the database") {
			t.Fatalf("waited for a refused permission:\n%s", logs)
		}
	})

	t.Run("a database that hangs up is waited for", func(t *testing.T) {
		// What a client sees of a server killed with kill -9, or of a proxy
		// whose server is gone: the connection accepted, then closed.
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ln.Close() })
		var hangups atomic.Int64
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				// Read what the client sent first: closing with unread
				// data would reset the connection instead (ECONNRESET),
				// which was waited for already.
				_ = c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
				_, _ = io.Copy(io.Discard, c)
				hangups.Add(1)
				c.Close()
			}
		}()
		cfg := admin.Config().Copy()
		cfg.ConnConfig.Host = "127.0.0.1"
		cfg.ConnConfig.Port = uint16(ln.Addr().(*net.TCPAddr).Port)
		cfg.ConnConfig.Fallbacks = nil
		cfg.ConnConfig.TLSConfig = nil
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		err, logs := wait(t, pool, true)
		if hangups.Load() == 0 {
			t.Fatal("the fake server never hung up on a connection")
		}
		if err == nil || !startup.OnlyTheStop(err) {
			t.Fatalf("stopped while the database hung up: %v; want a clean stop\n%s", err, logs)
		}
		if !strings.Contains(logs, "EOF") {
			t.Fatalf("the wait did not see the hang-up (EOF):\n%s", logs)
		}
	})

	t.Run("a database answering at the moment of the stop", func(t *testing.T) {
		// docker compose down: PostgreSQL's fast shutdown answers the
		// attempt in flight (57P01) as serve's own stop arrives (review
		// finding: that attempt's error was returned and exited 1).
		stopCtx, stop := context.WithCancel(ctx)
		defer stop()
		attempts := 0
		var logs testenv.Logs
		err := startup.ForDatabase(stopCtx, slog.New(slog.NewTextHandler(&logs, nil)), "the recorded retention", nil, func() error {
			attempts++
			stop()
			return fmt.Errorf("retention: read the retention: %w", &pgconn.PgError{Code: "57P01", Message: "terminating connection due to administrator command"})
		})
		if attempts != 1 {
			t.Fatalf("%d attempts; want the one the stop cut short", attempts)
		}
		if err == nil || !startup.OnlyTheStop(err) || !strings.Contains(err.Error(), "57P01") {
			t.Fatalf("%v; want a clean stop that says what the database answered", err)
		}
	})

	t.Run("a stop while the database is away is clean", func(t *testing.T) {
		cfg := admin.Config().Copy()
		host, port, err := net.SplitHostPort(testenv.FreeAddr(t)) // nothing listens there
		if err != nil {
			t.Fatal(err)
		}
		cfg.ConnConfig.Host = host
		p, err := strconv.ParseUint(port, 10, 16)
		if err != nil {
			t.Fatal(err)
		}
		cfg.ConnConfig.Port = uint16(p)
		cfg.ConnConfig.Fallbacks = nil
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		err, _ = wait(t, pool, true)
		if err == nil || !startup.OnlyTheStop(err) {
			t.Fatalf("stopped while the database was away: %v; want a clean stop", err)
		}
		if !strings.Contains(err.Error(), "connection refused") {
			t.Fatalf("%v; want what it waited for (connection refused) kept", err)
		}
	})
}
