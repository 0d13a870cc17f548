package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"
)

// A bad or missing setting stops start-up with a message naming it, before
// anything connects anywhere.
func TestBadSettingsAreNamed(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"serve", "--database-url", "postgres://x@127.0.0.1/db"}, "--kafka-brokers"},
		{[]string{"serve", "--kafka-brokers", "127.0.0.1:9092"}, "--database-url"},
		{[]string{"serve", "--kafka-brokers", "localhost", "--database-url", "postgres://x@h/db"}, "KAFKA_BROKERS"},
		{[]string{"serve", "--kafka-brokers", "h:1", "--database-url", "postgres://x@h/db", "--kafka-version", "0.10.2"}, "KAFKA_VERSION"},
		{[]string{"serve", "--kafka-brokers", "h:1", "--database-url", "postgres://x@h/db", "--groups", "shipping"}, "ONCE_GROUPS"},
		{[]string{"serve", "--kafka-brokers", "h:1", "--database-url", "postgres://x@h/db", "--commit-mode", "never"}, "--commit-mode"},
		{[]string{"serve", "--kafka-brokers", "h:1", "--database-url", "::nope", "--partitions", "1"}, "DATABASE_URL"},
		{[]string{"migrate", "--database-url", "postgres://x@h/db", "--db-max-conns", "1"}, "ONCE_DB_MAX_CONNS"},
		{[]string{"serve", "--kafka-brokers", "h:1", "--database-url", "postgres://x@h/db", "--watch-interval", "10ms"}, "--watch-interval"},
		{[]string{"serve", "--kafka-brokers", "h:1", "--database-url", "postgres://x@h/db", "--kafka-start-timeout", "-1s"}, "--kafka-start-timeout"},
		{[]string{"serve", "--kafka-brokers", "h:1", "--database-url", "postgres://x@h/db", "--kafka-sasl-mechanism", "PLAIN", "--kafka-sasl-user", "u"}, "--kafka-sasl-mechanism"},
		{[]string{"serve", "--kafka-brokers", "h:1", "--database-url", "postgres://x@h/db", "--kafka-sasl-mechanism", "SCRAM-SHA-512"}, "KAFKA_SASL_PASSWORD"},
		{[]string{"serve", "--kafka-brokers", "h:1", "--database-url", "postgres://x@h/db", "--kafka-tls-ca", "/nonexistent.pem"}, "--kafka-tls-ca"},
		{[]string{"inbox", "status", "not-a-uuid", "--database-url", "postgres://x@h/db"}, "<event-id>"},
		{[]string{"inbox", "forget", "0190c1b2-0000-7000-8000-000000000000", "--group", "billing", "--database-url", "postgres://x@h/db"}, "--force"},
		{[]string{"dlq", "list", "--kafka-brokers", "h:1", "--reason", "("}, "--reason"},
		{[]string{"dlq", "list", "--kafka-brokers", "h:1", "--dlq-topic", "orders.dead"}, "--source-topic"},
		{[]string{"dlq", "replay", "--kafka-brokers", "h:1", "--source-topic", "orders", "--dlq-topic", "orders"}, "--dlq-topic"},
		{[]string{"inbox", "status", "6ba7b810-9dad-41d1-80b4-00c04fd430c8", "--database-url", "postgres://x@h/db"}, "--id-namespace"},
		{[]string{"inbox", "status", "42", "--id-namespace", "inventory", "--scan-timeout", "0s", "--database-url", "postgres://x@h/db"}, "--scan-timeout"},
		{[]string{"dlq", "replay", "--kafka-brokers", "h:1", "--older-than", "48h"}, "--max-age"},
		{[]string{"serve", "--kafka-brokers", "h:1", "--database-url", "postgres://x@h/db", "--drain-timeout", "10s", "--revocation-grace", "10s"}, "--drain-timeout"},
		{[]string{"serve", "--kafka-brokers", "h:1", "--database-url", "postgres://x@h/db", "--concurrency", "-1"}, "--concurrency"},
		{[]string{"payment-provider", "--database-url", "postgres://x@h/db", "--fault-latency", "2s", "--in-flight-timeout", "1s"}, "--in-flight-timeout"},
		{[]string{"payment-provider", "--database-url", "postgres://x@h/db", "--in-flight-timeout", "0s"}, "--in-flight-timeout"},
	} {
		t.Setenv("KAFKA_BROKERS", "")
		t.Setenv("DATABASE_URL", "")
		var out, errOut bytes.Buffer
		err := run(context.Background(), tc.args, &out, &errOut)
		if err == nil || !strings.Contains(err.Error()+errOut.String(), tc.want) {
			t.Errorf("%v: got %v (stderr %q); want an error naming %s", tc.args, err, errOut.String(), tc.want)
		}
	}
}

func TestHelpOnEverySubcommand(t *testing.T) {
	for _, args := range [][]string{{"--help"}, {"serve", "--help"}, {"migrate", "--help"}, {"maintain", "--help"}, {"bench", "--help"},
		{"bench-retention", "--help"}, {"orders", "--help"}, {"demo", "--help"}, {"dlq", "list", "--help"}, {"dlq", "replay", "--help"},
		{"inbox", "status", "--help"}, {"inbox", "forget", "--help"}, {"payment-provider", "--help"}, {"group", "remove-member", "--help"}} {
		var out, errOut bytes.Buffer
		if err := run(context.Background(), args, &out, &errOut); err != nil {
			t.Errorf("%v: %v", args, err)
		}
		if !strings.Contains(out.String(), "Usage: app") {
			t.Errorf("%v: no usage printed: %q", args, out.String())
		}
	}
}

