package pipeline

import (
	"slices"
	"testing"
)

// A topic one group consumes and another publishes to (analytics reads
// billing's payment events) needs READ and WRITE (review finding: only
// WRITE was checked, and a principal without READ passed start-up).
func TestATopicConsumedAndPublishedNeedsReadAndWrite(t *testing.T) {
	p := &Pipeline{groups: []groupRef{{topic: "orders"}, {topic: "payments"}}, dlqTopics: []string{"orders.dlq", "payments.dlq"},
		publisher: &publisher{byName: map[string]outgoingBinding{"payments": {}}}}
	for topic, want := range map[string][]int{
		"orders":     {aclRead, aclDescribe},
		"orders.dlq": {aclWrite, aclDescribe},
		"payments":   {aclRead, aclWrite, aclDescribe},
	} {
		if got, what := p.topicNeeds(topic); !slices.Equal(got, want) {
			t.Errorf("%s needs %v (%s); want %v", topic, got, what, want)
		}
	}
}
