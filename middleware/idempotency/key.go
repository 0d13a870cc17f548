package idempotency

import (
	"encoding/json"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
)

// KeyFunc extracts the dedup key of a message. An error means the message can
// never be processed; the middleware marks it [Permanent].
type KeyFunc func(msg *message.Message) (uuid.UUID, error)

// PayloadEventID is the default [KeyFunc]: the UUIDv7 in the JSON payload's
// top-level "event_id" field (R-KFK-IDEM-1). Headers and Kafka coordinates are
// deliberately not used: they differ between deliveries of one event.
// An event whose producer sends another kind of id needs a KeyFunc of its
// own that derives a UUIDv7 from it with [DeriveEventID].
func PayloadEventID(msg *message.Message) (uuid.UUID, error) {
	var doc struct {
		EventID *string `json:"event_id"`
	}
	if err := json.Unmarshal(msg.Payload, &doc); err != nil {
		return uuid.Nil, fmt.Errorf("%w: payload is not a JSON object: %v", ErrInvalidKey, err)
	}
	if doc.EventID == nil {
		return uuid.Nil, fmt.Errorf("%w: payload has no event_id", ErrInvalidKey)
	}
	id, err := uuid.Parse(*doc.EventID)
	if err != nil {
		return uuid.Nil, fmt.Errorf("%w: event_id %q: %v", ErrInvalidKey, *doc.EventID, err)
	}
	if id.Version() != 7 || id.Variant() != uuid.RFC4122 {
		return uuid.Nil, fmt.Errorf("%w: event_id %s is UUID version %d, want 7 "+
			"(for a producer whose ids are not UUIDv7s, give Config.Key a KeyFunc that derives one with DeriveEventID)",
			ErrInvalidKey, id, id.Version())
	}
	return id, nil
}
