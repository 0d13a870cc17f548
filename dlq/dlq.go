// Package dlq replays dead-lettered messages to the topic they came from.
// A replay is itself a source of duplicates (every consumer group sees the
// message again, including those that processed it): the consumers' dedup is
// what makes it safe. Replay progress is a Kafka consumer group of its own, so
// each dead letter is replayed once, and a replay stops at the end offsets it
// saw when it started: a message that fails again is dead-lettered again, not
// replayed in a loop.
package dlq

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/once-dev/once/middleware/idempotency"
)

// DefaultGroup keeps the replay progress.
const DefaultGroup = "once-dlq-replay"

// HeaderReplayedFrom names the dead letter a replayed message came from.
const HeaderReplayedFrom = "dlq_replayed_from"

// HeaderEventID is a letter's event id as the pipeline decoded it (the
// claim's key), on the letters of events that decoded. An event whose
// producer sends ids of its own (idempotency.DeriveEventID) has no UUIDv7
// in its payload: this is where a letter's event time, which the replay
// window judges, comes from then.
const HeaderEventID = "once_event_id"

// HeaderVerdict, with the value [VerdictRecorded], is on the letters of
// events whose group recorded its own verdict with the event's claim
// (idempotency.RejectAfterCommit: a charge the provider declined, marked
// failed). A replay cannot change that verdict: the group finds the claim
// and skips the replay as a duplicate; with the claim forgotten, a handler
// that meets its own record gives the same verdict again (billing does) and
// the new letter carries the header too.
//
// A letter without it is one whose group committed no claim of the event:
// a payload that does not decode, a handler's permanent error (the
// attempt rolled back), or a payload mismatch (the group's claim of the
// event id is another payload's). A replay runs the group's checks and
// handler again, and they decide anew from what they find: what the
// handler wrote outside its transaction or in other events' records stays
// (billing's unsettled charge intent after a reused idempotency key, or
// another event's payment for the order, refuse it again until a person
// reconciles), and a mismatch is dead-lettered again while that claim
// stands. The header is set by the pipeline alone: one a message arrives
// with is not kept on its letter, and a replay sends none.
const HeaderVerdict = "once_verdict"

// VerdictRecorded is [HeaderVerdict]'s value.
const VerdictRecorded = "recorded"

// Config configures [Replay].
type Config struct {
	Brokers []string
	// Sarama is the producer configuration (and carries the Kafka version).
	Sarama   *sarama.Config
	DLQTopic string
	// Topic receives dead letters that do not say where they came from.
	Topic string
	// Group keeps the replay progress. Default [DefaultGroup].
	Group string
	// MaxAge skips (and counts) dead letters whose event is older than this
	// (the time in its UUIDv7 event_id): for example beyond the payment
	// provider's key retention, where a replayed charge whose transaction
	// had rolled back would charge again. 0 replays all.
	MaxAge time.Duration
	// SkipVerdicts skips (and counts) the letters of recorded verdicts
	// ([HeaderVerdict]): for their group a replay is a duplicate that
	// changes nothing. Like a stale letter, a skipped one is done for this
	// progress: send it later alone ([ReplayLetter]) or from a progress
	// group of its own. Default false: every letter is sent.
	SkipVerdicts bool
	// Filter replays only the letters it selects; the others stay for a
	// later replay (a filtered replay keeps its progress in a group of its
	// own, see progressGroup). With a MinAge, a partition's replay stops at
	// its first letter too young for it, which may match later: the next
	// replay with the same filter starts there.
	Filter Filter
	// Progress, if set, is called after each message.
	Progress func(done, total int64)
	// DryRun judges every letter exactly as the replay would, from the
	// same progress, and reports it, but sends nothing and moves no
	// progress: what a confirmation shows before the real run.
	DryRun bool
	// Each, if set, is told every letter read and what became of it
	// (in a dry run, what would).
	Each func(Entry, Outcome)
	// Until, if set, bounds the replay to what a dry run read: each
	// partition stops at its offset here (the dry run's [Report.Ends]);
	// a partition not in it is not read. Letters dead-lettered after the
	// dry run wait for the next replay instead of being sent unseen.
	Until map[Position]int64
	Now   func() time.Time
}

// Position is a partition of a dead-letter topic.
type Position struct {
	Topic     string
	Partition int32
}

// Outcome is what a replay does with one letter.
type Outcome int

