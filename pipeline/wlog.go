package pipeline

import (
	"context"
	"errors"
	"log/slog"

	"github.com/ThreeDotsLabs/watermill"
)

// quietLogger is Watermill's slog adapter, with its info lines moved to
// debug (they are per-subscription detail), and its trace and debug lines
// dropped before their fields are built: the router writes two per
// message, and building them cost a measurable share of a batched group's
// CPU.
type quietLogger struct {
	watermill.LoggerAdapter
	log *slog.Logger
}

// WatermillLogger is the pipeline's Watermill logger over log: Watermill's
// info lines at debug level, its trace and debug lines dropped before their
// fields are built. For a team's own router.
func WatermillLogger(log *slog.Logger) watermill.LoggerAdapter { return newWatermillLogger(log) }

func newWatermillLogger(log *slog.Logger) watermill.LoggerAdapter {
	return quietLogger{
		LoggerAdapter: watermill.NewSlogLoggerWithLevelMapping(log, map[slog.Level]slog.Level{slog.LevelInfo: slog.LevelDebug}),
		log:           log,
	}
}

func (q quietLogger) Info(msg string, fields watermill.LogFields) {
	if q.log.Enabled(context.Background(), slog.LevelDebug) {
		q.LoggerAdapter.Info(msg, fields)
	}
}

func (q quietLogger) Debug(msg string, fields watermill.LogFields) {
	if q.log.Enabled(context.Background(), slog.LevelDebug) {
		q.LoggerAdapter.Debug(msg, fields)
	}
}

func (q quietLogger) Trace(msg string, fields watermill.LogFields) {
	if q.log.Enabled(context.Background(), watermill.LevelTrace) {
		q.LoggerAdapter.Trace(msg, fields)
	}
}

// Error keeps Watermill's "Handler returned error" for the errors that are
// errors: a message given back because its partition was revoked, the
// pipeline stops, or its context ended is given back on purpose (it comes
// again), and is logged at debug level.
func (q quietLogger) Error(msg string, err error, fields watermill.LogFields) {
	if errors.Is(err, ErrRevoked) || errors.Is(err, errShutdown) || errors.Is(err, errMessageContextDone) {
		if q.log.Enabled(context.Background(), slog.LevelDebug) {
			q.LoggerAdapter.Debug(msg, fields.Add(watermill.LogFields{"err": err}))
		}
		return
	}
	q.LoggerAdapter.Error(msg, err, fields)
}

func (q quietLogger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return quietLogger{LoggerAdapter: q.LoggerAdapter.With(fields), log: q.log}
}
