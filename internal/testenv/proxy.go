package testenv

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Proxy forwards TCP to PostgreSQL. While down it accepts connections and
// closes them at once: to pgx that is the database being unreachable, over a
// real network connection.
type Proxy struct {
	ln        net.Listener
	down      atomic.Bool
	blackHole atomic.Bool
	swallowed atomic.Int64
	mu        sync.Mutex
	open      []net.Conn
}

// BlackHole makes the proxy swallow every byte in both directions while the
// connections stay open (true), as a network that silently drops packets
// would, or forward again (false).
func (p *Proxy) BlackHole(on bool) { p.blackHole.Store(on) }

// Swallowed reports whether the black hole ate any bytes.
func (p *Proxy) Swallowed() bool { return p.swallowed.Load() > 0 }

// pipe copies src to dst, or swallows what src sends while the black hole is on.
func (p *Proxy) pipe(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if p.blackHole.Load() {
				p.swallowed.Add(int64(n))
			} else if _, werr := dst.Write(buf[:n]); werr != nil {
				break
			}
		}
		if err != nil {
			break
		}
	}
	if p.blackHole.Load() {
		// A black hole drops the goodbye too: the far end never learns this
		// side is gone, and keeps its session until its own timeouts end it.
		return
	}
	dst.Close()
}

// Down makes the database unreachable (true) or reachable again (false).
// Going down cuts the open connections too, as a database restart would.
func (p *Proxy) Down(down bool) {
	p.down.Store(down)
	if down {
		p.Cut()
	}
}

// Cut drops every open connection.
func (p *Proxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.open {
		c.Close()
	}
	p.open = nil
}

func newProxy(t testing.TB, target string) *Proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &Proxy{ln: ln}
	t.Cleanup(func() { ln.Close(); p.Cut() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			if p.down.Load() {
				c.Close()
				continue
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			p.mu.Lock()
			p.open = append(p.open, c, s)
			p.mu.Unlock()
			go p.pipe(s, c)
			go p.pipe(c, s)
		}
	}()
	return p
}

// ProxiedPostgres returns a pool that reaches the database of direct through
// a [Proxy] the test controls.
func ProxiedPostgres(t testing.TB, direct *pgxpool.Pool) (*pgxpool.Pool, *Proxy) {
	t.Helper()
	cfg := direct.Config().Copy()
	p := newProxy(t, fmt.Sprintf("%s:%d", cfg.ConnConfig.Host, cfg.ConnConfig.Port))
	addr := p.ln.Addr().(*net.TCPAddr)
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = addr.IP.String(), uint16(addr.Port)
	cfg.ConnConfig.ConnectTimeout = time.Second
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool, p
}

// URL is databaseURL with its host and port replaced by the proxy's.
func (p *Proxy) URL(databaseURL string) string {
	u, err := url.Parse(databaseURL)
	if err != nil {
		return databaseURL
	}
	u.Host = p.ln.Addr().String()
	return u.String()
}
