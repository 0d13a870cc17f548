package console

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"embed"
	"encoding/hex"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/url"
	"path"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"

	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/inbox"
	"github.com/once-dev/once/pgdb"
	"github.com/once-dev/once/pipeline"
	"github.com/once-dev/once/schema"
)

// DefaultReplayWindow is how old an event may be and still be replayed: a
// day, well within a payment provider's idempotency-key retention.
const DefaultReplayWindow = 24 * time.Hour

// DefaultPrefix is the path the console is served under.
const DefaultPrefix = "/console"

// Groups reports what the consumer groups are doing: a *pipeline.Pipeline.
type Groups interface {
	Status() []pipeline.GroupStatus
	Holds() []pipeline.HeldMessage
	Lag(ctx context.Context) ([]pipeline.PartitionLag, error)
}

// Database is one database the groups keep claims and park letters in.
type Database struct {
	// Name shows where a letter or claim is: "default", or the group whose
	// own database it is. Never its URL.
	Name string
	DB   pgdb.DB
}

// Config configures a [Console].
type Config struct {
	// Brokers and Sarama reach the dead-letter topics (Sarama carries the
	// version and the connection's security). Required.
	Brokers []string
	Sarama  *sarama.Config
	// Routes are the consumed topics and their dead-letter topics. Required.
	Routes []dlq.Route
	// Databases where letters are parked and claims kept, the main one
	// first. Required.
	Databases []Database
	// Tables names the library's tables. Default: schema's defaults.
	Tables schema.Config
	// IDNamespaces are the namespaces topics derive their event ids under
	// (pipeline.Topic.IDNamespace), for producers whose ids are not
	// UUIDv7s: the inbox then finds an event by its producer's own id too,
	// with a scan of the claim table bounded by ScanTimeout. Default: none
	// (the inbox takes event ids only).
	IDNamespaces []string
	// ScanTimeout bounds each such scan, on the server. Default:
	// [inbox.DefaultScanTimeout].
	ScanTimeout time.Duration
	// Groups shows lag and held messages. Default: none (the groups page
	// says it has nothing to show).
	Groups Groups
	// ReplayGroup keeps the progress of a filtered group's replay, as app
	// dlq replay's --group does. Default: [dlq.DefaultGroup].
	ReplayGroup string
	// ReplayWindow: a letter whose event is older is not replayed (and the
	// confirmation says how many that leaves out). Negative: no window.
	// Default: [DefaultReplayWindow].
	ReplayWindow time.Duration
	// Token lets a person who signs in with it replay, forget, and see
	// what may be personal data (through Redact): the letters' reasons,
	// payloads and headers, parked letters' last errors, held messages'
	// keys and last errors. Give it from the environment or a file, never
	// a flag (a flag is in ps). Default: none, and the console is
	// read-only and shows none of that.
	Token string
	// Prefix is the path the console is served under. Default:
	// [DefaultPrefix].
	Prefix string
	// Hosts the console answers to besides localhost and IP addresses
	// (the Host a browser sends, without the port): a request for any
	// other name is refused, so that a site whose name is made to resolve
	// to this listener (DNS rebinding) cannot read it. Default: none.
	Hosts []string
	// Limit: at most this many letters are listed, the newest. Default 500.
	Limit int
	// Redact is what a signed-in person sees of what may be personal
	// data, wherever the console shows it: a dead letter's reason,
	// payload and headers (its page, the lists of letters and the
	// replay's confirmation, which show the reason alone), a parked
	// letter's last error, a held message's Kafka key and last error (the
	// groups page). It may mask, hash or drop what is personal data (a
	// name, an address, a card's last digits) and must not keep or log
	// what it is given. What it returns is shown, and only that: a field
	// it leaves empty shows nothing. It is called by concurrent requests,
	// once per letter or held message shown. A panic in it hides all of
	// that letter's or held message's. A person who is not signed in sees
	// none of it, redacted or not: no text of a payload, a header (but the
	// source topic and group the pipeline writes, see the package doc), a
	// key or an error leaves a console without a token. The reason filter
	// matches the reason as it is (it is a signed-in person's only).
	// Default: none, a signed-in person sees them as they are.
	Redact func(RedactParams) Redacted
	// Now. Default: time.Now.
	Now    func() time.Time
	Logger *slog.Logger
}

