package once_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once"
	"github.com/once-dev/once/console"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/middleware/idempotency"
)

// reserved is an event of a producer whose ids are UUIDv4s.
type reserved struct {
	ReservationID string    `json:"reservation_id"`
	CreatedAt     time.Time `json:"created_at"`
	Quantity      int       `json:"quantity"`
}

func (r reserved) EventID() uuid.UUID {
	return once.DeriveEventID("inventory", r.ReservationID, r.CreatedAt)
}

// Through the front door, against Kafka and PostgreSQL: a topic with an
// IDNamespace whose events derive their ids with once.DeriveEventID is
// processed once per event, and the service's console (Service.Console)
// finds the event's claim by the producer's own id.
func TestAProducersIDFindsItsEventInTheServicesConsole(t *testing.T) {
	brokers := testenv.Brokers(t)
	topic := testenv.Topic(t, brokers, 1)
	group := "stock-" + uuid.NewString()[:8]
	handled := make(chan reserved, 4)
	var decided atomic.Int64
	svc, err := once.New(context.Background(), once.Config{Brokers: brokers, DatabaseURL: os.Getenv("DATABASE_URL"), Tables: ownTables(t), Logger: quiet(),
		Hooks: once.Hooks{OnResult: func(r idempotency.Result) {
			if r.Outcome == idempotency.Processed || r.Outcome == idempotency.Duplicate {
				decided.Add(1)
			}
		}},
		Topics: []once.Binding{once.Topic[reserved]{Name: topic, IDNamespace: "inventory",
			Decode: func(b []byte) (r reserved, err error) { return r, json.Unmarshal(b, &r) },
			Groups: []once.Group[reserved]{{Name: group, Handle: func(_ context.Context, _ pgx.Tx, r reserved) error {
				handled <- r
				return nil
			}}}}}})
	if err != nil {
		t.Fatal(err)
	}
	start(t, svc)
	foreign := uuid.NewString()
	ev := reserved{ReservationID: foreign, CreatedAt: time.Now().UTC(), Quantity: 3}
	b, _ := json.Marshal(ev)
	producer := testenv.Producer(t, brokers)
	for range 2 {
		testenv.Publish(t, producer, topic, "k", b)
	}
	testenv.Eventually(t, 60*time.Second, "both deliveries decided", func() bool { return decided.Load() == 2 })
	if len(handled) != 1 {
		t.Fatalf("the handler ran %d times for an event delivered twice; want once", len(handled))
	}

	con, err := svc.Console(console.Config{})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(con)
	defer srv.Close()
	id := ev.EventID()
	var page string
	testenv.Eventually(t, 30*time.Second, "the inbox lists the claim", func() bool {
		resp, err := http.Get(srv.URL + "/console/inbox?" + url.Values{"event": {foreign}}.Encode())
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		page = fmt.Sprintf("%d %s", resp.StatusCode, body)
		return resp.StatusCode == http.StatusOK && strings.Contains(page, id.String()) && strings.Contains(page, "<td>"+group+"</td>")
	})
}
