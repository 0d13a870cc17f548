package dlq

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/internal/durable"
	"github.com/once-dev/once/internal/kafkasend"
	"github.com/once-dev/once/internal/retrylog"
	"github.com/once-dev/once/pgdb"
	"github.com/once-dev/once/schema"
)

// Letter is a dead letter: the message as it arrived, and headers that say
// why and where it failed.
type Letter struct {
	// Topic is the dead-letter topic it goes to.
	Topic   string
	Key     []byte
	Payload []byte
	Headers map[string]string
}

// Store parks dead letters in a database table and drains them to Kafka. A
// dead letter is written to the table first (in the very transaction that
// rejected the message, where there is one), so it survives a crash, a
// broker outage, a missing dead-letter topic or a refused publish; each row
// is published on its own and deleted only after Kafka acknowledged it, so
// one letter that cannot be published holds up no other, and none is lost.
type Store struct {
	table   string
	sources string
	nudge   chan struct{}
}

// Source is where a dead-lettered message was read: a consumer group's
// delivery of one Kafka record.
type Source struct {
	Group     string
	Topic     string
	Partition int32
	Offset    int64
}

// DefaultSourceRetention is how long [Store.ParkFrom] remembers the
// messages it dead-lettered: as long as claims are kept by default, which is
// as far back as an offset reset is expected to reach.
const DefaultSourceRetention = 7 * 24 * time.Hour

// NewStore validates the names of the store's tables (schema.Config's
// DeadLetters) and returns the store. It touches no database.
func NewStore(tables schema.Config) (*Store, error) {
	if err := tables.Validate(); err != nil {
		return nil, err
	}
	return &Store{table: tables.DeadLettersTable().Qualified, sources: tables.DeadLetterSourcesTable().Qualified,
		nudge: make(chan struct{}, 1)}, nil
}

// storedHeader keeps a header's bytes as they are: JSON would replace
// invalid UTF-8, and []byte is base64 in JSON.
type storedHeader struct {
	Key   []byte `json:"k"`
	Value []byte `json:"v"`
}

func encodeHeaders(h map[string]string) ([]byte, error) {
	list := make([]storedHeader, 0, len(h))
	for k, v := range h {
		list = append(list, storedHeader{Key: []byte(k), Value: []byte(v)})
	}
	return json.Marshal(list)
}

func decodeHeaders(b []byte) (map[string]string, error) {
	var list []storedHeader
	if err := json.Unmarshal(b, &list); err != nil {
		// Letters parked before headers kept their bytes: a plain object.
		var plain map[string]string
		if json.Unmarshal(b, &plain) == nil {
			return plain, nil
		}
		return nil, err
	}
	h := make(map[string]string, len(list))
	for _, kv := range list {
		h[string(kv.Key)] = string(kv.Value)
	}
	return h, nil
}

// Park writes letters in tx: the transaction of the verdict they report,
// or one of their own (pgdb.InTx).
func (s *Store) Park(ctx context.Context, tx pgx.Tx, letters ...Letter) error {
	for _, l := range letters {
		headers, err := encodeHeaders(l.Headers)
		if err != nil {
			return fmt.Errorf("dlq: encode headers: %w", err)
		}
		// Durable before it returns: the message is acknowledged right after.
		if _, err := tx.Exec(ctx, `INSERT INTO `+s.table+` (topic, key, payload, headers) SELECT $1, $2, $3, $4 FROM (SELECT `+durable.RaiseSynchronousCommit+`) AS durable`,
			l.Topic, l.Key, l.Payload, headers); err != nil {
			return fmt.Errorf("dlq: park a dead letter for %s: %w", l.Topic, err)
		}
	}
	return nil
}

// parkFromSQL parks a letter only when its source was not dead-lettered
// before with the same bytes: one statement, so that the record of the
// source and the letter commit together or not at all.
const parkFromSQL = `WITH first AS (
  INSERT INTO %[1]s AS s (consumer_group, topic, kafka_partition, kafka_offset, payload_sha256)
  VALUES ($5, $6, $7, $8, $9)
  ON CONFLICT (consumer_group, topic, kafka_partition, kafka_offset)
  DO UPDATE SET payload_sha256 = EXCLUDED.payload_sha256, dead_lettered_at = now()
  WHERE s.payload_sha256 <> EXCLUDED.payload_sha256
  RETURNING 1
)
INSERT INTO %[2]s (topic, key, payload, headers)
SELECT $1, $2, $3, $4 FROM first, (SELECT ` + durable.RaiseSynchronousCommit + `) AS durable`

