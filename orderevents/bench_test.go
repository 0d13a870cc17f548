package orderevents_test

import (
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/orderevents"
)

// BenchmarkDecodeConfirmed is the decoder's share of a consumer's CPU per
// event: one Go-written and one pydantic-written event.
func BenchmarkDecodeConfirmed(b *testing.B) {
	ev, err := orderevents.NewConfirmed(uuid.Must(uuid.NewV7()), time.Now(), 1234567, 89, decimal.RequireFromString("129.90"))
	if err != nil {
		b.Fatal(err)
	}
	ours, _ := ev.MarshalJSON()
	pydantic := []byte(`{"event_id":"0192f3a4-5b6c-7d8e-9f01-23456789abcd","event_type":"order.confirmed.v1","occurred_at":"2026-12-02T15:08:21.123456Z","order_id":1234567,"customer_id":89,"total_amount":"129.90"}`)
	for name, payload := range map[string][]byte{"go": ours, "pydantic": pydantic} {
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := orderevents.DecodeConfirmed(payload); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
