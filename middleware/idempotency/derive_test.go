package idempotency_test

import (
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/once-dev/once/middleware/idempotency"
)

// A derived id is a function of its three inputs and of nothing else; each
// input changes it; the time in it is at's, to the millisecond; and it is a
// UUIDv7 that the claim's key check takes.
func TestDeriveEventID(t *testing.T) {
	at := time.Date(2026, 3, 14, 9, 26, 53, 589_793_238, time.UTC)
	id := idempotency.DeriveEventID("inventory", "42", at)

	if again := idempotency.DeriveEventID("inventory", "42", at.In(time.FixedZone("CET", 3600))); again != id {
		t.Fatalf("the same inputs (at in another zone) gave %s, then %s", id, again)
	}
	if same := idempotency.DeriveEventID("inventory", "42", at.Add(time.Microsecond)); same != id {
		t.Fatalf("at within the same millisecond gave %s, then %s: the id keeps milliseconds only", id, same)
	}
	for name, other := range map[string]uuid.UUID{
		"another foreign id":           idempotency.DeriveEventID("inventory", "43", at),
		"another namespace":            idempotency.DeriveEventID("payments", "42", at),
		"another millisecond":          idempotency.DeriveEventID("inventory", "42", at.Add(time.Millisecond)),
		"the namespace moved into id":  idempotency.DeriveEventID("inventory4", "2", at),
		"an empty namespace":           idempotency.DeriveEventID("", "inventory\x0042", at),
		"another id, namespace, epoch": idempotency.DeriveEventID("", "", time.UnixMilli(0)),
	} {
		if other == id {
			t.Errorf("%s gave the same id %s", name, id)
		}
	}

	if id.Version() != 7 || id.Variant() != uuid.RFC4122 {
		t.Fatalf("%s is version %d, variant %v; want 7, RFC 4122", id, id.Version(), id.Variant())
	}
	if got, want := idempotency.IDTime(id), at.Truncate(time.Millisecond); !got.Equal(want) {
		t.Fatalf("the time in %s is %s; want at to the millisecond, %s", id, got, want)
	}
	// The key check the claim makes (PayloadEventID's, the middleware's).
	msg := message.NewMessage("m", []byte(fmt.Sprintf(`{"event_id":%q}`, id)))
	if key, err := idempotency.PayloadEventID(msg); err != nil || key != id {
		t.Fatalf("PayloadEventID of a derived id: %s, %v", key, err)
	}

	// The last 21 characters of the text form depend on namespace and
	// foreign id only: what a lookup by the producer's id matches.
	later := idempotency.DeriveEventID("inventory", "42", at.Add(1000*time.Hour))
	if id.String()[15:] != later.String()[15:] || id.String()[:15] == later.String()[:15] {
		t.Fatalf("%s and %s (same producer id, other times): want the same last 21 characters, another head", id, later)
	}
}

// The layout is fixed, bit for bit, so that other languages can derive the
// same ids (a producer-side script, a lookup tool). The expected id was
// computed apart from this code, with Python's hashlib and uuid:
//
//	h = sha256(b"inventory\0" + fid).digest(); b[0:6] = ms.to_bytes(6, "big")
//	b[6] = 0x70 | h[0] & 0x0f; b[7] = h[1]; b[8] = 0x80 | h[2] & 0x3f; b[9:] = h[3:10]
func TestDeriveEventIDLayout(t *testing.T) {
	at := time.Date(2026, 3, 14, 9, 26, 53, 589_000_000, time.UTC)
	got := idempotency.DeriveEventID("inventory", "3f1c2a54-0b7e-4e3a-9c51-7d2f8e6a1b90", at)
	if want := "019cebab-8995-7b1b-bb5d-65e23ab14d67"; got.String() != want {
		t.Fatalf("DeriveEventID = %s; want %s", got, want)
	}
}

// A derived id claims like any UUIDv7, against PostgreSQL: the first
// delivery runs the handler, the second is a duplicate.
func TestADerivedIDClaimsOnce(t *testing.T) {
	pool := setup(t)
	group := uniqueGroup(t, "g")
	id := idempotency.DeriveEventID("inventory", uuid.NewString(), time.Now())
	var runs atomic.Int64
	var outcomes []idempotency.Outcome
	m := newMiddleware(t, idempotency.Config{DB: pool, ConsumerGroup: group,
		OnResult: func(r idempotency.Result) { outcomes = append(outcomes, r.Outcome) }})
	h := m.Middleware(recordEffect(group, &runs))
	msg := newMessage(id, `"sku":"A-1"`)
	for range 2 {
		if _, err := h(msg.Copy()); err != nil {
			t.Fatal(err)
		}
	}
	if runs.Load() != 1 || effects(t, pool, id, group) != 1 || fmt.Sprint(outcomes) != fmt.Sprint([]idempotency.Outcome{idempotency.Processed, idempotency.Duplicate}) {
		t.Fatalf("%d runs, %d effects, outcomes %v; want 1, 1, processed then duplicate", runs.Load(), effects(t, pool, id, group), outcomes)
	}
}
