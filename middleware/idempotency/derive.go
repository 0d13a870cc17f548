package idempotency

import (
	"crypto/sha256"
	"time"

	"github.com/google/uuid"
)

// DeriveEventID is the claim key of an event whose producer does not send a
// UUIDv7 (a UUIDv4, a number, an id of its own): a UUIDv7 made from the
// producer's id and a time the event carries, the same on every delivery.
//
// Its first 48 bits are at's Unix milliseconds, so the dedup horizon and the
// claim table's range partitions judge the event by at, as they judge a
// UUIDv7 by the time its producer wrote in it. Its version is 7 and its
// variant RFC 4122's; its other 74 bits are the first bits of
// SHA-256(namespace, 0x00, foreignID). namespace keeps two producers' ids
// apart (two producers' "42" are two events): the producer's name or the
// topic's, the same for every event of that producer, and without a NUL
// byte.
//
// at must be a time the producer never changes for the event (when it
// created it, not when it sent it): a re-send that carries another at
// is another event, and runs again. A time before 1970 or after the year
// 10889 does not fit in 48 bits; the id then carries another time, and the
// dedup horizon refuses it.
//
// Two events with the same namespace and foreignID but different at get
// different ids that end alike: the last 21 characters of the id's text
// form depend on namespace and foreignID only, which is how an operator
// finds an event's claims by the producer's id (package inbox).
func DeriveEventID(namespace, foreignID string, at time.Time) uuid.UUID {
	h := sha256.New()
	h.Write([]byte(namespace))
	h.Write([]byte{0})
	h.Write([]byte(foreignID))
	sum := h.Sum(nil)

	var id uuid.UUID
	ms := uint64(at.UnixMilli())
	for i := range 6 {
		id[i] = byte(ms >> (8 * (5 - i)))
	}
	id[6] = 0x70 | sum[0]&0x0f // version 7, then 4 bits of the hash
	id[7] = sum[1]
	id[8] = 0x80 | sum[2]&0x3f // RFC 4122 variant (10), then 6 bits
	copy(id[9:], sum[3:10])
	return id
}
