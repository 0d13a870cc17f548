package main

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/internal/progress"
	"github.com/once-dev/once/schema"
)

type dlqCmd struct {
	List   dlqListCmd   `cmd:"" help:"List dead letters as a table: those on the dead-letter topics, and those parked in the database on their way there. Any topic: --source-topic (and --dlq-topic); without it, the reference service's topics."`
	Replay dlqReplayCmd `cmd:"" help:"Republish dead-lettered messages to the topic they came from (each once; stops at the end seen at start). Any topic: --source-topic (and --dlq-topic); without it, the reference service's topics."`
}

// dlqFilterFlags select letters for list and replay alike, and the
// dead-letter topics they are read from.
type dlqFilterFlags struct {
	SourceTopic string        `name:"source-topic" help:"Only letters consumed from this topic, any topic (its name without --topic-suffix); its dead-letter topic is the one read (--dlq-topic). Default: every letter of the reference service's topics (${topics}, as --confirmed-topic, --cancelled-topic and --payment-topic name them)."`
	DLQTopic    string        `name:"dlq-topic" help:"The dead-letter topic of --source-topic, as is (its Topic.DLQ). Default: --source-topic's name (with --topic-suffix) + .dlq."`
	SourceGroup string        `name:"source-group" help:"Only letters of this consumer group, any group (the reference service's: ${groups}); --group-suffix is added."`
	Reason      string        `name:"reason" help:"Only letters whose reason matches this regular expression."`
	NewerThan   time.Duration `name:"newer-than" help:"Only letters whose event is at most this old."`
	OlderThan   time.Duration `name:"older-than" help:"Only letters whose event is at least this old."`
	GroupSuffix string        `name:"group-suffix" env:"ONCE_GROUP_SUFFIX" help:"The suffix app serve was given."`
}

func (f *dlqFilterFlags) filter(k *kafkaSettings) (dlq.Filter, error) {
	re, err := dlq.ParseReason(f.Reason)
	if err != nil {
		return dlq.Filter{}, err
	}
	if f.NewerThan < 0 || f.OlderThan < 0 || (f.NewerThan > 0 && f.OlderThan > f.NewerThan) {
		return dlq.Filter{}, fmt.Errorf("--newer-than and --older-than must be positive, --older-than below --newer-than")
	}
	out := dlq.Filter{Reason: re, MinAge: f.OlderThan, MaxAge: f.NewerThan}
	if f.DLQTopic != "" && f.SourceTopic == "" {
		// A letter that does not say its topic goes back to the route's.
		return dlq.Filter{}, fmt.Errorf("--dlq-topic %s needs --source-topic, the topic its letters go back to", f.DLQTopic)
	}
	if f.SourceTopic != "" {
		out.Topic = f.SourceTopic + k.TopicSuffix
		if r := f.routes(k); r[0].DLQTopic == r[0].Topic {
			return dlq.Filter{}, fmt.Errorf("--dlq-topic %s is --source-topic itself: a replay would read what it writes", f.DLQTopic)
		}
	}
	if f.SourceGroup != "" {
		out.Group = f.SourceGroup + f.GroupSuffix
	}
	return out, nil
}

// routes are the topics whose letters list and replay read, each with its
// dead-letter topic: --source-topic's alone, or the reference service's.
func (f *dlqFilterFlags) routes(k *kafkaSettings) []dlq.Route {
	if f.SourceTopic != "" {
		topic := f.SourceTopic + k.TopicSuffix
		r := dlq.Route{Topic: topic, DLQTopic: f.DLQTopic}
		if r.DLQTopic == "" {
			r.DLQTopic = dlqOf(topic)
		}
		return []dlq.Route{r}
	}
	var out []dlq.Route
	for _, topic := range k.topics(k.TopicSuffix) {
		out = append(out, dlq.Route{Topic: topic, DLQTopic: dlqOf(topic)})
	}
	return out
}

type dlqListCmd struct {
	Kafka  kafkaSettings  `embed:""`
	Filter dlqFilterFlags `embed:""`
	DB     string         `name:"database-url" env:"DATABASE_URL" help:"Also list the letters parked in this database (committed, not yet on their topic)."`
	Limit  int            `name:"limit" default:"100" help:"Show at most this many letters, the newest."`
}

func (c *dlqListCmd) Validate() error {
	if c.Limit < 1 {
		return fmt.Errorf("--limit must be at least 1")
	}
	_, err := c.Filter.filter(&c.Kafka)
	return err
}

