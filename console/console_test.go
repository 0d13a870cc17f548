package console_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once"
	"github.com/once-dev/once/console"
	"github.com/once-dev/once/inbox"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/oncetest"
	"github.com/once-dev/once/schema"
)

type order struct {
	ID    uuid.UUID `json:"event_id"`
	Price int       `json:"price"`
}

func (o order) EventID() uuid.UUID { return o.ID }

const token = "console-test-token-0123456789"

// A poison message staged on a real service shows on the letters page with
// its reason, and its payload only once the person signed in; after the
// handler is fixed, a replay from the page (signed in,
// confirmed) takes effect once, and the inbox page says the replay
// processed it. A request without the token, and a cross-site POST with
// it, cannot replay. With ONCE_CONSOLE_SCREENSHOTS=docs, each page's
// screenshot is written to docs/.
func TestConsoleInABrowser(t *testing.T) {
	brokers := testenv.Brokers(t)
	pool := testenv.Postgres(t)
	chromium := testenv.Chromium(t)
	tables := schema.Config{Schema: "once_console_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+tables.Schema+" CASCADE") })
	topic := testenv.Topic(t, brokers, 1)
	group := "orders-" + uuid.NewString()[:8]

	var fixed atomic.Bool
	var effects atomic.Int64
	svc, err := once.New(context.Background(), once.Config{Brokers: brokers, DatabaseURL: os.Getenv("DATABASE_URL"), Tables: tables,
		Topics: []once.Binding{once.Topic[order]{Name: topic,
			Decode: func(b []byte) (o order, err error) { return o, json.Unmarshal(b, &o) },
			Groups: []once.Group[order]{{Name: group, Handle: func(_ context.Context, _ pgx.Tx, o order) error {
				if !fixed.Load() && o.Price < 0 {
					return once.Permanent(errors.New("price must not be negative"))
				}
				effects.Add(1)
				return nil
			}}}}}})
	if err != nil {
		t.Fatal(err)
	}
	oncetest.Run(t, svc)
	con, err := svc.Console(console.Config{Token: token})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(con)
	t.Cleanup(srv.Close)

	poison := order{ID: uuid.Must(uuid.NewV7()), Price: -5}
	b, _ := json.Marshal(poison)
	testenv.Publish(t, testenv.Producer(t, brokers), topic, "k", b)
	testenv.Eventually(t, 30*time.Second, "the poison message on the dead-letter topic", func() bool {
		return testenv.MessageCount(t, brokers, topic+".dlq") == 1
	})

	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(chromium), chromedp.NoSandbox, chromedp.WindowSize(1280, 900))
	actx, cancel := chromedp.NewExecAllocator(context.Background(), opts...)
	t.Cleanup(cancel)
	ctx, cancel := chromedp.NewContext(actx)
	t.Cleanup(cancel)
	if err := chromedp.Do(ctx); err != nil { // starts the browser, on a context without a deadline
		t.Fatalf("start %s: %v", chromium, err)
	}
	base := srv.URL + console.DefaultPrefix

	// Not signed in, a reason may be personal data: the letters are
	// grouped by source topic and group, and the page says why.
	do(t, ctx, "the letters page", chromedp.Navigate(base+"/letters"))
	if sources := text(t, ctx, "#sources"); !strings.Contains(sources, topic) || !strings.Contains(sources, group) {
		t.Fatalf("the sources table: %q; want the poison's topic and group", sources)
	}
	if hidden := text(t, ctx, "#reasons-hidden"); !strings.Contains(hidden, "until you sign in") {
		t.Fatalf("the letters page before signing in: %q; want its reasons hidden", hidden)
	}
	do(t, ctx, "a letter's page", chromedp.Click("#letters a"))
	// Not signed in, the reason and the payload may be personal data: the
	// page says why they are not shown.
	if hidden := text(t, ctx, "#hidden"); !strings.Contains(hidden, "until you sign in") {
		t.Fatalf("the letter's page before signing in: %q; want its reason and payload hidden", hidden)
	}
	letterURL, err := chromedp.Run(ctx, chromedp.Location())
	if err != nil {
		t.Fatal(err)
	}
	// #signed-in is only on the page the login redirected to: waiting for
	// #replay-one, on both, could find it on the page before, and a click there
	// would cancel the login's navigation.
	do(t, ctx, "sign in", chromedp.SendKeys(`input[name=token]`, token), chromedp.Click("#signin"), chromedp.WaitVisible("#signed-in"))
	if payload := text(t, ctx, "#payload"); !strings.Contains(payload, poison.ID.String()) || !strings.Contains(payload, "\n  \"price\": -5") {
		t.Fatalf("the letter's payload, signed in: %q; want it pretty-printed", payload)
	}
	if reason := text(t, ctx, "#reason"); reason != "price must not be negative" {
		t.Fatalf("the letter's reason, signed in: %q", reason)
	}
	shot(t, ctx, "console-letter.png")
	do(t, ctx, "the letters page, signed in", chromedp.Navigate(base+"/letters"), chromedp.WaitVisible("#signed-in"))
	if reasons := text(t, ctx, "#reasons"); !strings.Contains(reasons, "price must not be negative") || !strings.Contains(reasons, group) {
		t.Fatalf("the reasons table: %q; want the poison's reason and group", reasons)
	}
	shot(t, ctx, "console-letters.png")
	do(t, ctx, "the confirmation", chromedp.Navigate(letterURL), chromedp.WaitVisible("#replay-one"), chromedp.Click("#replay-one"), chromedp.WaitVisible("#confirm"))
	if window := text(t, ctx, "#window"); !strings.Contains(window, "1 within the replay window") {
		t.Fatalf("the confirmation says %q; want the letter within the window", window)
	}
	shot(t, ctx, "console-confirm.png")

	fixed.Store(true)
	do(t, ctx, "the replay", chromedp.Click("#confirm"))
	if report := text(t, ctx, "#report"); !strings.Contains(report, "Replayed 1") {
		t.Fatalf("the replay's report: %q", report)
	}
	// The handler's effect counts before its claim commits; the inbox page
	// reads the claim.
	testenv.Eventually(t, 30*time.Second, "the replayed event processed and its claim committed", func() bool {
		claims, err := inbox.Lookup(context.Background(), pool, tables, poison.ID, group)
		return err == nil && len(claims) == 1 && effects.Load() == 1
	})
	do(t, ctx, "the replay's outcome", chromedp.Click("#outcomes a"))
	if outcome := text(t, ctx, "#claims .outcome"); outcome != "processed by the replay" {
		t.Fatalf("the inbox says %q; want the replay to have processed the event", outcome)
	}
	shot(t, ctx, "console-inbox.png")
	do(t, ctx, "the groups page", chromedp.Navigate(base+"/groups"), chromedp.WaitVisible("#lag"))
	shot(t, ctx, "console-groups.png")

	// Outside the browser: a form without the session, and one from another
	// site with it, are refused, and nothing more reaches the topic.
	letter, _ := url.Parse(letterURL)
	form := letter.Query()
	if code, body := post(t, http.DefaultClient, base+"/replay", form, nil); code != http.StatusForbidden || !strings.Contains(body, "Sign in") {
		t.Fatalf("a replay without the token: %d\n%s", code, body)
	}
	jar, _ := cookiejar.New(nil)
	signedIn := &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	if code, _ := post(t, signedIn, base+"/login", url.Values{"token": {token}}, nil); code != http.StatusSeeOther {
		t.Fatalf("sign in: %d", code)
	}
	resp, err := signedIn.Get(base + "/replay?" + form.Encode())
	if err != nil {
		t.Fatal(err)
	}
	page, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	m := regexp.MustCompile(`name="csrf" value="([0-9a-f]+)"`).FindSubmatch(page)
	if m == nil {
		t.Fatalf("no CSRF token on the confirmation page:\n%s", page)
	}
	if code, body := post(t, signedIn, base+"/replay", form, nil); code != http.StatusForbidden || !strings.Contains(body, "CSRF") {
		t.Fatalf("a replay signed in, without the CSRF token: %d\n%s", code, body)
	}
	form.Set("csrf", string(m[1]))
	form.Set("plan", hidden(t, string(page), "plan"))
	for _, h := range []map[string]string{{"Sec-Fetch-Site": "cross-site"}, {"Origin": "https://evil.example"}} {
		if code, body := post(t, signedIn, base+"/replay", form, h); code != http.StatusForbidden {
			t.Fatalf("a cross-site replay (%v) with the session and the CSRF token: %d\n%s", h, code, body)
		}
	}
	time.Sleep(500 * time.Millisecond) // a replay that got through would be on the topic by now
	if n := testenv.MessageCount(t, brokers, topic); n != 2 {
		t.Fatalf("%d messages on %s; want 2: the poison and its one replay", n, topic)
	}
	if effects.Load() != 1 {
		t.Fatalf("the effect ran %d times; want once", effects.Load())
	}

	// The replay's answer is a redirect to its report: reloading the
	// report shows it again and sends nothing; the confirmation's form
	// posted again (a double click) replays nothing either.
	code, _, where := postRedirect(t, signedIn, base+"/replay", form)
	if code != http.StatusSeeOther {
		t.Fatalf("a replay signed in, with the CSRF token: %d; want a redirect to its report", code)
	}
	if code, body, _ := postRedirect(t, signedIn, base+"/replay", form); code != http.StatusConflict {
		t.Fatalf("the same confirmation posted again: %d; want 409\n%s", code, body)
	}
	for range 2 {
		if code, body := get(t, signedIn, srv.URL+where); code != http.StatusOK || !strings.Contains(body, "Replayed <strong>1</strong>") {
			t.Fatalf("the report %s: %d\n%s", where, code, body)
		}
	}
	testenv.Eventually(t, 10*time.Second, "the second replay on the topic", func() bool { return testenv.MessageCount(t, brokers, topic) == 3 })
	time.Sleep(500 * time.Millisecond)
	if n := testenv.MessageCount(t, brokers, topic); n != 3 {
		t.Fatalf("%d messages on %s after reloading the report twice; want 3", n, topic)
	}

	// A filtered group's confirmation counts what its replay will send:
	// the letter once, then (its progress moved) nothing.
	reason := url.Values{"reason": {"^price must not be negative$"}}
	for i, want := range []string{"<strong>1</strong> within", "<strong>0</strong> within"} {
		_, page := get(t, signedIn, base+"/replay?"+reason.Encode())
		if !strings.Contains(page, want) {
			t.Fatalf("the group's confirmation, %d: want %q in\n%s", i, want, page)
		}
		if i == 1 {
			break
		}
		group := url.Values{"csrf": {csrfOf(t, page)}, "plan": {hidden(t, page, "plan")}}
		if code, _, where := postRedirect(t, signedIn, base+"/replay", group); code != http.StatusSeeOther {
			t.Fatalf("the group's replay: %d", code)
		} else if _, body := get(t, signedIn, srv.URL+where); !strings.Contains(body, "Replayed <strong>1</strong>") {
			t.Fatalf("the group's report:\n%s", body)
		}
	}
	testenv.Eventually(t, 10*time.Second, "the group's replay on the topic", func() bool { return testenv.MessageCount(t, brokers, topic) == 4 })

	// Two days on, the letter is outside the 24h window: the confirmation
	// says so and offers no replay, and a replay posted anyway skips it.
	later, err := svc.Console(console.Config{Token: token, Now: func() time.Time { return time.Now().Add(48 * time.Hour) }})
	if err != nil {
		t.Fatal(err)
	}
	laterSrv := httptest.NewServer(later)
	t.Cleanup(laterSrv.Close)
	laterBase := laterSrv.URL + console.DefaultPrefix
	laterJar, _ := cookiejar.New(nil)
	laterClient := &http.Client{Jar: laterJar, CheckRedirect: signedIn.CheckRedirect}
	post(t, laterClient, laterBase+"/login", url.Values{"token": {token}}, nil)
	_, page = getBytes(t, laterClient, laterBase+"/replay?"+letter.Query().Encode())
	if !strings.Contains(string(page), "<strong>0</strong> within the replay window, <strong>1</strong> outside it") || !strings.Contains(string(page), `id="confirm" disabled`) {
		t.Fatalf("the confirmation of a letter outside the window:\n%s", page)
	}
	stale := url.Values{"csrf": {csrfOf(t, string(page))}, "plan": {hidden(t, string(page), "plan")}}
	if _, _, where := postRedirect(t, laterClient, laterBase+"/replay", stale); where == "" {
		t.Fatal("a replay of a letter outside the window was not answered with its report")
	} else if _, body := get(t, laterClient, laterSrv.URL+where); !strings.Contains(body, "Replayed <strong>0</strong>, skipped <strong>1</strong>") {
		t.Fatalf("the report of a letter outside the window:\n%s", body)
	}

	// Forgetting a claim needs the session and the form's token.
	claims := func() int {
		n, err := inbox.Lookup(context.Background(), pool, tables, poison.ID, group)
		if err != nil {
			t.Fatal(err)
		}
		return len(n)
	}
	forget := url.Values{"event": {poison.ID.String()}, "group": {group}, "database": {"default"}, "confirm": {"yes"}}
	if code, _ := post(t, http.DefaultClient, base+"/forget", forget, nil); code != http.StatusForbidden || claims() != 1 {
		t.Fatalf("a forget without the token: %d, %d claims left; want 403 and the claim kept", code, claims())
	}

	// Signing out ends that session: its cookie, kept, no longer replays.
	cookies := jar.Cookies(letter)
	if code, _ := post(t, signedIn, base+"/logout", url.Values{}, nil); code != http.StatusSeeOther {
		t.Fatalf("sign out: %d", code)
	}
	replayed := &http.Client{Jar: &stickyJar{cookies: cookies}}
	if code, body := post(t, replayed, base+"/replay", form, nil); code != http.StatusForbidden || !strings.Contains(body, "Sign in") {
		t.Fatalf("a replay with the cookie of a session signed out: %d\n%s", code, body)
	}

	// A page asked for under another name (DNS rebinding) is refused.
	req, _ := http.NewRequest(http.MethodGet, base+"/letters", nil)
	req.Host = "rebound.evil.example"
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusMisdirectedRequest || strings.Contains(string(body), "price must not be negative") {
		t.Fatalf("a request for host rebound.evil.example: %d\n%s", resp.StatusCode, body)
	}
	if n := testenv.MessageCount(t, brokers, topic); n != 4 || effects.Load() != 1 {
		t.Fatalf("%d messages on %s, the effect ran %d times; want 4 (the poison, three replays) and once", n, topic, effects.Load())
	}
}