const (
	Replayed       Outcome = iota // sent again to its topic
	SkippedStale                  // its event is older than MaxAge
	Filtered                      // the filter leaves it out
	NotYet                        // too young for the filter's MinAge: its partition stops there
	SkippedVerdict                // its group's recorded verdict, with SkipVerdicts
)

// Report says what a replay did.
type Report struct {
	Replayed     int64
	SkippedStale int64
	Filtered     int64 // left out by the filter, for good
	NotYet       int64 // partitions stopped at a letter too young for the filter's MinAge
	// SkippedVerdicts: letters of recorded verdicts left out (SkipVerdicts).
	SkippedVerdicts int64
	ByTopic         map[string]int64
	// Ends is where each partition's read ended: [Config.Until] for a
	// replay that is to do what this one (a dry run) said.
	Ends map[Position]int64
}

func newReport() Report { return Report{ByTopic: map[string]int64{}, Ends: map[Position]int64{}} }

// replaying keeps two replays of one progress group on one dead-letter
// topic in this process apart (a double-clicked button, two operators):
// both would read from the same committed offset and send every letter
// twice. Replays in two processes are not kept apart; the consumers'
// claims make the second sending harmless.
var replaying sync.Map // progress group + "\x00" + DLQ topic -> *sync.Mutex

// headers that describe the failed delivery, not the event: not replayed.
var dropped = map[string]bool{
	kafka.UUIDHeaderKey:              true,
	middleware.ReasonForPoisonedKey:  true,
	middleware.PoisonedTopicKey:      true,
	middleware.PoisonedHandlerKey:    true,
	middleware.PoisonedSubscriberKey: true,
	"kafka_partition":                true,
	"kafka_offset":                   true,
	"kafka_key":                      true,
	HeaderReplayedFrom:               true,
	HeaderEventID:                    true, // the pipeline's reading of this delivery: it reads the replay afresh
	HeaderVerdict:                    true,
}

// Replay republishes every dead letter not yet replayed, up to the end of the
// DLQ topic as it was when Replay started.
func Replay(ctx context.Context, cfg Config) (Report, error) {
	if cfg.Group == "" {
		cfg.Group = DefaultGroup
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if len(cfg.Brokers) == 0 || cfg.DLQTopic == "" || cfg.Topic == "" || cfg.Sarama == nil {
		return Report{}, errors.New("dlq: Brokers, Sarama, DLQTopic and Topic are required")
	}
	if cfg.MaxAge > 0 && cfg.Filter.MinAge >= cfg.MaxAge {
		return Report{}, fmt.Errorf("dlq: Filter.MinAge %s is not below MaxAge %s: every letter it selects would be skipped as stale", cfg.Filter.MinAge, cfg.MaxAge)
	}
	// The producer gets a client of its own: an idempotent producer allows one
	// request in flight per connection, and a shared connection would queue
	// every send behind the consumer's long-polling fetches.
	var producer sarama.SyncProducer
	if !cfg.DryRun {
		pc := *cfg.Sarama
		pc.Producer.Return.Successes = true
		p, err := sarama.NewSyncProducer(cfg.Brokers, &pc)
		if err != nil {
			return Report{}, fmt.Errorf("dlq: producer: %w", err)
		}
		defer p.Close()
		producer = p
	}
	cc := readerConfig(cfg.Sarama)
	cc.Consumer.Offsets.Initial = sarama.OffsetOldest
	client, err := sarama.NewClient(cfg.Brokers, cc)
	if err != nil {
		return Report{}, fmt.Errorf("dlq: connect: %w", err)
	}
	defer client.Close()
	consumer, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		return Report{}, fmt.Errorf("dlq: consumer: %w", err)
	}
	defer consumer.Close()
	group := progressGroup(cfg.Group, cfg.Filter)
	if !cfg.DryRun {
		mu, _ := replaying.LoadOrStore(group+"\x00"+cfg.DLQTopic, new(sync.Mutex))
		mu.(*sync.Mutex).Lock()
		defer mu.(*sync.Mutex).Unlock()
	}
	offsets, err := sarama.NewOffsetManagerFromClient(group, client)
	if err != nil {
		return Report{}, fmt.Errorf("dlq: offsets of %s: %w", group, err)
	}
	defer offsets.Close()

	partitions, err := client.Partitions(cfg.DLQTopic)
	if errors.Is(err, sarama.ErrUnknownTopicOrPartition) {
		// No letter yet: the topic is made with its first one. A replay of
		// every route must not stop at a topic that never had a letter.
		return newReport(), nil
	}
	if err != nil {
		return Report{}, fmt.Errorf("dlq: partitions of %s: %w", cfg.DLQTopic, err)
	}
	type span struct {
		pom        sarama.PartitionOffsetManager
		partition  int32
		start, end int64
	}
	var spans []span
	var total int64
	for _, p := range partitions {
		// Not closed one by one: a partition offset manager's Close waits for
		// the next auto-commit tick; Commit and the manager's Close flush all.
		pom, err := offsets.ManagePartition(cfg.DLQTopic, p)
		if err != nil {
			return Report{}, fmt.Errorf("dlq: offset of partition %d: %w", p, err)
		}
		start, _ := pom.NextOffset()
		oldest, err := client.GetOffset(cfg.DLQTopic, p, sarama.OffsetOldest)
		if err != nil {
			return Report{}, err
		}
		end, err := client.GetOffset(cfg.DLQTopic, p, sarama.OffsetNewest)
		if err != nil {
			return Report{}, err
		}
		start = max(start, oldest)
		if cfg.Until != nil {
			until, ok := cfg.Until[Position{cfg.DLQTopic, p}]
			if !ok {
				until = start
			}
			end = min(end, until)
		}
		if start < end {
			spans = append(spans, span{pom, p, start, end})
			total += end - start
		}
	}

	rep := newReport()
	var done int64
	var errs []error
	for _, sp := range spans {
		rep.Ends[Position{cfg.DLQTopic, sp.partition}] = sp.end
		// A partition that fails (a letter that cannot be sent, a read
		// that stops) keeps its letters from there for the next replay;
		// the other partitions go on.
		err := replayPartition(ctx, cfg, consumer, producer, sp.pom, sp.partition, sp.start, sp.end, &rep, func() {
			done++
			if cfg.Progress != nil {
				cfg.Progress(done, total)
			}
		})
		if err != nil {
			errs = append(errs, err)
		}
		if ctx.Err() != nil {
			break
		}
	}
	if !cfg.DryRun {
		offsets.Commit()
	}
	return rep, errors.Join(errs...)
}

