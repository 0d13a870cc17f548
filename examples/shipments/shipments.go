package shipments

import (
	"context"
	"encoding/json"
	"fmt"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/once-dev/once/pipeline"
)

type Dispatched struct { // shipment.dispatched.v1; its event_id is the dedup key
	ID       uuid.UUID `json:"event_id"`
	Shipment int64     `json:"shipment_id"`
	Parcels  int       `json:"parcels"`
}

func (d Dispatched) EventID() uuid.UUID { return d.ID }

// Decode refuses what can never be handled: it is dead-lettered with the reason.
func Decode(b []byte) (d Dispatched, err error) {
	if err = json.Unmarshal(b, &d); err == nil && (d.Shipment < 1 || d.Parcels < 1) {
		err = fmt.Errorf("want shipment_id and parcels of at least 1, got %d and %d", d.Shipment, d.Parcels)
	}
	return d, err
}

// Count adds the parcels in the claim's transaction: once per event.
func Count(ctx context.Context, tx pgx.Tx, d Dispatched) error {
	_, err := tx.Exec(ctx, `INSERT INTO parcels (shipment_id, n) VALUES ($1, $2)
		ON CONFLICT (shipment_id) DO UPDATE SET n = parcels.n + EXCLUDED.n`, d.Shipment, d.Parcels)
	return err
}

// Topic binds it all for pipeline.Config.Topics.
func Topic(name string) pipeline.Topic[Dispatched] {
	return pipeline.Topic[Dispatched]{Name: name, Decode: Decode,
		Groups: []pipeline.Group[Dispatched]{{Name: "parcel-counter", Handle: Count}}}
}
