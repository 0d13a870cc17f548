package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/IBM/sarama"

	"github.com/once-dev/once/pipeline"
)

// Where an event's time goes at an offered load (issue 32): the bench's
// producer stamps each event with the time it made it (producedHeader), the
// broker stamps the record with the time it appended it (the offered-load
// topics' message.timestamp.type is LogAppendTime: the record's timestamp is
// then the broker's, and sarama's ConsumerMessage.Timestamp carries it), the
// group's hooks see its delivery and its claim's commit, and the group's
// offset commit past it is read from the coordinator's own log
// (__consumer_offsets, its commit_timestamp). Four parts, each the span
// between two of these instants: the first three add up to the latency the
// offered-load table reports, the fourth comes after it.
//
// Every instant is a wall-clock time (the producer's, the broker's and the
// consumer's: the same machine's clock), so the spans add up exactly; the
// broker's two are to the millisecond, which is the split's resolution.

// producedHeader is the Kafka header of an offered-load event that says when
// the bench's producer made it, in nanoseconds since the Unix epoch.
const producedHeader = "once-bench-produced"

// warmupHeader marks an offered load's warm-up event: consumed like the
// others, left out of the figures.
const warmupHeader = "once-bench-warmup"

// splitParts name the parts of an event's latency, in order.
var splitParts = []string{
	"production -> broker's append",
	"append -> delivery to the group",
	"delivery -> claim's commit",
	"claim's commit -> offset's commit",
}

// eventTimes are the instants of one event of an offered-load run, and the
// parts of its latency between them.
type eventTimes struct {
	Partition int32 `json:"partition"`
	Offset    int64 `json:"offset"`
	// Produced: the bench's producer made it (its header, to the ns).
	Produced time.Time `json:"produced"`
	// Appended: the broker appended it to the log (LogAppendTime, to the ms).
	Appended time.Time `json:"appended"`
	// Delivered: its group's chain received it (Hooks.OnDelivered).
	Delivered time.Time `json:"delivered"`
	// Committed: its claim and effect committed (Hooks.OnResult).
	Committed time.Time `json:"committed"`
	// OffsetCommitted: the coordinator took the group's commit of an offset
	// past it (the commit's commit_timestamp, to the ms).
	OffsetCommitted time.Time `json:"offset_committed"`
	// Latency is the event's latency as the offered-load table counts it,
	// production to the claim's commit, as it was measured.
	Latency time.Duration `json:"latency_ns"`
	// Parts are the spans between the instants, in splitParts' order.
	Parts []time.Duration `json:"parts_ns"`
}

func (e *eventTimes) split() {
	e.Parts = []time.Duration{e.Appended.Sub(e.Produced), e.Delivered.Sub(e.Appended), e.Committed.Sub(e.Delivered), e.OffsetCommitted.Sub(e.Committed)}
}

// splitFigure is one part's percentiles over a run's events.
type splitFigure struct {
	Part   string  `json:"part"`
	P50ms  float64 `json:"p50_ms"`
	P99ms  float64 `json:"p99_ms"`
	P999ms float64 `json:"p999_ms"`
}

// percentiles are the p50, p99 and p99.9 of ds in milliseconds, to the
// microsecond; ds is sorted in place.
func percentiles(ds []time.Duration) (p50, p99, p999 float64) {
	if len(ds) == 0 {
		return 0, 0, 0
	}
	slices.Sort(ds)
	pct := func(p float64) float64 {
		return float64(ds[min(len(ds)-1, int(p*float64(len(ds))))].Microseconds()) / 1000
	}
	return pct(0.50), pct(0.99), pct(0.999)
}

// splitFigures are the parts' percentiles over events.
func splitFigures(events []*eventTimes) []splitFigure {
	out := make([]splitFigure, len(splitParts))
	for i, name := range splitParts {
		ds := make([]time.Duration, 0, len(events))
		for _, e := range events {
			ds = append(ds, e.Parts[i])
		}
		out[i].Part = name
		out[i].P50ms, out[i].P99ms, out[i].P999ms = percentiles(ds)
	}
	return out
}

