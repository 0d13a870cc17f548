package console_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/once-dev/once/console"
	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/internal/pipelinetest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/pipeline"
)

// standingGroups is a pipeline's report, fixed: the groups page's
// rendering is what is tested here (the pipeline's own tests make the
// report from a held key against Kafka and PostgreSQL).
type standingGroups struct{ status []pipeline.GroupStatus }

func (s standingGroups) Status() []pipeline.GroupStatus { return s.status }
func (standingGroups) Holds() []pipeline.HeldMessage    { return nil }
func (standingGroups) Lag(context.Context) ([]pipeline.PartitionLag, error) {
	return nil, nil
}

// The groups page shows a key-ordered group's held keys, how long its
// commit point has been pinned and its full windows, and nothing of the
// kind for a partition-ordered group.
func TestTheGroupsPageShowsHeldKeysAndPinnedCommitPoints(t *testing.T) {
	groups := standingGroups{status: []pipeline.GroupStatus{
		{Topic: "orders", Group: "billing", Joined: true, Partitions: []int32{0}, Order: pipeline.OrderKey, Held: 5, OldestHeld: 90 * time.Second,
			HeldKeys: 3, Pinned: 95 * time.Second, WindowFull: 2},
		{Topic: "orders", Group: "analytics", Joined: true, Partitions: []int32{0}, Order: pipeline.OrderPartition},
	}}
	con, err := console.New(console.Config{Brokers: testenv.Brokers(t), Sarama: pipelinetest.SaramaConfig(t), Groups: groups,
		Routes: []dlq.Route{{Topic: "orders", DLQTopic: "orders.dlq"}}, Databases: []console.Database{{Name: "default", DB: testenv.Postgres(t)}}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(con)
	t.Cleanup(srv.Close)
	code, page := get(t, http.DefaultClient, srv.URL+"/console/groups")
	if code != http.StatusOK {
		t.Fatalf("groups page: %d", code)
	}
	rows := strings.Split(page, "<tr>")
	var billing, analytics string
	for _, r := range rows {
		switch {
		case strings.Contains(r, "<td>billing</td>"):
			billing = r
		case strings.Contains(r, "<td>analytics</td>"):
			analytics = r
		}
	}
	// Each figure distinct, so that each cell is found by its own value
	// (review: the held count and the held keys were both 1).
	for _, want := range []string{"<td>key</td>", `<td class="n">5</td>`, `<td class="n">3</td>`, "1m35s", `<span class="warn">2</span>`} {
		if !strings.Contains(billing, want) {
			t.Errorf("billing's row lacks %q: %s", want, billing)
		}
	}
	if !strings.Contains(analytics, "<td>partition</td>") || strings.Contains(analytics, "warn") {
		t.Errorf("analytics' row: %s", analytics)
	}
}
