package pipeline

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"
)

// DefaultBrokerTimeout is Config.BrokerTimeout by default: a broker that
// has not answered for this long is taken for gone, well before a
// minute, and well after a leader election or a slow request.
const DefaultBrokerTimeout = 15 * time.Second

// ErrKafkaSilent is what [Pipeline.Lag] returns while the brokers have not
// answered for longer than Config.BrokerTimeout: the lag is unknown, not 0.
var ErrKafkaSilent = errors.New("pipeline: kafka has not answered")

// brokerProbe is whether Kafka answers this process what its groups need:
// the consumers' sessions do not say (sarama keeps a session it cannot
// heartbeat until the broker answers again), so every third of
// Config.BrokerTimeout a probe asks a broker for the consumed topics'
// metadata and for each group's coordinator, then asks each group's
// coordinator and the leader of each partition assigned to this process
// (their metadata, on connections of the probe's own): a group whose
// coordinator or one of whose partitions' leader is cut off, while
// another broker answers, is not ready either. Only the probe's goroutine
// touches broker and others.
type brokerProbe struct {
	lastAnswer atomic.Int64   // UnixNano; 0 while not running
	broker     *sarama.Broker // the last that answered the metadata request
	others     map[string]*sarama.Broker
}

// silentFor is how long Kafka has not answered, once that is longer than
// Config.BrokerTimeout; 0 while it answers, or while the pipeline does not
// run.
func (p *Pipeline) silentFor(now time.Time) time.Duration {
	last := p.probe.lastAnswer.Load()
	if last == 0 {
		return 0
	}
	if d := now.Sub(time.Unix(0, last)); d > p.cfg.BrokerTimeout {
		return d
	}
	return 0
}

// probeBrokers asks Kafka every third of BrokerTimeout until ctx ends, and
// records when everything asked last answered. A broker that neither
// answers nor fails (hung, paused, cut off) is seen within BrokerTimeout
// however long an ask takes: silence is the time since the last answer,
// not a verdict of the ask. Each request of an ask waits at most that
// third (the connection's dial, write and read timeouts; no ApiVersions
// handshake), and the brokers of each step are asked at once, but for the
// last that answered, asked alone first: a hung broker delays the answer
// of the others by at most a third, so a process whose broker hangs while
// another answers stays ready.
func (p *Pipeline) probeBrokers(ctx context.Context) {
	every := p.cfg.BrokerTimeout / 3
	p.probe.lastAnswer.Store(time.Now().UnixNano())
	defer p.closeProbe()
	t := time.NewTicker(every)
	defer t.Stop()
	said := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		err := p.askBrokers(every)
		switch silent := p.silentFor(time.Now()); {
		case err == nil:
			p.probe.lastAnswer.Store(time.Now().UnixNano())
			if said {
				said = false
				p.cfg.Logger.Info("kafka answers again: the groups are ready, their lag is read again")
			}
		case silent > 0 && !said && ctx.Err() == nil:
			said = true
			p.cfg.Logger.Error("kafka has not answered for longer than the broker timeout: the groups are not ready, their lag is unknown",
				"silent", silent.Round(time.Second).String(), "broker_timeout", p.cfg.BrokerTimeout.String(), "brokers", p.cfg.Brokers, "err", err)
		}
	}
}

// askBrokers asks one of the brokers for the consumed topics' metadata and
// the groups' coordinators, then those coordinators and the leaders of the
// partitions assigned to this process.
func (p *Pipeline) askBrokers(timeout time.Duration) error {
	b, md, err := p.askMetadata(timeout)
	if err != nil {
		return err
	}
	needed, err := p.neededBrokers(b, md)
	if err != nil {
		return err
	}
	return p.askNeeded(needed, b.Addr(), timeout)
}

// askMetadata asks the last broker that answered for the consumed topics'
// metadata, and when it does not answer, every configured broker at once:
// the first to answer is kept, the others closed.
func (p *Pipeline) askMetadata(timeout time.Duration) (*sarama.Broker, *sarama.MetadataResponse, error) {
	var errs []error
	if b := p.probe.broker; b != nil {
		md, err := p.ask(b)
		if err == nil {
			return b, md, nil
		}
		errs = append(errs, err)
		_ = b.Close()
		p.probe.broker = nil
	}
	cc := p.probeConfig(timeout)
	type result struct {
		b   *sarama.Broker
		md  *sarama.MetadataResponse
		err error
	}
	results := make(chan result, len(p.cfg.Brokers))
	for _, addr := range p.cfg.Brokers {
		go func() {
			b := sarama.NewBroker(addr)
			if err := b.Open(cc); err != nil {
				results <- result{err: fmt.Errorf("%s: %w", addr, err)}
				return
			}
			md, err := p.ask(b)
			if err != nil {
				_ = b.Close()
			}
			results <- result{b, md, err}
		}()
	}
	var won result
	for received := 1; received <= len(p.cfg.Brokers); received++ {
		r := <-results
		if r.err != nil {
			errs = append(errs, r.err)
			continue
		}
		won = r
		// The others are closed as they end, not waited for.
		go func(left int) {
			for range left {
				if r := <-results; r.err == nil {
					_ = r.b.Close()
				}
			}
		}(len(p.cfg.Brokers) - received)
		break
	}
	if won.b == nil {
		return nil, nil, errors.Join(errs...)
	}
	p.probe.broker = won.b
	return won.b, won.md, nil
}

