package main

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/once-dev/once/console"
	"github.com/once-dev/once/dlq"
)

type consoleCmd struct {
	Kafka          kafkaSettings     `embed:""`
	DB             dbSettings        `embed:""`
	GroupDatabases map[string]string `name:"group-database" env:"ONCE_GROUP_DATABASES" mapsep:";" placeholder:"GROUP=URL;..." help:"The databases of groups that have one of their own, as serve takes them: their claims and parked letters are shown too."`
	Listen         string            `name:"listen" env:"ONCE_CONSOLE_LISTEN" default:"127.0.0.1:9465" help:"Address to serve the console on, under /console; a loopback address (the console shows a signed-in person payloads): reach it with a port-forward."`
	Console        consoleSettings   `embed:""`
}

func (c *consoleCmd) Validate() error {
	return loopbackOnly("--listen (ONCE_CONSOLE_LISTEN)", c.Listen)
}

// Run serves the console apart from the consumers, against their brokers
// and databases: dead letters, replay and the inbox. Lag and held messages
// live in the consuming process (app serve --console shows them).
func (c *consoleCmd) Run(ctx context.Context, d deps) error {
	cfg, err := c.Console.config()
	if err != nil {
		return err
	}
	cfg.Brokers, cfg.Sarama, cfg.Logger = c.Kafka.Brokers, c.Kafka.saramaConfig(), d.log
	for _, topic := range c.Kafka.topics(c.Kafka.TopicSuffix) {
		cfg.Routes = append(cfg.Routes, dlq.Route{Topic: topic, DLQTopic: dlqOf(topic)})
	}
	for _, db := range claimDatabases(c.DB, c.GroupDatabases, "") {
		pool, err := db.connect(ctx)
		if err != nil {
			return err
		}
		defer pool.Close()
		cfg.Databases = append(cfg.Databases, console.Database{Name: databaseName(db.DatabaseURL, c.DB.DatabaseURL, c.GroupDatabases), DB: pool})
	}
	con, err := console.New(cfg)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", c.Listen)
	if err != nil {
		return fmt.Errorf("--listen (ONCE_CONSOLE_LISTEN): %w", err)
	}
	srv := &http.Server{Handler: con, ReadHeaderTimeout: 5 * time.Second}
	mode := "read-only, no reason, payload, header, key or error shown: no token (ONCE_CONSOLE_TOKEN or --console-token-file)"
	if cfg.Token != "" {
		mode = "reasons, payloads, replay and forget after signing in with the token"
	}
	fmt.Fprintf(d.stderr, "console on http://%s%s (%s); Ctrl-C stops it\n", ln.Addr(), console.DefaultPrefix, mode)
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// databaseName names a database as the console shows it, never by its
// URL: "default", or the groups that have it as their own.
func databaseName(url, main string, groups map[string]string) string {
	if url == main {
		return "default"
	}
	var names []string
	for _, g := range slices.Sorted(maps.Keys(groups)) {
		if groups[g] == url {
			names = append(names, g)
		}
	}
	return strings.Join(names, ", ")
}
