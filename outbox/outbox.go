package outbox

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	watermillsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel"

	"github.com/once-dev/once/internal/kafkasend"
	"github.com/once-dev/once/internal/retrylog"
	"github.com/once-dev/once/internal/tracing"
	"github.com/once-dev/once/pgdb"
	"github.com/once-dev/once/schema"
)

// MetaKey carries a message's Kafka key from the outbox to Kafka. Every
// event of one aggregate (an order) should share its key, so that they stay
// in one partition and in order.
const MetaKey = "partition_key"

// Outbox is the consumer outbox of one set of tables (package schema
// names them: schema.Config.Outbox and OutboxOffsets).
type Outbox struct {
	// IdleInTransactionTimeout is how long the server lets a forwarder's
	// transaction sit idle between its statements (the transaction holds
	// the outbox's lock while Kafka acknowledges what it read). A
	// forwarder that vanished behind a network black hole cannot tell the
	// server it gave up: without this bound its backend keeps the lock
	// until TCP keepalive notices, two hours by default, and every other
	// forwarder of the table waits all that time, so nothing from the
	// outbox reaches Kafka. Set it above the time Kafka takes to
	// acknowledge a poll's rows (up to 100, published one after another,
	// each waited for at most 30 s, watermill-sql's ack deadline): a
	// transaction cut short sends its rows again (consumers skip the copies
	// by their event ids), and a Kafka always slower than the bound for a
	// poll's rows ends every poll, so the outbox does not move. Zero means
	// [DefaultIdleInTransactionTimeout]; a negative value keeps the
	// server's setting.
	IdleInTransactionTimeout time.Duration

	tables  schema.Config
	schema  insertAsText
	offsets watermillsql.DefaultPostgreSQLOffsetsAdapter
	wlog    watermill.LoggerAdapter
	log     *slog.Logger
}

// DefaultIdleInTransactionTimeout is the forwarder's bound on an idle
// transaction (see [Outbox.IdleInTransactionTimeout]).
const DefaultIdleInTransactionTimeout = time.Minute

// New validates the names and returns the outbox, logging to logger (nil:
// slog.Default()). It touches no database.
func New(tables schema.Config, logger *slog.Logger) (*Outbox, error) {
	if err := tables.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = slog.Default()
	}
	messages, offsets := tables.OutboxAdapters()
	return &Outbox{
		tables:  tables.WithDefaults(),
		schema:  insertAsText{messages},
		offsets: offsets,
		wlog: stopQuiet{watermill.NewSlogLoggerWithLevelMapping(logger, map[slog.Level]slog.Level{
			slog.LevelInfo: slog.LevelDebug, // per-message details
		})},
		log: logger,
	}, nil
}

// stopQuiet is the outbox's Watermill logger: an error that is only the
// forwarder's stop cutting a poll short is logged at debug level.
// watermill-sql logs it as "could not commit tx for querying message" at
// ERROR, at the clean stop of every service, whether it has an outbox or
// not.
type stopQuiet struct{ watermill.LoggerAdapter }

func (l stopQuiet) Error(msg string, err error, fields watermill.LogFields) {
	// A failed poll's rollback fails too when the database went away:
	// the poll's error is logged once per backoff step (pollBackoff).
	if errors.Is(err, context.Canceled) || msg == "could not rollback tx for querying message" {
		l.LoggerAdapter.Debug(msg, fields.Add(watermill.LogFields{"err": err}))
		return
	}
	l.LoggerAdapter.Error(msg, err, fields)
}

func (l stopQuiet) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return stopQuiet{l.LoggerAdapter.With(fields)}
}

// insertAsText is watermill-sql's PostgreSQL schema with an insert that
// works in every pgx query exec mode. watermill-sql passes the payload and
// the metadata as []byte for their json columns: pgx's exec and
// simple_protocol modes (what a transaction pooler such as PgBouncer needs)
// send a []byte as bytea text ("\x7b22..."), which json refuses (22P02).
// Sent as text and cast by the server, they are the same JSON in every mode.
type insertAsText struct {
	watermillsql.DefaultPostgreSQLSchema
}

