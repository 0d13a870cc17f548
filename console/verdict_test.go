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
	"sync/atomic"
	"testing"
	"time"

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

// Issue 31, item 4: a declined charge was offered a replay, which is a
// duplicate (its claim is recorded with the verdict), and forgetting the
// claim and replaying dead-letters it again. A letter whose group recorded
// its verdict (RejectAfterCommit) now says so on its page and its
// confirmation, and its replay's POST is refused unless the person ticked
// that they know; a letter of a fault (a permanent error rolled back, the
// handler fixed since) keeps its plain replay. A console without a token,
// and one whose person has not signed in, shows no replay link.
func TestARecordedVerdictIsReplayedOnlyKnowingly(t *testing.T) {
	brokers := testenv.Brokers(t)
	pool := testenv.Postgres(t)
	tables := schema.Config{Schema: "once_verdict_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+tables.Schema+" CASCADE") })
	topic := testenv.Topic(t, brokers, 1)
	group := "billing-" + uuid.NewString()[:8]
	var fixed atomic.Bool
	var effects, declines atomic.Int64
	svc, err := once.New(context.Background(), once.Config{Brokers: brokers, DatabaseURL: os.Getenv("DATABASE_URL"), Tables: tables,
		Topics: []once.Binding{once.Topic[order]{Name: topic,
			Decode: func(b []byte) (o order, err error) { return o, json.Unmarshal(b, &o) },
			Groups: []once.Group[order]{{Name: group, Handle: func(_ context.Context, _ pgx.Tx, o order) error {
				switch {
				case o.Price < 0: // the group's own verdict, recorded with the claim
					declines.Add(1)
					return once.RejectAfterCommit(errors.New("card declined"))
				case o.Price == 0 && !fixed.Load(): // a bug in the handler, fixed below
					return once.Permanent(errors.New("price zero not handled"))
				}
				effects.Add(1)
				return nil
			}}}}}})
	if err != nil {
		t.Fatal(err)
	}
	oncetest.Run(t, svc)
	prod := testenv.Producer(t, brokers)
	declined, faulty := order{ID: uuid.Must(uuid.NewV7()), Price: -1}, order{ID: uuid.Must(uuid.NewV7()), Price: 0}
	for _, o := range []order{declined, faulty} {
		b, _ := json.Marshal(o)
		testenv.Publish(t, prod, topic, "k", b)
	}
	dlqTopic := topic + ".dlq"
	testenv.Eventually(t, 30*time.Second, "both letters on the dead-letter topic", func() bool { return testenv.MessageCount(t, brokers, dlqTopic) == 2 })
	if declines.Load() != 1 {
		t.Fatalf("the handler declined %d times; want once", declines.Load())
	}
	entries, err := dlq.List(context.Background(), dlq.ListConfig{Brokers: brokers, Sarama: pipelinetest.SaramaConfig(t), DLQTopics: []string{dlqTopic}})
	if err != nil {
		t.Fatal(err)
	}
	where := map[uuid.UUID]url.Values{}
	for _, e := range entries {
		if e.Verdict != (e.EventID == declined.ID.String()) {
			t.Fatalf("letter of %s (reason %q): verdict %v", e.EventID, e.Reason, e.Verdict)
		}
		where[uuid.MustParse(e.EventID)] = url.Values{"topic": {dlqTopic}, "partition": {strconv.Itoa(int(e.Partition))}, "offset": {strconv.FormatInt(e.Offset, 10)}}
	}

	serve := func(cfg console.Config) string {
		con, err := svc.Console(cfg)
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(con)
		t.Cleanup(srv.Close)
		return srv.URL + console.DefaultPrefix
	}
	jar, _ := cookiejar.New(nil)
	c := &http.Client{Jar: jar, Timeout: 60 * time.Second, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}

	// Read-only: no token, or not signed in. The verdict is said (it is
	// the pipeline's own header), no replay is offered.
	readOnly := serve(console.Config{})
	withToken := serve(console.Config{Token: token, ReplayGroup: "replay-" + uuid.NewString()[:8]})
	for _, base := range []string{readOnly, withToken} {
		_, page := get(t, c, base+"/letter?"+where[declined.ID].Encode())
		if !strings.Contains(page, `id="verdict"`) || !strings.Contains(page, "A replay will not change this") {
			t.Errorf("%s: the declined letter's page says nothing of its verdict:\n%s", base, page)
		}
		for _, p := range []string{"/letter?" + where[declined.ID].Encode(), "/letter?" + where[faulty.ID].Encode(), "/letters"} {
			if _, page := get(t, c, base+p); strings.Contains(page, "/replay?") {
				t.Errorf("%s%s, not signed in: a replay link:\n%s", base, p, page)
			}
		}
	}
	if _, page := get(t, c, readOnly+"/letter?"+where[faulty.ID].Encode()); strings.Contains(page, `id="verdict"`) {
		t.Errorf("the fault's letter says it is a verdict:\n%s", page)
	}

	if code, _ := post(t, c, withToken+"/login", url.Values{"token": {token}}, nil); code != http.StatusSeeOther {
		t.Fatalf("sign in: %d", code)
	}
	if _, page := get(t, c, withToken+"/letter?"+where[declined.ID].Encode()); !strings.Contains(page, "Replay it anyway, knowing it is a duplicate") {
		t.Errorf("signed in, the declined letter's replay link:\n%s", page)
	}
	// The declined letter: its confirmation asks, and a POST without the
	// box is refused and sends nothing; its plan is kept for the POST
	// with it.
	_, page := get(t, c, withToken+"/replay?"+where[declined.ID].Encode())
	if !strings.Contains(page, `name="duplicate"`) || !strings.Contains(page, "This letter is its group's recorded verdict") {
		t.Fatalf("the declined letter's confirmation does not ask:\n%s", page)
	}
	form := url.Values{"csrf": {csrfOf(t, page)}, "plan": {hidden(t, page, "plan")}}
	code, body := post(t, c, withToken+"/replay", form, nil)
	if code != http.StatusBadRequest || !strings.Contains(body, "recorded its verdict") {
		t.Fatalf("a replay of the verdict without the box: %d\n%s", code, body)
	}
	if n := testenv.MessageCount(t, brokers, topic); n != 2 {
		t.Fatalf("the refused replay sent something: %d messages on the topic, want the 2 published", n)
	}
	form.Set("duplicate", "yes")
	if code, _, _ := postRedirect(t, c, withToken+"/replay", form); code != http.StatusSeeOther {
		t.Fatalf("a replay of the verdict with the box: %d", code)
	}
	testenv.Eventually(t, 30*time.Second, "the replayed verdict on the topic", func() bool { return testenv.MessageCount(t, brokers, topic) == 3 })

	// The fault's letter: the handler is fixed, a plain confirmation
	// replays it, and it takes effect.
	fixed.Store(true)
	_, page = get(t, c, withToken+"/replay?"+where[faulty.ID].Encode())
	if strings.Contains(page, `name="duplicate"`) || strings.Contains(page, `id="verdict"`) {
		t.Fatalf("the fault's confirmation asks about a verdict:\n%s", page)
	}
	if code, _, _ := postRedirect(t, c, withToken+"/replay", url.Values{"csrf": {csrfOf(t, page)}, "plan": {hidden(t, page, "plan")}}); code != http.StatusSeeOther {
		t.Fatalf("a replay of the fault: %d", code)
	}
	testenv.Eventually(t, 30*time.Second, "the fault replayed and processed", func() bool { return effects.Load() == 1 })
	if declines.Load() != 1 || testenv.MessageCount(t, brokers, dlqTopic) != 2 {
		t.Fatalf("the replayed verdict ran the handler again (%d declines) or a letter was added (%d)", declines.Load(), testenv.MessageCount(t, brokers, dlqTopic))
	}

	// A filtered replay over both: its confirmation counts the verdict,
	// and its POST without the box is refused.
	_, page = get(t, c, withToken+"/replay?"+url.Values{"group": {group}}.Encode())
	if !strings.Contains(page, "1 of these letters are its group's recorded verdict") || !strings.Contains(page, `name="duplicate"`) {
		t.Fatalf("the filtered confirmation does not count the verdict:\n%s", page)
	}
	if code, body := post(t, c, withToken+"/replay", url.Values{"csrf": {csrfOf(t, page)}, "plan": {hidden(t, page, "plan")}}, nil); code != http.StatusBadRequest ||
		!strings.Contains(body, "Replay without them") {
		t.Fatalf("a filtered replay with a verdict, without the box: %d (its refusal must name the replay without them)\n%s", code, body)
	}
	if n := testenv.MessageCount(t, brokers, topic); n != 4 {
		t.Fatalf("%d messages on the topic; want the 2 published and the 2 replayed", n)
	}

	// The replay without them: offered on the confirmation, it asks
	// nothing, counts the verdict it leaves out, and sends the fault only.
	if !strings.Contains(page, `id="without-verdicts"`) {
		t.Fatalf("the filtered confirmation offers no replay without the verdicts:\n%s", page)
	}
	_, page = get(t, c, withToken+"/replay?"+url.Values{"group": {group}, "verdicts": {"skip"}}.Encode())
	if strings.Contains(page, `name="duplicate"`) || !strings.Contains(page, `id="skipped-verdicts"`) || !strings.Contains(page, "<strong>1</strong> letters of a group's recorded verdict are left out") {
		t.Fatalf("the confirmation without the verdicts:\n%s", page)
	}
	code, _, to := postRedirect(t, c, withToken+"/replay", url.Values{"csrf": {csrfOf(t, page)}, "plan": {hidden(t, page, "plan")}})
	if code != http.StatusSeeOther {
		t.Fatalf("the replay without the verdicts: %d", code)
	}
	if _, report := get(t, c, srvOf(withToken)+to); !strings.Contains(report, "Replayed <strong>1</strong>") || !strings.Contains(report, "left 1 recorded verdicts out") {
		t.Fatalf("the report of the replay without the verdicts:\n%s", report)
	}
	testenv.Eventually(t, 30*time.Second, "the fault sent again", func() bool { return testenv.MessageCount(t, brokers, topic) == 5 })
	for _, m := range testenv.ReadTopic(t, brokers, topic)[4:] {
		var o order
		if err := json.Unmarshal(m.Value, &o); err != nil || o.ID != faulty.ID {
			t.Fatalf("the replay without the verdicts sent %s (%v), want the fault's event %s", o.ID, err, faulty.ID)
		}
	}
}

// srvOf is the server's address of a console base URL.
func srvOf(base string) string { return strings.TrimSuffix(base, console.DefaultPrefix) }
