package idempotency_test

import (
	"testing"

	"github.com/once-dev/once/middleware/idempotency"
)

// BenchmarkCanonicalJSON is the default fingerprint's cost per message
// (PayloadSHA256 runs it on every payload): the guide's event as pydantic
// writes it, the same with its members out of order and an offset, and a
// larger event with nesting, escapes and numbers in several forms.
func BenchmarkCanonicalJSON(b *testing.B) {
	for name, payload := range map[string]string{
		"pydantic":  `{"event_id":"0192f3a4-5b6c-7d8e-9f01-23456789abcd","event_type":"order.confirmed.v1","occurred_at":"2026-12-02T15:08:21.123456Z","order_id":1234567,"customer_id":89,"total_amount":"129.90"}`,
		"reordered": `{"total_amount":129.90, "order_id":1234567, "occurred_at":"2026-12-02T17:08:21.123456+02:00", "event_type":"order.confirmed.v1", "event_id":"0192f3a4-5b6c-7d8e-9f01-23456789abcd", "customer_id":89}`,
		"nested": `{"event_id":"0192f3a4-5b6c-7d8e-9f01-23456789abcd","event_type":"shipment.sent.v1","occurred_at":"2026-12-02T15:08:21Z",` +
			`"address":{"name":"J\u00fcrgen M\u00fcller","street":"Stra\u00dfe 1 \"Hinterhaus\"","city":"K\u00f6ln","zip":"50667"},` +
			`"parcels":[{"weight_kg":12.50,"dims":[30,20,10.0]},{"weight_kg":1.25e1,"dims":[40,30,20]},{"weight_kg":0.5,"dims":[10,10,10]}],` +
			`"note":"fragile <glass> & \"handle with care\"\n","tags":["a","b","c"],"insured":true,"customs":null}`,
	} {
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(payload)))
			p := []byte(payload)
			for b.Loop() {
				if _, err := idempotency.CanonicalJSON(p); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