func (s insertAsText) InsertQuery(params watermillsql.InsertQueryParams) (watermillsql.Query, error) {
	var values strings.Builder
	args := make([]any, 0, 3*len(params.Msgs))
	for i, msg := range params.Msgs {
		metadata, err := json.Marshal(msg.Metadata)
		if err != nil {
			return watermillsql.Query{}, fmt.Errorf("outbox: metadata of %s: %w", msg.UUID, err)
		}
		if i > 0 {
			values.WriteString(",")
		}
		n := 3 * i
		fmt.Fprintf(&values, "($%d, $%d::text::json, $%d::text::json, pg_current_xact_id())", n+1, n+2, n+3)
		args = append(args, msg.UUID, string(msg.Payload), string(metadata))
	}
	return watermillsql.Query{
		Query: "INSERT INTO " + s.MessagesTable(params.Topic) + " (uuid, payload, metadata, transaction_id) VALUES " + values.String(),
		Args:  args,
	}, nil
}

// topic is the watermill-sql topic of every outbox: the table names are fixed
// by schema.Config, and the forwarder's envelope carries each message's real
// topic.
const topic = schema.OutboxTopic

// forwarderGroup keeps the forwarder's progress in the offsets table.
const forwarderGroup = "kafka_forwarder"

// Message is an event to publish.
type Message struct {
	// Topic is the Kafka topic. Required.
	Topic string
	// Key is the Kafka message key. Required: see [MetaKey].
	Key string
	// ID names the message in logs and Watermill; use the event id.
	ID string
	// Payload is the message value, byte for byte.
	Payload []byte
	// Headers become Kafka headers.
	Headers map[string]string
}

// Publish writes msgs into tx. They reach Kafka only if tx commits, through a
// [Forwarder] on the same table.
func (o *Outbox) Publish(ctx context.Context, tx pgx.Tx, msgs ...Message) error {
	pub, err := watermillsql.NewPublisher(watermillsql.TxFromPgx(tx), watermillsql.PublisherConfig{SchemaAdapter: o.schema}, o.wlog)
	if err != nil {
		return fmt.Errorf("outbox: publisher: %w", err)
	}
	fw := forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: topic})
	for _, m := range msgs {
		if m.Topic == "" || m.Key == "" {
			return fmt.Errorf("outbox: message %s needs a Topic and a Key", m.ID)
		}
		id := m.ID
		if id == "" {
			id = watermill.NewUUID()
		}
		wm := message.NewMessage(id, m.Payload)
		wm.SetContext(ctx)
		for k, v := range m.Headers {
			wm.Metadata.Set(k, v)
		}
		if wm.Metadata.Get("traceparent") == "" {
			// The event carries the trace of the work that wrote it: the
			// order service's request, a consumer's handling.
			otel.GetTextMapPropagator().Inject(ctx, tracing.MetadataCarrier(wm.Metadata))
		}
		wm.Metadata.Set(MetaKey, m.Key)
		if err := fw.Publish(m.Topic, wm); err != nil {
			return fmt.Errorf("outbox: write %s for %s: %w", id, m.Topic, err)
		}
	}
	return nil
}

// envelope is how Watermill's forwarder stores a message in the outbox
// table: the destination topic around the message.
type envelope struct {
	DestinationTopic string            `json:"destination_topic"`
	UUID             string            `json:"uuid"`
	Payload          []byte            `json:"payload"`
	Metadata         map[string]string `json:"metadata"`
}