// RedactParams is what [Config.Redact] is given: a dead letter (on its
// topic, or parked in a database), or a message held for retry. Fields may
// be added.
type RedactParams struct {
	// Topic the message was consumed from, and the Group that refused or
	// holds it: the shape of a payload is the topic's.
	Topic, Group string
	// DLQTopic holds the letter; "" for a held message.
	DLQTopic string
	// Payload and Headers of a letter as they are on the dead-letter topic
	// (or parked in the database), but the reason's header (it is Reason):
	// copies, which Redact may change and return. A held message has
	// neither here.
	Payload []byte
	Headers map[string]string
	// Reason is why the letter was dead-lettered, or why a held message's
	// last attempt failed: a decoder's or a handler's error, which may
	// quote the payload.
	Reason string
	// Key is a held message's Kafka key, often a customer's or an order's
	// id; "" for a letter.
	Key string
	// LastError is why a parked letter has not reached its topic yet.
	LastError string
}

// Redacted is what the console shows of a [RedactParams]: see
// [Config.Redact]. A field left empty shows nothing.
type Redacted struct {
	Payload   []byte
	Headers   map[string]string
	Reason    string
	Key       string
	LastError string
}

func (c *Config) setDefaults() {
	if c.ReplayGroup == "" {
		c.ReplayGroup = dlq.DefaultGroup
	}
	if c.ReplayWindow == 0 {
		c.ReplayWindow = DefaultReplayWindow
	}
	if c.ReplayWindow < 0 {
		c.ReplayWindow = 0 // dlq's "no window"
	}
	if c.Prefix == "" {
		c.Prefix = DefaultPrefix
	}
	c.Prefix = "/" + strings.Trim(c.Prefix, "/")
	if c.Limit == 0 {
		c.Limit = 500
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.ScanTimeout == 0 {
		c.ScanTimeout = inbox.DefaultScanTimeout
	}
	// Two topics of one producer share its namespace: one scan serves both.
	// "" is a topic's "no namespace".
	c.IDNamespaces = slices.DeleteFunc(slices.Compact(slices.Sorted(slices.Values(c.IDNamespaces))), func(ns string) bool { return ns == "" })
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Validate reports every missing setting at once. It has no side effects.
func (c Config) Validate() error {
	var errs []error
	if len(c.Brokers) == 0 || c.Sarama == nil {
		errs = append(errs, errors.New("console: Brokers and Sarama are required"))
	}
	if len(c.Routes) == 0 {
		errs = append(errs, errors.New("console: Routes are required"))
	}
	if len(c.Databases) == 0 {
		errs = append(errs, errors.New("console: Databases are required"))
	}
	if c.Token != "" && len(c.Token) < 16 {
		// A short token is guessed by anyone who can reach the listener.
		errs = append(errs, errors.New("console: Token must be at least 16 characters"))
	}
	if c.Limit < 0 {
		errs = append(errs, errors.New("console: Limit must not be negative"))
	}
	if c.ScanTimeout < 0 {
		errs = append(errs, errors.New("console: ScanTimeout must not be negative"))
	}
	return errors.Join(errs...)
}

//go:embed assets templates
var files embed.FS

// Console serves the pages. Make one with [New]; it is an http.Handler for
// the paths under its Prefix.
type Console struct {
	cfg     Config
	store   *dlq.Store
	pages   map[string]*template.Template
	handler http.Handler
	// csrfKey signs the forms' CSRF tokens: new with each process, so a
	// token read from an old page is worth nothing after a restart.
	csrfKey  []byte
	sessions sessions
	plans    kept[plan]
	results  kept[confirmData]
}

// New checks cfg and returns the console. It opens no connection.
func New(cfg Config) (*Console, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	store, err := dlq.NewStore(cfg.Tables)
	if err != nil {
		return nil, err
	}
	c := &Console{cfg: cfg, store: store, csrfKey: make([]byte, 32), sessions: sessions{byID: map[string]time.Time{}},
		plans: newKept[plan](), results: newKept[confirmData]()}
	if _, err := rand.Read(c.csrfKey); err != nil {
		return nil, err
	}
	if c.pages, err = parsePages(); err != nil {
		return nil, err
	}
	p := cfg.Prefix
	mux := http.NewServeMux()
	assets, _ := fs.Sub(files, "assets")
	mux.Handle("GET "+p+"/assets/", http.StripPrefix(p+"/assets/", http.FileServerFS(assets)))
	mux.HandleFunc("GET "+p+"/{$}", func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, p+"/letters", http.StatusSeeOther)
	})
	mux.HandleFunc("GET "+p, func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, p+"/letters", http.StatusSeeOther)
	})
	mux.HandleFunc("GET "+p+"/letters", c.letters)
	mux.HandleFunc("GET "+p+"/letter", c.letter)
	mux.HandleFunc("GET "+p+"/replay", c.confirmReplay)
	mux.HandleFunc("POST "+p+"/replay", c.operator(c.replay))
	mux.HandleFunc("GET "+p+"/replayed", c.replayed)
	mux.HandleFunc("GET "+p+"/groups", c.groups)
	mux.HandleFunc("GET "+p+"/inbox", c.inbox)
	mux.HandleFunc("POST "+p+"/forget", c.operator(c.forget))
	mux.HandleFunc("POST "+p+"/login", c.login)
	mux.HandleFunc("POST "+p+"/logout", c.logout)
	// Refuses a POST another site's page makes (Sec-Fetch-Site, else Origin
	// against Host): the CSRF token below is the second lock, for browsers
	// that send neither header.
	c.handler = securityHeaders(c.knownHost(http.NewCrossOriginProtection().Handler(mux)))
	return c, nil
}