// stickyJar sends its cookies whatever the server says of them: a copy
// of a session's cookie kept after signing out.
type stickyJar struct{ cookies []*http.Cookie }

func (j *stickyJar) SetCookies(*url.URL, []*http.Cookie) {}
func (j *stickyJar) Cookies(*url.URL) []*http.Cookie     { return j.cookies }

func get(t *testing.T, c *http.Client, to string) (int, string) {
	t.Helper()
	code, b := getBytes(t, c, to)
	return code, string(b)
}

func getBytes(t *testing.T, c *http.Client, to string) (int, []byte) {
	t.Helper()
	resp, err := c.Get(to)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// postRedirect posts form and returns the answer's code, body and where
// it redirects to.
func postRedirect(t *testing.T, c *http.Client, to string, form url.Values) (int, string, string) {
	t.Helper()
	resp, err := c.PostForm(to, form)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), resp.Header.Get("Location")
}

func csrfOf(t *testing.T, page string) string {
	t.Helper()
	return hidden(t, page, "csrf")
}

// hidden is the value of the page's hidden field name.
func hidden(t *testing.T, page, name string) string {
	t.Helper()
	m := regexp.MustCompile(`name="` + name + `" value="([0-9a-f]+)"`).FindStringSubmatch(page)
	if m == nil {
		t.Fatalf("no %s on the page:\n%s", name, page)
	}
	return m[1]
}

