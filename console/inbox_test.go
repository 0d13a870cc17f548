package console_test

import (
	"context"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/once-dev/once/console"
	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/internal/pipelinetest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/middleware/idempotency"
)

// The inbox finds an event by its producer's own id when a topic derives
// its ids (IDNamespaces): every event derived from that id under the
// topics' namespaces, whatever its time and however the UUID is written,
// and nothing under a namespace no topic has. Each claim is forgotten by
// its own event id. Without namespaces the producer's id is refused,
// naming the setting.
func TestTheInboxFindsAnEventByItsProducersID(t *testing.T) {
	pool := testenv.Postgres(t)
	ctx := context.Background()
	foreign := uuid.NewString() // the producer's UUIDv4
	suffix := uuid.NewString()[:8]
	billing, analytics := "billing-"+suffix, "analytics-"+suffix
	t0 := time.Now().Add(-time.Hour).Truncate(time.Millisecond)
	first := idempotency.DeriveEventID("inventory", foreign, t0)
	resent := idempotency.DeriveEventID("inventory", foreign, t0.Add(time.Minute))
	elsewhere := idempotency.DeriveEventID("payments", foreign, t0)
	for _, c := range []struct {
		id    uuid.UUID
		group string
	}{{first, billing}, {first, analytics}, {resent, billing}, {elsewhere, billing}} {
		if _, err := pool.Exec(ctx, `INSERT INTO processed_event (event_id, consumer_group, payload_sha256) VALUES ($1, $2, '\xabcd')`, c.id, c.group); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), `DELETE FROM processed_event WHERE consumer_group = ANY($1)`, []string{billing, analytics})
	})
	serve := func(namespaces ...string) (string, *http.Client) {
		con, err := console.New(console.Config{Brokers: testenv.Brokers(t), Sarama: pipelinetest.SaramaConfig(t),
			Routes:    []dlq.Route{{Topic: "inventory.reservations", DLQTopic: "inventory.reservations.dlq"}},
			Databases: []console.Database{{Name: "default", DB: pool}}, Token: token, IDNamespaces: namespaces})
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(con)
		t.Cleanup(srv.Close)
		jar, _ := cookiejar.New(nil)
		c := &http.Client{Jar: jar, Timeout: 30 * time.Second, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
		if code, _ := post(t, c, srv.URL+"/console/login", url.Values{"token": {token}}, nil); code != http.StatusSeeOther {
			t.Fatalf("sign in: %d", code)
		}
		return srv.URL + "/console", c
	}
	inboxOf := func(base, event string) string { return base + "/inbox?" + url.Values{"event": {event}}.Encode() }

	base, c := serve("inventory", "", "inventory") // two topics of one producer
	for _, asTyped := range []string{foreign, strings.ToUpper(foreign), "{" + foreign + "}"} {
		code, page := get(t, c, inboxOf(base, asTyped))
		if code != http.StatusOK || strings.Count(page, "<td>"+billing+"</td>") != 2 || strings.Count(page, "<td>"+analytics+"</td>") != 1 ||
			!strings.Contains(page, first.String()) || !strings.Contains(page, resent.String()) || strings.Contains(page, elsewhere.String()) {
			t.Fatalf("the inbox for the producer's id %s: %d; want the claims of %s (billing, analytics) and %s (billing), not %s:\n%s",
				asTyped, code, first, resent, elsewhere, page)
		}
	}
	code, page := get(t, c, inboxOf(base, first.String()))
	if code != http.StatusOK || !strings.Contains(page, "<td>"+analytics+"</td>") || strings.Contains(page, resent.String()) {
		t.Fatalf("the inbox for the event id %s: %d\n%s", first, code, page)
	}

	_, page = get(t, c, inboxOf(base, foreign))
	forget := url.Values{"csrf": {csrfOf(t, page)}, "event": {first.String()}, "looked": {foreign}, "group": {billing}, "database": {"default"}, "confirm": {"yes"}}
	code, body, to := postRedirect(t, c, base+"/forget", forget)
	if code != http.StatusSeeOther || to != inboxOf("/console", foreign) {
		t.Fatalf("forget: %d to %q\n%s", code, to, body)
	}
	var left []string
	rows, err := pool.Query(ctx, `SELECT event_id::text || ' ' || consumer_group FROM processed_event WHERE consumer_group = ANY($1) ORDER BY 1`, []string{billing, analytics})
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		left = append(left, s)
	}
	if len(left) != 3 || strings.Contains(strings.Join(left, ","), first.String()+" "+billing) {
		t.Fatalf("claims left %v; want all but billing's of %s", left, first)
	}

	base, c = serve()
	code, page = get(t, c, inboxOf(base, foreign))
	if code != http.StatusBadRequest || !strings.Contains(page, "UUID version 4") || !strings.Contains(page, "IDNamespace") {
		t.Fatalf("a producer's id without namespaces: %d; want 400 naming IDNamespace\n%s", code, page)
	}
}
