package oncetest_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/oncetest"
	"github.com/once-dev/once/pipeline"
)

func TestMain(m *testing.M) { testenv.MainWithServices(m, "DATABASE_URL") }

// exampleT stands in for a test's *testing.T, which an example does not
// have.
type exampleT struct{ cleanups []func() }

func (*exampleT) Helper()                      {}
func (*exampleT) Fatal(args ...any)            { panic(fmt.Sprint(args...)) }
func (*exampleT) Fatalf(f string, args ...any) { panic(fmt.Sprintf(f, args...)) }
func (*exampleT) Errorf(f string, args ...any) { panic(fmt.Sprintf(f, args...)) }
func (*exampleT) Skip(args ...any)             { panic(fmt.Sprint(args...)) }
func (e *exampleT) Cleanup(f func())           { e.cleanups = append(e.cleanups, f) }
func (e *exampleT) done() {
	for i := len(e.cleanups) - 1; i >= 0; i-- {
		e.cleanups[i]()
	}
}

type shipped struct {
	ID     uuid.UUID `json:"event_id"`
	Parcel int64     `json:"parcel_id"`
}

func (s shipped) EventID() uuid.UUID { return s.ID }

// A team's test of its topic: the same event twice, and the bytes of a
// producer with a bug, through the topic's groups as the pipeline runs them.
func ExampleNew() {
	t := &exampleT{} // in a test: the test's t
	defer t.done()

	db := oncetest.NewDB(t)
	if _, err := db.Pool.Exec(context.Background(), `CREATE TABLE parcels (parcel_id bigint PRIMARY KEY)`); err != nil {
		panic(err)
	}
	h := oncetest.New(t, oncetest.Config{DB: db.Pool, Tables: db.Tables, Topics: []pipeline.Binding{
		pipeline.Topic[shipped]{Name: "parcel.shipped.v1",
			Decode: func(b []byte) (s shipped, err error) { return s, json.Unmarshal(b, &s) },
			Groups: []pipeline.Group[shipped]{{Name: "parcels", Handle: func(ctx context.Context, tx pgx.Tx, s shipped) error {
				_, err := tx.Exec(ctx, `INSERT INTO parcels VALUES ($1)`, s.Parcel)
				return err
			}}}},
	}})

	ev := shipped{ID: uuid.Must(uuid.NewV7()), Parcel: 42}
	h.RequireOnce("parcel.shipped.v1", oncetest.JSON("42", ev)) // rolled back, processed, a duplicate
	fmt.Println(h.SendJSON("parcel.shipped.v1", ev).Outcomes())
	fmt.Println(h.Send("parcel.shipped.v1", oncetest.Message{Payload: []byte(`{"event_id": 17}`)}).Outcomes())

	var n int
	_ = db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM parcels`).Scan(&n)
	fmt.Println("parcels:", n)
	// Output:
	// [duplicate]
	// [dead-lettered]
	// parcels: 1
}
