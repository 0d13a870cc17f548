package idempotency

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"

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
	// The errors name what is wrong, never the payload's text: they become
	// the dead letter's reason, and an event_id that is no UUID may be
	// anything (encoding/json's and uuid's own messages quote it).
	if err := json.Unmarshal(msg.Payload, &doc); err != nil {
		var syntax *json.SyntaxError
		var typ *json.UnmarshalTypeError
		switch {
		case errors.As(err, &syntax):
			return uuid.Nil, fmt.Errorf("%w: payload is not JSON (at byte %d of %d)", ErrInvalidKey, syntax.Offset, len(msg.Payload))
		case errors.As(err, &typ) && typ.Field == "event_id":
			kind, _, _ := strings.Cut(typ.Value, " ") // "number 1e400": the kind alone
			return uuid.Nil, fmt.Errorf("%w: event_id is a JSON %s, want a UUIDv7 string", ErrInvalidKey, kind)
		case errors.As(err, &typ):
			kind, _, _ := strings.Cut(typ.Value, " ")
			return uuid.Nil, fmt.Errorf("%w: payload is a JSON %s, want an object", ErrInvalidKey, kind)
		}
		return uuid.Nil, fmt.Errorf("%w: payload is not a JSON object", ErrInvalidKey)
	}
	if doc.EventID == nil {
		return uuid.Nil, fmt.Errorf("%w: payload has no event_id", ErrInvalidKey)
	}
	id, err := uuid.Parse(*doc.EventID)
	if err != nil {
		return uuid.Nil, fmt.Errorf("%w: event_id is a string of %d bytes that is not a UUID", ErrInvalidKey, len(*doc.EventID))
	}
	if id.Version() != 7 || id.Variant() != uuid.RFC4122 {
		return uuid.Nil, fmt.Errorf("%w: event_id %s is UUID version %d, want 7 "+
			"(for a producer whose ids are not UUIDv7s, give Config.Key a KeyFunc that derives one with DeriveEventID)",
			ErrInvalidKey, id, id.Version())
	}
	return id, nil
}
