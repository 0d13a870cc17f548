package pipeline

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message"
)

// GroupStatus is what one consumer group of one topic is doing now: the
// parameters of readiness checks and of the metrics that watch a pipeline.
type GroupStatus struct {
	Topic, Group string
	// Joined: the group has had a consumer-group session since Run began
	// (a rebalance in progress does not unset it), and Kafka answers: not
	// while KafkaSilent.
	Joined bool
	// KafkaSilent is how long Kafka has not answered this process, once
	// that is longer than [Config.BrokerTimeout]; 0 while it answers. Its
	// lag is unknown meanwhile.
	KafkaSilent time.Duration
	// Partitions assigned to this process in the current session (none
	// between two sessions).
	Partitions []int32
	// Held: messages held now because the environment failed them, and
	// how long the oldest of them has been held.
	Held       int
	OldestHeld time.Duration
	// Order is the group's order of a partition's messages; empty for a
	// batched group, whose batches keep its partitions' order.
	Order Order
	// Of a key-ordered group (see [OrderKey]): HeldKeys, the keys a held
	// message holds now (each key's later messages wait for it, the other
	// keys go on); Pinned, the longest any of its partitions' commit
	// points has stood at the partition's first unfinished message (a
	// crash redelivers from there); WindowFull, its partitions whose
	// window is full, where nothing new starts until the first unfinished
	// message is done.
	HeldKeys   int
	Pinned     time.Duration
	WindowFull int
}

// Status reports every consumer group of the pipeline, in configuration
// order.
func (p *Pipeline) Status() []GroupStatus {
	now := time.Now()
	p.holdsMu.Lock()
	held := map[[2]string][]time.Time{}
	heldKeys := map[[2]string]map[string]bool{}
	for _, h := range p.holds {
		k := [2]string{h.topic, h.group}
		held[k] = append(held[k], h.since)
		if heldKeys[k] == nil {
			heldKeys[k] = map[string]bool{}
		}
		// One partition's keyless message holds all of its keys; counted
		// as one, its partition's window shows the rest.
		heldKeys[k][fmt.Sprint(h.at.Partition, "/", h.at.Key)] = true
	}
	p.holdsMu.Unlock()
	silent := p.silentFor(now)
	out := make([]GroupStatus, 0, len(p.groups))
	for _, g := range p.groups {
		s := GroupStatus{Topic: g.topic, Group: g.group, Joined: g.feed.joined.Load(), Order: g.order, KafkaSilent: silent}
		s.Joined = s.Joined && silent == 0
		if parts := g.feed.assigned.Load(); parts != nil {
			s.Partitions = slices.Clone(*parts)
		}
		for _, since := range held[[2]string{g.topic, g.group}] {
			s.Held++
			s.OldestHeld = max(s.OldestHeld, now.Sub(since))
		}
		if g.gate != nil {
			gs := g.gate.status(now)
			s.HeldKeys, s.Pinned, s.WindowFull = len(heldKeys[[2]string{g.topic, g.group}]), gs.pinned, gs.full
		}
		out = append(out, s)
	}
	return out
}

// groupRef is one topic of a consumer group's subscriber, for Status and Lag.
type groupRef struct {
	topic, group string
	feed         *feed
	gate         *keyGate // a key-ordered group's; nil for others
	order        Order
}

// holdEntry is a message held now (see Pipeline.hold).
type holdEntry struct {
	topic, group string
	since        time.Time
	// at is where the message is, read when it was first held, on its own
	// goroutine: a retry may be running when Holds is called, and a team's
	// middleware may write the message's metadata meanwhile.
	at       Delivery
	attempts int
	err      error
}

// HeldMessage is one message held now: where it is, since when, and why its
// last attempt failed.
type HeldMessage struct {
	Topic, Group string
	Partition    int32
	Offset       int64
	Key          string
	Since        time.Time
	Attempts     int
	// Err is the last attempt's error; nil before the first is reported.
	Err error
}

// Holds returns the messages held now, the longest held first.
func (p *Pipeline) Holds() []HeldMessage {
	p.holdsMu.Lock()
	out := make([]HeldMessage, 0, len(p.holds))
	for _, h := range p.holds {
		d := h.at
		out = append(out, HeldMessage{Topic: h.topic, Group: h.group, Partition: d.Partition, Offset: d.Offset, Key: d.Key,
			Since: h.since, Attempts: h.attempts, Err: h.err})
	}
	p.holdsMu.Unlock()
	slices.SortFunc(out, func(a, b HeldMessage) int { return a.Since.Compare(b.Since) })
	return out
}

