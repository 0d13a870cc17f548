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
	defer p.Done()
	var total dlq.Report
	total.ByTopic = map[string]int64{}
	for _, topic := range []string{c.Kafka.confirmed(), c.Kafka.cancelled(), c.Kafka.payments()} {
		rep, err := dlq.Replay(ctx, dlq.Config{
			Brokers: c.Kafka.Brokers, Sarama: pipeline.PublisherSaramaConfig(c.Kafka.version),
			DLQTopic: dlqOf(topic), Topic: topic, Group: c.Group, MaxAge: c.MaxAge,
			Progress: func(done, n int64) { p.Set("replaying %s: %d/%d", dlqOf(topic), done, n) },
		})
		if err != nil {
			return err
		}
		total.Replayed += rep.Replayed
		total.SkippedStale += rep.SkippedStale
		for t, n := range rep.ByTopic {
			total.ByTopic[t] += n
		}
	}
	p.Done()
	fmt.Fprintf(d.stdout, "replayed %d dead letters, skipped %d whose event is older than %s\n", total.Replayed, total.SkippedStale, c.MaxAge)
	for topic, n := range total.ByTopic {
		fmt.Fprintf(d.stdout, "  %s\t%d\n", topic, n)
	}
	return nil
}
