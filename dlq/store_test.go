package dlq_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/dlq"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/pgdb"
	"github.com/once-dev/once/schema"
)

// Parked letters reach Kafka byte for byte (a binary header included), each
// once; a letter whose topic does not exist stays parked with its error and
// holds no other up.
func TestParkedLettersDrainOneByOne(t *testing.T) {
	ctx := context.Background()
	store, _, pool := newStore(t)
	brokers := testenv.Brokers(t)
	topic := testenv.Topic(t, brokers, 1)
	missing := topic + ".nowhere"
	binary := "\xff\x00\xfe"
	if err := park(ctx, store, pool,
		dlq.Letter{Topic: missing, Payload: []byte("lost?"), Headers: map[string]string{"reason_poisoned": "x"}},
		dlq.Letter{Topic: topic, Key: []byte("k1"), Payload: []byte("first"), Headers: map[string]string{"bin": binary}},
		dlq.Letter{Topic: topic, Key: []byte("k2"), Payload: []byte("second"), Headers: map[string]string{"reason_poisoned": "y"}},
	); err != nil {
		t.Fatal(err)
	}
	producer := testenv.Producer(t, brokers)
	cfg := dlq.DrainConfig{DB: pool, Producer: producer, MaxBackoff: time.Hour}
	if n, err := store.DrainOnce(ctx, cfg); err != nil || n != 3 {
		t.Fatalf("drained %d (%v), want 3 taken", n, err)
	}
	parked, err := store.List(ctx, pool, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(parked) != 1 || parked[0].Topic != missing || parked[0].Attempts != 1 || parked[0].LastError == "" {
		t.Fatalf("parked after a pass: %+v; want only the letter for the missing topic, with its error", parked)
	}
	if n, err := store.DrainOnce(ctx, cfg); err != nil || n != 0 {
		t.Fatalf("a second pass took %d (%v); the failed letter waits for its backoff", n, err)
	}
	c, err := sarama.NewConsumer(brokers, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	pc, err := c.ConsumePartition(topic, 0, sarama.OffsetOldest)
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	var got []string
	for len(got) < 2 {
		select {
		case m := <-pc.Messages():
			got = append(got, string(m.Value))
			if string(m.Value) == "first" {
				var h string
				for _, rh := range m.Headers {
					if string(rh.Key) == "bin" {
						h = string(rh.Value)
					}
				}
				if h != binary || string(m.Key) != "k1" {
					t.Errorf("header %q key %q; want the bytes %q and k1 as parked", h, m.Key, binary)
				}
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("read %v", got)
		}
	}
	if got[0] != "first" || got[1] != "second" {
		t.Fatalf("topic holds %v", got)
	}
}

func newStore(t *testing.T) (*dlq.Store, schema.Config, *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	pool := testenv.Postgres(t)
	names := schema.Config{Schema: "dlq_test_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")}
	if _, err := schema.Migrate(ctx, pool, names); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA "+names.Schema+" CASCADE") })
	store, err := dlq.NewStore(names)
	if err != nil {
		t.Fatal(err)
	}
	return store, names, pool
}

// A parked letter's message is acknowledged right after the park commits, so
// the commit must be durable whatever the server's synchronous_commit: the
// park raises "off" to "local" for its transaction.
func TestParkIsDurableWhateverTheDefault(t *testing.T) {
	ctx := context.Background()
	store, _, pool := newStore(t)
	cfg := pool.Config().Copy()
	cfg.ConnConfig.RuntimeParams["synchronous_commit"] = "off"
	lax, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer lax.Close()
	tx, err := lax.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var before, after string
	_ = tx.QueryRow(ctx, `SHOW synchronous_commit`).Scan(&before)
	if err := store.Park(ctx, tx, dlq.Letter{Topic: "t", Payload: []byte("p")}); err != nil {
		t.Fatal(err)
	}
	_ = tx.QueryRow(ctx, `SHOW synchronous_commit`).Scan(&after)
	if before != "off" || after != "local" {
		t.Fatalf("synchronous_commit %q before the park, %q after; want off raised to local", before, after)
	}
}

// A row whose headers this version cannot read stays parked, with the
// reason, and the letters behind it are published all the same.
func TestAnUnreadableLetterHoldsNoOtherUp(t *testing.T) {
	ctx := context.Background()
	store, names, pool := newStore(t)
	brokers := testenv.Brokers(t)
	topic := testenv.Topic(t, brokers, 1)
	if _, err := pool.Exec(ctx, `INSERT INTO `+names.Schema+`.once_dead_letter (topic, payload, headers) VALUES ($1, 'x', '"not a list"')`, topic); err != nil {
		t.Fatal(err)
	}
	var good []dlq.Letter
	for i := range 12 {
		good = append(good, dlq.Letter{Topic: topic, Payload: []byte(fmt.Sprint("good ", i))})
	}
	if err := park(ctx, store, pool, good...); err != nil {
		t.Fatal(err)
	}
	var published int
	cfg := dlq.DrainConfig{DB: pool, Producer: testenv.Producer(t, brokers), OnPublished: func(dlq.Letter) { published++ }}
	for pass := 0; pass < 5 && published < len(good); pass++ {
		if _, err := store.DrainOnce(ctx, cfg); err != nil {
			t.Fatalf("pass %d: %v", pass, err)
		}
	}
	parked, err := store.List(ctx, pool, 10)
	if err != nil {
		t.Fatal(err)
	}
	if published != len(good) || len(parked) != 1 || !strings.Contains(parked[0].LastError, "headers cannot be read") {
		t.Fatalf("published %d of %d; parked %+v; want every good letter out and the unreadable one parked with its reason", published, len(good), parked)
	}
}

// A drainer scoped to its service's topics leaves another service's letters
// parked and untouched (no attempt counted), and publishes its own.
func TestADrainerTakesOnlyItsTopics(t *testing.T) {
	ctx := context.Background()
	store, _, pool := newStore(t)
	brokers := testenv.Brokers(t)
	mine := testenv.Topic(t, brokers, 1)
	theirs := mine + ".theirs"
	if err := park(ctx, store, pool,
		dlq.Letter{Topic: theirs, Payload: []byte("not mine")},
		dlq.Letter{Topic: mine, Payload: []byte("mine")},
	); err != nil {
		t.Fatal(err)
	}
	var published []string
	cfg := dlq.DrainConfig{DB: pool, Producer: testenv.Producer(t, brokers), Topics: []string{mine},
		OnPublished: func(l dlq.Letter) { published = append(published, l.Topic) }}
	if n, err := store.DrainOnce(ctx, cfg); err != nil || n != 1 {
		t.Fatalf("took %d (%v); want only the letter of its own topic", n, err)
	}
	parked, err := store.List(ctx, pool, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(published) != 1 || published[0] != mine || len(parked) != 1 || parked[0].Topic != theirs || parked[0].Attempts != 0 {
		t.Fatalf("published %v, parked %+v; want %s published and %s parked untried", published, parked, mine, theirs)
	}
}

// silentBroker is a producer whose sends never return, as sarama's do for
// minutes on a broker that neither answers nor fails; it counts them.
type silentBroker struct {
	sarama.SyncProducer
	sends   chan struct{}
	release chan struct{}
}

func (s silentBroker) SendMessage(*sarama.ProducerMessage) (int32, int64, error) {
	s.sends <- struct{}{}
	<-s.release
	return 0, 0, fmt.Errorf("released")
}

// A stop ends the drain at once while a send waits on a silent broker
// (review finding: sarama's SendMessage takes no context, and shutdown
// waited for its retries); the letter stays parked, to be sent later.
func TestAStopEndsTheDrainWhileKafkaIsSilent(t *testing.T) {
	ctx := context.Background()
	store, _, pool := newStore(t)
	if err := park(ctx, store, pool, dlq.Letter{Topic: "t", Payload: []byte("p")}); err != nil {
		t.Fatal(err)
	}
	broker := silentBroker{sends: make(chan struct{}, 10), release: make(chan struct{})}
	defer close(broker.release)
	drainCtx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		store.Drain(drainCtx, dlq.DrainConfig{DB: pool, Producer: broker})
	}()
	select {
	case <-broker.sends:
	case <-time.After(10 * time.Second):
		t.Fatal("the drainer sent nothing: the fault did not happen")
	}
	stopped := time.Now()
	stop()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("the drain did not stop within 5s of its context while the broker was silent")
	}
	t.Logf("stopped %s after the stop", time.Since(stopped).Round(time.Millisecond))
	parked, err := store.List(ctx, pool, 10)
	if err != nil || len(parked) != 1 {
		t.Fatalf("parked after the stop: %v (%v); want the letter still there", parked, err)
	}
}

// ParkFrom parks a message's letter once: the same bytes read again at the
// same place (an offset reset) are not parked twice; other bytes at that
// place (the topic made again) are another message.
func TestParkFromParksAMessageOnce(t *testing.T) {
	ctx := context.Background()
	store, _, pool := newStore(t)
	src := dlq.Source{Group: "g", Topic: "orders", Partition: 3, Offset: 17}
	for i, c := range []struct {
		payload string
		want    bool
	}{{"bad", true}, {"bad", false}, {"other", true}, {"other", false}} {
		parked, err := parkFrom(ctx, store, pool, src, dlq.Letter{Topic: "orders.dlq", Payload: []byte(c.payload)})
		if err != nil || parked != c.want {
			t.Fatalf("park %d (%s): parked %t (%v), want %t", i, c.payload, parked, err, c.want)
		}
	}
	other := src
	other.Group = "h"
	if parked, err := parkFrom(ctx, store, pool, other, dlq.Letter{Topic: "orders.dlq", Payload: []byte("bad")}); err != nil || !parked {
		t.Fatalf("another group's letter: parked %t (%v), want parked", parked, err)
	}
	if letters, err := store.List(ctx, pool, 10); err != nil || len(letters) != 3 {
		t.Fatalf("%d letters parked (%v), want 3", len(letters), err)
	}
	if n, err := store.PruneSources(ctx, pool, 0); err != nil || n != 2 {
		t.Fatalf("pruned %d sources (%v), want 2", n, err)
	}
}

// park parks letters in a transaction of their own.
func park(ctx context.Context, store *dlq.Store, pool *pgxpool.Pool, letters ...dlq.Letter) error {
	return pgdb.InTx(ctx, pool, func(tx pgx.Tx) error { return store.Park(ctx, tx, letters...) })
}

func parkFrom(ctx context.Context, store *dlq.Store, pool *pgxpool.Pool, src dlq.Source, l dlq.Letter) (parked bool, err error) {
	err = pgdb.InTx(ctx, pool, func(tx pgx.Tx) error {
		parked, err = store.ParkFrom(ctx, tx, src, l)
		return err
	})
	return parked, err
}
