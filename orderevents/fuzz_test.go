package orderevents_test

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/orderevents"
)

// The decoders are the first code a stranger's bytes reach. On any input
// they return an event or an error, never panic; an event they accept
// encodes to our one byte form, which decodes again and encodes to the
// same bytes (one event, one byte form; the encoding carries every field,
// so equal bytes are the same event). The normal
// test run replays the seeds and the committed corpus (testdata/fuzz);
// go test -fuzz FuzzDecodeConfirmed ./orderevents explores further.

var confirmedSeeds = []string{
	`{"event_id":"0190c1b2-3c4d-7e5f-8a6b-7c8d9e0f1a2b","event_type":"order.confirmed.v1","occurred_at":"2024-07-17T17:16:26.123456Z","order_id":42,"customer_id":7,"total_amount":"19.99"}`,
	`{"event_id":"0190c1b2-3c4d-7e5f-8a6b-7c8d9e0f1a2b","event_type":"order.confirmed.v1","occurred_at":"2024-07-17T17:16:26+00:00","order_id":9223372036854775807,"customer_id":1,"total_amount":19.5,"extra":{"a":[1,2]}}`,
	`{"event_id":"0190c1b2-3c4d-7e5f-8a6b-7c8d9e0f1a2b","event_type":"order.confirmed.v1","occurred_at":"2024-07-17T17:16:26Z","order_id":1e3,"customer_id":7,"total_amount":"0.001"}`,
	`{"event_id":1}`, `[]`, `null`, ``, `{"event_id":"x","event_id":"y"}`,
}

func FuzzDecodeConfirmed(f *testing.F) {
	for _, s := range confirmedSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, payload []byte) {
		ev, err := orderevents.DecodeConfirmed(payload)
		if err != nil {
			return
		}
		roundTrip(t, payload, ev, func(b []byte) (json.Marshaler, error) { return orderevents.DecodeConfirmed(b) })
		sameCanonicalForm(t, ev)
	})
}

// sameCanonicalForm: the canonical form Confirmed writes itself is the one
// the pipeline made of its JSON before it had one; claims stored then must
// match.
func sameCanonicalForm(t *testing.T, ev orderevents.Confirmed) {
	t.Helper()
	marshalled, err := json.Marshal(ev)
	if err != nil {
		t.Fatal(err)
	}
	want, err := idempotency.CanonicalJSON(marshalled)
	if err != nil {
		t.Fatal(err)
	}
	got, err := ev.CanonicalJSON()
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("canonical form %s (%v); want %s, from %s", got, err, want, marshalled)
	}
}

func FuzzDecodeCancelled(f *testing.F) {
	for _, s := range []string{
		`{"event_id":"0190c1b2-3c4d-7e5f-8a6b-7c8d9e0f1a2b","event_type":"order.cancelled.v1","occurred_at":"2024-07-17T17:16:26.5Z","order_id":42,"reason":"customer asked"}`,
		`{"event_id":"0190c1b2-3c4d-7e5f-8a6b-7c8d9e0f1a2b","event_type":"order.cancelled.v1","occurred_at":"2024-07-17T17:16:26Z","order_id":-1,"reason":""}`,
		`{"reason":"\u0000\ud800"}`, `{}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, payload []byte) {
		ev, err := orderevents.DecodeCancelled(payload)
		if err != nil {
			return
		}
		roundTrip(t, payload, ev, func(b []byte) (json.Marshaler, error) { return orderevents.DecodeCancelled(b) })
	})
}

func FuzzDecodePayment(f *testing.F) {
	for _, s := range []string{
		`{"event_id":"0190c1b2-3c4d-7e5f-8a6b-7c8d9e0f1a2b","event_type":"payment.charged.v1","occurred_at":"2024-07-17T17:16:26Z","order_id":42,"customer_id":7,"amount":"19.99","currency":"EUR","provider_charge_id":"ch_1"}`,
		`{"event_id":"0190c1b2-3c4d-7e5f-8a6b-7c8d9e0f1a2b","event_type":"payment.failed.v1","occurred_at":"2024-07-17T17:16:26Z","order_id":42,"customer_id":7,"amount":"19.99","currency":"EUR","reason":"declined"}`,
		`{"event_id":"0190c1b2-3c4d-7e5f-8a6b-7c8d9e0f1a2b","event_type":"payment.refunded.v1","occurred_at":"2024-07-17T17:16:26Z","order_id":42,"customer_id":7,"amount":"19.99","currency":"EUR","provider_refund_id":"re_1"}`,
		`{"event_type":"payment.unknown.v1"}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, payload []byte) {
		ev, err := orderevents.DecodePayment(payload)
		if err != nil {
			return
		}
		roundTrip(t, payload, ev, func(b []byte) (json.Marshaler, error) { return orderevents.DecodePayment(b) })
	})
}

func roundTrip(t *testing.T, payload []byte, ev json.Marshaler, decode func([]byte) (json.Marshaler, error)) {
	t.Helper()
	if len(payload) > orderevents.MaxPayloadBytes {
		t.Fatalf("accepted %d bytes, above the bound of %d", len(payload), orderevents.MaxPayloadBytes)
	}
	ours, err := ev.MarshalJSON()
	if err != nil {
		t.Fatalf("accepted %q, cannot encode it: %v", payload, err)
	}
	again, err := decode(ours)
	if err != nil {
		t.Fatalf("accepted %q; our form %s does not decode: %v", payload, ours, err)
	}
	twice, err := again.MarshalJSON()
	if err != nil || !bytes.Equal(ours, twice) {
		t.Fatalf("accepted %q; one event, two byte forms: %s and %s (%v)", payload, ours, twice, err)
	}
}
