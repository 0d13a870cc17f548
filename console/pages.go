package console

import (
	"bytes"
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"maps"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"

	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/inbox"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/pipeline"
)

func parsePages() (map[string]*template.Template, error) {
	funcs := template.FuncMap{
		"age":  func(d time.Duration) string { return humanAge(d) },
		"when": func(t time.Time) string { return t.UTC().Format("2006-01-02 15:04:05Z") },
		"add":  func(a, b int64) int64 { return a + b },
	}
	pages := map[string]*template.Template{}
	for _, name := range []string{"letters", "letter", "confirm", "replayed", "groups", "inbox", "error"} {
		t, err := template.New("layout.html").Funcs(funcs).ParseFS(files, "templates/layout.html", "templates/"+name+".html")
		if err != nil {
			return nil, fmt.Errorf("console: template %s: %w", name, err)
		}
		pages[name] = t
	}
	return pages, nil
}

func humanAge(d time.Duration) string {
	switch {
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh%02dm", int(d.Hours()), int(d.Minutes())%60)
	}
	return fmt.Sprintf("%dd%02dh", int(d.Hours())/24, int(d.Hours())%24)
}

// page is what every page's layout needs.
type page struct {
	Title, Nav, Prefix string
	CanOperate         bool // a token is configured
	SignedIn           bool
	CSRF               string
	Here               string // this page, for a form to come back to
	Window             time.Duration
	Errors             []string
	Data               any
}