func do(t *testing.T, ctx context.Context, what string, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	for {
		err := chromedp.Do(ctx, steps...)
		if err == nil {
			return
		}
		// The page was replaced between finding a node and acting on it
		// (a redirect still landing): the action did not happen; again.
		if strings.Contains(err.Error(), "Could not find node with given id") && ctx.Err() == nil {
			time.Sleep(100 * time.Millisecond)
			continue
		}
		t.Fatalf("%s: %v\npage:\n%s", what, err, html(ctx))
	}
}

func text(t *testing.T, ctx context.Context, sel string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	s, err := chromedp.Run(ctx, chromedp.Text(sel))
	if err != nil {
		t.Fatalf("the text of %s: %v\npage:\n%s", sel, err, html(ctx))
	}
	return s
}

func html(ctx context.Context) string {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	s, _ := chromedp.Run(ctx, chromedp.OuterHTML("html"))
	return s
}

// shot writes the page's screenshot to $ONCE_CONSOLE_SCREENSHOTS (a path
// from the repository's root, such as docs): only when asked, so a test run
// does not change the tree.
func shot(t *testing.T, ctx context.Context, name string) {
	t.Helper()
	dir := os.Getenv("ONCE_CONSOLE_SCREENSHOTS")
	if dir == "" {
		return
	}
	if !filepath.IsAbs(dir) {
		dir = filepath.Join(testenv.RepoRoot(), dir)
	}
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err == nil {
		err = os.WriteFile(filepath.Join(dir, name), png, 0o644)
	}
	if err != nil {
		t.Fatalf("screenshot %s: %v", name, err)
	}
}

func post(t *testing.T, c *http.Client, to string, form url.Values, headers map[string]string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, to, strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}
