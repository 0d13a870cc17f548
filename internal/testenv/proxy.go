package testenv

import (
	"context"
	"fmt"
	"io"
	"net"
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
	ln   net.Listener
	down atomic.Bool
	mu   sync.Mutex
	open []net.Conn
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
			go func() { _, _ = io.Copy(s, c); s.Close() }()
			go func() { _, _ = io.Copy(c, s); c.Close() }()
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
