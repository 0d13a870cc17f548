package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"maps"
	"net"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/migrations"
	"github.com/once-dev/once/pgdb"
	"github.com/once-dev/once/pipeline"
)

// kafkaSettings are shared by every subcommand that talks to Kafka.
type kafkaSettings struct {
	Brokers           []string `name:"kafka-brokers" env:"KAFKA_BROKERS" required:"" sep:"," help:"Kafka bootstrap addresses, host:port, comma-separated."`
	KafkaVersion      string   `name:"kafka-version" env:"KAFKA_VERSION" default:"${kafka_version}" help:"The brokers' Kafka version (sarama needs it; Kafka 4 refuses protocols older than 2.1)."`
	ConfirmedTopic    string   `name:"confirmed-topic" env:"ONCE_CONFIRMED_TOPIC" default:"order.confirmed.v1" help:"Topic of order.confirmed.v1 events."`
	CancelledTopic    string   `name:"cancelled-topic" env:"ONCE_CANCELLED_TOPIC" default:"order.cancelled.v1" help:"Topic of order.cancelled.v1 events."`
	PaymentTopic      string   `name:"payment-topic" env:"ONCE_PAYMENT_TOPIC" default:"payment.events.v1" help:"Topic of billing's payment events (payment.charged.v1, payment.failed.v1, payment.refunded.v1)."`
	TopicSuffix       string   `name:"topic-suffix" env:"ONCE_TOPIC_SUFFIX" help:"Appended to every topic name (to run isolated copies side by side, as the e2e tests do). Each topic's dead-letter topic is its name + .dlq."`
	Partitions        int32    `name:"partitions" env:"ONCE_PARTITIONS" default:"6" help:"Partitions of the topics when this service creates them."`
	ReplicationFactor int16    `name:"replication-factor" env:"ONCE_REPLICATION_FACTOR" default:"1" help:"Replication factor of the topics when this service creates them."`

	TLS              bool   `name:"kafka-tls" env:"KAFKA_TLS" help:"Encrypt every Kafka connection with TLS."`
	TLSCA            string `name:"kafka-tls-ca" env:"KAFKA_TLS_CA" placeholder:"PEM-FILE" help:"CA certificates the brokers' certificates are checked against (default: the system's)."`
	SASLMechanism    string `name:"kafka-sasl-mechanism" env:"KAFKA_SASL_MECHANISM" enum:",SCRAM-SHA-512,SCRAM-SHA-256,PLAIN" default:"" help:"SASL mechanism: SCRAM-SHA-512, SCRAM-SHA-256, or PLAIN (over --kafka-tls only). The password comes from KAFKA_SASL_PASSWORD or --kafka-sasl-password-file, never from a flag."`
	SASLUser         string `name:"kafka-sasl-user" env:"KAFKA_SASL_USER" help:"SASL user."`
	SASLPasswordFile string `name:"kafka-sasl-password-file" env:"KAFKA_SASL_PASSWORD_FILE" placeholder:"FILE" help:"File holding the SASL password (a mounted secret)."`

	version  sarama.KafkaVersion
	security pipeline.KafkaSecurity
}

// saramaConfig is the producer configuration with the settings' security,
// for the tools and services that talk to Kafka outside a pipeline.
func (k *kafkaSettings) saramaConfig() *sarama.Config {
	c := pipeline.PublisherSaramaConfig(k.version)
	k.security.Apply(c)
	return c
}

// loadSecurity reads the TLS and SASL settings; secrets come from the
// environment or a file only.
func (k *kafkaSettings) loadSecurity() error {
	sec := pipeline.KafkaSecurity{SASLMechanism: k.SASLMechanism, User: k.SASLUser}
	if k.TLS || k.TLSCA != "" {
		sec.TLS = &tls.Config{MinVersion: tls.VersionTLS12}
		if k.TLSCA != "" {
			pem, err := os.ReadFile(k.TLSCA)
			if err != nil {
				return fmt.Errorf("--kafka-tls-ca (KAFKA_TLS_CA): %w", err)
			}
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(pem) {
				return fmt.Errorf("--kafka-tls-ca (KAFKA_TLS_CA) %s: no PEM certificate in it", k.TLSCA)
			}
			sec.TLS.RootCAs = pool
		}
	}
	sec.Password = os.Getenv("KAFKA_SASL_PASSWORD")
	if k.SASLPasswordFile != "" {
		b, err := os.ReadFile(k.SASLPasswordFile)
		if err != nil {
			return fmt.Errorf("--kafka-sasl-password-file (KAFKA_SASL_PASSWORD_FILE): %w", err)
		}
		sec.Password = strings.TrimRight(string(b), "\r\n")
	}
	if err := sec.Validate(); err != nil {
		return fmt.Errorf("--kafka-sasl-mechanism, --kafka-sasl-user, KAFKA_SASL_PASSWORD, --kafka-tls: %w", err)
	}
	k.security = sec
	return nil
}