func (c *dlqListCmd) Run(ctx context.Context, d deps) error {
	f, _ := c.Filter.filter(&c.Kafka)
	var dlqs []string
	for _, r := range c.Filter.routes(&c.Kafka) {
		dlqs = append(dlqs, r.DLQTopic)
	}
	p := progress.New(d.stderr)
	p.Set("reading %s", strings.Join(dlqs, ", "))
	entries, err := dlq.List(ctx, dlq.ListConfig{Brokers: c.Kafka.Brokers, Sarama: c.Kafka.saramaConfig(),
		DLQTopics: dlqs, Filter: f, Limit: c.Limit})
	p.Done()
	if err != nil {
		return fmt.Errorf("KAFKA_BROKERS: %w", err)
	}
	now := time.Now()
	w := tabwriter.NewWriter(d.stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "where\tevent id\tfrom topic\tgroup\tevent age\treason")
	for _, e := range entries {
		fmt.Fprintf(w, "%s/%d@%d\t%s\t%s\t%s\t%s\t%s\n", e.DLQTopic, e.Partition, e.Offset, oneLine(orDash(e.EventID), 100), oneLine(orDash(e.Topic), 100), oneLine(orDash(e.Group), 100),
			now.Sub(e.EventTime).Round(time.Second), verdictMark(e)+oneLine(e.Reason, 100))
	}
	parked := 0
	if c.DB != "" {
		pool, err := pgxpool.New(ctx, c.DB)
		if err != nil {
			return fmt.Errorf("--database-url (DATABASE_URL): %w", err)
		}
		defer pool.Close()
		store, err := dlq.NewStore(schema.Config{})
		if err != nil {
			return err
		}
		letters, err := store.ListMatching(ctx, pool, dlqs, f, c.Limit, now)
		if err != nil {
			return fmt.Errorf("--database-url (DATABASE_URL): %w", err)
		}
		for _, l := range letters {
			e := l.Entry()
			parked++
			fmt.Fprintf(w, "parked #%d (%d attempts: %s)\t-\t%s\t%s\t%s\t%s\n", l.ID, l.Attempts, oneLine(orDash(l.LastError), 60), oneLine(orDash(e.Topic), 100), oneLine(orDash(e.Group), 100),
				now.Sub(l.CreatedAt).Round(time.Second), verdictMark(e)+oneLine(e.Reason, 100))
		}
	}
	w.Flush()
	fmt.Fprintf(d.stdout, "%d dead letters on the topics, %d parked in the database\n", len(entries), parked)
	return nil
}

// verdictMark marks the letter of a group's recorded verdict, which a
// replay does not change (dlq.HeaderVerdict): for that group a duplicate.
func verdictMark(e dlq.Entry) string {
	if e.Verdict {
		return "[recorded verdict: a replay is a duplicate for its group] "
	}
	return ""
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// oneLine is text of a letter (its reason, a header, an error: written by
// whoever wrote the letter) as one line of at most max bytes, its control
// codes escaped (\x1b): written raw, they would move a terminal's cursor,
// recolour it or set its title.
func oneLine(s string, max int) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > max {
		s = strings.ToValidUTF8(s[:max], "") + "..."
	}
	var b strings.Builder
	for _, r := range s {
		if unicode.IsControl(r) {
			b.WriteString(strings.Trim(strconv.QuoteRune(r), "'"))
			continue
		}
		b.WriteRune(r)
	}
	return b.String()
}

type dlqReplayCmd struct {
	Kafka  kafkaSettings  `embed:""`
	Filter dlqFilterFlags `embed:""`
	Group  string         `name:"group" default:"${dlq_group}" help:"Consumer group that keeps the replay progress (a filtered replay keeps its own, derived from it and the filter)."`
	MaxAge time.Duration  `name:"max-age" env:"ONCE_DLQ_REPLAY_WINDOW" default:"24h" help:"Skip dead letters older than this (keep it within the payment provider's key retention); 0 replays all."`
	// A verdict's replay is a duplicate for its group: not sent unless
	// asked for by name, and counted either way.
	IncludeVerdicts bool `name:"include-verdicts" help:"Send the letters of a group's recorded verdict too (a declined charge: dlq list marks them); for that group a replay is a duplicate that changes nothing. Default: skipped and counted, done for this progress like stale ones (send one later from the console's letter page, or with this flag and a --group of its own)."`
}

func (c *dlqReplayCmd) Validate() error {
	if c.MaxAge > 0 && c.Filter.OlderThan >= c.MaxAge {
		return fmt.Errorf("--older-than %s is not below --max-age %s: every letter it selects would be skipped as stale", c.Filter.OlderThan, c.MaxAge)
	}
	_, err := c.Filter.filter(&c.Kafka)
	return err
}

func (c *dlqReplayCmd) Run(ctx context.Context, d deps) error {
	f, _ := c.Filter.filter(&c.Kafka)
	p := progress.New(d.stderr)
	defer p.Done()
	routes := c.Filter.routes(&c.Kafka)
	total, err := dlq.ReplayRoutes(ctx, dlq.Config{
		Brokers: c.Kafka.Brokers, Sarama: c.Kafka.saramaConfig(), Group: c.Group, MaxAge: c.MaxAge, Filter: f, SkipVerdicts: !c.IncludeVerdicts,
		Progress: func(done, n int64) { p.Set("replaying: %d/%d", done, n) },
	}, routes)
	// What was sent is said even when a partition failed: its letters
	// wait there, and the others went on.
	p.Done()
	fmt.Fprintf(d.stdout, "replayed %d dead letters, skipped %d whose event is older than %s, left %d out by the filter\n",
		total.Replayed, total.SkippedStale, c.MaxAge, total.Filtered)
	if c.IncludeVerdicts {
		fmt.Fprintf(d.stdout, "sent every group's recorded verdict among them (--include-verdicts): for its group a duplicate\n")
	} else {
		fmt.Fprintf(d.stdout, "skipped %d letters of a group's recorded verdict (a replay is a duplicate for its group; --include-verdicts sends them)\n", total.SkippedVerdicts)
	}
	if total.NotYet > 0 {
		fmt.Fprintf(d.stdout, "stopped %d partitions at a letter younger than --older-than %s: the same command replays from there later\n", total.NotYet, c.Filter.OlderThan)
	}
	w := tabwriter.NewWriter(d.stdout, 0, 0, 2, ' ', 0)
	for topic, n := range total.ByTopic {
		fmt.Fprintf(w, "  %s\t%d\n", topic, n)
	}
	if ferr := w.Flush(); err == nil {
		err = ferr
	}
	return err
}