func (p *Pipeline) probeConfig(timeout time.Duration) *sarama.Config {
	cc := PublisherSaramaConfig(p.version)
	cc.ClientID = "once-probe"
	p.cfg.Security.Apply(cc)
	cc.Net.DialTimeout, cc.Net.ReadTimeout, cc.Net.WriteTimeout = timeout, timeout, timeout
	// No ApiVersions handshake on opening: sarama sends it, and again at
	// version 0 when it fails, each waiting up to the read timeout, so a
	// hung broker would take three timeouts to fail rather than one. The
	// requests' versions follow KafkaVersion, as the pipeline's own do.
	cc.ApiVersionsRequest = false
	return cc
}

func (p *Pipeline) ask(b *sarama.Broker) (*sarama.MetadataResponse, error) {
	var topics []string
	for _, g := range p.groups {
		topics = append(topics, g.topic)
	}
	md, err := b.GetMetadata(sarama.NewMetadataRequest(p.version, topics))
	if err != nil {
		return nil, fmt.Errorf("%s: metadata: %w", b.Addr(), err)
	}
	return md, nil
}

// neededBrokers are, by address, what this process's groups need of which
// broker: each group's coordinator (asked of b), and the leader of each
// partition assigned to this process (md's). A coordinator that cannot be
// found, or a partition without a leader, is an error: the group cannot
// work either way.
func (p *Pipeline) neededBrokers(b *sarama.Broker, md *sarama.MetadataResponse) (map[string][]string, error) {
	addrs := map[int32]string{}
	for _, br := range md.Brokers {
		addrs[br.ID()] = br.Addr()
	}
	leaders := map[string]map[int32]int32{} // topic -> partition -> leader
	for _, t := range md.Topics {
		leaders[t.Name] = map[int32]int32{}
		for _, part := range t.Partitions {
			leaders[t.Name][part.ID] = part.Leader
		}
	}
	needed := map[string][]string{}
	coordinators := map[string]string{}
	for _, g := range p.groups {
		addr, found := coordinators[g.group]
		if !found {
			req := &sarama.FindCoordinatorRequest{CoordinatorKey: g.group, CoordinatorType: sarama.CoordinatorGroup}
			switch {
			case p.version.IsAtLeast(sarama.V2_4_0_0):
				req.Version = 3
			case p.version.IsAtLeast(sarama.V2_0_0_0):
				req.Version = 2
			case p.version.IsAtLeast(sarama.V0_11_0_0):
				req.Version = 1
			}
			resp, err := b.FindCoordinator(req)
			switch {
			case err != nil:
				return nil, fmt.Errorf("%s: the coordinator of group %s: %w", b.Addr(), g.group, err)
			case resp.Err != sarama.ErrNoError:
				return nil, fmt.Errorf("%s: the coordinator of group %s: %w", b.Addr(), g.group, resp.Err)
			case resp.Coordinator == nil:
				return nil, fmt.Errorf("%s: the coordinator of group %s: none", b.Addr(), g.group)
			}
			addr = resp.Coordinator.Addr()
			coordinators[g.group] = addr
			needed[addr] = append(needed[addr], "the coordinator of group "+g.group)
		}
		parts := g.feed.assigned.Load()
		if parts == nil {
			continue
		}
		for _, part := range *parts {
			leader, known := leaders[g.topic][part]
			if !known {
				continue // a topic the metadata did not return: the consumer's errors say why
			}
			addr, ok := addrs[leader]
			if !ok {
				return nil, fmt.Errorf("%s/%d, assigned to group %s: no leader (broker %d)", g.topic, part, g.group, leader)
			}
			needed[addr] = append(needed[addr], fmt.Sprintf("the leader of %s/%d", g.topic, part))
		}
	}
	return needed, nil
}

// askNeeded asks each broker of needed but answered (which just did) for
// the consumed topics' metadata, all at once, on the probe's connection to
// it; a connection that failed is closed, and opened again next time.
func (p *Pipeline) askNeeded(needed map[string][]string, answered string, timeout time.Duration) error {
	if p.probe.others == nil {
		p.probe.others = map[string]*sarama.Broker{}
	}
	cc := p.probeConfig(timeout)
	type result struct {
		addr string
		b    *sarama.Broker
		err  error
	}
	results := make(chan result, len(needed))
	n := 0
	for addr, what := range needed {
		if addr == answered {
			continue
		}
		n++
		b := p.probe.others[addr]
		go func() {
			if b == nil {
				b = sarama.NewBroker(addr)
				if err := b.Open(cc); err != nil {
					results <- result{addr, nil, fmt.Errorf("%s (%s): %w", addr, strings.Join(what, ", "), err)}
					return
				}
			}
			if _, err := p.ask(b); err != nil {
				_ = b.Close()
				results <- result{addr, nil, fmt.Errorf("%w (%s)", err, strings.Join(what, ", "))}
				return
			}
			results <- result{addr, b, nil}
		}()
	}
	var errs []error
	for range n {
		r := <-results
		if r.b == nil {
			delete(p.probe.others, r.addr)
		} else {
			p.probe.others[r.addr] = r.b
		}
		if r.err != nil {
			errs = append(errs, r.err)
		}
	}
	return errors.Join(errs...)
}

func (p *Pipeline) closeProbe() {
	p.probe.lastAnswer.Store(0)
	if p.probe.broker != nil {
		_ = p.probe.broker.Close()
		p.probe.broker = nil
	}
	for addr, b := range p.probe.others {
		_ = b.Close()
		delete(p.probe.others, addr)
	}
}