// holdFailed records a held message's failed attempt, for Holds.
func (p *Pipeline) holdFailed(msg *message.Message, attempt int, err error) {
	p.holdsMu.Lock()
	defer p.holdsMu.Unlock()
	if h, ok := p.holds[msg]; ok {
		h.attempts, h.err = attempt, err
		p.holds[msg] = h
	}
}

func (p *Pipeline) holding(msg *message.Message, topic, group string, since time.Time) {
	d := delivery(topic, group, msg)
	p.holdsMu.Lock()
	defer p.holdsMu.Unlock()
	if p.holds == nil {
		p.holds = map[*message.Message]holdEntry{}
	}
	p.holds[msg] = holdEntry{topic: topic, group: group, since: since,
		at: Delivery{Partition: d.Partition, Offset: d.Offset, Key: d.Key}}
}

func (p *Pipeline) released(msg *message.Message) {
	p.holdsMu.Lock()
	defer p.holdsMu.Unlock()
	delete(p.holds, msg)
}

// PartitionLag is a consumer group's position in one partition.
type PartitionLag struct {
	Topic, Group string
	Partition    int32
	// Committed is the group's committed offset, -1 when it has none yet;
	// HighWatermark the offset the next message will get.
	Committed, HighWatermark int64
	// Lag: messages not yet committed by the group (from the partition's
	// oldest offset when it has committed none).
	Lag int64
}

// Lag reads every group's committed offsets and the topics' high watermarks
// from Kafka; a partition whose lag could not be read is left out, and the
// error says why. While Kafka has not answered for longer than
// [Config.BrokerTimeout] it returns [ErrKafkaSilent] at once: the lag is
// unknown. It holds its own Kafka client, made on first use and closed
// with the pipeline.
func (p *Pipeline) Lag(ctx context.Context) ([]PartitionLag, error) {
	if silent := p.silentFor(time.Now()); silent > 0 {
		return nil, fmt.Errorf("%w for %s (BrokerTimeout %s)", ErrKafkaSilent, silent.Round(time.Second), p.cfg.BrokerTimeout)
	}
	p.lagMu.Lock()
	defer p.lagMu.Unlock()
	client, admin, err := p.kafkaAdmin()
	if err != nil {
		return nil, err
	}
	var out []PartitionLag
	var errs []error
	for _, g := range p.groups {
		if ctx.Err() != nil {
			return out, ctx.Err()
		}
		parts, err := client.Partitions(g.topic)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: partitions: %w", g.topic, err))
			continue
		}
		offsets, err := admin.ListConsumerGroupOffsets(g.group, map[string][]int32{g.topic: parts})
		if err != nil {
			errs = append(errs, fmt.Errorf("group %s: committed offsets: %w", g.group, err))
			continue
		}
		for _, part := range parts {
			hwm, err := client.GetOffset(g.topic, part, sarama.OffsetNewest)
			if err != nil {
				errs = append(errs, fmt.Errorf("%s/%d: high watermark: %w", g.topic, part, err))
				continue
			}
			l := PartitionLag{Topic: g.topic, Group: g.group, Partition: part, Committed: -1, HighWatermark: hwm}
			if b := offsets.GetBlock(g.topic, part); b != nil && b.Err == sarama.ErrNoError {
				l.Committed = b.Offset
			}
			from := l.Committed
			if from < 0 {
				if from, err = client.GetOffset(g.topic, part, sarama.OffsetOldest); err != nil {
					errs = append(errs, fmt.Errorf("%s/%d: oldest offset: %w", g.topic, part, err))
					continue
				}
			}
			l.Lag = max(hwm-from, 0)
			out = append(out, l)
		}
	}
	return out, errors.Join(errs...)
}

// kafkaAdmin is the pipeline's Kafka client for Lag and CheckAccess, made
// on first use. Caller holds lagMu.
func (p *Pipeline) kafkaAdmin() (sarama.Client, sarama.ClusterAdmin, error) {
	select {
	case <-p.stopping:
		return nil, nil, errors.New("pipeline: stopped")
	default:
	}
	if p.lagClient == nil {
		cc := PublisherSaramaConfig(p.version)
		p.cfg.Security.Apply(cc)
		client, err := sarama.NewClient(p.cfg.Brokers, cc)
		if err != nil {
			return nil, nil, fmt.Errorf("pipeline: kafka client on %v: %w", p.cfg.Brokers, err)
		}
		admin, err := sarama.NewClusterAdminFromClient(client)
		if err != nil {
			_ = client.Close()
			return nil, nil, fmt.Errorf("pipeline: kafka admin: %w", err)
		}
		p.lagClient, p.lagAdmin = client, admin
	}
	return p.lagClient, p.lagAdmin, nil
}