// replayPartition replays one partition's letters from start to end,
// marking each as done once it is (never in a dry run).
func replayPartition(ctx context.Context, cfg Config, consumer sarama.Consumer, producer sarama.SyncProducer, pom sarama.PartitionOffsetManager,
	partition int32, start, end int64, rep *Report, step func()) error {
	pc, err := consumer.ConsumePartition(cfg.DLQTopic, partition, start)
	if err != nil {
		return fmt.Errorf("dlq: read %s/%d: %w", cfg.DLQTopic, partition, err)
	}
	defer pc.Close()
	for next := start; next < end; {
		m, err := nextMessage(ctx, pc, cfg.DLQTopic, partition)
		if err != nil {
			return err
		}
		if m.Offset >= end {
			return nil // the letters before end were deleted by retention while read
		}
		if cfg.Filter.MinAge > 0 && cfg.Now().Sub(eventTime(m)) < cfg.Filter.MinAge {
			// Too young for this filter today, not for good: the
			// partition stops here, and the next replay with the same
			// filter starts from this letter.
			rep.NotYet++
			if cfg.Each != nil {
				cfg.Each(entryOf(m), NotYet)
			}
			return nil
		}
		if err := replayOne(cfg, producer, m, rep); err != nil {
			return err
		}
		next = m.Offset + 1
		if !cfg.DryRun {
			pom.MarkOffset(next, "")
		}
		step()
	}
	return nil
}

