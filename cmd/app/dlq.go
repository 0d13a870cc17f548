package main

import (
	"context"
	"fmt"
	"time"

	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/internal/progress"
	"github.com/once-dev/once/pipeline"
)

type dlqCmd struct {
	Replay dlqReplayCmd `cmd:"" help:"Republish dead-lettered messages to the topic they came from (each once; stops at the end seen at start)."`
}

type dlqReplayCmd struct {
	Kafka  kafkaSettings `embed:""`
	Group  string        `name:"group" default:"${dlq_group}" help:"Consumer group that keeps the replay progress."`
	MaxAge time.Duration `name:"max-age" env:"ONCE_DLQ_REPLAY_WINDOW" default:"24h" help:"Skip dead letters older than this (keep it within the payment provider's key retention); 0 replays all."`
}

func (c *dlqReplayCmd) Run(ctx context.Context, d deps) error {
	p := progress.New(d.stderr)
	rep, err := dlq.Replay(ctx, dlq.Config{
		Brokers: c.Kafka.Brokers, Sarama: pipeline.PublisherSaramaConfig(c.Kafka.version),
		DLQTopic: c.Kafka.DLQTopic, Topic: c.Kafka.Topic, Group: c.Group, MaxAge: c.MaxAge,
		Progress: func(done, total int64) { p.Set("replaying %d/%d", done, total) },
	})
	p.Done()
	if err != nil {
		return err
	}
	fmt.Fprintf(d.stdout, "replayed %d dead letters, skipped %d older than %s\n", rep.Replayed, rep.SkippedStale, c.MaxAge)
	for topic, n := range rep.ByTopic {
		fmt.Fprintf(d.stdout, "  %s\t%d\n", topic, n)
	}
	return nil
}