// ParkFrom parks the letter of the message read at src, unless that very
// message (the same bytes at the same place, for the same group) was
// dead-lettered before: an offset reset or a rebalance that re-reads a
// partition delivers it again, and its letter is already on its way or on
// its topic. It reports whether it parked the letter.
func (s *Store) ParkFrom(ctx context.Context, tx pgx.Tx, src Source, l Letter) (bool, error) {
	headers, err := encodeHeaders(l.Headers)
	if err != nil {
		return false, fmt.Errorf("dlq: encode headers: %w", err)
	}
	sum := sha256.Sum256(l.Payload)
	tag, err := tx.Exec(ctx, fmt.Sprintf(parkFromSQL, s.sources, s.table), l.Topic, l.Key, l.Payload, headers,
		src.Group, src.Topic, src.Partition, src.Offset, sum[:])
	if err != nil {
		return false, fmt.Errorf("dlq: park a dead letter for %s: %w", l.Topic, err)
	}
	return tag.RowsAffected() == 1, nil
}

// PruneSources forgets dead-lettered sources older than olderThan, in
// batches, and returns how many it forgot.
func (s *Store) PruneSources(ctx context.Context, db pgdb.DB, olderThan time.Duration) (int64, error) {
	var total int64
	for {
		tag, err := db.Exec(ctx, `DELETE FROM `+s.sources+` WHERE ctid IN (SELECT ctid FROM `+s.sources+`
WHERE dead_lettered_at < now() - make_interval(secs => $1) LIMIT 5000)`, olderThan.Seconds())
		if err != nil {
			return total, fmt.Errorf("dlq: prune dead-lettered sources: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < 5000 {
			return total, nil
		}
	}
}

// Nudge tells a running [Store.Drain] loop that letters are waiting, so it
// does not wait for its next poll.
func (s *Store) Nudge() {
	select {
	case s.nudge <- struct{}{}:
	default:
	}
}

// DrainConfig configures [Store.Drain].
type DrainConfig struct {
	DB       pgdb.DB
	Producer sarama.SyncProducer
	// PollInterval between passes when nothing is nudged. Default 500ms.
	PollInterval time.Duration
	// Lease: a letter taken by a drainer that died is taken again after it;
	// a batch is published well within it, so that two drainers do not take
	// the same letters. Default 60s.
	Lease time.Duration
	// MaxBackoff between two attempts of one letter. Default 30s.
	MaxBackoff time.Duration
	// Topics limits the drainer to letters for these dead-letter topics: a
	// service publishes only to the topics it was configured for (and its
	// principal may be allowed no others), so letters of another service
	// sharing the database, or of a topic since renamed, stay parked for
	// their owner or a person (app dlq list). Empty: every topic.
	Topics []string
	// SourceRetention is how long the sources of dead letters are
	// remembered (see [Store.ParkFrom]); they are forgotten once an hour.
	// Default [DefaultSourceRetention].
	SourceRetention time.Duration
	// OnPublished is called after a letter reached Kafka. Default: none.
	OnPublished func(Letter)
	Logger      *slog.Logger
}

func (cfg *DrainConfig) setDefaults() {
	if cfg.PollInterval == 0 {
		cfg.PollInterval = 500 * time.Millisecond
	}
	if cfg.Lease == 0 {
		cfg.Lease = 60 * time.Second
	}
	if cfg.MaxBackoff == 0 {
		cfg.MaxBackoff = 30 * time.Second
	}
	if cfg.SourceRetention == 0 {
		cfg.SourceRetention = DefaultSourceRetention
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
}

// Drain publishes parked letters until ctx ends: one pass per poll or nudge.
func (s *Store) Drain(ctx context.Context, cfg DrainConfig) {
	cfg.setDefaults()
	s.reportOthers(ctx, cfg)
	t := time.NewTicker(cfg.PollInterval)
	defer t.Stop()
	var pruned time.Time
	// A database that fails the reads is read again after a backoff, with
	// one line per step: not a line every PollInterval.
	steps := retrylog.Steps{First: time.Second, Last: cfg.MaxBackoff}
	host := retrylog.Host(cfg.DB)
	for {
		wait := time.Duration(0)
		if time.Since(pruned) > time.Hour {
			if _, err := s.PruneSources(ctx, cfg.DB, cfg.SourceRetention); err != nil && ctx.Err() == nil {
				cfg.Logger.Warn("dead letters: cannot forget old sources; trying again in an hour", "err", err)
			}
			pruned = time.Now()
		}
		for {
			n, err := s.DrainOnce(ctx, cfg)
			if err != nil && ctx.Err() == nil {
				var since time.Time
				wait, since = steps.Failed()
				level, class, action := retrylog.Class(err)
				cfg.Logger.Log(ctx, level, fmt.Sprintf("dead letters: cannot read the parked ones on database %s: %s; retrying in %s", host, action, wait),
					"database", host, "table", s.table, "error_class", class, "retry_in", wait, "failing_for", time.Since(since).Round(time.Millisecond), "err", err)
			} else if recovered, failing := steps.Worked(); err == nil && recovered {
				cfg.Logger.Info("dead letters: reading the parked ones again", "database", host, "table", s.table, "failing_for", failing)
			}
			if n == 0 || err != nil || ctx.Err() != nil {
				break
			}
		}
		if wait > 0 {
			select {
			case <-ctx.Done():
				return
			case <-time.After(wait):
			}
			continue
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-s.nudge:
		}
	}
}

// reportOthers says, once, which parked letters this drainer leaves to
// another: a letter whose topic no running service drains would otherwise
// wait unseen (once_dead_letters_parked counts it too).
func (s *Store) reportOthers(ctx context.Context, cfg DrainConfig) {
	if len(cfg.Topics) == 0 {
		return
	}
	rows, err := cfg.DB.Query(ctx, `SELECT topic, count(*), min(created_at) FROM `+s.table+` WHERE NOT topic = ANY($1) GROUP BY topic ORDER BY topic`, cfg.Topics)
	if err != nil {
		return // the drain's own reads report the database
	}
	defer rows.Close()
	for rows.Next() {
		var topic string
		var n int64
		var oldest time.Time
		if rows.Scan(&topic, &n, &oldest) != nil {
			return
		}
		cfg.Logger.Warn("dead letters parked for a topic this service does not publish to: they wait for a service configured with it (app dlq list --database-url ...)",
			"dlq", topic, "letters", n, "oldest", oldest)
	}
}

// batch is small: a failing publish takes a second or two of retries, and
// the whole batch must be through long before its lease ends.
const batch = 10

// DrainOnce takes up to a batch of letters that are due, publishes each, and
// returns how many it took.
func (s *Store) DrainOnce(ctx context.Context, cfg DrainConfig) (int, error) {
	cfg.setDefaults()
	rows, err := cfg.DB.Query(ctx, `UPDATE `+s.table+` SET next_attempt_at = now() + make_interval(secs => $1), attempts = attempts + 1
WHERE id IN (SELECT id FROM `+s.table+` WHERE next_attempt_at <= now() AND (coalesce(cardinality($3::text[]), 0) = 0 OR topic = ANY($3)) ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED)
RETURNING id, topic, key, payload, headers, attempts`, cfg.Lease.Seconds(), batch, cfg.Topics)
	if err != nil {
		return 0, fmt.Errorf("dlq: take parked letters: %w", err)
	}
	type taken struct {
		id       int64
		letter   Letter
		attempts int
	}
	leased := time.Now()
	var due []taken
	undecodable := map[int64]error{}
	for rows.Next() {
		var t taken
		var headers []byte
		if err := rows.Scan(&t.id, &t.letter.Topic, &t.letter.Key, &t.letter.Payload, &headers, &t.attempts); err != nil {
			rows.Close()
			return 0, err
		}
		if t.letter.Headers, err = decodeHeaders(headers); err != nil {
			undecodable[t.id] = err
			continue
		}
		due = append(due, t)
	}
	if err := rows.Err(); err != nil {
		return 0, err
	}
	// A row this version cannot read (written by hand, or by a newer
	// version) stays parked for a person, and never holds the others up.
	for id, derr := range undecodable {
		cfg.Logger.Error("dead letters: a parked letter's headers cannot be read; it stays parked for a person (app dlq list)", "letter", id, "err", derr)
		if _, err := cfg.DB.Exec(ctx, `UPDATE `+s.table+` SET last_error = $2, next_attempt_at = now() + make_interval(secs => $3) WHERE id = $1`,
			id, "headers cannot be read: "+derr.Error(), cfg.MaxBackoff.Seconds()); err != nil {
			return len(due) + len(undecodable), fmt.Errorf("dlq: note unreadable letter %d: %w", id, err)
		}
	}
	for i, t := range due {
		// Past half the lease, another drainer may take these soon and
		// publish them too: give the rest back rather than race it.
		if time.Since(leased) > cfg.Lease/2 {
			rest := make([]int64, 0, len(due)-i)
			for _, r := range due[i:] {
				rest = append(rest, r.id)
			}
			if _, err := cfg.DB.Exec(ctx, `UPDATE `+s.table+` SET next_attempt_at = now(), attempts = attempts - 1 WHERE id = ANY($1)`, rest); err != nil {
				return len(due) + len(undecodable), fmt.Errorf("dlq: give back %d letters: %w", len(rest), err)
			}
			return i + len(undecodable), nil
		}
		pm := &sarama.ProducerMessage{Topic: t.letter.Topic, Value: sarama.ByteEncoder(t.letter.Payload)}
		if len(t.letter.Key) > 0 {
			pm.Key = sarama.ByteEncoder(t.letter.Key)
		}
		for k, v := range t.letter.Headers {
			pm.Headers = append(pm.Headers, sarama.RecordHeader{Key: []byte(k), Value: []byte(v)})
		}
		perr := kafkasend.Send(ctx, cfg.Producer, pm)
		if perr != nil && ctx.Err() != nil {
			// Stopping: the letter stays leased, and is published again
			// after the lease (perhaps twice, never lost).
			return i + len(undecodable), ctx.Err()
		}
		if perr != nil {
			wait := min(time.Duration(1<<min(t.attempts, 20))*100*time.Millisecond, cfg.MaxBackoff)
			cfg.Logger.Warn("dead letters: publish failed; the letter stays parked and is tried again",
				"dlq", t.letter.Topic, "letter", t.id, "attempts", t.attempts, "retry_in", wait, "cause", perr)
			if _, err := cfg.DB.Exec(ctx, `UPDATE `+s.table+` SET last_error = $2, next_attempt_at = now() + make_interval(secs => $3) WHERE id = $1`,
				t.id, perr.Error(), wait.Seconds()); err != nil {
				return len(due), fmt.Errorf("dlq: note failed attempt of letter %d: %w", t.id, err)
			}
			continue
		}
		if _, err := cfg.DB.Exec(ctx, `DELETE FROM `+s.table+` WHERE id = $1`, t.id); err != nil {
			// Published, and still parked: after the lease it is published
			// again, a duplicate dead letter rather than a lost one.
			return len(due), fmt.Errorf("dlq: delete published letter %d: %w", t.id, err)
		}
		if cfg.OnPublished != nil {
			cfg.OnPublished(t.letter)
		}
	}
	return len(due) + len(undecodable), nil
}

// Parked is a letter waiting in the table.
type Parked struct {
	ID        int64
	Topic     string
	Payload   []byte
	Headers   map[string]string
	CreatedAt time.Time
	Attempts  int
	LastError string
}

// List returns the parked letters, oldest first.
func (s *Store) List(ctx context.Context, db pgdb.DB, limit int) ([]Parked, error) {
	rows, err := db.Query(ctx, `SELECT id, topic, payload, headers, created_at, attempts, coalesce(last_error, '') FROM `+s.table+` ORDER BY id LIMIT $1`, limit)
	if err != nil {
		return nil, fmt.Errorf("dlq: list parked letters: %w", err)
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (Parked, error) {
		var p Parked
		var headers []byte
		if err := row.Scan(&p.ID, &p.Topic, &p.Payload, &headers, &p.CreatedAt, &p.Attempts, &p.LastError); err != nil {
			return p, err
		}
		// An unreadable row is listed too, headers left out: it is the one a
		// person most needs to see (its last_error says why).
		if h, err := decodeHeaders(headers); err == nil {
			p.Headers = h
		}
		return p, nil
	})
}

// Entry is the letter as [List] would report it once it is on its topic,
// for [Filter.Matches]: where it came from and why, and its age counted
// from when it was parked (its event's time is in a payload that may not
// decode).
func (p Parked) Entry() Entry {
	return Entry{DLQTopic: p.Topic, Partition: -1, Offset: -1, EventID: eventIDOf(p.Payload, p.Headers[HeaderEventID]),
		Topic: p.Headers[middleware.PoisonedTopicKey], Group: p.Headers[middleware.PoisonedHandlerKey],
		Reason: p.Headers[middleware.ReasonForPoisonedKey], Verdict: p.Headers[HeaderVerdict] == VerdictRecorded, EventTime: p.CreatedAt, LetterAt: p.CreatedAt,
		Payload: p.Payload, Headers: p.Headers}
}

// ListMatching returns the parked letters for topics (every topic when
// empty) that f selects at now, oldest first, reading at most limit rows:
// what app dlq list and the console show as parked.
func (s *Store) ListMatching(ctx context.Context, db pgdb.DB, topics []string, f Filter, limit int, now time.Time) ([]Parked, error) {
	all, err := s.List(ctx, db, limit)
	if err != nil {
		return nil, err
	}
	var out []Parked
	for _, p := range all {
		if (len(topics) == 0 || slices.Contains(topics, p.Topic)) && f.Matches(p.Entry(), now) {
			out = append(out, p)
		}
	}
	return out, nil
}