// Written are the messages for topic committed to the outbox of db and
// not yet pruned, forwarded or not, in the order they were written: what
// a test asserts after its handler published.
func (o *Outbox) Written(ctx context.Context, db pgdb.DB, topic string) ([]Message, error) {
	q := `SELECT payload::text FROM ` + o.tables.OutboxTable().Qualified + ` WHERE payload->>'destination_topic' = $1 ORDER BY "offset"`
	rows, err := db.Query(ctx, q, topic)
	if err != nil {
		return nil, fmt.Errorf("outbox: read %s: %w", o.tables.OutboxTable().Qualified, err)
	}
	raw, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("outbox: read %s: %w", o.tables.OutboxTable().Qualified, err)
	}
	out := make([]Message, 0, len(raw))
	for _, r := range raw {
		var e envelope
		if err := json.Unmarshal([]byte(r), &e); err != nil {
			return nil, fmt.Errorf("outbox: a row that is not a forwarder's envelope: %w", err)
		}
		headers := maps.Clone(e.Metadata)
		key := headers[MetaKey]
		delete(headers, MetaKey)
		out = append(out, Message{Topic: e.DestinationTopic, Key: key, ID: e.UUID, Payload: e.Payload, Headers: headers})
	}
	return out, nil
}

// Init creates the outbox's tables if they are missing, for databases that
// do not run package schema's migrations (a producer's own outbox).
func (o *Outbox) Init(ctx context.Context, db pgdb.DB) error {
	sub, err := o.subscriber(db, true)
	if err != nil {
		return err
	}
	defer sub.Close()
	if err := sub.SubscribeInitialize(topic); err != nil {
		return fmt.Errorf("outbox: create %s: %w", o.tables.OutboxTable(), err)
	}
	return nil
}

func (o *Outbox) subscriber(db pgdb.DB, initialize bool) (*watermillsql.Subscriber, error) {
	sub, _, err := o.subscriberWatched(db, initialize)
	return sub, err
}

// subscriberWatched is subscriber; for a forwarder (not initialize) it
// also returns the watch on its progress row, which the forwarder closes on.
func (o *Outbox) subscriberWatched(db pgdb.DB, initialize bool) (*watermillsql.Subscriber, *progressWatch, error) {
	backoff := &pollBackoff{log: o.log, database: retrylog.Host(db), table: o.tables.OutboxTable().Qualified,
		steps: retrylog.Steps{First: firstRetry, Last: lastRetry}}
	progress := forwarderGroup
	var beginner watermillsql.Beginner = rowsErrBeginner{watermillsql.BeginnerFromPgx(pgdb.IdleBounded{DB: db, Idle: o.idleLimit()}), backoff}
	var watch *progressWatch
	if !initialize {
		// Forwarder takes no context; the question is one short query.
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		var err error
		if progress, err = o.progress(ctx, db); err != nil {
			return nil, nil, err
		}
		watch = &progressWatch{Beginner: beginner, o: o, db: db, name: progress, checked: time.Now()}
		beginner = watch
	}
	sub, err := watermillsql.NewSubscriber(beginner, watermillsql.SubscriberConfig{
		ConsumerGroup:    progress,
		PollInterval:     pollInterval,
		SchemaAdapter:    o.schema,
		OffsetsAdapter:   o.offsets,
		InitializeSchema: initialize,
		BackoffManager:   backoff,
	}, o.wlog)
	if err != nil {
		return nil, nil, fmt.Errorf("outbox: subscriber on %s: %w", o.tables.OutboxTable(), err)
	}
	return sub, watch, nil
}

// progressCheckEvery is how often a running forwarder asks again which
// progress row is its own.
const progressCheckEvery = 5 * time.Second

// progressWatch begins the forwarder's transactions and, every
// progressCheckEvery, asks again which progress row is the forwarder's
// (see progress). A migration that turns row security on or changes the
// policies while the forwarder runs can hide the row it started with:
// watermill-sql then finds no progress and forwards nothing, saying
// nothing. On a change the watch closes the forwarder, whose Run returns,
// so that whoever runs it starts it again on the right row (package
// pipeline restarts it).
type progressWatch struct {
	watermillsql.Beginner
	o    *Outbox
	db   pgdb.DB
	name string

	mu      sync.Mutex
	checked time.Time
	stop    func() error
	changed bool
}

