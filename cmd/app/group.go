package main

import (
	"context"
	"fmt"
	"strings"

	"github.com/IBM/sarama"
)

type groupCmd struct {
	RemoveMember groupRemoveMemberCmd `cmd:"" name:"remove-member" help:"Remove static members (app serve --instance-id) from a consumer group for good: a static member sends no LeaveGroup when it stops, so after scaling in its partitions would wait a session timeout for it."`
}

type groupRemoveMemberCmd struct {
	Kafka       kafkaSettings `embed:""`
	Group       string        `name:"group" required:"" help:"The consumer group (billing, analytics, or any group), as app serve names it: --group-suffix is added."`
	InstanceIDs []string      `name:"instance-id" required:"" sep:"," help:"The instance ids to remove (app serve --instance-id), comma-separated."`
	GroupSuffix string        `name:"group-suffix" env:"ONCE_GROUP_SUFFIX" help:"The suffix app serve was given."`
}

func (c *groupRemoveMemberCmd) Run(ctx context.Context, d deps) error {
	admin, err := sarama.NewClusterAdmin(c.Kafka.Brokers, c.Kafka.saramaConfig())
	if err != nil {
		return fmt.Errorf("kafka admin on %s (--kafka-brokers): %w", strings.Join(c.Kafka.Brokers, ","), err)
	}
	defer admin.Close()
	group := c.Group + c.GroupSuffix
	resp, err := admin.RemoveMemberFromConsumerGroup(group, c.InstanceIDs)
	if err != nil {
		return fmt.Errorf("remove %v from consumer group %s: %w", c.InstanceIDs, group, err)
	}
	if resp.Err != sarama.ErrNoError {
		return fmt.Errorf("remove %v from consumer group %s: %w", c.InstanceIDs, group, resp.Err)
	}
	failed := 0
	for _, m := range resp.Members {
		id := ""
		if m.GroupInstanceId != nil {
			id = *m.GroupInstanceId
		}
		if m.Err != sarama.ErrNoError {
			failed++
			fmt.Fprintf(d.stdout, "%s\tnot removed: %v\n", id, m.Err)
			continue
		}
		fmt.Fprintf(d.stdout, "%s\tremoved from %s\n", id, group)
	}
	if failed > 0 {
		return fmt.Errorf("%d of %d members not removed from consumer group %s", failed, len(c.InstanceIDs), group)
	}
	return nil
}