// CheckAccess asks Kafka, before anything is consumed, whether this
// process's principal may read every topic it consumes, write every
// dead-letter topic, and read its consumer groups: a missing ACL then stops
// start-up with its name, rather than surfacing later as consumer errors,
// or as dead letters that never leave the database; and write every
// [Config.Outgoing] topic, whose events would otherwise wait in the outbox.
func (p *Pipeline) CheckAccess(ctx context.Context) error {
	p.lagMu.Lock()
	defer p.lagMu.Unlock()
	_, admin, err := p.kafkaAdmin()
	if err != nil {
		return err
	}
	principal := p.cfg.Security.principal()
	var topics []string
	for _, g := range p.groups {
		if !slices.Contains(topics, g.topic) {
			topics = append(topics, g.topic)
		}
	}
	for _, t := range append(slices.Clone(p.dlqTopics), p.OutgoingTopics()...) {
		if !slices.Contains(topics, t) {
			topics = append(topics, t)
		}
	}
	var errs []error
	meta, err := admin.DescribeTopics(topics)
	if err != nil {
		return fmt.Errorf("pipeline: describe topics %v: %w", topics, err)
	}
	for _, m := range meta {
		switch {
		case errors.Is(m.Err, sarama.ErrTopicAuthorizationFailed):
			_, what := p.topicNeeds(m.Name)
			errs = append(errs, fmt.Errorf("%s is not authorized on topic %s: it needs %s", principal, m.Name, what))
		case m.Err != sarama.ErrNoError:
			errs = append(errs, fmt.Errorf("topic %s: %w", m.Name, m.Err))
		}
	}
	if len(errs) == 0 {
		errs = append(errs, p.checkTopicOperations(topics, principal)...)
	}
	checked := map[string]bool{}
	for _, g := range p.groups {
		if ctx.Err() != nil {
			// What was found so far is kept: stopping does not hide a
			// missing permission.
			return errors.Join(append(errs, ctx.Err())...)
		}
		if checked[g.group] {
			continue
		}
		checked[g.group] = true
		resp, err := admin.ListConsumerGroupOffsets(g.group, nil)
		if err == nil && resp.Err != sarama.ErrNoError {
			err = resp.Err
		}
		if errors.Is(err, sarama.ErrGroupAuthorizationFailed) {
			errs = append(errs, fmt.Errorf("%s is not authorized on consumer group %s: it needs READ and DESCRIBE on the group", principal, g.group))
		} else if err != nil {
			errs = append(errs, fmt.Errorf("consumer group %s: %w", g.group, err))
		}
	}
	return errors.Join(errs...)
}

// Operations of Kafka's ACLs, as bits of a topic's authorized operations.
const (
	aclRead     = 3
	aclWrite    = 4
	aclDescribe = 8
)

// topicNeeds is what the pipeline's principal must be allowed on topic:
// READ and DESCRIBE on one it consumes, WRITE and DESCRIBE on a dead-letter
// or Outgoing topic, all of them on a topic that is both (analytics
// consumes what billing publishes); and how an error says so.
func (p *Pipeline) topicNeeds(topic string) (ops []int, what string) {
	var names, whys []string
	if slices.ContainsFunc(p.groups, func(g groupRef) bool { return g.topic == topic }) {
		ops, names, whys = append(ops, aclRead), append(names, "READ"), append(whys, "to consume it")
	}
	deadLetters, outgoing := slices.Contains(p.dlqTopics, topic), slices.Contains(p.OutgoingTopics(), topic)
	if deadLetters || outgoing {
		ops, names = append(ops, aclWrite), append(names, "WRITE")
	}
	if deadLetters {
		whys = append(whys, "to publish dead letters")
	}
	if outgoing {
		whys = append(whys, "to forward the outbox's events")
	}
	ops, names = append(ops, aclDescribe), append(names, "DESCRIBE")
	return ops, fmt.Sprintf("%s (%s)", strings.Join(names, ", "), strings.Join(whys, "; "))
}