func (w *progressWatch) BeginTx(ctx context.Context, opts *sql.TxOptions) (watermillsql.Tx, error) {
	w.mu.Lock()
	due := !w.changed && time.Since(w.checked) >= progressCheckEvery
	if due {
		w.checked = time.Now()
	}
	changed := w.changed
	w.mu.Unlock()
	if due {
		now, err := w.o.progress(ctx, w.db)
		if err == nil && now != w.name {
			err = &progressRowError{restart: true, err: fmt.Errorf("outbox: the forwarder's progress row is now %s, not %s (a migration changed the row security of %s): restarting the forwarder on it",
				now, w.name, w.o.tables.OutboxOffsetsTable())}
			w.mu.Lock()
			w.changed, changed = true, true
			stop := w.stop
			w.mu.Unlock()
			w.o.log.Info("outbox forwarder restarts on its new progress row", "from", w.name, "to", now, "table", w.o.tables.OutboxOffsetsTable().Qualified)
			if stop != nil {
				go func() { _ = stop() }()
			}
		}
		if err != nil {
			return nil, err
		}
	}
	if changed {
		return nil, &progressRowError{restart: true, err: fmt.Errorf("outbox: the forwarder's progress row %s is no longer its own; the forwarder is closing", w.name)}
	}
	return w.Beginner.BeginTx(ctx, opts)
}

// progressRowError is the forwarder's progress row not being what it
// should: a restart on a new one (restart), which a migration caused and
// the watch carries out, or a row security that lets this role see no
// progress row of its own, which a person must fix (app migrate). Neither
// is the database being unreachable, which the backoff would otherwise
// take it for.
type progressRowError struct {
	err     error
	restart bool
}

func (e *progressRowError) Error() string { return e.err.Error() }
func (e *progressRowError) Unwrap() error { return e.err }

