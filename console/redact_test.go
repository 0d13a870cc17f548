package console_test

import (
	"context"
	"encoding/json"
	"errors"
	htmlpkg "html"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/console"
	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/internal/pipelinetest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/oncetest"
	"github.com/once-dev/once/pgdb"
	"github.com/once-dev/once/pipeline"
)

// The personal data the console could show, one marker for each place it
// can be, and the page that shows it to a signed-in person (without a
// Redact): a letter's payload, header and reason on the dead-letter topic
// (its page); its reason (the letters page); a parked letter's payload,
// header, reason and last error (the letters page); a held message's Kafka
// key and last error (the groups page). The forged ones are where only the
// library's own names belong (a letter's source topic and group headers)
// and an event id that is no UUID: no page shows them to anyone.
var (
	onLetterPage  = []string{"pii-topic-payload@example.com", "pii-topic-header", "pii-topic-reason@example.com"}
	onLettersPage = []string{"pii-topic-reason@example.com", "pii-parked-payload@example.com", "pii-parked-header",
		"pii-parked-reason@example.com", "pii-parked-error@example.com"}
	onGroupsPage = []string{"pii-held-key@example.com", "pii-held-error@example.com"}
	forged       = []string{"pii-forged-topic@example.com", "pii-forged-group@example.com", "pii-forged-id@example.com"}
	markers      = append(append(append(append([]string{}, onLetterPage...), onLettersPage...), onGroupsPage...), forged...)
)