// Validate is called by kong after parsing; its errors name the setting.
func (k *kafkaSettings) Validate() error {
	if len(k.Brokers) == 0 {
		return fmt.Errorf("--kafka-brokers (KAFKA_BROKERS) is empty")
	}
	for _, b := range k.Brokers {
		if _, _, err := net.SplitHostPort(strings.TrimSpace(b)); err != nil {
			return fmt.Errorf("--kafka-brokers (KAFKA_BROKERS): %q is not host:port", b)
		}
	}
	v, err := pipeline.ParseKafkaVersion(k.KafkaVersion)
	if err != nil {
		return fmt.Errorf("--kafka-version (KAFKA_VERSION): %w", err)
	}
	k.version = v
	if err := k.loadSecurity(); err != nil {
		return err
	}
	names := map[string]string{}
	for flag, name := range map[string]string{"--confirmed-topic": k.ConfirmedTopic, "--cancelled-topic": k.CancelledTopic, "--payment-topic": k.PaymentTopic} {
		if name == "" {
			return fmt.Errorf("%s must not be empty", flag)
		}
		if other, ok := names[name]; ok {
			return fmt.Errorf("%s and %s name the same topic %q", flag, other, name)
		}
		names[name] = flag
	}
	if k.Partitions < 1 {
		return fmt.Errorf("--partitions (ONCE_PARTITIONS) must be at least 1, got %d", k.Partitions)
	}
	if k.ReplicationFactor < 1 {
		return fmt.Errorf("--replication-factor (ONCE_REPLICATION_FACTOR) must be at least 1, got %d", k.ReplicationFactor)
	}
	return nil
}

// confirmed, cancelled and payments are the topics' names, suffix included.
func (k *kafkaSettings) confirmed() string { return k.ConfirmedTopic + k.TopicSuffix }
func (k *kafkaSettings) cancelled() string { return k.CancelledTopic + k.TopicSuffix }
func (k *kafkaSettings) payments() string  { return k.PaymentTopic + k.TopicSuffix }

// dlqOf is a topic's dead-letter topic.
func dlqOf(topic string) string { return topic + ".dlq" }

// topics are the service's topics, each with suffix.
func (k *kafkaSettings) topics(suffix string) []string {
	return []string{k.ConfirmedTopic + suffix, k.CancelledTopic + suffix, k.PaymentTopic + suffix}
}

// ensureTopics creates the three topics and their dead-letter topics.
func (k *kafkaSettings) ensureTopics(ctx context.Context) error {
	var all []string
	for _, t := range []string{k.confirmed(), k.cancelled(), k.payments()} {
		all = append(all, t, dlqOf(t))
	}
	return pipeline.EnsureTopics(ctx, k.Brokers, k.version, k.security, k.Partitions, k.ReplicationFactor, all...)
}

type dbSettings struct {
	DatabaseURL      string        `name:"database-url" env:"DATABASE_URL" required:"" help:"PostgreSQL connection URL (TLS: sslmode=verify-full&sslrootcert=...)."`
	MaxConns         int32         `name:"db-max-conns" env:"ONCE_DB_MAX_CONNS" default:"20" help:"Connections in the pool."`
	ConnectTimeout   time.Duration `name:"db-connect-timeout" env:"ONCE_DB_CONNECT_TIMEOUT" default:"5s" help:"Bound on opening a connection to PostgreSQL."`
	StatementTimeout time.Duration `name:"db-statement-timeout" env:"ONCE_DB_STATEMENT_TIMEOUT" default:"30s" help:"Bound on one statement: enforced by the server (statement_timeout) and, for the claim's own statements, by the client, so that a database that went silent cannot hold a message."`

	// label names the setting this URL came from in errors, when it is not
	// DATABASE_URL.
	label string
}

// setting names where the URL came from, without its password.
func (d dbSettings) setting() string {
	if d.label != "" {
		return d.label
	}
	return "--database-url (DATABASE_URL)"
}

// forGroup is d on a group's own database URL.
func (d dbSettings) forGroup(url string) dbSettings {
	d.DatabaseURL = url
	d.label = "--group-database (ONCE_GROUP_DATABASES)"
	if cfg, err := pgxpool.ParseConfig(url); err == nil {
		d.label = fmt.Sprintf("--group-database (ONCE_GROUP_DATABASES) %s:%d/%s", cfg.ConnConfig.Host, cfg.ConnConfig.Port, cfg.ConnConfig.Database)
	}
	return d
}

