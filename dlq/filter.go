package dlq

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
)

// Filter selects dead letters by where they came from, why, and how old
// their event is. The zero Filter selects every letter.
type Filter struct {
	// Topic the letter was consumed from (its topic_poisoned header).
	Topic string
	// Group that dead-lettered it (its handler_poisoned header).
	Group string
	// Reason: a regular expression the reason must match.
	Reason *regexp.Regexp
	// ReasonSum: the reason's first line must have this [SumReason]. It
	// selects the letters of one reason without writing the reason down
	// (the console's links carry it, so no reason is in a URL).
	ReasonSum string
	// MinAge and MaxAge bound the event's age (the time in its UUIDv7
	// event_id, else the record's timestamp); 0 leaves a side open.
	MinAge, MaxAge time.Duration
}

// IsZero reports whether f selects every letter.
func (f Filter) IsZero() bool {
	return f.Topic == "" && f.Group == "" && f.Reason == nil && f.ReasonSum == "" && f.MinAge == 0 && f.MaxAge == 0
}

func (f Filter) key() string {
	reason := ""
	if f.Reason != nil {
		reason = f.Reason.String()
	}
	key := fmt.Sprintf("topic=%s group=%s reason=%s age=%s..%s", f.Topic, f.Group, reason, f.MinAge, f.MaxAge)
	if f.ReasonSum != "" {
		// Only then: a filter without it keeps the progress group it had.
		key += " reason_sum=" + f.ReasonSum
	}
	return key
}

// SumReason is the hex SHA-256 of a reason's first line, spaces around it
// trimmed: what [Filter.ReasonSum] selects.
func SumReason(reason string) string {
	line, _, _ := strings.Cut(strings.TrimSpace(reason), "\n")
	sum := sha256.Sum256([]byte(strings.TrimSpace(line)))
	return hex.EncodeToString(sum[:])
}

// progressGroup is the consumer group that keeps a replay's progress: one
// per filter, so that a filtered replay never marks as done the letters it
// left out (an unfiltered replay later still finds them), and each filter
// resumes where it stopped. A letter two filters select is replayed twice,
// which the consumers' claims make harmless.
func progressGroup(group string, f Filter) string {
	if f.IsZero() {
		return group
	}
	sum := sha256.Sum256([]byte(f.key()))
	return group + ".filter-" + hex.EncodeToString(sum[:6])
}

// Entry is a dead letter as [List] reports it.
type Entry struct {
	DLQTopic  string
	Partition int32
	Offset    int64
	EventID   string // "" when the payload has none
	Topic     string // where it was consumed from
	Group     string
	Reason    string
	// Verdict: its group recorded its verdict with the event's claim
	// ([HeaderVerdict]), and a replay cannot change it.
	Verdict   bool
	EventTime time.Time // from the event id, else the record's timestamp
	LetterAt  time.Time // when it reached the dead-letter topic
	Payload   []byte
	Headers   map[string]string
}

// Matches reports whether f selects e, at now.
func (f Filter) Matches(e Entry, now time.Time) bool {
	age := now.Sub(e.EventTime)
	return (f.Topic == "" || e.Topic == f.Topic) && (f.Group == "" || e.Group == f.Group) &&
		(f.Reason == nil || f.Reason.MatchString(e.Reason)) && (f.ReasonSum == "" || SumReason(e.Reason) == f.ReasonSum) &&
		(f.MinAge == 0 || age >= f.MinAge) && (f.MaxAge == 0 || age <= f.MaxAge)
}