// progress is the name of the forwarder's progress row in db. Where row
// security restricts the outbox for the current user (a group's role in a
// database groups share, as the reference service's migrations set up),
// the forwarder may see only some rows: with the shared progress it would
// move past the others, and they would never be sent. A role that sees the
// shared progress row (kafka_forwarder) is taken to see every row, as the
// policies that let it see that row let it see every outbox row (a role of
// no group: the reference service's once_other_roles): it keeps the shared
// progress. One that does not keeps the one progress row of its own that
// its policy lets it see (named kafka_forwarder: and its scope, made by
// the migrations that made the policy); none, or several, is an error
// rather than a skipped row.
func (o *Outbox) progress(ctx context.Context, db pgdb.DB) (string, error) {
	offsets := o.offsets.MessagesOffsetsTable(topic)
	var restricted bool
	if err := db.QueryRow(ctx, `SELECT row_security_active($1::regclass)`, offsets).Scan(&restricted); err != nil {
		return "", fmt.Errorf("outbox: is %s restricted by row security: %w", o.tables.OutboxOffsetsTable(), err)
	}
	if !restricted {
		return forwarderGroup, nil
	}
	rows, err := db.Query(ctx, `SELECT consumer_group FROM `+offsets+` WHERE consumer_group = $1 OR starts_with(consumer_group, $1 || ':')`, forwarderGroup)
	if err != nil {
		return "", fmt.Errorf("outbox: the forwarder's progress in %s: %w", o.tables.OutboxOffsetsTable(), err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return "", fmt.Errorf("outbox: the forwarder's progress in %s: %w", o.tables.OutboxOffsetsTable(), err)
	}
	if slices.Contains(names, forwarderGroup) {
		return forwarderGroup, nil
	}
	if len(names) != 1 {
		return "", &progressRowError{err: fmt.Errorf("outbox: row security restricts %s for this role, which sees %d progress rows named %s:* and not %s, want exactly its own: "+
			"run the migrations that made its policy (app migrate) as the tables' owner, or forward as a role the policies do not restrict",
			o.tables.OutboxOffsetsTable(), len(names), forwarderGroup, forwarderGroup)}
	}
	return names[0], nil
}

// rowsErrBeginner makes a read's failure seen. watermill-sql's subscriber
// never asks its rows for their error, and with pgx a read the server
// refuses (permission denied for the outbox table) fails there: the poll
// looked like an empty outbox, forwarding nothing and saying nothing. Its
// rows' Close returns the error (the subscriber then fails the poll and
// rolls back), and the backoff logs the error itself, which the
// subscriber's own wrapping of a Close error loses.
type rowsErrBeginner struct {
	watermillsql.Beginner
	backoff *pollBackoff
}

func (b rowsErrBeginner) BeginTx(ctx context.Context, opts *sql.TxOptions) (watermillsql.Tx, error) {
	tx, err := b.Beginner.BeginTx(ctx, opts)
	if err != nil {
		return tx, err
	}
	return rowsErrTx{tx, b.backoff}, nil
}

type rowsErrTx struct {
	watermillsql.Tx
	backoff *pollBackoff
}

func (t rowsErrTx) QueryContext(ctx context.Context, query string, args ...any) (watermillsql.Rows, error) {
	rows, err := t.Tx.QueryContext(ctx, query, args...)
	if err != nil {
		return rows, err
	}
	return rowsErr{rows, t.backoff}, nil
}

type rowsErr struct {
	watermillsql.Rows
	backoff *pollBackoff
}

func (r rowsErr) Close() error {
	err := r.Rows.Close()
	if e, ok := r.Rows.(interface{ Err() error }); ok && err == nil {
		err = e.Err()
	}
	if err != nil {
		r.backoff.mu.Lock()
		r.backoff.readErr = err
		r.backoff.mu.Unlock()
	}
	return err
}

// pollInterval is how often an idle forwarder reads the outbox; after a
// failed read it waits pollBackoff's steps instead.
const pollInterval = 50 * time.Millisecond

// The forwarder's backoff after a failed read of the outbox: it doubles
// from the first to the last step, and is back to pollInterval after a
// read that worked.
const (
	firstRetry = time.Second
	lastRetry  = 16 * time.Second
)

// pollBackoff is the forwarder's backoff after a failed read of the
// outbox (watermill-sql's retried every second, with an ERROR each time:
// 150 lines in half a minute of a database outage, naming nothing a
// person could act on). It logs one line per step, naming the database's
// host, the table and when it tries again, and one when a read works
// again.
type pollBackoff struct {
	log             *slog.Logger
	database, table string
	mu              sync.Mutex
	steps           retrylog.Steps
	// readErr: the error of the poll's rows (rowsErr), which the
	// subscriber returns only as "could not close rows".
	readErr error
}

func (b *pollBackoff) HandleError(_ watermill.LoggerAdapter, noMsg bool, err error) time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	if err != nil && b.readErr != nil {
		err = b.readErr
	}
	b.readErr = nil
	if err == nil {
		if recovered, failing := b.steps.Worked(); recovered {
			b.log.Info("outbox forwarder reads the outbox again", "database", b.database, "table", b.table, "failing_for", failing)
		}
		if noMsg {
			return pollInterval
		}
		return 0
	}
	if errors.Is(err, context.Canceled) {
		return pollInterval // the stop's: the loop ends at once
	}
	if pe := (*progressRowError)(nil); errors.As(err, &pe) {
		if pe.restart {
			return pollInterval // the watch closes the forwarder; said once there
		}
		wait, since := b.steps.Failed()
		b.log.Error(fmt.Sprintf("outbox forwarder has no progress row of its own on database %s; retrying in %s", b.database, wait),
			"database", b.database, "table", b.table, "error_class", "refused", "retry_in", wait, "failing_for", time.Since(since).Round(time.Millisecond), "err", err)
		return wait
	}
	if msg := strings.ToLower(err.Error()); strings.Contains(msg, "deadlock") || strings.Contains(msg, "concurrent update") {
		// Two forwarders taking turns on the table: at once again, as
		// watermill-sql's own backoff does.
		b.log.Debug("outbox forwarder: a read lost a race with another forwarder; reading again", "table", b.table, "err", err)
		return 0
	}
	wait, since := b.steps.Failed()
	level, class, action := retrylog.Class(err)
	b.log.Log(context.Background(), level, fmt.Sprintf("outbox forwarder cannot read the outbox on database %s: %s; retrying in %s", b.database, action, wait),
		"database", b.database, "table", b.table, "error_class", class, "retry_in", wait, "failing_for", time.Since(since).Round(time.Millisecond), "err", err)
	return wait
}

