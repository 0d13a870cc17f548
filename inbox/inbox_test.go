package inbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/inbox"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/oncetest"
	"github.com/once-dev/once/schema"
)

func TestMain(m *testing.M) { testenv.MainWithServices(m, "DATABASE_URL") }

// A lookup by the producer's own id finds the claims of every event derived
// from it under the namespace, whatever their times, and no other's: not
// the same id under another namespace, not another id. Each claim says its
// event id. A UUID is found however it is spelled. In every exec mode,
// directly and behind PgBouncer.
func TestLookupForeignFindsTheDerivedClaims(t *testing.T) {
	direct := testenv.Postgres(t)
	ctx := context.Background()
	foreign := uuid.NewString() // a producer's UUIDv4
	suffix := uuid.NewString()[:8]
	billing, analytics := "billing-"+suffix, "analytics-"+suffix
	t0 := time.Now().Add(-time.Hour)
	first := idempotency.DeriveEventID("inventory", foreign, t0)
	resent := idempotency.DeriveEventID("inventory", foreign, t0.Add(30*time.Minute)) // re-sent with another time: another event
	others := []uuid.UUID{
		idempotency.DeriveEventID("payments", foreign, t0),           // another producer's same id
		idempotency.DeriveEventID("inventory", uuid.NewString(), t0), // another id
	}
	insert := func(id uuid.UUID, group string) {
		t.Helper()
		if _, err := direct.Exec(ctx, `INSERT INTO processed_event (event_id, consumer_group, payload_sha256) VALUES ($1, $2, '\xabcd')`, id, group); err != nil {
			t.Fatal(err)
		}
	}
	insert(first, billing)
	insert(first, analytics)
	insert(resent, billing)
	for _, id := range others {
		insert(id, billing)
	}
	t.Cleanup(func() {
		_, _ = direct.Exec(context.Background(), `DELETE FROM processed_event WHERE consumer_group = ANY($1)`, []string{billing, analytics})
	})

	for _, w := range testenv.EveryWay {
		t.Run(w.String(), func(t *testing.T) {
			db := w.Pool(t)
			claims, err := inbox.LookupForeign(ctx, db, schema.Config{}, inbox.Foreign{Namespace: "inventory", ID: foreign}, "")
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, c := range claims {
				got = append(got, c.EventID.String()+" "+c.Group)
			}
			want := []string{first.String() + " " + analytics, first.String() + " " + billing, resent.String() + " " + billing}
			if first.String() > resent.String() {
				t.Fatalf("the test's ids are out of time order: %s, %s", first, resent)
			}
			if strings.Join(got, ", ") != strings.Join(want, ", ") {
				t.Fatalf("claims %v; want %v", got, want)
			}
			// A UUID spelled otherwise (capitals, braces) is the same
			// producer id: its canonical form is looked up too.
			for _, spelled := range []string{strings.ToUpper(foreign), "{" + foreign + "}"} {
				claims, err = inbox.LookupForeign(ctx, db, schema.Config{}, inbox.Foreign{Namespace: "inventory", ID: spelled}, analytics)
				if err != nil || len(claims) != 1 || claims[0].EventID != first || claims[0].Group != analytics {
					t.Fatalf("analytics' claims by %s: %+v, %v; want its claim of %s", spelled, claims, err, first)
				}
			}
		})
	}
}

// The scan is bounded: a claim table it cannot read (here locked by another
// transaction, proved held first) stops it at its ScanTimeout with
// ErrScanTimeout, directly and behind PgBouncer.
func TestLookupForeignIsBoundedByItsScanTimeout(t *testing.T) {
	db := oncetest.NewDB(t) // a claim table of the test's own, to lock
	ctx := context.Background()
	lock, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = lock.Rollback(context.Background()) })
	if _, err := lock.Exec(ctx, `LOCK TABLE `+db.Tables.Claims().Qualified+` IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	var held int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE relation = $1::regclass AND mode = 'AccessExclusiveLock' AND granted`,
		db.Tables.Claims().Qualified).Scan(&held); err != nil || held != 1 {
		t.Fatalf("the claim table's lock is not held (%d, %v)", held, err)
	}
	for _, w := range []testenv.Where{{Pooled: false, Mode: pgx.QueryExecModeCacheStatement}, {Pooled: true, Mode: pgx.QueryExecModeExec}} {
		t.Run(w.String(), func(t *testing.T) {
			start := time.Now()
			_, err := inbox.LookupForeign(ctx, w.Pool(t), db.Tables, inbox.Foreign{Namespace: "inventory", ID: "42", ScanTimeout: 300 * time.Millisecond}, "")
			if !errors.Is(err, inbox.ErrScanTimeout) {
				t.Fatalf("a scan that cannot finish: %v; want ErrScanTimeout", err)
			}
			if took := time.Since(start); took < 300*time.Millisecond || took > 5*time.Second {
				t.Fatalf("stopped after %s; want the scan timeout, 300ms", took)
			}
		})
	}
}
