package idempotency_test

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/once-dev/once/middleware/idempotency"
)

// FuzzPayloadEventID: on any payload the key extractor returns a UUIDv7
// that the payload's event_id spells, or an ErrInvalidKey; never a panic,
// never another id.
func FuzzPayloadEventID(f *testing.F) {
	for _, s := range []string{
		`{"event_id":"0190c1b2-3c4d-7e5f-8a6b-7c8d9e0f1a2b"}`, `{"event_id":"0190C1B2-3C4D-7E5F-8A6B-7C8D9E0F1A2B","x":1}`,
		`{"event_id":"urn:uuid:0190c1b2-3c4d-7e5f-8a6b-7c8d9e0f1a2b"}`, `{"event_id":"{0190c1b2-3c4d-7e5f-8a6b-7c8d9e0f1a2b}"}`,
		`{"event_id":"6ba7b810-9dad-11d1-80b4-00c04fd430c8"}`, `{"event_id":null}`, `{"event_id":7}`, `[`, ``,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, payload []byte) {
		id, err := idempotency.PayloadEventID(message.NewMessage("m", payload))
		if err != nil {
			if !errors.Is(err, idempotency.ErrInvalidKey) {
				t.Fatalf("%q: error %v is not an ErrInvalidKey", payload, err)
			}
			return
		}
		if id.Version() != 7 || id.Variant() != uuid.RFC4122 {
			t.Fatalf("%q: accepted %s, version %d", payload, id, id.Version())
		}
		var doc struct {
			EventID string `json:"event_id"`
		}
		if json.Unmarshal(payload, &doc) != nil {
			t.Fatalf("%q: accepted a payload encoding/json rejects", payload)
		}
		if again, err := uuid.Parse(doc.EventID); err != nil || again != id {
			t.Fatalf("%q: key %s, but event_id reads %q", payload, id, doc.EventID)
		}
	})
}

// The default key refuses another UUID version naming the payload's field,
// and says what a producer with ids of its own needs: a Config.Key that
// derives a UUIDv7 with DeriveEventID.
func TestPayloadEventIDPointsAtDeriveEventID(t *testing.T) {
	v4 := uuid.New()
	_, err := idempotency.PayloadEventID(message.NewMessage("m", []byte(`{"event_id":"`+v4.String()+`"}`)))
	if !errors.Is(err, idempotency.ErrInvalidKey) {
		t.Fatalf("a UUIDv4 event_id: %v; want an ErrInvalidKey", err)
	}
	for _, want := range []string{"event_id " + v4.String() + " is UUID version 4, want 7", "Config.Key", "DeriveEventID"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
}

// Review finding of issue 28: the default key's error quoted an event_id
// that is no UUID (and encoding/json's message a character of a payload
// that is not JSON); the error is the dead letter's reason, and the
// console and the logs show it. It names what is wrong, not the text.
func TestPayloadEventIDNeverQuotesThePayload(t *testing.T) {
	const pii = "jane.doe@example.com"
	for _, payload := range []string{pii, `{"event_id":"` + pii + `"}`, `{"event_id":"urn:` + pii + `"}`, `["` + pii + `"]`,
		`"` + pii + `"`, `{"event_id":["` + pii + `"]}`, `{"event_id":` + "1e400" + `}`, `{"event_id":"` + pii} {
		_, err := idempotency.PayloadEventID(message.NewMessage("m", []byte(payload)))
		if !errors.Is(err, idempotency.ErrInvalidKey) {
			t.Fatalf("%s: %v; want an ErrInvalidKey", payload, err)
		}
		for _, quoted := range []string{"jane", "example", "'j'", "1e400"} {
			if strings.Contains(err.Error(), quoted) {
				t.Errorf("%s: the error quotes the payload (%s): %v", payload, quoted, err)
			}
		}
	}
}