// knownHost refuses a request for a host name the console does not know.
// The browser's same-origin rule protects a loopback listener only while
// the page's name is the listener's: a name an attacker resolves to
// 127.0.0.1 (DNS rebinding) makes their page same-origin with it.
func (c *Console) knownHost(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host := r.Host
		if hp, _, err := net.SplitHostPort(host); err == nil {
			host = hp
		}
		host = strings.TrimSuffix(strings.Trim(host, "[]"), ".")
		if net.ParseIP(host) == nil && !strings.EqualFold(host, "localhost") && !slices.ContainsFunc(c.cfg.Hosts, func(k string) bool { return strings.EqualFold(k, host) }) {
			c.cfg.Logger.Warn("console: a request for an unknown host refused", "host", r.Host, "remote", r.RemoteAddr)
			http.Error(w, fmt.Sprintf("console: %q is not a host this console answers to; add it to its Hosts (app serve --console-host)", host), http.StatusMisdirectedRequest)
			return
		}
		h.ServeHTTP(w, r)
	})
}

func (c *Console) ServeHTTP(w http.ResponseWriter, r *http.Request) { c.handler.ServeHTTP(w, r) }

func securityHeaders(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Security-Policy", "default-src 'self'; style-src 'self'; script-src 'none'; frame-ancestors 'none'; form-action 'self'")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		w.Header().Set("Referrer-Policy", "same-origin")
		w.Header().Set("Cache-Control", "no-store")
		h.ServeHTTP(w, r)
	})
}

// sessionCookie is the sign-in cookie's name for r's port: browsers send
// a cookie to every port of its host, and two consoles on one host (app
// serve --console and app console) would each take the other's for a
// stale session of its own.
func sessionCookie(r *http.Request) string {
	if _, port, err := net.SplitHostPort(r.Host); err == nil && port != "" {
		return "once_console_" + port
	}
	return "once_console"
}

// sessionTTL is how long a sign-in lasts; maxSessions bounds what a
// visitor who signs in again and again can make the process keep.
const (
	sessionTTL  = 12 * time.Hour
	maxSessions = 1000
)

// sessions are the signed-in browsers: a random id each, kept only in
// this process, so that signing out ends that session (a cookie copied
// before is worth nothing after) and a restart ends them all.
type sessions struct {
	mu   sync.Mutex
	byID map[string]time.Time // its end
}