func (d *dbSettings) Validate() error {
	// An empty URL would parse: libpq's defaults would pick a database nobody chose.
	if strings.TrimSpace(d.DatabaseURL) == "" {
		return fmt.Errorf("--database-url (DATABASE_URL) is empty")
	}
	if _, err := pgxpool.ParseConfig(d.DatabaseURL); err != nil {
		return fmt.Errorf("--database-url (DATABASE_URL): %w", err)
	}
	if d.MaxConns < 2 {
		return fmt.Errorf("--db-max-conns (ONCE_DB_MAX_CONNS) must be at least 2, got %d", d.MaxConns)
	}
	if d.ConnectTimeout <= 0 || d.StatementTimeout <= 0 {
		return fmt.Errorf("--db-connect-timeout (ONCE_DB_CONNECT_TIMEOUT) and --db-statement-timeout (ONCE_DB_STATEMENT_TIMEOUT) must be positive")
	}
	return nil
}

// connect opens the pool and checks the database answers, so that a wrong URL
// stops start-up with a message naming it instead of surfacing later.
func (d *dbSettings) connect(ctx context.Context) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(d.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", d.setting(), err)
	}
	cfg.MaxConns = d.MaxConns
	if d.ConnectTimeout > 0 {
		cfg.ConnConfig.ConnectTimeout = d.ConnectTimeout
	}
	// No statement_timeout in the start-up packet: a transaction pooler
	// refuses it (or would apply it to whichever client gets the server
	// connection next). The claim sets it for its own transaction.
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", d.setting(), err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("%s: cannot reach PostgreSQL at %s:%d: %w", d.setting(), cfg.ConnConfig.Host, cfg.ConnConfig.Port, err)
	}
	if err := pgdb.CheckPooler(ctx, pool, d.setting()); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

// open connects and, when asked, applies the migrations first: what every
// command that serves does at start-up.
func (d *dbSettings) open(ctx context.Context, dp deps, migrateFirst bool) (*pgxpool.Pool, error) {
	pool, err := d.connect(ctx)
	if err != nil {
		return nil, err
	}
	if migrateFirst {
		if err := migrate(ctx, pool, dp); err != nil {
			pool.Close()
			return nil, err
		}
	}
	return pool, nil
}

func migrate(ctx context.Context, pool *pgxpool.Pool, d deps) error {
	applied, err := migrations.Up(ctx, pool)
	if err != nil {
		return err
	}
	d.log.Info("migrations applied", "versions", applied)
	return nil
}

// groupPools is every database the groups of a process use: the main one and
// those of --group-database.
type groupPools struct {
	of  map[string]*pgxpool.Pool // by group name, without suffix
	all []*pgxpool.Pool          // each database once
	own []*pgxpool.Pool          // the ones opened here, to close
}

func (g groupPools) close() {
	for _, p := range g.own {
		p.Close()
	}
}

// groupPools opens (and migrates, when asked) the database of every group
// that has one of its own; the others use main.
func (d *dbSettings) groupPools(ctx context.Context, dp deps, main *pgxpool.Pool, urls map[string]string, groups []string, migrateFirst bool) (groupPools, error) {
	g := groupPools{of: map[string]*pgxpool.Pool{}, all: []*pgxpool.Pool{main}}
	byURL := map[string]*pgxpool.Pool{d.DatabaseURL: main}
	for _, name := range groups {
		url, ok := urls[name]
		if !ok {
			g.of[name] = main
			continue
		}
		if byURL[url] == nil {
			own := dbSettings{DatabaseURL: url, MaxConns: d.MaxConns, ConnectTimeout: d.ConnectTimeout, StatementTimeout: d.StatementTimeout}
			p, err := own.open(ctx, dp, migrateFirst)
			if err != nil {
				g.close()
				return g, fmt.Errorf("--group-database %s: %w", name, err)
			}
			byURL[url] = p
			g.own = append(g.own, p)
			g.all = append(g.all, p)
		}
		g.of[name] = byURL[url]
	}
	return g, nil
}

// migrateAll applies every migration (the library's and the reference
// service's) to the main database and each group's own, and records the
// claims' retention there as the tables' owner.
func migrateAll(ctx context.Context, dp deps, d dbSettings, groupURLs map[string]string) error {
	targets := []dbSettings{d}
	seen := map[string]bool{d.DatabaseURL: true}
	for _, g := range slices.Sorted(maps.Keys(groupURLs)) {
		if url := groupURLs[g]; !seen[url] {
			seen[url] = true
			targets = append(targets, d.forGroup(url))
		}
	}
	for _, t := range targets {
		pool, err := t.open(ctx, dp, true)
		if err != nil {
			return err
		}
		pool.Close()
	}
	return nil
}
