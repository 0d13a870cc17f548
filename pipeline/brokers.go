package pipeline

import (
	"context"
	"errors"
	"fmt"
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

// brokerProbe is whether Kafka answers this process: the consumers'
// sessions do not say (sarama keeps a session it cannot heartbeat until
// the broker answers again), so a probe asks the brokers for the consumed
// topics' metadata every third of Config.BrokerTimeout.
type brokerProbe struct {
	lastAnswer atomic.Int64 // UnixNano; 0 while not running
	broker     *sarama.Broker
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
// records when it last answered. Each ask is bounded by that third too: a
// broker that neither answers nor fails (hung, paused, cut off) is seen
// within BrokerTimeout.
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

// askBrokers asks one of the brokers, the last one that answered first,
// for the consumed topics' metadata, within timeout.
func (p *Pipeline) askBrokers(timeout time.Duration) error {
	var errs []error
	if b := p.probe.broker; b != nil {
		err := p.ask(b)
		if err == nil {
			return nil
		}
		errs = append(errs, err)
		_ = b.Close()
		p.probe.broker = nil
	}
	cc := PublisherSaramaConfig(p.version)
	cc.ClientID = "once-probe"
	p.cfg.Security.Apply(cc)
	cc.Net.DialTimeout, cc.Net.ReadTimeout, cc.Net.WriteTimeout = timeout, timeout, timeout
	for _, addr := range p.cfg.Brokers {
		b := sarama.NewBroker(addr)
		if err := b.Open(cc); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", addr, err))
			continue
		}
		if err := p.ask(b); err != nil {
			_ = b.Close()
			errs = append(errs, err)
			continue
		}
		p.probe.broker = b
		return nil
	}
	return errors.Join(errs...)
}

func (p *Pipeline) ask(b *sarama.Broker) error {
	var topics []string
	for _, g := range p.groups {
		topics = append(topics, g.topic)
	}
	if _, err := b.GetMetadata(sarama.NewMetadataRequest(p.version, topics)); err != nil {
		return fmt.Errorf("%s: metadata: %w", b.Addr(), err)
	}
	return nil
}

func (p *Pipeline) closeProbe() {
	p.probe.lastAnswer.Store(0)
	if p.probe.broker != nil {
		_ = p.probe.broker.Close()
		p.probe.broker = nil
	}
}
