// Command app runs the once reference service: the consumer groups of the
// order-confirmed topic, its migrations, and (as they land) the payment
// provider simulator, the order service and the demo. Every subcommand has
// --help; settings come from flags or the environment variables named there.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/alecthomas/kong"

	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/internal/reference"
	"github.com/once-dev/once/internal/tracing"
	"github.com/once-dev/once/pipeline"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	code := 0
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		var exit exitCode
		var done logged
		switch {
		case errors.As(err, &exit):
			code = int(exit)
		case errors.As(err, &done):
			code = 1 // run logged it, in the log's format
		default:
			fmt.Fprintf(os.Stderr, "app: %v\n", err)
			code = 1
		}
	}
	stop()
	os.Exit(code)
}

// exitCode carries kong's requested exit (after --help, or a usage error it
// already printed) out of run, so only main calls os.Exit.
type exitCode int

func (e exitCode) Error() string { return fmt.Sprintf("exit %d", int(e)) }

// logged is an error run has written to the log already, as one line of
// --log-format json (a log pipeline that reads JSON would drop or garble
// main's plain "app: ..." line): main only exits with it.
type logged struct{ error }

func (l logged) Unwrap() error { return l.error }

type cli struct {
	LogLevel     slog.Level `name:"log-level" env:"ONCE_LOG_LEVEL" default:"info" help:"Log level: debug, info, warn, error."`
	LogFormat    string     `name:"log-format" env:"ONCE_LOG_FORMAT" default:"text" enum:"text,json" help:"Log format: text or json."`
	OTLPEndpoint string     `name:"otlp-endpoint" env:"OTEL_EXPORTER_OTLP_ENDPOINT" help:"Export traces over OTLP/HTTP to this URL (e.g. http://collector:4318/v1/traces); empty: no tracing recorded (W3C trace context is still passed on)."`

	Serve   serveCmd   `cmd:"" help:"Consume the order-confirmed topic with the configured consumer groups until stopped."`
	Migrate migrateCmd `cmd:"" help:"As the tables' owner: apply the database migrations (to --database-url and each --group-database), record the claims' retention, make today's and the next partitions, and exit."`

	Maintain       maintainCmd       `cmd:"" help:"Run one retention pass over processed_event (create partitions ahead, drop or delete expired claims) and exit."`
	Bench          benchCmd          `cmd:"" help:"Measure throughput side by side in one run: the broker's and the database's limits, the unsafe baseline, the pipeline per event and batched, and the style guide's Python consumer."`
	BenchRun       benchRunCmd       `cmd:"" name:"bench-run" hidden:"" help:"One measurement of app bench, in a process of its own."`
	BenchRetention benchRetentionCmd `cmd:"" name:"bench-retention" help:"Measure dropping a day's partition vs deleting its rows, and UUIDv7 vs UUIDv4 claim inserts."`

	Orders          ordersCmd          `cmd:"" help:"Run the order service: POST /v1/orders writes the order and its event (outbox), a forwarder moves events to Kafka."`
	Demo            demoCmd            `cmd:"" help:"Run the whole system in one process with duplicates from every source, and check every order was charged and counted exactly once."`
	DLQ             dlqCmd             `cmd:"" name:"dlq" help:"Dead-letter topic tools."`
	Group           groupCmd           `cmd:"" name:"group" help:"Consumer group tools: remove static members after scaling in."`
	Inbox           inboxCmd           `cmd:"" name:"inbox" help:"Claim tools: was an event processed, and by whom; forget a claim."`
	Console         consoleCmd         `cmd:"" name:"console" help:"Serve the web console (dead letters, replay, inbox) on loopback, apart from the consumers; app serve --console also shows their lag and held messages."`
	PaymentProvider paymentProviderCmd `cmd:"" name:"payment-provider" help:"Run the payment provider simulator (idempotency keys, ledger, fault injection)."`
}

// deps is what every subcommand receives.
type deps struct {
	log    *slog.Logger
	stdout io.Writer
	stderr io.Writer
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) (err error) {
	var c cli
	var command string // the subcommand, once parsed
	exited := false
	parser, err := kong.New(&c,
		kong.Name("app"),
		kong.Description("once: Kafka consumers whose effects happen exactly once."),
		kong.Writers(stdout, stderr),
		kong.UsageOnError(),
		kong.ConfigureHelp(kong.HelpOptions{Compact: true}),
		kong.Vars{"kafka_version": pipeline.DefaultKafkaVersion, "dlq_group": dlq.DefaultGroup, "groups": strings.Join(reference.Groups, ", "), "topics": "order.confirmed.v1, order.cancelled.v1, payment.events.v1"},
		kong.Exit(func(code int) { exited = true; panic(exitCode(code)) }),
	)
	if err != nil {
		return err
	}
	defer func() {
		// Runs after the recover below: a kong exit is no failure.
		var exit exitCode
		if err != nil && c.LogFormat == "json" && !errors.As(err, &exit) {
			newLogger(stderr, slog.LevelError, "json").Error("app: "+err.Error(), "command", command, "err", err.Error(), "exit_code", 1)
			err = logged{err}
		}
	}()
	defer func() {
		if r := recover(); r != nil {
			code, ok := r.(exitCode)
			if !ok || !exited {
				panic(r)
			}
			err = code
			if code == 0 {
				err = nil
			}
		}
	}()
	kctx, err := parser.Parse(args)
	if err != nil {
		if strings.HasPrefix(err.Error(), "missing flags") {
			return fmt.Errorf("%w (each can also be set through the environment variable that --help names)", err)
		}
		return err
	}
	command = strings.Fields(kctx.Command())[0]
	log := newLogger(stderr, c.LogLevel, c.LogFormat)
	slog.SetDefault(log)
	shutdown, err := tracing.Setup(ctx, "once-"+command, c.OTLPEndpoint)
	if err != nil {
		return err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if serr := shutdown(sctx); serr != nil {
			log.Warn("flushing traces", "err", serr)
		}
	}()
	kctx.BindTo(ctx, (*context.Context)(nil))
	return flagNames(kctx.Run(deps{log: log, stdout: stdout, stderr: stderr}))
}

// newLogger writes format's lines to w. A duration is written as a person
// reads it in text ("2.5s", slog's own) and as a number of seconds in
// JSON (2.5; slog writes nanoseconds, 2500000000), in every line of app
// and of the library it runs.
func newLogger(w io.Writer, level slog.Level, format string) *slog.Logger {
	opts := &slog.HandlerOptions{Level: level}
	if format == "json" {
		opts.ReplaceAttr = durationSeconds
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

func durationSeconds(_ []string, a slog.Attr) slog.Attr {
	if a.Value.Kind() == slog.KindDuration {
		a.Value = slog.Float64Value(a.Value.Duration().Seconds())
	}
	return a
}
