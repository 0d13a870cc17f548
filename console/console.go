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
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/IBM/sarama"

	"github.com/once-dev/once/dlq"
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
	// Token lets a person who signs in with it replay and forget. Give it
	// from the environment or a file, never a flag (a flag is in ps).
	// Default: none, and the console is read-only.
	Token string
	// Prefix is the path the console is served under. Default:
	// [DefaultPrefix].
	Prefix string
	// Limit: at most this many letters are listed, the newest. Default 500.
	Limit int
	// Now. Default: time.Now.
	Now    func() time.Time
	Logger *slog.Logger
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
	csrfKey []byte
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
	c := &Console{cfg: cfg, store: store, csrfKey: make([]byte, 32)}
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
	mux.HandleFunc("GET "+p+"/groups", c.groups)
	mux.HandleFunc("GET "+p+"/inbox", c.inbox)
	mux.HandleFunc("POST "+p+"/forget", c.operator(c.forget))
	mux.HandleFunc("POST "+p+"/login", c.login)
	mux.HandleFunc("POST "+p+"/logout", c.logout)
	// Refuses a POST another site's page makes (Sec-Fetch-Site, else Origin
	// against Host): the CSRF token below is the second lock, for browsers
	// that send neither header.
	c.handler = securityHeaders(http.NewCrossOriginProtection().Handler(mux))
	return c, nil
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

const sessionCookie = "once_console"

// session is what the sign-in cookie holds: derived from the token, so the
// token itself never sits in a cookie, and a new token ends every session.
func (c *Console) session() string {
	m := hmac.New(sha256.New, []byte(c.cfg.Token))
	m.Write([]byte("once console session"))
	return hex.EncodeToString(m.Sum(nil))
}

// signedIn reports whether r carries the session of the configured token.
func (c *Console) signedIn(r *http.Request) bool {
	if c.cfg.Token == "" {
		return false
	}
	ck, err := r.Cookie(sessionCookie)
	return err == nil && subtle.ConstantTimeCompare([]byte(ck.Value), []byte(c.session())) == 1
}

// csrf is the forms' token for r's session.
func (c *Console) csrf(r *http.Request) string {
	ck, err := r.Cookie(sessionCookie)
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
	http.SetCookie(w, &http.Cookie{Name: sessionCookie, Value: c.session(), Path: c.cfg.Prefix, HttpOnly: true,
		SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil, MaxAge: int((12 * time.Hour).Seconds())})
	http.Redirect(w, r, c.back(r), http.StatusSeeOther)
}

func (c *Console) logout(w http.ResponseWriter, r *http.Request) {
	http.SetCookie(w, &http.Cookie{Name: sessionCookie, Path: c.cfg.Prefix, MaxAge: -1, HttpOnly: true, SameSite: http.SameSiteStrictMode})
	http.Redirect(w, r, c.back(r), http.StatusSeeOther)
}

// back is the console page a form came from, never another site.
func (c *Console) back(r *http.Request) string {
	if to := r.PostFormValue("back"); strings.HasPrefix(to, c.cfg.Prefix+"/") && !strings.HasPrefix(to, "//") {
		return to
	}
	return c.cfg.Prefix + "/letters"
}