// Issue 28, item 10 and its review: a console without a token showed every
// letter's payload and headers to whoever reached its port, and after that
// fix still its reason (a decoder's error quoting the payload), a parked
// letter's last error, and a held message's key and last error. Now a
// person who has not signed in sees none of them, on any page, and is told
// why; a signed-in person sees them, through Config.Redact when a team
// sets it, and nothing but what it returns.
func TestPersonalDataOnlyForASignedInPerson(t *testing.T) {
	brokers := testenv.Brokers(t)
	db := oncetest.NewDB(t)
	dlqTopic := testenv.Topic(t, brokers, 1)
	target := testenv.Topic(t, brokers, 1)
	prod := testenv.Producer(t, brokers)
	event := uuid.Must(uuid.NewV7())
	if _, _, err := prod.SendMessage(&sarama.ProducerMessage{Topic: dlqTopic,
		Value: sarama.StringEncoder(`{"event_id":"` + event.String() + `","email":"` + onLetterPage[0] + `"}`),
		Headers: []sarama.RecordHeader{{Key: []byte(middleware.PoisonedTopicKey), Value: []byte(target)},
			{Key: []byte(middleware.PoisonedHandlerKey), Value: []byte("billing")},
			{Key: []byte(middleware.ReasonForPoisonedKey), Value: []byte("card declined for " + onLetterPage[2])},
			{Key: []byte("x-customer"), Value: []byte(onLetterPage[1])}}}); err != nil {
		t.Fatal(err)
	}
	// A letter someone else wrote, with text where the library writes names.
	if _, _, err := prod.SendMessage(&sarama.ProducerMessage{Topic: dlqTopic,
		Value: sarama.StringEncoder(`{"event_id":"` + forged[2] + `"}`),
		Headers: []sarama.RecordHeader{{Key: []byte(middleware.PoisonedTopicKey), Value: []byte(forged[0])},
			{Key: []byte(middleware.PoisonedHandlerKey), Value: []byte(forged[1])},
			{Key: []byte(middleware.ReasonForPoisonedKey), Value: []byte("card declined")}}}); err != nil {
		t.Fatal(err)
	}
	store, err := dlq.NewStore(db.Tables)
	if err != nil {
		t.Fatal(err)
	}
	if err := pgdb.InTx(context.Background(), db.Pool, func(tx pgx.Tx) error {
		return store.Park(context.Background(), tx, dlq.Letter{Topic: dlqTopic,
			Payload: []byte(`{"event_id":"` + uuid.Must(uuid.NewV7()).String() + `","email":"` + onLettersPage[1] + `"}`),
			Headers: map[string]string{middleware.PoisonedTopicKey: target, middleware.PoisonedHandlerKey: "billing",
				middleware.ReasonForPoisonedKey: "card declined for " + onLettersPage[3], "x-customer": onLettersPage[2]}})
	}); err != nil {
		t.Fatal(err)
	}
	// What the drainer records when Kafka refuses the letter.
	if _, err := db.Pool.Exec(context.Background(), `UPDATE `+db.Tables.DeadLettersTable().Qualified+` SET attempts = 1, last_error = $1`,
		"kafka: refused for "+onLettersPage[4]); err != nil {
		t.Fatal(err)
	}
	groups := heldMessage(t, brokers, db)

	letter := url.Values{"topic": {dlqTopic}, "partition": {"0"}, "offset": {"0"}}.Encode()
	// Every page that shows letters or held messages, or could.
	pages := []string{"/letters", "/letter?" + letter, "/replay?" + letter, "/replay", "/inbox?event=" + event.String(), "/groups"}
	serve := func(t *testing.T, cfg console.Config, signIn bool) map[string]string {
		t.Helper()
		cfg.Brokers, cfg.Sarama, cfg.Tables, cfg.Groups = brokers, pipelinetest.SaramaConfig(t), db.Tables, groups
		cfg.Routes = []dlq.Route{{Topic: target, DLQTopic: dlqTopic}}
		cfg.Databases = []console.Database{{Name: "default", DB: db.Pool}}
		cfg.ReplayGroup = "replay-" + uuid.NewString()[:8]
		con, err := console.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(con)
		t.Cleanup(srv.Close)
		jar, _ := cookiejar.New(nil)
		c := &http.Client{Jar: jar, Timeout: 60 * time.Second, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
		if signIn {
			if code, _ := post(t, c, srv.URL+"/console/login", url.Values{"token": {cfg.Token}}, nil); code != http.StatusSeeOther {
				t.Fatalf("sign in: %d", code)
			}
		}
		out := map[string]string{}
		for _, p := range pages {
			code, body := get(t, c, srv.URL+"/console"+p)
			if code != http.StatusOK {
				t.Fatalf("GET %s: %d\n%s", p, code, body)
			}
			out[p] = htmlpkg.UnescapeString(body)
		}
		// The letters and the held message were read: their pages list
		// them, whatever they hide.
		if !strings.Contains(out["/letter?"+letter], event.String()) || !strings.Contains(out["/letters"], dlqTopic+"/0@1") ||
			!strings.Contains(out["/letters"], `id="parked"`) || !strings.Contains(out["/groups"], `id="holds"`) {
			t.Fatalf("the letters or the held message are not on the pages:\n%s\n%s\n%s", out["/letter?"+letter], out["/letters"], out["/groups"])
		}
		// Wherever a sign-in shows the reason filter, a person without
		// one is refused it (a pattern would read the reason).
		if !signIn {
			for _, p := range []string{"/letters?reason=declined", "/replay?reason=declined", "/letters?reason_sum=" + dlq.SumReason("card declined")} {
				if code, _ := get(t, c, srv.URL+"/console"+p); code != http.StatusForbidden {
					t.Errorf("GET %s without signing in: %d; want 403", p, code)
				}
			}
		}
		return out
	}
	absent := func(t *testing.T, pages map[string]string, what ...string) {
		t.Helper()
		for p, body := range pages {
			for _, m := range what {
				if strings.Contains(body, m) {
					t.Errorf("%s shows %q:\n%s", p, m, body)
				}
			}
		}
	}
	present := func(t *testing.T, body, page string, what ...string) {
		t.Helper()
		for _, m := range what {
			if !strings.Contains(body, m) {
				t.Errorf("%s lacks %q:\n%s", page, m, body)
			}
		}
	}

	t.Run("no token", func(t *testing.T) {
		got := serve(t, console.Config{}, false)
		absent(t, got, markers...)
		absent(t, got, "card declined")
		for _, p := range []string{"/letter?" + letter, "/letters", "/groups"} {
			present(t, got[p], p, "this console has no token")
		}
		present(t, got["/letters"], "/letters", `id="sources"`, target, "billing")
	})
	t.Run("not signed in", func(t *testing.T) {
		got := serve(t, console.Config{Token: token}, false)
		absent(t, got, markers...)
		absent(t, got, "card declined")
		for _, p := range []string{"/letter?" + letter, "/letters", "/groups"} {
			present(t, got[p], p, "until you sign in")
		}
	})
	t.Run("signed in", func(t *testing.T) {
		got := serve(t, console.Config{Token: token}, true)
		present(t, got["/letter?"+letter], "the letter's page", onLetterPage...)
		present(t, got["/letters"], "the letters page", onLettersPage...)
		present(t, got["/groups"], "the groups page", onGroupsPage...)
		present(t, got["/replay?"+letter], "the confirmation", onLetterPage[2])
		absent(t, got, forged...)
	})
	t.Run("signed in, redacted", func(t *testing.T) {
		var calls, held atomic.Int64
		redact := func(p console.RedactParams) console.Redacted {
			calls.Add(1)
			if p.Key != "" {
				held.Add(1)
			}
			switch {
			case p.Key != "": // the held message: no letter's fields
				if p.DLQTopic != "" || p.Payload != nil || p.Headers != nil || p.Reason == "" {
					t.Errorf("Redact got a held message with dead-letter topic %q, payload %q, headers %v, reason %q", p.DLQTopic, p.Payload, p.Headers, p.Reason)
				}
			case p.Topic == forged[0]: // the forged letter: its headers as they are
			case p.Topic != target || p.Group != "billing" || p.DLQTopic != dlqTopic:
				t.Errorf("Redact got topic %q, group %q, dead-letter topic %q", p.Topic, p.Group, p.DLQTopic)
			}
			if _, ok := p.Headers[middleware.ReasonForPoisonedKey]; ok {
				t.Error("Redact got the reason among the headers: it is Reason")
			}
			mask := func(s string) string { return strings.ReplaceAll(s, "@example.com", "@redacted.example") }
			headers := p.Headers // a copy of the console's: Redact may change it
			if _, ok := headers["x-customer"]; ok {
				headers["x-customer"] = "header-redacted"
			}
			return console.Redacted{Payload: []byte(mask(string(p.Payload))), Headers: headers,
				Reason: mask(p.Reason), Key: mask(p.Key), LastError: mask(p.LastError)}
		}
		got := serve(t, console.Config{Token: token, Redact: redact}, true)
		absent(t, got, markers...)
		if calls.Load() == 0 || held.Load() == 0 {
			t.Fatalf("Redact was called %d times, %d for a held message", calls.Load(), held.Load())
		}
		redacted := func(ms []string) []string {
			var out []string
			for _, m := range ms {
				if r := strings.ReplaceAll(m, "@example.com", "@redacted.example"); r != m {
					out = append(out, r)
				}
			}
			return append(out, "header-redacted")
		}
		present(t, got["/letter?"+letter], "the letter's page", redacted(onLetterPage)...)
		present(t, got["/letters"], "the letters page", redacted(onLettersPage)...)
		present(t, got["/groups"], "the groups page", redacted(onGroupsPage)[:2]...)
	})
	t.Run("signed in, a redaction that panics", func(t *testing.T) {
		got := serve(t, console.Config{Token: token, Redact: func(console.RedactParams) console.Redacted { panic("a team's bug") }}, true)
		absent(t, got, markers...)
		for _, p := range []string{"/letter?" + letter, "/letters", "/groups"} {
			present(t, got[p], p, "redaction (console.Config.Redact) failed")
		}
	})
}

// heldMessage runs a pipeline that holds one message, keyed with a
// marker, its handler failing with another: what a provider's outage
// does. It returns the pipeline once the hold has its error.
func heldMessage(t *testing.T, brokers []string, db *oncetest.DB) *pipeline.Pipeline {
	t.Helper()
	topic := testenv.Topic(t, brokers, 1)
	p, err := pipeline.New(pipeline.Config{Brokers: brokers, DB: db.Pool, Tables: db.Tables, HoldBackoff: 50 * time.Millisecond,
		Topics: []pipeline.Binding{pipeline.Topic[order]{Name: topic,
			Decode: func(b []byte) (o order, err error) { return o, json.Unmarshal(b, &o) },
			Groups: []pipeline.Group[order]{{Name: pipelinetest.UniqueGroup("holder"), Handle: func(context.Context, pgx.Tx, order) error {
				return errors.New("provider down for " + onGroupsPage[1])
			}}}}}})
	if err != nil {
		t.Fatal(err)
	}
	pipelinetest.Start(t, p)
	b, _ := json.Marshal(order{ID: uuid.Must(uuid.NewV7()), Price: 5})
	testenv.Publish(t, testenv.Producer(t, brokers), topic, onGroupsPage[0], b)
	testenv.Eventually(t, 30*time.Second, "the message held with its error", func() bool {
		h := p.Holds()
		return len(h) == 1 && h[0].Err != nil && h[0].Key == onGroupsPage[0]
	})
	return p
}
