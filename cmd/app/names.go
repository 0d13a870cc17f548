package main

import (
	"regexp"
	"strings"
)

// settingFlags are the library's settings (fields of once.Config,
// console.Config and pipeline.Config, as their errors name them) and the
// flag and environment variable a person sets each with here.
var settingFlags = map[string]string{
	"DatabaseURL":       "--database-url (DATABASE_URL)",
	"Brokers":           "--kafka-brokers (KAFKA_BROKERS)",
	"KafkaVersion":      "--kafka-version (KAFKA_VERSION)",
	"KafkaStartTimeout": "--kafka-start-timeout (ONCE_KAFKA_START_TIMEOUT)",
	"Retention":         "--dedup-retention (ONCE_DEDUP_RETENTION)",
	"OutboxRetention":   "--outbox-retention (ONCE_OUTBOX_RETENTION)",
	"DrainTimeout":      "--drain-timeout (ONCE_DRAIN_TIMEOUT)",
	"RevocationGrace":   "--revocation-grace (ONCE_REVOCATION_GRACE)",
	"WatchInterval":     "--watch-interval (ONCE_WATCH_INTERVAL)",
	"MaxClockSkew":      "--max-clock-skew (ONCE_MAX_CLOCK_SKEW)",
	"Token":             "the console's token (ONCE_CONSOLE_TOKEN, or the file --console-token-file, ONCE_CONSOLE_TOKEN_FILE)",
	"Hosts":             "--console-host (ONCE_CONSOLE_HOSTS)",
	"CloseTimeout":      "--drain-timeout (ONCE_DRAIN_TIMEOUT)",
	"SessionTimeout":    "--session-timeout (ONCE_SESSION_TIMEOUT)",
	"HeartbeatInterval": "--heartbeat-interval (ONCE_HEARTBEAT_INTERVAL)",
	"InstanceID":        "--instance-id (ONCE_INSTANCE_ID)",
	"AttemptTimeout":    "--attempt-timeout (ONCE_ATTEMPT_TIMEOUT)",
	"CommitMode":        "--commit-mode (ONCE_COMMIT_MODE)",
	"CommitInterval":    "--commit-interval (ONCE_COMMIT_INTERVAL)",
	"HoldMaxBackoff":    "--hold-max-backoff (ONCE_HOLD_MAX_BACKOFF)",
	"MaxConns":          "--db-max-conns (ONCE_DB_MAX_CONNS)",
	"ConnectTimeout":    "--db-connect-timeout (ONCE_DB_CONNECT_TIMEOUT)",
	"StatementTimeout":  "--db-statement-timeout (ONCE_DB_STATEMENT_TIMEOUT)",
	"ReplayWindow":      "--console-replay-window (ONCE_DLQ_REPLAY_WINDOW)",
}

var (
	settingField         = regexp.MustCompile(`\b(` + strings.Join(keys(settingFlags), "|") + `)\b`)
	groupDatabaseSetting = regexp.MustCompile(`GroupDatabases\[([^\]]+)\]`)
)

func keys(m map[string]string) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

// namedError is an error of the library with its settings named as a
// person sets them here; its chain is the library's.
type namedError struct {
	text string
	err  error
}

func (e namedError) Error() string { return e.text }
func (e namedError) Unwrap() error { return e.err }

// flagNames names, in an error of the library (once.SettingError, a
// Config's Validate), the flags and environment variables behind its
// settings: "--database-url (DATABASE_URL)", not "DatabaseURL".
func flagNames(err error) error {
	if err == nil {
		return nil
	}
	text := settingField.ReplaceAllStringFunc(err.Error(), func(f string) string { return settingFlags[f] })
	text = groupDatabaseSetting.ReplaceAllString(text, "--group-database $1 (ONCE_GROUP_DATABASES)")
	if text == err.Error() {
		return err
	}
	return namedError{text: strings.TrimPrefix(text, "once: "), err: err}
}