func (o *Outbox) idleLimit() time.Duration {
	if o.IdleInTransactionTimeout == 0 {
		return DefaultIdleInTransactionTimeout
	}
	return o.IdleInTransactionTimeout
}

// Forwarder moves the outbox's committed messages to Kafka through
// kafkaPublisher (see [NewKafkaPublisher]). A row is acknowledged only after
// the publish returned, so a crash in between publishes it again. Several
// forwarders on one table take turns; each message goes out in table order.
func (o *Outbox) Forwarder(db pgdb.DB, kafkaPublisher message.Publisher) (*forwarder.Forwarder, error) {
	if o.IdleInTransactionTimeout > pgdb.MaxIdleBound {
		return nil, fmt.Errorf("outbox: IdleInTransactionTimeout %s: at most %s (the server's idle_in_transaction_session_timeout is an int of milliseconds)", o.IdleInTransactionTimeout, pgdb.MaxIdleBound)
	}
	sub, watch, err := o.subscriberWatched(db, false)
	if err != nil {
		return nil, err
	}
	f, err := forwarder.NewForwarder(sub, kafkaPublisher, o.wlog, forwarder.Config{ForwarderTopic: topic})
	if err != nil {
		return nil, fmt.Errorf("outbox: forwarder: %w", err)
	}
	watch.mu.Lock()
	watch.stop = f.Close
	watch.mu.Unlock()
	return f, nil
}

// pruneSQL deletes, in one bounded batch, rows the forwarder has
// acknowledged (watermill-sql orders rows by transaction id, then offset)
// and that are older than the given age. Unforwarded rows are never touched.
// created_at is a timestamp without time zone written by CURRENT_TIMESTAMP,
// hence LOCALTIMESTAMP.
const pruneSQL = `DELETE FROM %[1]s WHERE ctid IN (
  SELECT m.ctid FROM %[1]s m JOIN %[2]s o ON o.consumer_group = $1
  WHERE (m.transaction_id < o.last_processed_transaction_id
     OR (m.transaction_id = o.last_processed_transaction_id AND m."offset" <= o.offset_acked))
    AND m.created_at < LOCALTIMESTAMP - make_interval(secs => $2)
  LIMIT $3)`

// pruneScopedSQL is pruneSQL for an outbox whose rows carry their scope
// (column group_role: the writer's group role, with row security): a row
// with one was forwarded by its scope's forwarder and acknowledged in its
// progress (see progress), and is pruned by that progress only (the shared
// progress may stand past a group's row that its group has not sent); a
// row without one is sent by every forwarder, and once any progress stands
// past it, it was sent.
const pruneScopedSQL = `DELETE FROM %[1]s WHERE ctid IN (
  SELECT m.ctid FROM %[1]s m
  WHERE m.created_at < LOCALTIMESTAMP - make_interval(secs => $2)
    AND EXISTS (SELECT FROM %[2]s o
      WHERE (o.consumer_group = $1 || ':' || m.group_role
             OR (m.group_role IS NULL AND (o.consumer_group = $1 OR starts_with(o.consumer_group, $1 || ':'))))
        AND (m.transaction_id < o.last_processed_transaction_id
          OR (m.transaction_id = o.last_processed_transaction_id AND m."offset" <= o.offset_acked)))
  LIMIT $3)`

