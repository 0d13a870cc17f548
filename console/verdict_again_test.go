package console_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once"
	"github.com/once-dev/once/console"
	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/internal/pipelinetest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/oncetest"
	"github.com/once-dev/once/schema"
)

// verdictService runs one group with billing's shape on a topic of its
// own: a negative price is declined and recorded (RejectAfterCommit); an
// event that meets its own record (its claim forgotten) gets the same
// verdict again, as billing does; a zero price is a fault (Permanent,
// rolled back).
type verdictService struct {
	svc      *once.Service
	tables   schema.Config
	topic    string
	dlqTopic string
	group    string
	runs     atomic.Int64
}

func newVerdictService(t *testing.T, brokers []string) (*verdictService, func(string, ...any) int64) {
	pool := testenv.Postgres(t)
	v := &verdictService{tables: schema.Config{Schema: "once_again_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")}}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+v.tables.Schema+" CASCADE") })
	v.topic = testenv.Topic(t, brokers, 1)
	v.dlqTopic = v.topic + ".dlq"
	v.group = "billing-" + uuid.NewString()[:8]
	var mu sync.Mutex
	recorded := map[uuid.UUID]bool{} // billing's payments: outside the claims, kept when a claim is forgotten
	svc, err := once.New(context.Background(), once.Config{Brokers: brokers, DatabaseURL: os.Getenv("DATABASE_URL"), Tables: v.tables,
		Topics: []once.Binding{once.Topic[order]{Name: v.topic,
			Decode: func(b []byte) (o order, err error) { return o, json.Unmarshal(b, &o) },
			Groups: []once.Group[order]{{Name: v.group, Handle: func(_ context.Context, _ pgx.Tx, o order) error {
				v.runs.Add(1)
				mu.Lock()
				defer mu.Unlock()
				switch {
				case o.Price == 0:
					return once.Permanent(errors.New("price zero not handled"))
				case recorded[o.ID]:
					return once.RejectAfterCommit(errors.New("charge failed before and its record stands"))
				}
				recorded[o.ID] = true
				return once.RejectAfterCommit(errors.New("card declined"))
			}}}}}})
	if err != nil {
		t.Fatal(err)
	}
	v.svc = svc
	oncetest.Run(t, svc)
	exec := func(sql string, args ...any) int64 {
		t.Helper()
		tag, err := pool.Exec(context.Background(), sql, args...)
		if err != nil {
			t.Fatal(err)
		}
		return tag.RowsAffected()
	}
	return v, exec
}

func (v *verdictService) letters(t *testing.T, brokers []string) []dlq.Entry {
	t.Helper()
	entries, err := dlq.List(context.Background(), dlq.ListConfig{Brokers: brokers, Sarama: pipelinetest.SaramaConfig(t), DLQTopics: []string{v.dlqTopic}})
	if err != nil {
		t.Fatal(err)
	}
	return entries
}

func (v *verdictService) at(e dlq.Entry) url.Values {
	return url.Values{"topic": {v.dlqTopic}, "partition": {strconv.Itoa(int(e.Partition))}, "offset": {strconv.FormatInt(e.Offset, 10)}}
}