func entryOf(m *sarama.ConsumerMessage) Entry {
	e := Entry{DLQTopic: m.Topic, Partition: m.Partition, Offset: m.Offset, EventTime: eventTime(m), LetterAt: m.Timestamp,
		Payload: m.Value, Headers: make(map[string]string, len(m.Headers))}
	for _, h := range m.Headers {
		e.Headers[string(h.Key)] = string(h.Value)
		switch string(h.Key) {
		case middleware.PoisonedTopicKey:
			e.Topic = string(h.Value)
		case middleware.PoisonedHandlerKey:
			e.Group = string(h.Value)
		case middleware.ReasonForPoisonedKey:
			e.Reason = string(h.Value)
		}
	}
	e.EventID = eventIDOf(m.Value, e.Headers[HeaderEventID])
	e.Verdict = e.Headers[HeaderVerdict] == VerdictRecorded
	return e
}

// ListConfig configures [List].
type ListConfig struct {
	Brokers   []string
	Sarama    *sarama.Config
	DLQTopics []string
	Filter    Filter
	// Limit: at most this many entries, the newest kept. Default 1000.
	Limit int
	Now   func() time.Time
}

// List reads the dead-letter topics from their oldest offset to their end
// as it is when List starts, and returns the letters the filter selects,
// oldest first. It commits nothing: listing never moves a replay.
func List(ctx context.Context, cfg ListConfig) ([]Entry, error) {
	if cfg.Limit == 0 {
		cfg.Limit = 1000
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if len(cfg.Brokers) == 0 || cfg.Sarama == nil || len(cfg.DLQTopics) == 0 {
		return nil, errors.New("dlq: Brokers, Sarama and DLQTopics are required")
	}
	cc := readerConfig(cfg.Sarama)
	client, err := sarama.NewClient(cfg.Brokers, cc)
	if err != nil {
		return nil, fmt.Errorf("dlq: connect: %w", err)
	}
	defer client.Close()
	consumer, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		return nil, fmt.Errorf("dlq: consumer: %w", err)
	}
	defer consumer.Close()
	now := cfg.Now()
	var out []Entry
	for _, topic := range cfg.DLQTopics {
		partitions, err := client.Partitions(topic)
		if errors.Is(err, sarama.ErrUnknownTopicOrPartition) {
			continue // no letter yet: the topic is made on the first one
		}
		if err != nil {
			return nil, fmt.Errorf("dlq: partitions of %s: %w", topic, err)
		}
		for _, p := range partitions {
			start, err := client.GetOffset(topic, p, sarama.OffsetOldest)
			if err != nil {
				return nil, err
			}
			end, err := client.GetOffset(topic, p, sarama.OffsetNewest)
			if err != nil {
				return nil, err
			}
			if start >= end {
				continue
			}
			pc, err := consumer.ConsumePartition(topic, p, start)
			if err != nil {
				return nil, fmt.Errorf("dlq: read %s/%d: %w", topic, p, err)
			}
			for next := start; next < end; {
				m, err := nextMessage(ctx, pc, topic, p)
				if err != nil {
					pc.Close()
					return newest(out, cfg.Limit), err
				}
				if e := entryOf(m); cfg.Filter.Matches(e, now) {
					out = append(out, e)
					if len(out) >= 2*cfg.Limit {
						// Entries carry their payloads: a topic of
						// millions of letters must not be held in memory
						// (the console lists from the consumer's process).
						out = newest(out, cfg.Limit)
					}
				}
				next = m.Offset + 1
			}
			pc.Close()
		}
	}
	return newest(out, cfg.Limit), nil
}

// newest sorts entries oldest first and keeps the newest limit of them.
func newest(entries []Entry, limit int) []Entry {
	sort.SliceStable(entries, func(i, j int) bool { return entries[i].LetterAt.Before(entries[j].LetterAt) })
	if len(entries) > limit {
		entries = slices.Clone(entries[len(entries)-limit:])
	}
	return entries
}

// ParseReason compiles a --reason filter, naming the flag in its error.
func ParseReason(expr string) (*regexp.Regexp, error) {
	if strings.TrimSpace(expr) == "" {
		return nil, nil
	}
	re, err := regexp.Compile(expr)
	if err != nil {
		return nil, fmt.Errorf("--reason %q: %w", expr, err)
	}
	return re, nil
}
