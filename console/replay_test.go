package console_test

import (
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"

	"github.com/once-dev/once/console"
	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/internal/pipelinetest"
	"github.com/once-dev/once/internal/testenv"
)

// letterTo puts a letter of from's on dlqTopic, as the pipeline does.
func letterTo(t *testing.T, prod sarama.SyncProducer, dlqTopic, from, reason string) {
	t.Helper()
	id := uuid.Must(uuid.NewV7())
	if _, _, err := prod.SendMessage(&sarama.ProducerMessage{Topic: dlqTopic, Value: sarama.StringEncoder(`{"event_id":"` + id.String() + `"}`),
		Headers: []sarama.RecordHeader{{Key: []byte(middleware.PoisonedTopicKey), Value: []byte(from)},
			{Key: []byte(middleware.ReasonForPoisonedKey), Value: []byte(reason)}}}); err != nil {
		t.Fatal(err)
	}
}

// signedInConsole serves a console on routes and signs in; it returns the
// server's URL and a client that does not follow redirects.
func signedInConsole(t *testing.T, routes []dlq.Route, now func() time.Time) (string, *http.Client) {
	t.Helper()
	con, err := console.New(console.Config{Brokers: testenv.Brokers(t), Sarama: pipelinetest.SaramaConfig(t), Routes: routes,
		Databases: []console.Database{{Name: "default", DB: testenv.Postgres(t)}}, Token: token, Now: now,
		ReplayGroup: "replay-" + uuid.NewString()[:8]})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(con)
	t.Cleanup(srv.Close)
	jar, _ := cookiejar.New(nil)
	c := &http.Client{Jar: jar, Timeout: 60 * time.Second, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	if code, _ := post(t, c, srv.URL+"/console/login", url.Values{"token": {token}}, nil); code != http.StatusSeeOther {
		t.Fatalf("sign in: %d", code)
	}
	return srv.URL, c
}

var (
	replayedN = regexp.MustCompile(`Replayed <strong>(\d+)</strong>`)
	withinN   = regexp.MustCompile(`<strong>(\d+)</strong> within`)
)

// confirmAndReplay opens the confirmation at query, posts its form and
// returns the confirmation and the report.
func confirmAndReplay(t *testing.T, base string, c *http.Client, query url.Values, between func()) (string, string) {
	t.Helper()
	_, page := get(t, c, base+"/console/replay?"+query.Encode())
	if between != nil {
		between()
	}
	code, _, where := postRedirect(t, c, base+"/console/replay", url.Values{"csrf": {csrfOf(t, page)}, "plan": {hidden(t, page, "plan")}})
	if code != http.StatusSeeOther {
		t.Fatalf("the replay: %d", code)
	}
	_, report := get(t, c, base+where)
	return page, report
}

// Review finding: the POST carried only the filter, so letters
// dead-lettered between the confirmation and the click were replayed too,
// unseen and uncounted. The replay now stops where the confirmation's dry
// run read to.
func TestAFilteredReplaySendsOnlyWhatItsConfirmationShowed(t *testing.T) {
	brokers := testenv.Brokers(t)
	dlqTopic := testenv.Topic(t, brokers, 1)
	target := testenv.Topic(t, brokers, 1)
	prod := testenv.Producer(t, brokers)
	letterTo(t, prod, dlqTopic, target, "bad")
	base, c := signedInConsole(t, []dlq.Route{{Topic: target, DLQTopic: dlqTopic}}, nil)
	page, report := confirmAndReplay(t, base, c, url.Values{"reason": {"^bad$"}}, func() {
		for range 5 { // meanwhile the service dead-letters more, with the same reason
			letterTo(t, prod, dlqTopic, target, "bad")
		}
	})
	if m := withinN.FindStringSubmatch(page); m == nil || m[1] != "1" {
		t.Fatalf("the confirmation: %v\n%s", m, page)
	}
	got := replayedN.FindStringSubmatch(report)
	if n := testenv.MessageCount(t, brokers, target); got == nil || got[1] != "1" || n != 1 {
		t.Fatalf("the confirmation promised 1 letter; the replay sent %v (%d on the topic)", got, n)
	}
	// The five wait for the next confirmation.
	if page, _ := confirmAndReplay(t, base, c, url.Values{"reason": {"^bad$"}}, nil); !strings.Contains(page, "<strong>5</strong> within") {
		t.Fatalf("the next confirmation:\n%s", page)
	}
}

// Review finding: two topics sharing a dead-letter topic made two routes
// to it: the letters page listed each letter twice and the dry run counted
// it twice, while the replay sent it once.
func TestASharedDeadLetterTopicIsCountedOnce(t *testing.T) {
	brokers := testenv.Brokers(t)
	shared := testenv.Topic(t, brokers, 1)
	a := testenv.Topic(t, brokers, 1)
	b := testenv.Topic(t, brokers, 1)
	letterTo(t, testenv.Producer(t, brokers), shared, a, "bad")
	base, c := signedInConsole(t, []dlq.Route{{Topic: a, DLQTopic: shared}, {Topic: b, DLQTopic: shared}}, nil)
	_, letters := get(t, c, base+"/console/letters")
	_, page := get(t, c, base+"/console/replay")
	m := withinN.FindStringSubmatch(page)
	if listed := strings.Count(letters, shared+"/0@0</a>"); m == nil || m[1] != "1" || listed != 1 {
		t.Fatalf("one letter on a shared dead-letter topic: the confirmation says %v within, the letters page lists it %d times", m, listed)
	}
}

// Review finding: offset -1 is sarama's "newest": the letter's page waited
// for the next letter, holding a Kafka client, as long as the visitor did.
func TestALetterAtANegativeOffsetIsNotFoundAtOnce(t *testing.T) {
	brokers := testenv.Brokers(t)
	dlqTopic := testenv.Topic(t, brokers, 1)
	target := testenv.Topic(t, brokers, 1)
	letterTo(t, testenv.Producer(t, brokers), dlqTopic, target, "bad")
	base, c := signedInConsole(t, []dlq.Route{{Topic: target, DLQTopic: dlqTopic}}, nil)
	c.Timeout = 10 * time.Second
	if code, _ := get(t, c, base+"/console/letter?"+url.Values{"topic": {dlqTopic}, "partition": {"0"}, "offset": {"-1"}}.Encode()); code != http.StatusNotFound {
		t.Fatalf("GET /letter?offset=-1: %d; want 404", code)
	}
}

// Review finding: a one-letter replay that sent nothing (its event outside
// the window) linked its event's outcome, and the inbox then said "not
// processed yet; reload" for good.
func TestAReplayThatSentNothingLinksNoOutcome(t *testing.T) {
	brokers := testenv.Brokers(t)
	dlqTopic := testenv.Topic(t, brokers, 1)
	target := testenv.Topic(t, brokers, 1)
	letterTo(t, testenv.Producer(t, brokers), dlqTopic, target, "bad")
	base, c := signedInConsole(t, []dlq.Route{{Topic: target, DLQTopic: dlqTopic}}, func() time.Time { return time.Now().Add(48 * time.Hour) })
	_, report := confirmAndReplay(t, base, c, url.Values{"topic": {dlqTopic}, "partition": {"0"}, "offset": {"0"}}, nil)
	if !strings.Contains(report, "Replayed <strong>0</strong>") || strings.Contains(report, "replay=") {
		t.Fatalf("the report of a replay that sent nothing: want 0 replayed and no outcome to follow\n%s", report)
	}
}

// Review finding: back() let "/console/../\host" through; http.Redirect
// cleaned it to "/\host", which browsers read as //host.
func TestSignOutRedirectsOnlyWithinTheConsole(t *testing.T) {
	con, err := console.New(console.Config{Brokers: []string{"127.0.0.1:1"}, Sarama: sarama.NewConfig(),
		Routes: []dlq.Route{{Topic: "t", DLQTopic: "t.dlq"}}, Databases: []console.Database{{Name: "default"}}})
	if err != nil {
		t.Fatal(err)
	}
	for _, back := range []string{`/console/../\evil.example/`, `//evil.example/console/`, `/console/..//evil.example`, `https://evil.example/console/`} {
		req := httptest.NewRequest(http.MethodPost, "/console/logout", strings.NewReader(url.Values{"back": {back}}.Encode()))
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		req.Host = "127.0.0.1:9464"
		w := httptest.NewRecorder()
		con.ServeHTTP(w, req)
		if loc := w.Header().Get("Location"); loc != "/console/letters" {
			t.Fatalf("sign out with back=%q redirects to %q; want /console/letters", back, loc)
		}
	}
}