// nextMessage is pc's next message. sarama closes Messages when the
// partition cannot be read on (its next offset was deleted by retention
// while read: ErrOffsetOutOfRange): an error, not a nil message.
func nextMessage(ctx context.Context, pc sarama.PartitionConsumer, topic string, partition int32) (*sarama.ConsumerMessage, error) {
	select {
	case m, ok := <-pc.Messages():
		if !ok {
			return nil, fmt.Errorf("dlq: %s/%d: the read stopped (letters deleted by retention while read?); the next replay goes on from there", topic, partition)
		}
		return m, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// eventTime is when the event itself happened, from the UUIDv7 of its
// event id (eventIDOf): always before its first charge, however often it
// was dead-lettered since (the record's own timestamp is reset each time).
// A letter without one falls back to the record's timestamp.
func eventTime(m *sarama.ConsumerMessage) time.Time {
	if id, err := uuid.Parse(eventIDOf(m.Value, headerOf(m, HeaderEventID))); err == nil && id.Version() == 7 {
		return idempotency.IDTime(id)
	}
	return m.Timestamp
}

func headerOf(m *sarama.ConsumerMessage, key string) string {
	for _, h := range m.Headers {
		if string(h.Key) == key {
			return string(h.Value)
		}
	}
	return ""
}

// eventIDOf is a letter's event id: the one the pipeline decoded
// (header, its [HeaderEventID]), else its payload's event_id; "" when it has
// neither (a letter is often a payload that does not decode).
func eventIDOf(payload []byte, header string) string {
	if header != "" {
		return header
	}
	var doc struct {
		EventID string `json:"event_id"`
	}
	if json.Unmarshal(payload, &doc) != nil {
		return ""
	}
	return doc.EventID
}

// replayOne judges m and, unless it is left out or this is a dry run,
// sends it again; rep and cfg.Each learn the outcome once it is so.
func replayOne(cfg Config, producer sarama.SyncProducer, m *sarama.ConsumerMessage, rep *Report) error {
	e := entryOf(m)
	tell := func(o Outcome) {
		if cfg.Each != nil {
			cfg.Each(e, o)
		}
	}
	if !cfg.Filter.Matches(e, cfg.Now()) {
		rep.Filtered++
		tell(Filtered)
		return nil
	}
	if cfg.MaxAge > 0 && cfg.Now().Sub(eventTime(m)) > cfg.MaxAge {
		rep.SkippedStale++
		tell(SkippedStale)
		return nil
	}
	if cfg.SkipVerdicts && e.Verdict {
		rep.SkippedVerdicts++
		tell(SkippedVerdict)
		return nil
	}
	topic := cfg.Topic
	var key sarama.Encoder
	var headers []sarama.RecordHeader
	for _, h := range m.Headers {
		switch string(h.Key) {
		case middleware.PoisonedTopicKey:
			if len(h.Value) > 0 {
				topic = string(h.Value)
			}
		case "kafka_key":
			if len(h.Value) > 0 {
				key = sarama.ByteEncoder(h.Value)
			}
		}
		if !dropped[string(h.Key)] {
			headers = append(headers, *h)
		}
	}
	headers = append(headers, sarama.RecordHeader{Key: []byte(HeaderReplayedFrom),
		Value: []byte(m.Topic + "/" + strconv.Itoa(int(m.Partition)) + "/" + strconv.FormatInt(m.Offset, 10))})
	if !cfg.DryRun {
		if _, _, err := producer.SendMessage(&sarama.ProducerMessage{Topic: topic, Key: key, Value: sarama.ByteEncoder(m.Value), Headers: headers}); err != nil {
			return fmt.Errorf("dlq: republish %s/%d/%d to %s: %w", m.Topic, m.Partition, m.Offset, topic, err)
		}
	}
	rep.Replayed++
	rep.ByTopic[topic]++
	tell(Replayed)
	return nil
}

// Route is a topic and the dead-letter topic of its letters.
type Route struct {
	Topic, DLQTopic string
}

// ReplayRoutes runs [Replay] for each route in turn (cfg's Topic and
// DLQTopic are each route's) and adds up their reports: what app dlq replay
// and the console's replay of a filtered group both run. A dead-letter
// topic two routes share is replayed once (its letters say which topic
// each goes back to). A route that fails does not stop the others: the
// error joins every route's.
func ReplayRoutes(ctx context.Context, cfg Config, routes []Route) (Report, error) {
	total := newReport()
	var errs []error
	seen := map[string]bool{}
	for _, r := range routes {
		if seen[r.DLQTopic] {
			continue
		}
		seen[r.DLQTopic] = true
		cfg.Topic, cfg.DLQTopic = r.Topic, r.DLQTopic
		rep, err := Replay(ctx, cfg)
		total.add(rep)
		if err != nil {
			errs = append(errs, err)
		}
		if ctx.Err() != nil {
			break
		}
	}
	return total, errors.Join(errs...)
}

func (r *Report) add(o Report) {
	r.Replayed += o.Replayed
	r.SkippedStale += o.SkippedStale
	r.Filtered += o.Filtered
	r.NotYet += o.NotYet
	r.SkippedVerdicts += o.SkippedVerdicts
	for t, n := range o.ByTopic {
		r.ByTopic[t] += n
	}
	maps.Copy(r.Ends, o.Ends)
}

// ReplayLetter republishes the one letter at partition and offset of
// cfg.DLQTopic, if cfg's Filter selects it and it is within cfg.MaxAge (the
// report says which). It moves no replay progress: a later [Replay] that
// reaches it republishes it again, a duplicate the consumers' claims make
// harmless, never a letter lost.
func ReplayLetter(ctx context.Context, cfg Config, partition int32, offset int64) (Report, Entry, error) {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if len(cfg.Brokers) == 0 || cfg.DLQTopic == "" || cfg.Topic == "" || cfg.Sarama == nil {
		return Report{}, Entry{}, errors.New("dlq: Brokers, Sarama, DLQTopic and Topic are required")
	}
	m, err := readOne(ctx, cfg, partition, offset)
	if err != nil {
		return Report{}, Entry{}, err
	}
	pc := *cfg.Sarama
	pc.Producer.Return.Successes = true
	producer, err := sarama.NewSyncProducer(cfg.Brokers, &pc)
	if err != nil {
		return Report{}, Entry{}, fmt.Errorf("dlq: producer: %w", err)
	}
	defer producer.Close()
	rep := newReport()
	err = replayOne(cfg, producer, m, &rep)
	return rep, entryOf(m), err
}

// readerConfig is a consumer's configuration on the connection settings
// (version, client id, TLS/SASL) of the caller's producer configuration.
func readerConfig(s *sarama.Config) *sarama.Config {
	cc := sarama.NewConfig()
	cc.Version = s.Version
	cc.ClientID = s.ClientID
	cc.Net = s.Net
	// Reading a dead-letter topic that does not exist must not make it,
	// with the broker's defaults, where auto-creation is on.
	cc.Metadata.AllowAutoTopicCreation = false
	return cc
}

// readOne reads the record at partition and offset of cfg.DLQTopic.
func readOne(ctx context.Context, cfg Config, partition int32, offset int64) (*sarama.ConsumerMessage, error) {
	client, err := sarama.NewClient(cfg.Brokers, readerConfig(cfg.Sarama))
	if err != nil {
		return nil, fmt.Errorf("dlq: connect: %w", err)
	}
	defer client.Close()
	// An offset at or past the end would wait for a letter not yet written,
	// holding a Kafka consumer for as long as the caller waits.
	end, err := client.GetOffset(cfg.DLQTopic, partition, sarama.OffsetNewest)
	if err != nil {
		return nil, fmt.Errorf("dlq: end of %s/%d: %w", cfg.DLQTopic, partition, err)
	}
	if offset < 0 || offset >= end {
		// A negative offset is sarama's "newest": the same wait.
		return nil, fmt.Errorf("dlq: %s/%d@%d: no such letter (the partition ends at %d)", cfg.DLQTopic, partition, offset, end)
	}
	consumer, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		return nil, fmt.Errorf("dlq: consumer: %w", err)
	}
	defer consumer.Close()
	pc, err := consumer.ConsumePartition(cfg.DLQTopic, partition, offset)
	if err != nil {
		return nil, fmt.Errorf("dlq: read %s/%d@%d: %w", cfg.DLQTopic, partition, offset, err)
	}
	defer pc.Close()
	m, err := nextMessage(ctx, pc, cfg.DLQTopic, partition)
	if err != nil {
		return nil, err
	}
	if m.Offset != offset {
		// Compacted or deleted: the next record is another letter.
		return nil, fmt.Errorf("dlq: %s/%d@%d is gone (retention removed it)", cfg.DLQTopic, partition, offset)
	}
	return m, nil
}

// ReadLetter returns the letter at partition and offset of cfg.DLQTopic
// (cfg's Brokers and Sarama reach it), for a person to look at.
func ReadLetter(ctx context.Context, cfg Config, partition int32, offset int64) (Entry, error) {
	if len(cfg.Brokers) == 0 || cfg.DLQTopic == "" || cfg.Sarama == nil {
		return Entry{}, errors.New("dlq: Brokers, Sarama and DLQTopic are required")
	}
	m, err := readOne(ctx, cfg, partition, offset)
	if err != nil {
		return Entry{}, err
	}
	return entryOf(m), nil
}