// Review of issue 31, item 4: an operator forgets a declined charge's claim
// and replays its letter knowingly; the handler meets its own record and
// gives the same verdict. The second letter is a verdict's too (its page
// warns, its replay asks), and the record the replay put on the source
// topic carries no once_verdict header (a replay sends the event, not the
// verdict of the delivery that failed).
func TestAForgottenVerdictReplayedIsAVerdictAgain(t *testing.T) {
	brokers := testenv.Brokers(t)
	v, exec := newVerdictService(t, brokers)
	declined := order{ID: uuid.Must(uuid.NewV7()), Price: -1}
	b, _ := json.Marshal(declined)
	testenv.Publish(t, testenv.Producer(t, brokers), v.topic, "k", b)
	testenv.Eventually(t, 30*time.Second, "the verdict letter", func() bool { return testenv.MessageCount(t, brokers, v.dlqTopic) == 1 })

	con, err := v.svc.Console(console.Config{Token: token, ReplayGroup: "replay-" + uuid.NewString()[:8]})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(con)
	t.Cleanup(srv.Close)
	base := srv.URL + console.DefaultPrefix
	jar, _ := cookiejar.New(nil)
	c := &http.Client{Jar: jar, Timeout: 60 * time.Second, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	if code, _ := post(t, c, base+"/login", url.Values{"token": {token}}, nil); code != http.StatusSeeOther {
		t.Fatalf("sign in: %d", code)
	}
	// Forget the claim, as the console's Forget does.
	if n := exec("DELETE FROM "+v.tables.Claims().Qualified+" WHERE consumer_group = $1", v.group); n != 1 {
		t.Fatalf("forgot %d claims, want 1", n)
	}
	first := v.letters(t, brokers)[0]
	if !first.Verdict {
		t.Fatalf("the decline's letter is not a verdict: %+v", first.Headers)
	}
	_, page := get(t, c, base+"/replay?"+v.at(first).Encode())
	form := url.Values{"csrf": {csrfOf(t, page)}, "plan": {hidden(t, page, "plan")}, "duplicate": {"yes"}}
	if code, _, _ := postRedirect(t, c, base+"/replay", form); code != http.StatusSeeOther {
		t.Fatalf("replay: %d", code)
	}
	testenv.Eventually(t, 30*time.Second, "the second letter", func() bool { return testenv.MessageCount(t, brokers, v.dlqTopic) == 2 })
	if v.runs.Load() != 2 {
		t.Fatalf("the handler ran %d times; want twice (the replay ran it, its claim forgotten)", v.runs.Load())
	}

	var replayed *sarama.ConsumerMessage
	for _, m := range testenv.ReadTopic(t, brokers, v.topic) {
		for _, h := range m.Headers {
			if string(h.Key) == dlq.HeaderReplayedFrom {
				replayed = m
			}
		}
	}
	if replayed == nil {
		t.Fatal("no replayed record on the source topic")
	}
	for _, h := range replayed.Headers {
		if string(h.Key) == dlq.HeaderVerdict {
			t.Errorf("the replayed record carries %s: %s", h.Key, h.Value)
		}
	}

	second := v.letters(t, brokers)[1]
	if !second.Verdict {
		t.Fatalf("the second letter (reason %q) is not a verdict", second.Reason)
	}
	if _, page := get(t, c, base+"/letter?"+v.at(second).Encode()); !strings.Contains(page, `id="verdict"`) || strings.Contains(page, "Replay this letter…") {
		t.Errorf("the second letter's page shows no verdict, or a plain replay:\n%s", page)
	}
	if _, page := get(t, c, base+"/replay?"+v.at(second).Encode()); !strings.Contains(page, `name="duplicate"`) {
		t.Errorf("the second letter's confirmation does not ask:\n%s", page)
	}
}

// A message that arrives with the once_verdict header set (a producer's,
// or a letter copied back by hand) and is dead-lettered for a fault gets no
// verdict mark: the header is the pipeline's judgement of this delivery.
func TestAVerdictHeaderAMessageArrivesWithMarksNoFault(t *testing.T) {
	brokers := testenv.Brokers(t)
	v, _ := newVerdictService(t, brokers)
	faulty := order{ID: uuid.Must(uuid.NewV7()), Price: 0}
	b, _ := json.Marshal(faulty)
	if _, _, err := testenv.Producer(t, brokers).SendMessage(&sarama.ProducerMessage{Topic: v.topic, Key: sarama.StringEncoder("k"), Value: sarama.ByteEncoder(b),
		Headers: []sarama.RecordHeader{{Key: []byte(dlq.HeaderVerdict), Value: []byte(dlq.VerdictRecorded)}}}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "the fault's letter", func() bool { return testenv.MessageCount(t, brokers, v.dlqTopic) == 1 })
	if arrived := testenv.ReadTopic(t, brokers, v.topic); len(arrived) != 1 || len(arrived[0].Headers) != 1 || string(arrived[0].Headers[0].Key) != dlq.HeaderVerdict {
		t.Fatalf("the message did not arrive with the header: %+v", arrived)
	}
	letter := v.letters(t, brokers)[0]
	if letter.Verdict || letter.Headers[dlq.HeaderVerdict] != "" {
		t.Fatalf("the fault's letter (reason %q) is marked a verdict: %v", letter.Reason, letter.Headers)
	}
}
