package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/internal/pipelinetest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/pipeline"
)

// A static member that stopped stays in its group (it sends no LeaveGroup)
// until app group remove-member takes it out, for good.
func TestGroupRemoveMemberTakesAStaticMemberOut(t *testing.T) {
	brokers := testenv.Brokers(t)
	topic := testenv.Topic(t, brokers, 2)
	group := pipelinetest.UniqueGroup("remove-member")
	cfg := pipeline.Config{Brokers: brokers, DB: testenv.Postgres(t), InstanceID: "pod-0",
		Topics: []pipeline.Binding{pipeline.Topic[reservation]{Name: topic, Decode: decodeReservation,
			Groups: []pipeline.Group[reservation]{{Name: group, Handle: func(context.Context, pgx.Tx, reservation) error { return nil }}}}}}
	p, err := pipeline.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stop := pipelinetest.Start(t, p)
	testenv.Eventually(t, 30*time.Second, "the member joined", func() bool { return p.Status()[0].Joined })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	admin := testenv.Admin(t, brokers)
	members := func() int {
		groups, err := admin.DescribeConsumerGroups([]string{group})
		if err != nil || len(groups) != 1 {
			t.Fatalf("describe %s: %v", group, err)
		}
		return len(groups[0].Members)
	}
	if n := members(); n != 1 {
		t.Fatalf("after its stop the static member's group has %d members; want it still there", n)
	}
	out, err := runApp(t, "group", "remove-member", "--kafka-brokers", strings.Join(brokers, ","), "--group", group, "--instance-id", "pod-0")
	if err != nil || !strings.Contains(out, "pod-0\tremoved from "+group) {
		t.Fatalf("remove-member: %v\n%s", err, out)
	}
	if n := members(); n != 0 {
		t.Fatalf("after remove-member the group has %d members; want none", n)
	}
	if out, err := runApp(t, "group", "remove-member", "--kafka-brokers", strings.Join(brokers, ","), "--group", group, "--instance-id", "pod-7"); err == nil {
		t.Fatalf("removing a member that is not there: no error\n%s", out)
	}
}
