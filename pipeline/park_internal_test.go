package pipeline

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/schema"
)

// A dead letter's park whose client vanished behind a network black hole
// before its commit reached the server leaves a transaction that inserted
// the letter's source row, its key locked. Every retry of the message (the
// hold path's, or the partition's next owner's) waits on that key. The
// park bounds its transaction's idle time on the server by the statement
// timeout, so the orphan ends and a retry parks the letter, once. Before,
// nothing bounded it: the retries waited until TCP keepalive noticed (two
// hours), and the partition held the message all that time.
func TestAParkWhoseClientVanishedLetsTheRetryPark(t *testing.T) {
	pool := testenv.Postgres(t)
	letters, err := dlq.NewStore(schema.Config{})
	if err != nil {
		t.Fatal(err)
	}
	p := &Pipeline{cfg: Config{StatementTimeout: 2 * time.Second}, letters: letters}
	proxied, proxy := testenv.ProxiedPostgres(t, pool)
	// The proxy's connections end before its pool closes (cleanups run
	// last first): a pool closing over a black hole waits for nothing.
	t.Cleanup(func() { proxy.BlackHole(false); proxy.Cut() })
	var blackHoled atomic.Bool
	var orphans atomic.Int64
	vanishing := &testenv.Intercepted{DB: proxied, OnCommit: func(ctx context.Context, _ bool) {
		// The letter is written, in a transaction the server holds open
		// (it has a transaction id); its commit never reaches the server.
		var n int64
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' AND backend_xid IS NOT NULL`).Scan(&n); err == nil {
			orphans.Store(n)
		}
		proxy.BlackHole(true)
		blackHoled.Store(true)
	}}
	topic := "park-vanished-" + uuid.NewString()[:8]
	msg := message.NewMessage(uuid.NewString(), []byte(`{"bad":`))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msg.SetContext(context.WithValue(ctx, claimCtxKey{}, claimInfo{owner: ctx, topic: topic, partition: 0}))
	d := Delivery{Topic: topic, Group: "park-vanished", Partition: 0, Offset: 7}
	letter := dlq.Letter{Topic: topic + ".dlq", Payload: msg.Payload, Headers: map[string]string{"reason": "test"}}

	if _, err := p.park(msg, vanishing, d, letter); err == nil {
		t.Fatal("the park through the black hole succeeded")
	}
	if !blackHoled.Load() || !proxy.Swallowed() {
		t.Fatal("the park's commit was not swallowed: the fault did not happen")
	}
	if orphans.Load() == 0 {
		t.Fatal("no transaction was idle with the letter written when its commit was swallowed: the fault did not happen")
	}

	// The retry, on a working connection, until it parks or 20 s pass.
	retried := time.Now()
	deadline := retried.Add(20 * time.Second)
	for {
		parked, err := p.park(msg, pool, d, letter)
		if err == nil {
			if !parked {
				t.Fatal("the retry found the letter parked already: the vanished park committed")
			}
			t.Logf("the retry parked the letter %s after the vanished park", time.Since(retried).Round(time.Millisecond))
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the retry could not park the letter within 20s: %v", err)
		}
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM once_dead_letter WHERE topic = $1`, letter.Topic).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 1 {
		t.Fatalf("%d letters parked, want 1", n)
	}
}