func (s *sessions) start(now time.Time) (string, error) {
	id, err := randomID()
	if err != nil {
		return "", err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	maps.DeleteFunc(s.byID, func(_ string, end time.Time) bool { return !now.Before(end) })
	for len(s.byID) >= maxSessions {
		var first string
		for k, end := range s.byID {
			if first == "" || end.Before(s.byID[first]) {
				first = k
			}
		}
		delete(s.byID, first)
	}
	s.byID[id] = now.Add(sessionTTL)
	return id, nil
}

func (s *sessions) valid(id string, now time.Time) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	end, ok := s.byID[id]
	return ok && now.Before(end)
}

func (s *sessions) end(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.byID, id)
}

func randomID() (string, error) {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return hex.EncodeToString(b), nil
}

// signedIn reports whether r carries a live session.
func (c *Console) signedIn(r *http.Request) bool {
	if c.cfg.Token == "" {
		return false
	}
	ck, err := r.Cookie(sessionCookie(r))
	return err == nil && c.sessions.valid(ck.Value, c.cfg.Now())
}

// csrf is the forms' token for r's session.
func (c *Console) csrf(r *http.Request) string {
	ck, err := r.Cookie(sessionCookie(r))
	if err != nil {
		return ""
	}
	m := hmac.New(sha256.New, c.csrfKey)
	m.Write([]byte(ck.Value))
	return hex.EncodeToString(m.Sum(nil))
}

// operator lets h run for a signed-in person whose form carries the CSRF
// token of the page it came from; anyone else gets 403 and h never runs.
func (c *Console) operator(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if c.cfg.Token == "" {
			c.fail(w, r, http.StatusForbidden, "This console is read-only: it was started without a token (ONCE_CONSOLE_TOKEN or ONCE_CONSOLE_TOKEN_FILE).")
			return
		}
		if !c.signedIn(r) {
			c.fail(w, r, http.StatusForbidden, "Sign in with the console's token to replay or forget.")
			return
		}
		if want := c.csrf(r); subtle.ConstantTimeCompare([]byte(r.PostFormValue("csrf")), []byte(want)) != 1 {
			c.fail(w, r, http.StatusForbidden, "This form is not from this console's page (its CSRF token is missing or stale): reload the page and try again.")
			return
		}
		h(w, r)
	}
}

func (c *Console) login(w http.ResponseWriter, r *http.Request) {
	if c.cfg.Token == "" || subtle.ConstantTimeCompare([]byte(r.PostFormValue("token")), []byte(c.cfg.Token)) != 1 {
		c.cfg.Logger.Warn("console: a sign-in with a wrong token", "remote", r.RemoteAddr)
		c.fail(w, r, http.StatusForbidden, "Wrong token.")
		return
	}
	id, err := c.sessions.start(c.cfg.Now())
	if err != nil {
		c.fail(w, r, http.StatusInternalServerError, "cannot start a session: "+err.Error())
		return
	}
	http.SetCookie(w, &http.Cookie{Name: sessionCookie(r), Value: id, Path: c.cfg.Prefix, HttpOnly: true,
		SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil, MaxAge: int(sessionTTL.Seconds())})
	http.Redirect(w, r, c.back(r), http.StatusSeeOther)
}

func (c *Console) logout(w http.ResponseWriter, r *http.Request) {
	if ck, err := r.Cookie(sessionCookie(r)); err == nil {
		c.sessions.end(ck.Value)
	}
	http.SetCookie(w, &http.Cookie{Name: sessionCookie(r), Path: c.cfg.Prefix, MaxAge: -1, HttpOnly: true, SameSite: http.SameSiteStrictMode})
	http.Redirect(w, r, c.back(r), http.StatusSeeOther)
}

// back is the console page a form came from, never another site: a
// path under the prefix as it is once cleaned (http.Redirect cleans
// "/console/../\\host" to "/\\host", which browsers read as //host).
func (c *Console) back(r *http.Request) string {
	to := r.PostFormValue("back")
	u, err := url.Parse(to)
	if err == nil && u.Scheme == "" && u.Host == "" && !strings.ContainsRune(to, '\\') &&
		path.Clean(u.Path) == u.Path && strings.HasPrefix(u.Path, c.cfg.Prefix+"/") {
		return to
	}
	return c.cfg.Prefix + "/letters"
}
