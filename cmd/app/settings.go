package main

import (
	"context"
	"fmt"
	"net"
	"strings"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/pipeline"
	"github.com/once-dev/once/service/migrations"
)

// kafkaSettings are shared by every subcommand that talks to Kafka.
type kafkaSettings struct {
	Brokers           []string `name:"kafka-brokers" env:"KAFKA_BROKERS" required:"" sep:"," help:"Kafka bootstrap addresses, host:port, comma-separated."`
	KafkaVersion      string   `name:"kafka-version" env:"KAFKA_VERSION" default:"${kafka_version}" help:"The brokers' Kafka version (sarama needs it; Kafka 4 refuses protocols older than 2.1)."`
	Topic             string   `name:"topic" env:"ONCE_TOPIC" default:"order.confirmed.v1" help:"Topic of order.confirmed.v1 events."`
	DLQTopic          string   `name:"dlq-topic" env:"ONCE_DLQ_TOPIC" default:"order.confirmed.v1.dlq" help:"Dead-letter topic."`
	Partitions        int32    `name:"partitions" env:"ONCE_PARTITIONS" default:"6" help:"Partitions of the topics when this service creates them."`
	ReplicationFactor int16    `name:"replication-factor" env:"ONCE_REPLICATION_FACTOR" default:"1" help:"Replication factor of the topics when this service creates them."`

	version sarama.KafkaVersion
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
	if k.Topic == "" || k.DLQTopic == "" || k.Topic == k.DLQTopic {
		return fmt.Errorf("--topic (ONCE_TOPIC) and --dlq-topic (ONCE_DLQ_TOPIC) must be set and differ")
	}
	if k.Partitions < 1 {
		return fmt.Errorf("--partitions (ONCE_PARTITIONS) must be at least 1, got %d", k.Partitions)
	}
	if k.ReplicationFactor < 1 {
		return fmt.Errorf("--replication-factor (ONCE_REPLICATION_FACTOR) must be at least 1, got %d", k.ReplicationFactor)
	}
	return nil
}

func (k *kafkaSettings) ensureTopics(ctx context.Context) error {
	return pipeline.EnsureTopics(ctx, k.Brokers, k.version, k.Partitions, k.ReplicationFactor, k.Topic, k.DLQTopic)
}

type dbSettings struct {
	DatabaseURL string `name:"database-url" env:"DATABASE_URL" required:"" help:"PostgreSQL connection URL."`
	MaxConns    int32  `name:"db-max-conns" env:"ONCE_DB_MAX_CONNS" default:"20" help:"Connections in the pool."`
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
	return nil
}

// connect opens the pool and checks the database answers, so that a wrong URL
// stops start-up with a message naming it instead of surfacing later.
func (d *dbSettings) connect(ctx context.Context) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(d.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("DATABASE_URL: %w", err)
	}
	cfg.MaxConns = d.MaxConns
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("DATABASE_URL: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("DATABASE_URL: cannot reach PostgreSQL at %s:%d: %w", cfg.ConnConfig.Host, cfg.ConnConfig.Port, err)
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