func (c *Console) render(w http.ResponseWriter, r *http.Request, status int, name, title string, data any, errs ...error) {
	p := page{Title: title, Nav: name, Prefix: c.cfg.Prefix, CanOperate: c.cfg.Token != "", SignedIn: c.signedIn(r),
		CSRF: c.csrf(r), Here: r.URL.RequestURI(), Window: c.cfg.ReplayWindow, Data: data}
	for _, err := range errs {
		if err != nil {
			p.Errors = append(p.Errors, err.Error())
		}
	}
	var buf bytes.Buffer
	if err := c.pages[name].Execute(&buf, p); err != nil {
		c.cfg.Logger.Error("console: render", "page", name, "err", err)
		http.Error(w, "console: cannot render the page", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_, _ = buf.WriteTo(w)
}

func (c *Console) fail(w http.ResponseWriter, r *http.Request, status int, msg string) {
	c.render(w, r, status, "error", http.StatusText(status), msg)
}

// filterForm is the letters' filter as the page's form and links carry it.
// ReasonSum is a reason group's link's (dlq.Filter.ReasonSum): no reason
// is written in a URL.
type filterForm struct {
	Topic, Group, Reason, ReasonSum, Older, Newer string
}

func filterOf(r *http.Request) filterForm {
	v := func(k string) string { return strings.TrimSpace(r.FormValue(k)) }
	return filterForm{Topic: v("topic"), Group: v("group"), Reason: v("reason"), ReasonSum: v("reason_sum"), Older: v("older"), Newer: v("newer")}
}

func (f filterForm) Query() template.URL {
	q := url.Values{}
	for k, v := range map[string]string{"topic": f.Topic, "group": f.Group, "reason": f.Reason, "reason_sum": f.ReasonSum, "older": f.Older, "newer": f.Newer} {
		if v != "" {
			q.Set(k, v)
		}
	}
	return template.URL(q.Encode())
}

func (f filterForm) IsZero() bool { return f == filterForm{} }

// filter is the dlq.Filter the form selects, with each bad field named.
func (f filterForm) filter() (dlq.Filter, error) {
	var errs []error
	re, err := dlq.ParseReason(f.Reason)
	if err != nil {
		errs = append(errs, fmt.Errorf("reason: %w", err))
	}
	if b, err := hex.DecodeString(f.ReasonSum); err != nil || (len(b) != 0 && len(b) != sha256.Size) {
		errs = append(errs, fmt.Errorf("reason_sum %q: want the 64 hex digits a reason group's link carries", f.ReasonSum))
	}
	dur := func(name, s string) time.Duration {
		if s == "" {
			return 0
		}
		d, err := time.ParseDuration(s)
		if err != nil || d < 0 {
			errs = append(errs, fmt.Errorf("%s %q: want a duration such as 30m or 2h", name, s))
		}
		return d
	}
	out := dlq.Filter{Topic: f.Topic, Group: f.Group, Reason: re, ReasonSum: strings.ToLower(f.ReasonSum), MinAge: dur("older than", f.Older), MaxAge: dur("newer than", f.Newer)}
	if out.MaxAge > 0 && out.MinAge > out.MaxAge {
		errs = append(errs, errors.New("older than must be below newer than"))
	}
	return out, errors.Join(errs...)
}

// dlqTopics are the routes' dead-letter topics, each once: two topics
// may share one.
func (c *Console) dlqTopics() []string {
	out := make([]string, 0, len(c.cfg.Routes))
	for _, r := range c.cfg.Routes {
		if !slices.Contains(out, r.DLQTopic) {
			out = append(out, r.DLQTopic)
		}
	}
	return out
}

func (c *Console) route(dlqTopic string) (dlq.Route, bool) {
	for _, r := range c.cfg.Routes {
		if r.DLQTopic == dlqTopic {
			return r, true
		}
	}
	return dlq.Route{}, false
}

// What a person who has not signed in sees: only what the console's
// configuration or Kafka names, never text of a payload, a key or an
// error, nor of a header but the two names the pipeline writes there from
// the service's configuration (the source topic and the group). Another
// writer of a dead-letter topic could put anything in those two, so a
// topic is shown when it is one of the routes', a group when it reads as a
// consumer group's name, an event id when it is a UUID, a source partition
// and offset when they are numbers; else nothing, to anyone.
var groupName = regexp.MustCompile(`^[A-Za-z0-9._-]{1,249}$`)

func (c *Console) shownTopic(topic string) string {
	if slices.ContainsFunc(c.cfg.Routes, func(r dlq.Route) bool { return r.Topic == topic }) {
		return topic
	}
	return ""
}

func shownGroup(group string) string {
	if groupName.MatchString(group) {
		return group
	}
	return ""
}

func shownID(id string) string {
	if u, err := uuid.Parse(id); err == nil {
		return u.String()
	}
	return ""
}

func shownNumber(n string) string {
	if _, err := strconv.ParseInt(n, 10, 64); err == nil {
		return n
	}
	return ""
}

// letterView is a letter as the pages show it: only what may be shown to
// the person asking. The reason, payload, headers and last error are
// filled only for a signed-in person, through Config.Redact.
type letterView struct {
	DLQTopic  string
	Partition int32
	Offset    int64
	// EventID, Topic and Group as the package doc says they are shown:
	// "" when they are not.
	EventID, Topic, Group string
	EventTime             time.Time
	Age, LetterAge        time.Duration
	InWindow              bool
	// Verdict: its group recorded its verdict with the event's claim
	// (dlq.HeaderVerdict), which a replay cannot change. Shown to anyone:
	// the pipeline writes the header, with one value, and it tells nothing
	// of the event.
	Verdict bool
	Link    template.URL
	// Where the letter's message was consumed: its source partition and
	// offset, from the library's own headers.
	SourcePartition, SourceOffset string
	// Shown: Reason (and, where the page shows them, Pretty and Headers;
	// for a parked letter, LastError) are the letter's, through
	// Config.Redact. Else Hidden says why the page shows none of them.
	Shown   bool
	Hidden  string
	Reason  string
	Pretty  string // the payload, indented when it is JSON
	Headers []header
	// Parked only: where it waits and how its publishing goes.
	Parked    bool
	ParkedID  int64
	Database  string
	Attempts  int
	LastError string
}

type header struct{ Key, Value string }

// Why a page shows no reason, payload, headers, key or error.
const (
	hiddenNoToken  = "Not shown: a reason, a payload, headers, a key or an error may carry personal data, and this console has no token (ONCE_CONSOLE_TOKEN or ONCE_CONSOLE_TOKEN_FILE) for a person to sign in with."
	hiddenSignIn   = "Not shown until you sign in with the console's token (top right): a reason, a payload, headers, a key or an error may carry personal data."
	hiddenRedactor = "Not shown: the console's redaction (console.Config.Redact) failed on this one."
	// A replay's report is kept, and shown to whoever has its link.
	hiddenInReport = "Not shown in a replay's report."
)

// errReasonFilter refuses a reason filter to a person who has not signed
// in: the reason is not shown to them, and a pattern would read it a
// letter at a time.
var errReasonFilter = errors.New("a reason is shown, and filtered on, only to a signed-in person (it may carry personal data, and a pattern would read it a letter at a time)")

// hiddenFrom is why r's person may not see what may be personal data, or
// "" when they may (through Config.Redact).
func (c *Console) hiddenFrom(r *http.Request) string {
	switch {
	case c.cfg.Token == "":
		return hiddenNoToken
	case !c.signedIn(r):
		return hiddenSignIn
	}
	return ""
}

// view is e as a page shows it to a person from whom hidden says what is
// hidden ("" for nothing: its reason, and with payload its payload and
// headers, and lastError for a parked letter, through Config.Redact).
func (c *Console) view(e dlq.Entry, lastError string, now time.Time, hidden string, payload bool) letterView {
	v := letterView{DLQTopic: e.DLQTopic, Partition: e.Partition, Offset: e.Offset, EventID: shownID(e.EventID),
		Topic: c.shownTopic(e.Topic), Group: shownGroup(e.Group), EventTime: e.EventTime,
		Age: now.Sub(e.EventTime), LetterAge: now.Sub(e.LetterAt),
		SourcePartition: shownNumber(e.Headers[pipeline.MetaKafkaPartition]), SourceOffset: shownNumber(e.Headers[pipeline.MetaKafkaOffset])}
	v.InWindow = c.cfg.ReplayWindow == 0 || v.Age <= c.cfg.ReplayWindow
	v.Verdict = e.Verdict
	v.Link = template.URL(url.Values{"topic": {e.DLQTopic}, "partition": {strconv.Itoa(int(e.Partition))}, "offset": {strconv.FormatInt(e.Offset, 10)}}.Encode())
	if hidden != "" {
		v.Hidden = hidden
		return v
	}
	headers := maps.Clone(e.Headers)
	delete(headers, middleware.ReasonForPoisonedKey) // shown as the reason
	out, ok := c.redact(RedactParams{Topic: e.Topic, Group: e.Group, DLQTopic: e.DLQTopic,
		Payload: e.Payload, Headers: headers, Reason: e.Reason, LastError: lastError},
		"dlq", e.DLQTopic, "partition", e.Partition, "offset", e.Offset, "topic", v.Topic)
	if !ok {
		v.Hidden = hiddenRedactor
		return v
	}
	v.Shown, v.Reason, v.LastError = true, out.Reason, out.LastError
	if payload {
		v.Pretty = pretty(out.Payload)
		for _, k := range slices.Sorted(maps.Keys(out.Headers)) {
			v.Headers = append(v.Headers, header{k, out.Headers[k]})
		}
	}
	return v
}

// redact is what Config.Redact lets a signed-in person see of p; false
// when it panicked, and none of it may be shown. where names the letter
// or held message in the log, without any of p.
func (c *Console) redact(p RedactParams, where ...any) (out Redacted, ok bool) {
	if c.cfg.Redact == nil {
		return Redacted{Payload: p.Payload, Headers: p.Headers, Reason: p.Reason, Key: p.Key, LastError: p.LastError}, true
	}
	defer func() {
		if r := recover(); r != nil {
			// The panic's value may quote what it was given: only where.
			c.cfg.Logger.Error("console: Config.Redact panicked; what it was given is hidden", where...)
			out, ok = Redacted{}, false
		}
	}()
	p.Payload, p.Headers = slices.Clone(p.Payload), maps.Clone(p.Headers)
	return c.cfg.Redact(p), true
}

// pretty is payload for a person: indented JSON, else the text, else its
// bytes in hex (a letter is often a payload that does not decode).
func pretty(payload []byte) string {
	var buf bytes.Buffer
	if json.Indent(&buf, payload, "", "  ") == nil {
		return buf.String()
	}
	if utf8.Valid(payload) {
		return string(payload)
	}
	return "(not UTF-8; hex) " + hex.EncodeToString(payload)
}

// letterGroup is a group of letters on the letters page: of one reason
// for a signed-in person, else of one source topic and group.
type letterGroup struct {
	Reason       string // the first line, as Config.Redact lets it be shown
	Topic, Group string // without sign-in
	Count        int
	Topics       []string
	Groups       []string
	Oldest       time.Duration
	Filter       template.URL // "" when no filter selects the group alone
}

type lettersData struct {
	Filter     filterForm
	Topics     []string // the consumed topics, for the filter's choice
	ByReason   bool     // Groups are by reason; else by source
	Hidden     string   // why reasons are not shown
	Groups     []letterGroup
	Letters    []letterView
	Parked     []letterView
	ReplayLink template.URL
}

func (c *Console) letters(w http.ResponseWriter, r *http.Request) {
	ff := filterOf(r)
	f, ferr := ff.filter()
	hidden := c.hiddenFrom(r)
	data := lettersData{Filter: ff, ByReason: hidden == "", Hidden: hidden}
	for _, rt := range c.cfg.Routes {
		data.Topics = append(data.Topics, rt.Topic)
	}
	if ferr != nil {
		c.render(w, r, http.StatusBadRequest, "letters", "Dead letters", data, ferr)
		return
	}
	if hidden != "" && (f.Reason != nil || f.ReasonSum != "") {
		c.render(w, r, http.StatusForbidden, "letters", "Dead letters", data, errReasonFilter)
		return
	}
	now := c.cfg.Now()
	entries, kerr := dlq.List(r.Context(), dlq.ListConfig{Brokers: c.cfg.Brokers, Sarama: c.cfg.Sarama, DLQTopics: c.dlqTopics(), Filter: f, Limit: c.cfg.Limit, Now: c.cfg.Now})
	if kerr != nil {
		kerr = fmt.Errorf("the dead-letter topics on Kafka: %w", kerr)
	}
	groups := map[string]*letterGroup{}
	for i := len(entries) - 1; i >= 0; i-- { // the newest first
		e := entries[i]
		v := c.view(e, "", now, hidden, false)
		data.Letters = append(data.Letters, v)
		var key string
		var g *letterGroup
		if data.ByReason {
			// Grouped, and linked, by the reason as it is, by its sum: the
			// shown one may be redacted, and no reason goes into a URL.
			key = dlq.SumReason(e.Reason)
			if g = groups[key]; g == nil {
				g = &letterGroup{Reason: shortened(firstLine(v.Reason))}
				if !v.Shown {
					g.Reason = v.Hidden
				}
				rf := ff
				rf.Reason, rf.ReasonSum = "", key
				g.Filter = rf.Query()
			}
		} else {
			key = v.Topic + "\x00" + v.Group
			if g = groups[key]; g == nil {
				g = &letterGroup{Topic: v.Topic, Group: v.Group}
				if v.Topic != "" && v.Group != "" {
					rf := ff
					rf.Topic, rf.Group = v.Topic, v.Group
					g.Filter = rf.Query()
				}
			}
		}
		groups[key] = g
		g.Count++
		g.Oldest = max(g.Oldest, v.Age)
		if !slices.Contains(g.Topics, v.Topic) {
			g.Topics = append(g.Topics, v.Topic)
		}
		if !slices.Contains(g.Groups, v.Group) {
			g.Groups = append(g.Groups, v.Group)
		}
	}
	for _, g := range groups {
		data.Groups = append(data.Groups, *g)
	}
	slices.SortFunc(data.Groups, func(a, b letterGroup) int {
		return cmp.Or(b.Count-a.Count, strings.Compare(a.Reason, b.Reason), strings.Compare(a.Topic, b.Topic), strings.Compare(a.Group, b.Group))
	})
	var perrs []error
	for _, db := range c.cfg.Databases {
		parked, err := c.store.ListMatching(r.Context(), db.DB, c.dlqTopics(), f, c.cfg.Limit, now)
		if err != nil {
			perrs = append(perrs, fmt.Errorf("the parked letters in database %s: %w", db.Name, err))
			continue
		}
		for _, p := range parked {
			v := c.view(p.Entry(), p.LastError, now, hidden, true)
			v.Parked, v.ParkedID, v.Database, v.Attempts = true, p.ID, db.Name, p.Attempts
			data.Parked = append(data.Parked, v)
		}
	}
	data.ReplayLink = ff.Query()
	c.render(w, r, http.StatusOK, "letters", "Dead letters", data, append(perrs, kerr)...)
}

// firstLine is the first line of a reason, which groups letters.
func firstLine(s string) string {
	s, _, _ = strings.Cut(strings.TrimSpace(s), "\n")
	return strings.TrimSpace(s)
}

// shortened is a reason as a group's heading shows it: at most 200 runes.
func shortened(reason string) string {
	if reason == "" {
		return "(no reason given)"
	}
	if r := []rune(reason); len(r) > 200 {
		return string(r[:200]) + "…"
	}
	return reason
}

// letterAt reads the letter r names (topic, partition, offset), refusing
// a topic that is not one of the console's dead-letter topics.
func (c *Console) letterAt(r *http.Request) (dlq.Route, int32, int64, dlq.Entry, error) {
	rt, ok := c.route(r.FormValue("topic"))
	p, perr := strconv.ParseInt(r.FormValue("partition"), 10, 32)
	o, oerr := strconv.ParseInt(r.FormValue("offset"), 10, 64)
	if !ok || perr != nil || oerr != nil || p < 0 || o < 0 {
		return rt, 0, 0, dlq.Entry{}, errors.New("no such letter: topic must be one of the dead-letter topics, partition and offset numbers")
	}
	e, err := dlq.ReadLetter(r.Context(), dlq.Config{Brokers: c.cfg.Brokers, Sarama: c.cfg.Sarama, DLQTopic: rt.DLQTopic}, int32(p), o)
	return rt, int32(p), o, e, err
}

func (c *Console) letter(w http.ResponseWriter, r *http.Request) {
	_, _, _, e, err := c.letterAt(r)
	if err != nil {
		c.fail(w, r, http.StatusNotFound, err.Error())
		return
	}
	v := c.view(e, "", c.cfg.Now(), c.hiddenFrom(r), true)
	c.render(w, r, http.StatusOK, "letter", "Dead letter "+e.DLQTopic+"/"+strconv.Itoa(int(e.Partition))+"@"+strconv.FormatInt(e.Offset, 10), v)
}

// confirmData is the replay's confirmation, and its result.
type confirmData struct {
	One      *letterView // one letter; else the filtered group
	Filter   filterForm
	Letters  []letterView // at most Limit of them
	InWindow int64
	Stale    int64
	NotYet   int64 // partitions a filtered replay stops in, at a letter too young
	// Verdicts is how many of the letters the replay sends are of events
	// whose group recorded its verdict: for that group the replay is a
	// duplicate. The form then asks the person to say they know.
	Verdicts int64
	// SkipVerdicts: a filtered replay that leaves the recorded verdicts
	// out (the confirmation's "without them" link, verdicts=skip);
	// SkippedVerdicts counts them.
	SkipVerdicts    bool
	SkippedVerdicts int64
	Plan            string // the confirmation's id, which its form posts
	// After the replay:
	ID     string // the report's, for the inbox's links
	Report dlq.Report
	// At is when the replay started by each database's clock (by name):
	// a claim's time is on its own database's.
	At  map[string]time.Time
	Err string
}

// plan is what a confirmation page showed, and so what its replay does:
// the one letter, or the filter and where each partition's read ended.
// Its form posts only the plan's id; a plan is used once.
type plan struct {
	one    *dlq.Position
	offset int64
	filter filterForm
	until  map[dlq.Position]int64
	// verdicts: letters of recorded verdicts among those it sends; its
	// POST must say the person knows (knowsDuplicate), or it is refused.
	verdicts int64
	// skipVerdicts: a filtered replay that leaves them out.
	skipVerdicts bool
}

// knowsDuplicate is the confirmation's box a person ticks to replay
// letters whose group recorded its verdict.
const knowsDuplicate = "duplicate"

// maxKept is how many confirmations and reports each are kept.
const maxKept = 100

// kept holds the latest maxKept values of a kind by a random id, in this
// process: the confirmations' plans, and the reports a replay's POST
// redirects to (reloading the report shows it again instead of sending
// the replay again).
type kept[T any] struct {
	mu    sync.Mutex
	byID  map[string]T
	order []string
}

func newKept[T any]() kept[T] { return kept[T]{byID: map[string]T{}} }

func (k *kept[T]) put(v T) (string, error) {
	id, err := randomID()
	if err != nil {
		return "", err
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	for len(k.order) >= maxKept {
		delete(k.byID, k.order[0])
		k.order = k.order[1:]
	}
	k.byID[id] = v
	k.order = append(k.order, id)
	return id, nil
}

func (k *kept[T]) get(id string) (T, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	v, ok := k.byID[id]
	return v, ok
}

// take is get, and the value is gone: a plan replays once.
func (k *kept[T]) take(id string) (T, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	v, ok := k.byID[id]
	delete(k.byID, id)
	return v, ok
}

func (c *Console) confirmReplay(w http.ResponseWriter, r *http.Request) {
	now := c.cfg.Now()
	if r.FormValue("offset") != "" {
		rt, p, o, e, err := c.letterAt(r)
		if err != nil {
			c.fail(w, r, http.StatusNotFound, err.Error())
			return
		}
		v := c.view(e, "", now, c.hiddenFrom(r), false)
		d := confirmData{One: &v}
		if v.InWindow {
			d.InWindow = 1
			if v.Verdict {
				d.Verdicts = 1
			}
		} else {
			d.Stale = 1
		}
		d.Plan, err = c.plans.put(plan{one: &dlq.Position{Topic: rt.DLQTopic, Partition: p}, offset: o, verdicts: d.Verdicts})
		c.render(w, r, http.StatusOK, "confirm", "Replay one letter?", d, err)
		return
	}
	ff := filterOf(r)
	f, err := ff.filter()
	if err != nil {
		c.render(w, r, http.StatusBadRequest, "error", "Bad filter", err.Error())
		return
	}
	hidden := c.hiddenFrom(r)
	if hidden != "" && (f.Reason != nil || f.ReasonSum != "") {
		c.render(w, r, http.StatusForbidden, "error", "Forbidden", "Sign in to filter by reason: "+errReasonFilter.Error()+".")
		return
	}
	// A dry run from the replay's own progress: the counts are what the
	// replay will send, not every letter on the topics (letters an earlier
	// replay with this filter sent are not sent again).
	d := confirmData{Filter: ff, SkipVerdicts: r.FormValue("verdicts") == "skip"}
	rep, err := dlq.ReplayRoutes(r.Context(), c.replayConfig(f, d.SkipVerdicts, true, nil, func(e dlq.Entry, o dlq.Outcome) {
		if o == dlq.Replayed && e.Verdict {
			d.Verdicts++
		}
		if (o == dlq.Replayed || o == dlq.SkippedStale) && len(d.Letters) < c.cfg.Limit {
			d.Letters = append(d.Letters, c.view(e, "", now, hidden, false))
		}
	}), c.cfg.Routes)
	d.InWindow, d.Stale, d.NotYet, d.SkippedVerdicts = rep.Replayed, rep.SkippedStale, rep.NotYet, rep.SkippedVerdicts
	if err != nil {
		// Counts read in part are no promise: no form to confirm them.
		c.render(w, r, http.StatusOK, "confirm", "Replay these letters?", d, err)
		return
	}
	d.Plan, err = c.plans.put(plan{filter: ff, until: rep.Ends, verdicts: d.Verdicts, skipVerdicts: d.SkipVerdicts})
	c.render(w, r, http.StatusOK, "confirm", "Replay these letters?", d, err)
}

// replayConfig is the configuration of a replay of a filtered group (in a
// dry run, of its confirmation), telling each letter's outcome to each.
func (c *Console) replayConfig(f dlq.Filter, skipVerdicts, dryRun bool, until map[dlq.Position]int64, each func(dlq.Entry, dlq.Outcome)) dlq.Config {
	return dlq.Config{Brokers: c.cfg.Brokers, Sarama: c.cfg.Sarama, Group: c.cfg.ReplayGroup, MaxAge: c.cfg.ReplayWindow, SkipVerdicts: skipVerdicts,
		Filter: f, Now: c.cfg.Now, DryRun: dryRun, Until: until, Each: each}
}

// databaseClocks are the databases' clocks, by name, which their claims'
// times are on: a replayed event's claim is compared with its own
// database's clock, not with this process's, which may be off by more
// than the replay took.
func (c *Console) databaseClocks(r *http.Request) map[string]time.Time {
	out := map[string]time.Time{}
	for _, db := range c.cfg.Databases {
		var now time.Time
		if err := db.DB.QueryRow(r.Context(), "SELECT clock_timestamp()").Scan(&now); err != nil {
			c.cfg.Logger.Warn("console: a database's clock; its outcomes compare with this process's", "database", db.Name, "err", err)
			now = c.cfg.Now()
		}
		out[db.Name] = now
	}
	return out
}

func (c *Console) replay(w http.ResponseWriter, r *http.Request) {
	// Looked at before it is taken: a form posted without the box ticked
	// leaves its plan for the form posted again with it.
	if pl, ok := c.plans.get(r.PostFormValue("plan")); ok && pl.verdicts > 0 && r.PostFormValue(knowsDuplicate) != "yes" {
		instead := "Go back and tick the box that says you know."
		if pl.one == nil {
			instead = "Go back and tick the box that says you know, or follow its link \"Replay without them\", which leaves them out."
		}
		c.fail(w, r, http.StatusBadRequest, fmt.Sprintf("Not replayed: %d of these letters are of events whose group recorded its verdict with the event's claim, "+
			"which a replay cannot change (for that group it is a duplicate). %s", pl.verdicts, instead))
		return
	}
	pl, ok := c.plans.take(r.PostFormValue("plan"))
	if !ok {
		c.fail(w, r, http.StatusConflict, "This confirmation was used already, or is no longer kept: a replay is sent once per confirmation. Open the letters and confirm again.")
		return
	}
	now := c.cfg.Now()
	d := confirmData{At: c.databaseClocks(r)}
	var err error
	if pl.one != nil {
		rt, ok := c.route(pl.one.Topic)
		if !ok {
			c.fail(w, r, http.StatusNotFound, "no such dead-letter topic")
			return
		}
		var e dlq.Entry
		d.Report, e, err = dlq.ReplayLetter(r.Context(), dlq.Config{Brokers: c.cfg.Brokers, Sarama: c.cfg.Sarama,
			DLQTopic: rt.DLQTopic, Topic: rt.Topic, MaxAge: c.cfg.ReplayWindow, Now: c.cfg.Now}, pl.one.Partition, pl.offset)
		if err == nil || e.DLQTopic != "" {
			v := c.view(e, "", now, hiddenInReport, false)
			d.One = &v
		}
		c.cfg.Logger.Warn("console: replayed a dead letter", "dlq", rt.DLQTopic, "partition", pl.one.Partition, "offset", pl.offset, "event_id", e.EventID, "verdicts", pl.verdicts,
			"replayed", d.Report.Replayed, "skipped_stale", d.Report.SkippedStale, "remote", r.RemoteAddr, "err", err)
	} else {
		f, ferr := pl.filter.filter()
		if ferr != nil {
			c.fail(w, r, http.StatusBadRequest, ferr.Error())
			return
		}
		d.Filter, d.SkipVerdicts = pl.filter, pl.skipVerdicts
		d.Report, err = dlq.ReplayRoutes(r.Context(), c.replayConfig(f, pl.skipVerdicts, false, pl.until, func(e dlq.Entry, o dlq.Outcome) {
			if o == dlq.Replayed && len(d.Letters) < c.cfg.Limit {
				d.Letters = append(d.Letters, c.view(e, "", now, hiddenInReport, false))
			}
		}), c.cfg.Routes)
		c.cfg.Logger.Warn("console: replayed dead letters", "filter", string(pl.filter.Query()), "replayed", d.Report.Replayed, "verdicts", pl.verdicts,
			"skipped_stale", d.Report.SkippedStale, "skipped_verdicts", d.Report.SkippedVerdicts, "filtered", d.Report.Filtered, "remote", r.RemoteAddr, "err", err)
	}
	if err != nil {
		d.Err = err.Error()
	}
	// Redirected to the report's own page: reloading it must not send the
	// replay again, as reloading this POST's answer would.
	id, perr := c.results.put(d)
	if perr != nil {
		c.render(w, r, http.StatusOK, "replayed", "Replayed", d, err, perr)
		return
	}
	http.Redirect(w, r, c.cfg.Prefix+"/replayed?id="+id, http.StatusSeeOther)
}

func (c *Console) replayed(w http.ResponseWriter, r *http.Request) {
	d, ok := c.results.get(r.FormValue("id"))
	d.ID = r.FormValue("id")
	if !ok {
		c.fail(w, r, http.StatusNotFound, "This replay's report is no longer kept (the console keeps the latest reports, in memory): the letters and the inbox show what it did.")
		return
	}
	var err error
	if d.Err != "" {
		err = errors.New(d.Err)
	}
	c.render(w, r, http.StatusOK, "replayed", "Replayed", d, err)
}

type groupsData struct {
	Configured bool
	Hidden     string // why held messages' keys and errors are not shown
	Status     []groupRow
	Holds      []holdRow
	Lag        []lagRow
	TotalLag   int64
	// LagUnknown: some or all of the lag could not be read from Kafka
	// (the page's error says why); what could not is unknown, not 0.
	LagUnknown bool
}

type groupRow struct {
	Topic, Group string
	Joined       bool
	KafkaSilent  time.Duration // Kafka has not answered for this long (then not Joined)
	Partitions   string
	Held         int
	OldestHeld   time.Duration
	Order        string
	KeyOrdered   bool
	HeldKeys     int
	Pinned       time.Duration
	WindowFull   int
}

// holdRow is a held message as the groups page shows it: its key and last
// error only to a signed-in person (Shown), through Config.Redact.
type holdRow struct {
	Topic, Group string
	Partition    int32
	Offset       int64
	For          time.Duration
	Attempts     int
	Shown        bool
	Hidden       string
	Key          string
	Err          string
}

type lagRow struct {
	Topic, Group                  string
	Partition                     int32
	Committed, HighWatermark, Lag int64
}

func (c *Console) groups(w http.ResponseWriter, r *http.Request) {
	var d groupsData
	if c.cfg.Groups == nil {
		c.render(w, r, http.StatusOK, "groups", "Groups", d)
		return
	}
	d.Configured = true
	d.Hidden = c.hiddenFrom(r)
	now := c.cfg.Now()
	for _, s := range c.cfg.Groups.Status() {
		parts := make([]string, 0, len(s.Partitions))
		for _, p := range slices.Sorted(slices.Values(s.Partitions)) {
			parts = append(parts, strconv.Itoa(int(p)))
		}
		order := string(s.Order)
		if order == "" {
			order = "batched"
		}
		d.Status = append(d.Status, groupRow{Topic: s.Topic, Group: s.Group, Joined: s.Joined, KafkaSilent: s.KafkaSilent, Partitions: strings.Join(parts, ", "), Held: s.Held, OldestHeld: s.OldestHeld,
			Order: order, KeyOrdered: s.Order == pipeline.OrderKey, HeldKeys: s.HeldKeys, Pinned: s.Pinned, WindowFull: s.WindowFull})
	}
	for _, h := range c.cfg.Groups.Holds() {
		// Topic and group are the pipeline's own: its configuration's.
		row := holdRow{Topic: h.Topic, Group: h.Group, Partition: h.Partition, Offset: h.Offset, For: now.Sub(h.Since), Attempts: h.Attempts, Hidden: d.Hidden}
		if d.Hidden == "" {
			p := RedactParams{Topic: h.Topic, Group: h.Group, Key: h.Key}
			if h.Err != nil {
				p.Reason = h.Err.Error()
			}
			if out, ok := c.redact(p, "topic", h.Topic, "consumer_group", h.Group, "partition", h.Partition, "offset", h.Offset); ok {
				row.Shown, row.Key, row.Err = true, out.Key, out.Reason
			} else {
				row.Hidden = hiddenRedactor
			}
		}
		d.Holds = append(d.Holds, row)
	}
	lags, err := c.cfg.Groups.Lag(r.Context())
	for _, l := range lags {
		d.Lag = append(d.Lag, lagRow{Topic: l.Topic, Group: l.Group, Partition: l.Partition, Committed: l.Committed, HighWatermark: l.HighWatermark, Lag: l.Lag})
		d.TotalLag += l.Lag
	}
	if err != nil {
		d.LagUnknown = true
		err = fmt.Errorf("lag from Kafka: %w", err)
	}
	c.render(w, r, http.StatusOK, "groups", "Groups", d, err)
}

type inboxData struct {
	Event   string
	EventAt time.Time
	Replay  string    // a replay's report: each claim says whether it came after
	Since   time.Time // when that replay started, by the main database's clock
	Claims  []claimRow
	Looked  bool
	// Foreign: Event was looked up as a producer's own id too, and each
	// claim says which event it is of.
	Foreign bool
}

type claimRow struct {
	Database, Group, SHA256 string
	At                      time.Time
	Outcome                 string
	EventID                 string
	EventAt                 time.Time
	Namespace               string // the topic namespace a producer's id was found under
}

func (c *Console) inbox(w http.ResponseWriter, r *http.Request) {
	d := inboxData{Event: strings.TrimSpace(r.FormValue("event"))}
	if d.Event == "" {
		c.render(w, r, http.StatusOK, "inbox", "Inbox", d)
		return
	}
	id, err := uuid.Parse(d.Event)
	direct := err == nil && id.Version() == 7
	if !direct && len(c.cfg.IDNamespaces) == 0 {
		if err == nil {
			err = fmt.Errorf("a UUID version %d; event ids are UUIDv7 (a topic whose ids are derived from its producer's, "+
				"Topic.IDNamespace, lets the inbox find an event by its producer's id)", id.Version())
		}
		c.render(w, r, http.StatusBadRequest, "inbox", "Inbox", d, fmt.Errorf("event id %q: %w", d.Event, err))
		return
	}
	d.Looked = true
	if direct {
		d.EventAt = idempotency.IDTime(id)
	}
	var since map[string]time.Time
	if res, ok := c.results.get(r.FormValue("replay")); ok {
		d.Replay, since = r.FormValue("replay"), res.At
		d.Since = since[c.cfg.Databases[0].Name]
	}
	var errs []error
	for _, db := range c.cfg.Databases {
		var found []claimRow
		if direct {
			claims, err := inbox.Lookup(r.Context(), db.DB, c.cfg.Tables, id, "")
			if err != nil {
				errs = append(errs, fmt.Errorf("database %s: %w", db.Name, err))
				continue
			}
			for _, cl := range claims {
				found = append(found, claimRow{Database: db.Name, Group: cl.Group, At: cl.ProcessedAt, SHA256: hex.EncodeToString(cl.PayloadSHA256),
					EventID: cl.EventID.String(), EventAt: idempotency.IDTime(cl.EventID)})
			}
		}
		// A UUIDv7 may be a producer's own id too: looked up as one when
		// no event has it as its id.
		if len(found) == 0 && len(c.cfg.IDNamespaces) > 0 {
			d.Foreign = true
			rows, ferrs := c.foreignClaims(r, db, d.Event)
			found, errs = append(found, rows...), append(errs, ferrs...)
		}
		for _, row := range found {
			if at, ok := since[db.Name]; ok {
				// Claimed after the replay: the replay processed it. Before:
				// the replayed message met the claim, a duplicate.
				row.Outcome = "duplicate (claimed before the replay)"
				if !row.At.Before(at) {
					row.Outcome = "processed by the replay"
				}
			}
			d.Claims = append(d.Claims, row)
		}
	}
	c.render(w, r, http.StatusOK, "inbox", "Inbox", d, errs...)
}

// foreignClaims are db's claims of the events derived from the producer's
// id foreign, under each of the topics' namespaces.
func (c *Console) foreignClaims(r *http.Request, db Database, foreign string) ([]claimRow, []error) {
	var rows []claimRow
	var errs []error
	for _, ns := range c.cfg.IDNamespaces {
		claims, err := inbox.LookupForeign(r.Context(), db.DB, c.cfg.Tables, inbox.Foreign{Namespace: ns, ID: foreign, ScanTimeout: c.cfg.ScanTimeout}, "")
		if err != nil {
			errs = append(errs, fmt.Errorf("database %s: %w", db.Name, err))
			continue
		}
		for _, cl := range claims {
			rows = append(rows, claimRow{Database: db.Name, Group: cl.Group, At: cl.ProcessedAt, SHA256: hex.EncodeToString(cl.PayloadSHA256),
				EventID: cl.EventID.String(), EventAt: idempotency.IDTime(cl.EventID), Namespace: ns})
		}
	}
	return rows, errs
}

func (c *Console) forget(w http.ResponseWriter, r *http.Request) {
	id, err := uuid.Parse(r.PostFormValue("event"))
	group, dbName := r.PostFormValue("group"), r.PostFormValue("database")
	if err != nil || group == "" {
		c.fail(w, r, http.StatusBadRequest, "forget needs an event id and a group")
		return
	}
	if r.PostFormValue("confirm") != "yes" {
		c.fail(w, r, http.StatusBadRequest, "Tick the box: forgetting a claim lets the event's next delivery run its effect again.")
		return
	}
	for _, db := range c.cfg.Databases {
		if db.Name != dbName {
			continue
		}
		sum, err := inbox.Forget(r.Context(), db.DB, c.cfg.Tables, id, group)
		if err != nil {
			c.fail(w, r, http.StatusNotFound, err.Error())
			return
		}
		c.cfg.Logger.Warn("console: FORGOT A CLAIM: the next delivery of this event will be processed again by its group",
			"event_id", id, "consumer_group", group, "payload_sha256", hex.EncodeToString(sum), "remote", r.RemoteAddr)
		back := r.PostFormValue("looked")
		if back == "" {
			back = id.String()
		}
		http.Redirect(w, r, c.cfg.Prefix+"/inbox?"+url.Values{"event": {back}}.Encode(), http.StatusSeeOther)
		return
	}
	c.fail(w, r, http.StatusNotFound, "no such database")
}