// producedAt reads producedHeader from a delivery's headers.
func producedAt(headers map[string]string) (time.Time, error) {
	v, ok := headers[producedHeader]
	if !ok {
		return time.Time{}, fmt.Errorf("the event has no %s header (app bench's offered-load producer sets it)", producedHeader)
	}
	ns, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return time.Time{}, fmt.Errorf("the event's %s header %q: %w", producedHeader, v, err)
	}
	return time.Unix(0, ns), nil
}

// logAppendTimeTopic creates topic with the broker's append time as its
// records' timestamps, or checks that an existing one has it.
func logAppendTimeTopic(admin sarama.ClusterAdmin, topic string, partitions int32) error {
	t := "LogAppendTime"
	err := admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: partitions, ReplicationFactor: 1,
		ConfigEntries: map[string]*string{"message.timestamp.type": &t}}, false)
	if errors.Is(err, sarama.ErrTopicAlreadyExists) {
		return checkLogAppendTime(admin, topic)
	}
	if err != nil {
		return fmt.Errorf("create topic %s: %w", topic, err)
	}
	return nil
}

// checkLogAppendTime fails unless topic's records carry the broker's append
// time: the split's second instant.
func checkLogAppendTime(admin sarama.ClusterAdmin, topic string) error {
	entries, err := admin.DescribeConfig(sarama.ConfigResource{Type: sarama.TopicResource, Name: topic, ConfigNames: []string{"message.timestamp.type"}})
	if err != nil {
		return fmt.Errorf("describe topic %s: %w", topic, err)
	}
	for _, e := range entries {
		if e.Name == "message.timestamp.type" && e.Value == "LogAppendTime" {
			return nil
		}
	}
	return fmt.Errorf("--split: topic %s's message.timestamp.type is not LogAppendTime, so its records do not say when the broker appended them (app bench makes its offered-load topics so)", topic)
}

// kafkaReader is a plain client and consumer for the split's reading, after
// the events are done.
func (b *benchRunCmd) kafkaReader() (sarama.Client, sarama.Consumer, error) {
	version, err := pipeline.ParseKafkaVersion(b.KafkaVersion)
	if err != nil {
		return nil, nil, fmt.Errorf("--kafka-version: %w", err)
	}
	cfg := sarama.NewConfig()
	cfg.Version = version
	// A partition read to its end waits this long for more, at most.
	cfg.Consumer.MaxWaitTime = 10 * time.Millisecond
	client, err := sarama.NewClient(b.Brokers, cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("kafka client: %w", err)
	}
	consumer, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		client.Close()
		return nil, nil, fmt.Errorf("kafka consumer: %w", err)
	}
	return client, consumer, nil
}

// splitTimes fills in each event's append and offset commit, read from the
// broker once every event is done (nothing of it runs while they are
// measured), and its parts. It waits for the group's offset commits to pass
// every event (the pipeline is still running, and commits every
// CommitInterval).
func (b *benchRunCmd) splitTimes(ctx context.Context, events []*eventTimes) error {
	client, consumer, err := b.kafkaReader()
	if err != nil {
		return err
	}
	defer client.Close()
	defer consumer.Close()
	partitions, err := client.Partitions(b.Topic)
	if err != nil {
		return fmt.Errorf("partitions of %s: %w", b.Topic, err)
	}
	ends := map[int32]int64{}
	for _, p := range partitions {
		if ends[p], err = client.GetOffset(b.Topic, p, sarama.OffsetNewest); err != nil {
			return fmt.Errorf("end of %s/%d: %w", b.Topic, p, err)
		}
	}
	since := time.Now()
	for _, e := range events {
		if e.Produced.Before(since) {
			since = e.Produced
		}
	}
	// The coordinator's clock is this machine's; a second's margin all the same.
	commits, err := readOffsetCommits(ctx, client, consumer, b.Group, b.Topic, ends, since.Add(-time.Second))
	if err != nil {
		return err
	}
	appended, err := readAppendTimes(consumer, b.Topic, ends)
	if err != nil {
		return err
	}
	for _, e := range events {
		a, ok := appended[partitionOffset{e.Partition, e.Offset}]
		if !ok {
			return fmt.Errorf("--split: event %s/%d/%d was not read back from the topic", b.Topic, e.Partition, e.Offset)
		}
		e.Appended = a
		// The first commit of the partition past the event: commits of one
		// partition come in order, each of the next offset to read.
		cs := commits[e.Partition]
		i := slices.IndexFunc(cs, func(c offsetCommit) bool { return c.offset > e.Offset })
		if i < 0 {
			return fmt.Errorf("--split: no offset commit of group %s past %s/%d/%d", b.Group, b.Topic, e.Partition, e.Offset)
		}
		e.OffsetCommitted = cs[i].at
		e.split()
	}
	return nil
}

