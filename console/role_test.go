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
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/console"
	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/internal/pipelinetest"
	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/internal/testenv"
)

// The console's Forget under the role that may forget (docs/operating.md,
// "Least privilege", step 6): logged in as billing_svc, it forgets a claim
// of billing (before the reference service's migration 00013 it answered
// 404 "permission denied for table processed_event"), and not one of
// analytics, which that role cannot see.
func TestTheConsoleForgetsUnderTheGroupsRole(t *testing.T) {
	ctx := context.Background()
	admin := reftest.Postgres(t)
	testenv.LoginRole(t, admin, "billing_svc", "once_billing")
	pool := testenv.PoolAt(t, testenv.URLAs(testenv.Where{Mode: pgx.QueryExecModeExec, Pooled: true}.URL(t), "billing_svc", ""))
	suffix := ".console-" + uuid.NewString()[:8]
	billing, analytics := "billing"+suffix, "analytics"+suffix
	id := uuid.Must(uuid.NewV7())
	if _, err := admin.Exec(ctx, `INSERT INTO processed_event (event_id, consumer_group) VALUES ($1, $2), ($1, $3)`, id, billing, analytics); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = admin.Exec(context.Background(), `DELETE FROM processed_event WHERE event_id = $1`, id) })

	con, err := console.New(console.Config{Brokers: testenv.Brokers(t), Sarama: pipelinetest.SaramaConfig(t),
		Routes:    []dlq.Route{{Topic: "orders", DLQTopic: "orders.dlq"}},
		Databases: []console.Database{{Name: "default", DB: pool}}, Token: token})
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
	base := srv.URL + "/console"
	_, page := get(t, c, base+"/inbox?"+url.Values{"event": {id.String()}}.Encode())
	if !strings.Contains(page, "<td>"+billing+"</td>") || strings.Contains(page, analytics) {
		t.Errorf("the inbox under billing_svc shows analytics' claim, or not billing's:\n%s", page)
	}
	forget := func(group string) int {
		code, _, _ := postRedirect(t, c, base+"/forget", url.Values{"csrf": {csrfOf(t, page)}, "event": {id.String()}, "group": {group},
			"database": {"default"}, "confirm": {"yes"}})
		return code
	}
	if code := forget(analytics); code == http.StatusSeeOther {
		t.Errorf("billing_svc forgot analytics' claim")
	}
	if code := forget(billing); code != http.StatusSeeOther {
		t.Errorf("billing_svc forgets billing's claim: %d; want 303", code)
	}
	var left []string
	rows, _ := admin.Query(ctx, `SELECT consumer_group FROM processed_event WHERE event_id = $1`, id)
	for rows.Next() {
		var g string
		_ = rows.Scan(&g)
		left = append(left, g)
	}
	if rows.Err() != nil || len(left) != 1 || left[0] != analytics {
		t.Errorf("claims left %v (%v); want analytics' alone", left, rows.Err())
	}
}
