package pipeline

import (
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
)

// The probe asks what the groups need, not only some broker: a group's
// coordinator, or the leader of a partition assigned to this process, that
// neither answers nor fails while another broker answers makes the ask
// fail, naming it; answering again, it passes. Two brokers, one answering
// and one silent, cannot be staged with the one broker of the dev Kafka,
// so sarama's mock brokers stand for them here (a mock sends nothing to a
// request it has no handler for: a broker hung, paused, cut off); the
// paused real broker is cmd/app's TestReadinessFollowsASilentBroker.
func TestTheProbeAsksTheGroupsCoordinatorAndLeaders(t *testing.T) {
	seed := sarama.NewMockBroker(t, 1)
	defer seed.Close()
	other := sarama.NewMockBroker(t, 2)
	defer other.Close()
	seed.SetHandlerByMap(map[string]sarama.MockResponse{
		"MetadataRequest": sarama.NewMockMetadataResponse(t).SetBroker(seed.Addr(), 1).SetBroker(other.Addr(), 2).
			SetLeader("orders", 0, 2).SetLeader("orders", 1, 1),
		"FindCoordinatorRequest": sarama.NewMockFindCoordinatorResponse(t).SetCoordinator(sarama.CoordinatorGroup, "billing", other),
	})
	answers := func() {
		other.SetHandlerByMap(map[string]sarama.MockResponse{
			"MetadataRequest": sarama.NewMockMetadataResponse(t).SetBroker(seed.Addr(), 1).SetBroker(other.Addr(), 2),
		})
	}
	answers()
	assigned := []int32{0, 1}
	f := &feed{}
	f.assigned.Store(&assigned)
	p := &Pipeline{cfg: Config{Brokers: []string{seed.Addr()}}, version: sarama.V2_1_0_0,
		groups: []groupRef{{topic: "orders", group: "billing", feed: f}}}
	defer p.closeProbe()

	if err := p.askBrokers(time.Second); err != nil {
		t.Fatalf("every broker answers: %v", err)
	}
	// Broker 2, the group's coordinator and partition 0's leader, stops
	// answering; broker 1 still answers the metadata.
	other.SetHandlerByMap(map[string]sarama.MockResponse{})
	metadata := func(addr string) error {
		cc := sarama.NewConfig()
		cc.Net.DialTimeout, cc.Net.ReadTimeout, cc.Net.WriteTimeout = time.Second, time.Second, time.Second
		cc.ApiVersionsRequest = false
		b := sarama.NewBroker(addr)
		if err := b.Open(cc); err != nil {
			return err
		}
		defer b.Close()
		_, err := b.GetMetadata(&sarama.MetadataRequest{Topics: []string{"orders"}})
		return err
	}
	if err := metadata(seed.Addr()); err != nil {
		t.Fatalf("broker 1 does not answer: %v", err)
	}
	if err := metadata(other.Addr()); err == nil {
		t.Fatal("broker 2 answers a metadata request: the fault did not happen")
	}
	start := time.Now()
	err := p.askBrokers(time.Second)
	t.Logf("broker 2 silent: %v (after %s)", err, time.Since(start).Round(10*time.Millisecond))
	if err == nil {
		t.Fatal("the probe passed though the group's coordinator and a leader of its partitions do not answer")
	}
	for _, want := range []string{other.Addr(), "the coordinator of group billing", "the leader of orders/0"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the error does not name %q", want)
		}
	}
	if strings.Contains(err.Error(), "orders/1") {
		t.Errorf("partition 1, whose leader answers, is named")
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("the ask took %s; want it bounded by its timeouts", d)
	}
	answers()
	if err := p.askBrokers(time.Second); err != nil {
		t.Fatalf("broker 2 answers again: %v", err)
	}
}

// A broker that hangs delays the probe's answer by at most one timeout:
// the configured brokers are asked at once, not one after another (each
// hung one cost up to three timeouts in turn: the ApiVersions handshake,
// its retry at version 0, the request), so a process whose first broker
// hangs while another answers is not reported silent.
func TestTheProbeIsNotHeldUpByAHungBroker(t *testing.T) {
	hung := sarama.NewMockBroker(t, 1)
	defer hung.Close()
	hung.SetHandlerByMap(map[string]sarama.MockResponse{}) // answers nothing
	good := sarama.NewMockBroker(t, 2)
	defer good.Close()
	good.SetHandlerByMap(map[string]sarama.MockResponse{
		"MetadataRequest":        sarama.NewMockMetadataResponse(t).SetBroker(good.Addr(), 2).SetLeader("orders", 0, 2),
		"FindCoordinatorRequest": sarama.NewMockFindCoordinatorResponse(t).SetCoordinator(sarama.CoordinatorGroup, "billing", good),
	})
	assigned := []int32{0}
	f := &feed{}
	f.assigned.Store(&assigned)
	p := &Pipeline{cfg: Config{Brokers: []string{hung.Addr(), good.Addr()}}, version: sarama.V2_1_0_0,
		groups: []groupRef{{topic: "orders", group: "billing", feed: f}}}
	defer p.closeProbe()
	const timeout = 2 * time.Second
	start := time.Now()
	err := p.askBrokers(timeout)
	took := time.Since(start)
	t.Logf("broker 1 hung, broker 2 answers: %v after %s", err, took.Round(10*time.Millisecond))
	if err != nil {
		t.Fatalf("the probe failed though broker 2 answers: %v", err)
	}
	if took >= timeout {
		t.Errorf("the ask took %s, as long as a hung broker's timeout (%s): it waited on broker 1", took, timeout)
	}
	for deadline := time.Now().Add(time.Second); len(hung.History()) == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("broker 1 was never asked: the hang was not staged")
		}
	}
}
