package console_test

import (
	"bytes"
	"context"
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
)

// The personal data the letters carry, one marker for each place it can
// be: a payload and a header on the dead-letter topic, a payload and a
// header of a letter parked in the database.
var markers = []string{"pii-topic-payload@example.com", "pii-topic-header", "pii-parked-payload@example.com", "pii-parked-header"}

// Issue 28, item 10: a console without a token showed every letter's
// payload and headers to whoever reached its port. Now a person who has not
// signed in sees neither, on any page, and is told why; a signed-in person
// sees them, through Config.Redact when a team sets it.
func TestPayloadsAndHeadersOnlyForASignedInPerson(t *testing.T) {
	brokers := testenv.Brokers(t)
	db := oncetest.NewDB(t)
	dlqTopic := testenv.Topic(t, brokers, 1)
	target := testenv.Topic(t, brokers, 1)
	event := uuid.Must(uuid.NewV7())
	if _, _, err := testenv.Producer(t, brokers).SendMessage(&sarama.ProducerMessage{Topic: dlqTopic,
		Value: sarama.StringEncoder(`{"event_id":"` + event.String() + `","email":"` + markers[0] + `"}`),
		Headers: []sarama.RecordHeader{{Key: []byte(middleware.PoisonedTopicKey), Value: []byte(target)},
			{Key: []byte(middleware.PoisonedHandlerKey), Value: []byte("billing")},
			{Key: []byte(middleware.ReasonForPoisonedKey), Value: []byte("card declined")},
			{Key: []byte("x-customer"), Value: []byte(markers[1])}}}); err != nil {
		t.Fatal(err)
	}
	store, err := dlq.NewStore(db.Tables)
	if err != nil {
		t.Fatal(err)
	}
	if err := pgdb.InTx(context.Background(), db.Pool, func(tx pgx.Tx) error {
		return store.Park(context.Background(), tx, dlq.Letter{Topic: dlqTopic,
			Payload: []byte(`{"event_id":"` + uuid.Must(uuid.NewV7()).String() + `","email":"` + markers[2] + `"}`),
			Headers: map[string]string{middleware.PoisonedTopicKey: target, middleware.PoisonedHandlerKey: "billing",
				middleware.ReasonForPoisonedKey: "card declined", "x-customer": markers[3]}})
	}); err != nil {
		t.Fatal(err)
	}
	letter := url.Values{"topic": {dlqTopic}, "partition": {"0"}, "offset": {"0"}}.Encode()
	// Every page that shows letters, or could.
	pages := []string{"/letters", "/letter?" + letter, "/replay?" + letter, "/replay?reason=card", "/inbox?event=" + event.String(), "/groups"}
	serve := func(t *testing.T, cfg console.Config, signIn bool) map[string]string {
		t.Helper()
		cfg.Brokers, cfg.Sarama, cfg.Tables = brokers, pipelinetest.SaramaConfig(t), db.Tables
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
			out[p] = body
		}
		// The letters were read: their pages show them, whatever they hide.
		if !strings.Contains(out["/letter?"+letter], event.String()) || !strings.Contains(out["/letters"], "card declined") ||
			!strings.Contains(out["/letters"], `id="parked"`) {
			t.Fatalf("the letters are not on the pages:\n%s\n%s", out["/letter?"+letter], out["/letters"])
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

	t.Run("no token", func(t *testing.T) {
		got := serve(t, console.Config{}, false)
		absent(t, got, markers...)
		for _, p := range []string{"/letter?" + letter, "/letters"} {
			if !strings.Contains(got[p], "this console has no token") {
				t.Errorf("%s does not say why payload and headers are hidden:\n%s", p, got[p])
			}
		}
	})
	t.Run("not signed in", func(t *testing.T) {
		got := serve(t, console.Config{Token: token}, false)
		absent(t, got, markers...)
		for _, p := range []string{"/letter?" + letter, "/letters"} {
			if !strings.Contains(got[p], "until you sign in") {
				t.Errorf("%s does not say why payload and headers are hidden:\n%s", p, got[p])
			}
		}
	})
	t.Run("signed in", func(t *testing.T) {
		got := serve(t, console.Config{Token: token}, true)
		for _, m := range markers[:2] {
			if !strings.Contains(got["/letter?"+letter], m) {
				t.Errorf("the letter's page, signed in, lacks %q:\n%s", m, got["/letter?"+letter])
			}
		}
		for _, m := range markers[2:] {
			if !strings.Contains(got["/letters"], m) {
				t.Errorf("the parked letter, signed in, lacks %q:\n%s", m, got["/letters"])
			}
		}
	})
	t.Run("signed in, redacted", func(t *testing.T) {
		var calls atomic.Int64
		redact := func(p console.RedactParams) console.Redacted {
			calls.Add(1)
			if p.Topic != target || p.Group != "billing" || p.DLQTopic != dlqTopic {
				t.Errorf("Redact got topic %q, group %q, dead-letter topic %q", p.Topic, p.Group, p.DLQTopic)
			}
			headers := p.Headers // a copy of the console's: Redact may change it
			headers["x-customer"] = "header-redacted"
			return console.Redacted{Payload: bytes.ReplaceAll(p.Payload, []byte("@example.com"), []byte("@redacted.example")), Headers: headers}
		}
		got := serve(t, console.Config{Token: token, Redact: redact}, true)
		absent(t, got, markers...)
		if calls.Load() == 0 {
			t.Fatal("Redact was never called")
		}
		for p, want := range map[string][]string{"/letter?" + letter: {"pii-topic-payload@redacted.example", "header-redacted"},
			"/letters": {"pii-parked-payload@redacted.example", "header-redacted"}} {
			for _, w := range want {
				if !strings.Contains(got[p], w) {
					t.Errorf("%s lacks the redacted %q:\n%s", p, w, got[p])
				}
			}
		}
	})
	t.Run("signed in, a redaction that panics", func(t *testing.T) {
		got := serve(t, console.Config{Token: token, Redact: func(console.RedactParams) console.Redacted { panic("a team's bug") }}, true)
		absent(t, got, markers...)
		if !strings.Contains(got["/letter?"+letter], "redaction (console.Config.Redact) failed") {
			t.Errorf("the letter's page does not say why it hides them:\n%s", got["/letter?"+letter])
		}
	})
}