// Issue 31, item 5b: with --log-format json, an error that stops app was
// printed as plain text ("app: ..."), which a JSON log pipeline drops or
// garbles. It is now one JSON line on stderr, and main prints nothing more.
func TestAFatalErrorHonoursTheLogFormat(t *testing.T) {
	t.Setenv("KAFKA_BROKERS", "")
	t.Setenv("DATABASE_URL", "")
	for _, args := range [][]string{
		{"--log-format", "json", "serve", "--kafka-brokers", "h:1", "--database-url", "postgres://x@h/db", "--concurrency=-1"}, // refused by the command
		{"--log-format", "json", "serve", "--kafka-brokers", "h:1"},                                                            // refused by the parser
	} {
		var out, errOut bytes.Buffer
		err := run(context.Background(), args, &out, &errOut)
		var done logged
		if err == nil || !errors.As(err, &done) {
			t.Fatalf("%v: %v; want an error run logged", args, err)
		}
		var line map[string]any
		lines := strings.Split(strings.TrimSpace(errOut.String()), "\n")
		if jerr := json.Unmarshal([]byte(lines[len(lines)-1]), &line); jerr != nil || line["level"] != "ERROR" || line["err"] != err.Error() {
			t.Errorf("%v: the last line of stderr is not the error as JSON (%v):\n%s", args, jerr, errOut.String())
		}
	}
	// Text stays main's line.
	var errOut bytes.Buffer
	err := run(context.Background(), []string{"serve", "--kafka-brokers", "h:1", "--database-url", "postgres://x@h/db", "--concurrency=-1"}, io.Discard, &errOut)
	var done logged
	if err == nil || errors.As(err, &done) {
		t.Errorf("text format: %v; want an error for main to print", err)
	}
}

// Issue 31, item 5d: durations were nanoseconds in JSON logs
// ("retry_in":2000000000). They are seconds there, as a person reads them
// in text, nested in a group too.
func TestDurationsInTheLogsAreSecondsOrReadable(t *testing.T) {
	for _, tc := range []struct{ format, want string }{
		{"json", `"retry_in":2.5,"held":{"for":0.25}`},
		{"text", `retry_in=2.5s held.for=250ms`},
	} {
		var out bytes.Buffer
		newLogger(&out, slog.LevelInfo, tc.format).Info("x", "retry_in", 2500*time.Millisecond, slog.Group("held", "for", 250*time.Millisecond))
		if !strings.Contains(out.String(), tc.want) {
			t.Errorf("%s: %q; want %s", tc.format, out.String(), tc.want)
		}
	}
}

// Issue 31, item 5e: errors named the library's settings by their Go
// fields ("Token", "(DatabaseURL)"), which a person running app does not
// set. They name the flag and the environment variable now.
func TestLibrarySettingsAreNamedAsFlags(t *testing.T) {
	brokers := os.Getenv("KAFKA_BROKERS")
	if brokers == "" {
		t.Skip("needs KAFKA_BROKERS and DATABASE_URL (the README's test command)")
	}
	for _, tc := range []struct {
		env        map[string]string
		args       []string
		want, gone string
	}{
		{map[string]string{"ONCE_CONSOLE_TOKEN": "too-short"}, []string{"console", "--listen", "127.0.0.1:0"},
			"ONCE_CONSOLE_TOKEN", "Token must"},
		{map[string]string{"DATABASE_URL": "postgres://once@127.0.0.1:1/once?connect_timeout=1"}, []string{"serve", "--kafka-start-timeout", "1s"},
			"--database-url (DATABASE_URL): cannot reach PostgreSQL", "DatabaseURL"},
	} {
		for k, v := range tc.env {
			t.Setenv(k, v)
		}
		var errOut bytes.Buffer
		err := run(context.Background(), tc.args, io.Discard, &errOut)
		if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), tc.gone) {
			t.Errorf("%v: %v\n%s; want an error naming %s, not %s", tc.args, err, errOut.String(), tc.want, tc.gone)
		}
	}
}

// flagNames maps whole field names only, and keeps the library's chain.
func TestFlagNamesMapWholeFieldsAndKeepTheChain(t *testing.T) {
	cause := errors.New("pipeline: RevocationGrace 10s must be shorter than CloseTimeout 10s; TxStatementTimeout left as is")
	err := flagNames(fmt.Errorf("once: %w", cause))
	want := "--revocation-grace (ONCE_REVOCATION_GRACE) 10s must be shorter than --drain-timeout (ONCE_DRAIN_TIMEOUT) 10s; TxStatementTimeout left as is"
	if !strings.Contains(err.Error(), want) || strings.HasPrefix(err.Error(), "once: ") || !errors.Is(err, cause) {
		t.Errorf("%q (errors.Is the cause: %v); want %q", err, errors.Is(err, cause), want)
	}
}
