package outbox_test

import (
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/once-dev/once/outbox"
)

func TestEventIDIsAStableUUIDv7OfItsTime(t *testing.T) {
	cause := uuid.Must(uuid.NewV7())
	at := time.Date(2026, 12, 3, 10, 0, 0, 123e6, time.UTC)
	a, b := outbox.EventID(cause, "payment.charged.v1", at), outbox.EventID(cause, "payment.charged.v1", at)
	if a != b || a.Version() != 7 || a.Variant() != uuid.RFC4122 {
		t.Fatalf("%s, %s: want one UUIDv7", a, b)
	}
	sec, nsec := a.Time().UnixTime()
	if !time.Unix(sec, nsec).Equal(at) {
		t.Fatalf("the id's time is %s, want %s", time.Unix(sec, nsec).UTC(), at)
	}
	if outbox.EventID(cause, "payment.failed.v1", at) == a || outbox.EventID(uuid.Must(uuid.NewV7()), "payment.charged.v1", at) == a {
		t.Fatal("another type or cause gave the same id")
	}
}
