package oncetest_test

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/oncetest"
)

type event struct{ ID uuid.UUID }

func (e event) EventID() uuid.UUID { return e.ID }

const createEffects = `CREATE TABLE IF NOT EXISTS oncetest_effect (event_id uuid NOT NULL)`

// DeliverTwice makes the mistake it exists for visible: a handler that
// writes through the pool instead of the claim's transaction leaves two
// effects (the rolled-back attempt's and the committed one's), a handler that
// writes through tx leaves one.
func TestDeliverTwiceShowsAWriteOutsideTheTransaction(t *testing.T) {
	pool := testenv.Postgres(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, createEffects); err != nil {
		t.Fatal(err)
	}
	effects := func(id uuid.UUID) int {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM oncetest_effect WHERE event_id = $1`, id).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	good := oncetest.New(t, oncetest.Config[event]{DB: pool, Handle: func(ctx context.Context, tx pgx.Tx, e event) error {
		_, err := tx.Exec(ctx, `INSERT INTO oncetest_effect VALUES ($1)`, e.ID)
		return err
	}})
	bad := oncetest.New(t, oncetest.Config[event]{DB: pool, Handle: func(ctx context.Context, _ pgx.Tx, e event) error {
		_, err := pool.Exec(ctx, `INSERT INTO oncetest_effect VALUES ($1)`, e.ID)
		return err
	}})
	e1, e2 := event{uuid.Must(uuid.NewV7())}, event{uuid.Must(uuid.NewV7())}
	good.DeliverTwice(e1)
	bad.DeliverTwice(e2)
	if effects(e1.ID) != 1 || effects(e2.ID) != 2 {
		t.Fatalf("effects: through tx %d, through the pool %d; want 1 and 2", effects(e1.ID), effects(e2.ID))
	}
	if good.Runs() != 2 || bad.Runs() != 2 {
		t.Fatalf("handler runs %d and %d; want 2 each (rolled back, committed; the duplicate skipped)", good.Runs(), bad.Runs())
	}
}