// checkTopicOperations asks the broker what the principal may do on each
// topic (metadata v8's authorized operations): READ on the topics it
// consumes, WRITE on the dead-letter topics. A broker without an
// authorizer, or older than 2.3, does not say; then nothing is checked.
// Caller holds lagMu.
func (p *Pipeline) checkTopicOperations(topics []string, principal string) []error {
	client := p.lagClient
	if !p.version.IsAtLeast(sarama.V2_3_0_0) {
		return nil
	}
	broker := client.LeastLoadedBroker()
	if broker == nil {
		return nil
	}
	if err := broker.Open(client.Config()); err != nil && !errors.Is(err, sarama.ErrAlreadyConnected) {
		return []error{fmt.Errorf("pipeline: connect to %s: %w", broker.Addr(), err)}
	}
	req := sarama.NewMetadataRequest(p.version, topics)
	if req.Version < 8 {
		req.Version = 8
	}
	req.IncludeTopicAuthorizedOperations = true
	resp, err := broker.GetMetadata(req)
	if err != nil {
		return []error{fmt.Errorf("pipeline: topic permissions: %w", err)}
	}
	var errs []error
	for _, t := range resp.Topics {
		ops := t.TopicAuthorizedOperations
		if ops == math.MinInt32 {
			continue // not reported
		}
		need, what := p.topicNeeds(t.Name)
		for _, op := range need {
			if ops&(1<<op) == 0 {
				errs = append(errs, fmt.Errorf("%s is not authorized on topic %s: it needs %s", principal, t.Name, what))
				break
			}
		}
	}
	return errs
}

// lagState is the pipeline's lazily made Kafka client for Lag.
type lagState struct {
	lagMu     sync.Mutex
	lagClient sarama.Client
	lagAdmin  sarama.ClusterAdmin
}

func (l *lagState) closeLag() error {
	l.lagMu.Lock()
	defer l.lagMu.Unlock()
	if l.lagAdmin == nil {
		return nil
	}
	err := l.lagAdmin.Close() // closes its client too
	l.lagAdmin, l.lagClient = nil, nil
	return err
}

// TopicNames is a topic of the pipeline and its dead-letter topic.
type TopicNames struct {
	Name, DLQ string
	// IDNamespace is the topic's [Topic.IDNamespace]: "" when its events
	// carry their UUIDv7s.
	IDNamespace string
}

// Topics are the pipeline's topics, in configuration order.
func (p *Pipeline) Topics() []TopicNames {
	out := make([]TopicNames, 0, len(p.topics))
	for _, t := range p.topics {
		out = append(out, TopicNames{Name: t.name, DLQ: t.dlq, IDNamespace: t.idNamespace})
	}
	return out
}

// OutgoingTopics are the topics of [Config.Outgoing], which the handlers
// publish to.
func (p *Pipeline) OutgoingTopics() []string {
	if p.publisher == nil {
		return nil
	}
	return slices.Sorted(maps.Keys(p.publisher.byName))
}

// GroupNames are the pipeline's consumer groups, each once.
func (p *Pipeline) GroupNames() []string { return groupNames(p.topics) }

// KafkaVersion is the brokers' version the pipeline speaks.
func (p *Pipeline) KafkaVersion() sarama.KafkaVersion { return p.version }

// KafkaTopics are every topic cfg's pipeline uses: those it consumes,
// their dead-letter topics, and the [Config.Outgoing] ones, each once;
// without a topic that is not valid.
func (c Config) KafkaTopics() []string {
	var out []string
	add := func(name string) {
		if name != "" && !slices.Contains(out, name) {
			out = append(out, name)
		}
	}
	for _, t := range c.Topics {
		if t == nil {
			continue
		}
		if b, err := t.binding(); err == nil {
			add(b.name)
			add(b.dlq)
		}
	}
	for _, o := range c.Outgoing {
		if o == nil {
			continue
		}
		if b, err := o.outgoing(); err == nil {
			add(b.name)
		}
	}
	return out
}

// GroupNames are the consumer groups of cfg's topics, each once; none when
// a topic is not valid.
func (c Config) GroupNames() []string {
	var topics []topicBinding
	for _, t := range c.Topics {
		if t == nil {
			continue
		}
		if b, err := t.binding(); err == nil {
			topics = append(topics, b)
		}
	}
	return groupNames(topics)
}

func groupNames(topics []topicBinding) []string {
	var out []string
	for _, t := range topics {
		for _, g := range t.groups {
			if !slices.Contains(out, g.name) {
				out = append(out, g.name)
			}
		}
	}
	return out
}