type partitionOffset struct {
	partition int32
	offset    int64
}

// readAppendTimes reads topic's records up to ends, and returns each one's
// timestamp: on a LogAppendTime topic, when the broker appended it.
func readAppendTimes(consumer sarama.Consumer, topic string, ends map[int32]int64) (map[partitionOffset]time.Time, error) {
	out := map[partitionOffset]time.Time{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	errs := make(chan error, len(ends))
	for p, end := range ends {
		if end <= 0 {
			continue
		}
		pc, err := consumer.ConsumePartition(topic, p, sarama.OffsetOldest)
		if err != nil {
			return nil, fmt.Errorf("read %s/%d: %w", topic, p, err)
		}
		wg.Go(func() {
			defer pc.Close()
			timeout := time.After(time.Minute)
			for {
				select {
				case m, ok := <-pc.Messages():
					if !ok {
						errs <- fmt.Errorf("read %s/%d: its consumer stopped", topic, p)
						return
					}
					mu.Lock()
					out[partitionOffset{p, m.Offset}] = m.Timestamp
					mu.Unlock()
					if m.Offset >= end-1 {
						return
					}
				case <-timeout:
					errs <- fmt.Errorf("read %s/%d: not at its end %d within a minute", topic, p, end)
					return
				}
			}
		})
	}
	wg.Wait()
	select {
	case err := <-errs:
		return nil, err
	default:
		return out, nil
	}
}

// offsetCommit is one commit of a partition's offset, as the coordinator
// recorded it: the next offset to read, and when.
type offsetCommit struct {
	offset int64
	at     time.Time
}

// consumerOffsetsTopic is Kafka's own log of the groups' offset commits.
const consumerOffsetsTopic = "__consumer_offsets"

// readOffsetCommits reads group's offset commits of topic from the
// coordinators' log, from since on, until every partition's last commit is
// at its end (ends), or a minute passed: the group commits every
// CommitInterval (a second by default) while it runs.
func readOffsetCommits(ctx context.Context, client sarama.Client, consumer sarama.Consumer, group, topic string, ends map[int32]int64, since time.Time) (map[int32][]offsetCommit, error) {
	partitions, err := client.Partitions(consumerOffsetsTopic)
	if err != nil {
		return nil, fmt.Errorf("partitions of %s: %w", consumerOffsetsTopic, err)
	}
	msgs := make(chan *sarama.ConsumerMessage)
	stop := make(chan struct{})
	defer close(stop)
	for _, p := range partitions {
		// The first record at or after since; none yet: what comes next.
		start, err := client.GetOffset(consumerOffsetsTopic, p, since.UnixMilli())
		if err != nil {
			return nil, fmt.Errorf("offset of %s/%d at %s: %w", consumerOffsetsTopic, p, since, err)
		}
		if start < 0 {
			start = sarama.OffsetNewest
		}
		pc, err := consumer.ConsumePartition(consumerOffsetsTopic, p, start)
		if err != nil {
			return nil, fmt.Errorf("read %s/%d: %w", consumerOffsetsTopic, p, err)
		}
		go func() {
			defer pc.Close()
			for {
				select {
				case m, ok := <-pc.Messages():
					if !ok {
						return
					}
					select {
					case msgs <- m:
					case <-stop:
						return
					}
				case <-stop:
					return
				}
			}
		}()
	}
	commits := map[int32][]offsetCommit{}
	covered := func() bool {
		for p, end := range ends {
			cs := commits[p]
			if end > 0 && (len(cs) == 0 || cs[len(cs)-1].offset < end) {
				return false
			}
		}
		return true
	}
	timeout := time.After(time.Minute)
	for !covered() {
		select {
		case m := <-msgs:
			c, err := parseOffsetCommit(m.Key, m.Value)
			if err != nil {
				return nil, fmt.Errorf("%s/%d/%d: %w", consumerOffsetsTopic, m.Partition, m.Offset, err)
			}
			if c == nil || c.group != group || c.topic != topic {
				continue
			}
			commits[c.partition] = append(commits[c.partition], offsetCommit{c.offset, c.at})
		case <-timeout:
			return nil, fmt.Errorf("--split: group %s's offsets of %s were not committed to their ends %v within a minute (commits read: %v)", group, topic, ends, lastCommits(commits))
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return commits, nil
}

func lastCommits(commits map[int32][]offsetCommit) map[int32]int64 {
	out := map[int32]int64{}
	for p, cs := range commits {
		out[p] = cs[len(cs)-1].offset
	}
	return out
}

// committedOffset is an offset commit record of __consumer_offsets.
type committedOffset struct {
	group, topic string
	partition    int32
	offset       int64
	at           time.Time
}

// parseOffsetCommit decodes a record of __consumer_offsets: nil for one that
// is not an offset commit (a group's metadata, a deleted commit). The
// record formats are Kafka's OffsetCommitKey (versions 0 and 1) and
// OffsetCommitValue (versions 0 to 4).
func parseOffsetCommit(key, value []byte) (*committedOffset, error) {
	errShort := errors.New("an offset commit record shorter than its format")
	if len(key) < 2 || value == nil {
		return nil, nil
	}
	if v := binary.BigEndian.Uint16(key); v > 1 {
		return nil, nil // 2: a group's metadata; later: the new protocol's records
	}
	k := key[2:]
	str := func(b *[]byte) (string, bool) {
		if len(*b) < 2 {
			return "", false
		}
		n := int(int16(binary.BigEndian.Uint16(*b)))
		if n < 0 || len(*b) < 2+n {
			return "", false
		}
		s := string((*b)[2 : 2+n])
		*b = (*b)[2+n:]
		return s, true
	}
	c := &committedOffset{}
	var ok bool
	if c.group, ok = str(&k); !ok {
		return nil, errShort
	}
	if c.topic, ok = str(&k); !ok || len(k) < 4 {
		return nil, errShort
	}
	c.partition = int32(binary.BigEndian.Uint32(k))

	if len(value) < 10 {
		return nil, errShort
	}
	version := binary.BigEndian.Uint16(value)
	if version > 4 {
		return nil, fmt.Errorf("an offset commit of value version %d, newer than this reader's 4", version)
	}
	c.offset = int64(binary.BigEndian.Uint64(value[2:]))
	v := value[10:]
	if version >= 3 { // the leader epoch
		if len(v) < 4 {
			return nil, errShort
		}
		v = v[4:]
	}
	if version >= 4 { // flexible: a compact string, its length + 1 as an unsigned varint
		n, size := binary.Uvarint(v)
		if size <= 0 || n == 0 || uint64(len(v)-size) < n-1 {
			return nil, errShort
		}
		v = v[size+int(n-1):]
	} else {
		if _, ok := str(&v); !ok {
			return nil, errShort
		}
	}
	if len(v) < 8 {
		return nil, errShort
	}
	c.at = time.UnixMilli(int64(binary.BigEndian.Uint64(v)))
	return c, nil
}

// splitFileDir fails unless --split-file's folder exists: the file is
// written once the measurement is done, which is too late to find out.
func splitFileDir(path string) error {
	if path == "" {
		return nil
	}
	if fi, err := os.Stat(filepath.Dir(path)); err != nil || !fi.IsDir() {
		return fmt.Errorf("--split-file %s: its folder %s does not exist", path, filepath.Dir(path))
	}
	return nil
}

// writeSplitFile writes each event's instants and parts to path, a JSON
// line each.
func writeSplitFile(path string, events []*eventTimes) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	enc := json.NewEncoder(f)
	for _, e := range events {
		if err := enc.Encode(e); err != nil {
			f.Close()
			return err
		}
	}
	return f.Close()
}