// Prune deletes forwarded rows older than olderThan, batch rows per
// statement, and returns how many it deleted. watermill-sql keeps every row
// forever; without this the outbox grows with every event. Under a role
// that row security restricts it prunes the rows it sees against its own
// progress; under one it does not, rows that carry a scope against their
// scope's progress.
func (o *Outbox) Prune(ctx context.Context, db pgdb.DB, olderThan time.Duration, batch int) (int64, error) {
	progress, err := o.progress(ctx, db)
	if err != nil {
		return 0, err
	}
	messages, offsets := o.schema.MessagesTable(topic), o.offsets.MessagesOffsetsTable(topic)
	q := fmt.Sprintf(pruneSQL, messages, offsets)
	var scoped bool
	if err := db.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_attribute WHERE attrelid = $1::regclass AND attname = 'group_role' AND NOT attisdropped)`, messages).Scan(&scoped); err != nil {
		return 0, fmt.Errorf("outbox: prune %s: %w", o.tables.OutboxTable(), err)
	}
	if scoped && progress == forwarderGroup {
		q = fmt.Sprintf(pruneScopedSQL, messages, offsets)
	}
	var total int64
	for {
		tag, err := db.Exec(ctx, q, progress, olderThan.Seconds(), batch)
		if err != nil {
			return total, fmt.Errorf("outbox: prune %s: %w", o.tables.OutboxTable(), err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(batch) {
			return total, nil
		}
	}
}

// Marshal turns a message into a Kafka record: keyed by its [MetaKey] (no
// key without one), its payload as stored, its other metadata as headers.
func Marshal(topic string, msg *message.Message) *sarama.ProducerMessage {
	pm := &sarama.ProducerMessage{Topic: topic, Value: sarama.ByteEncoder(msg.Payload)}
	if key := msg.Metadata.Get(MetaKey); key != "" {
		pm.Key = sarama.StringEncoder(key)
	}
	for k, v := range msg.Metadata {
		if k != MetaKey {
			pm.Headers = append(pm.Headers, sarama.RecordHeader{Key: []byte(k), Value: []byte(v)})
		}
	}
	return pm
}

// KafkaPublisher is a Watermill publisher on a sarama producer the caller
// owns, writing records as [Marshal] does: the forwarder's output. The
// producer should be idempotent (acks from all in-sync replicas, one request
// in flight), so a retried send neither duplicates nor reorders.
type KafkaPublisher struct {
	Producer sarama.SyncProducer
	// AfterPublish, if set, is called after Kafka acknowledged a message.
	AfterPublish func(topic string, msg *message.Message)
	// Stop, if set, ends the wait for Kafka's answer when it is done (the
	// forwarder's shutdown): sarama's send takes no context, and a broker
	// that neither answers nor fails would hold the shutdown for minutes.
	// The row stays unacknowledged and is published again later. Default:
	// wait for the producer's answer.
	Stop context.Context
}

// Publish sends msgs in order, each acknowledged before the next.
func (k KafkaPublisher) Publish(topic string, msgs ...*message.Message) error {
	stop := k.Stop
	if stop == nil {
		stop = context.Background()
	}
	for _, m := range msgs {
		if err := kafkasend.Send(stop, k.Producer, Marshal(topic, m)); err != nil {
			return fmt.Errorf("outbox: publish %s to %s: %w", m.UUID, topic, err)
		}
		if k.AfterPublish != nil {
			k.AfterPublish(topic, m)
		}
	}
	return nil
}

// Close does nothing: the producer is the caller's to close.
func (k KafkaPublisher) Close() error { return nil }

// EventID derives the id of an event published because of another one: a
// UUIDv7 whose 48-bit millisecond timestamp is at, and whose other bits come
// from SHA-256 of the cause's id and the derived event's type. Give it a
// time that every attempt reads the same, from a durable record of what
// happened on a clock of your own (a row committed earlier, such as the
// time of a charge's intent; never a third party's clock, which may run
// ahead): then a handler that publishes in an attempt that
// rolled back and again in the one that committed, or on a replay of its
// input, publishes one id that downstream consumers dedup, and the id's age,
// which their dedup horizon judges, is the age of what it reports, however
// late the cause was handled.
func EventID(cause uuid.UUID, eventType string, at time.Time) uuid.UUID {
	h := sha256.New()
	h.Write(cause[:])
	h.Write([]byte(eventType))
	sum := h.Sum(nil)
	var id uuid.UUID
	ms := uint64(at.UnixMilli())
	for i := 0; i < 6; i++ {
		id[i] = byte(ms >> (40 - 8*i))
	}
	copy(id[6:], sum[:10])
	id[6] = 0x70 | id[6]&0x0f // version 7
	id[8] = 0x80 | id[8]&0x3f // RFC 4122 variant
	return id
}
