package e2e

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/orderevents"
	"github.com/once-dev/once/payment"
	"github.com/once-dev/once/pipeline"
)

const (
	billingGroup   = "billing"
	analyticsGroup = "analytics"
)

// scenario is one isolated run: its own topics, consumer groups (a suffix on
// the real names), merchant account at the provider, customers and events.
type scenario struct {
	t        *testing.T
	name     string
	pool     *pgxpool.Pool
	brokers  []string
	topic    string // order.confirmed.v1 of the scenario; dlq is its dead-letter topic
	dlq      string
	cancels  string // order.cancelled.v1 of the scenario
	payments string // payment.events.v1 of the scenario
	suffix   string // of every topic and consumer group
	parts    int32
	account  string
	producer sarama.SyncProducer
	dir      string

	providerURL   string
	providerEnv   []string // the simulator's own environment, on top of env
	providerFlags []string // the simulator's flags, where a helper starts it
	provider      *proc
	ordersURL     string

	mu        sync.Mutex
	events    []orderevents.Confirmed
	declined  []orderevents.Confirmed // priced above the provider's decline limit
	cancelled []orderevents.Cancelled
	poison    [][]byte
	customers []int64
	// analytics' totals of the customers before the scenario: customers of
	// another producer (the Python one) are not the scenario's alone.
	base     analyticsFigures
	procs    []*proc
	kills    int
	restarts int
	rebal    int
	// exactlyOnceDLQ: every poison message and declined order must be in the
	// dead-letter topic exactly once per group (no replay in the scenario).
	exactlyOnceDLQ bool
	// env is added to every process's environment.
	env []string
	// mode is how every consumer of the scenario orders and commits its
	// work; the row's name says which.
	mode mode
	// keyByCustomer keys the confirmations by their customer, not their
	// order: each key then has many events, whose order the call log can
	// check.
	keyByCustomer bool
	// keylessEvery publishes every n-th valid confirmation without a key.
	keylessEvery int
	// calls, if set, stands between the consumers and the provider and
	// logs every charge and refund (see callLog); verify then checks the
	// order of the calls.
	calls *callLog
	// consumerDB, if set, is the consumers' DATABASE_URL (a pooler in front
	// of the test database); the checks read the database directly.
	consumerDB string
	// sessionTimeout is the consumers' --session-timeout; default 6s, the
	// broker's minimum, so that a crashed member's partitions move soon.
	sessionTimeout string
	// gaps, if set, is what the row measured of its partitions' pauses
	// (see deploys_test.go): its figures go in the results.
	gaps *deployFigures
	// dbs are the groups' own databases (row 24), by group name without
	// the suffix; a group not in it keeps its tables in pool's.
	dbs map[string]*pgxpool.Pool
}

// dbOf is the database group (its name, with or without the suffix) keeps
// its claims and tables in.
func (s *scenario) dbOf(group string) *pgxpool.Pool {
	if p := s.dbs[strings.TrimSuffix(group, s.suffix)]; p != nil {
		return p
	}
	return s.pool
}

// parked counts the dead letters waiting in every database for topics.
func (s *scenario) parked(topics []string) (int64, error) {
	var total int64
	for _, db := range []*pgxpool.Pool{s.dbOf(billingGroup), s.dbOf(analyticsGroup)} {
		var n int64
		if err := db.QueryRow(context.Background(), `SELECT count(*) FROM once_dead_letter WHERE topic = ANY($1)`, topics).Scan(&n); err != nil {
			return 0, err
		}
		total += n
		if s.dbOf(billingGroup) == s.dbOf(analyticsGroup) {
			break
		}
	}
	return total, nil
}

// mode is how a scenario's consumers (app serve) order and commit their work.
type mode struct {
	name  string   // in the row's name
	flags []string // app serve's
}

var (
	// partitionOrder: one message of a partition at a time in every group,
	// analytics one event per transaction (serve's behaviour before it
	// defaulted to key order).
	partitionOrder = mode{"partition order", []string{"--concurrency", "0"}}
	// keyOrder: billing (confirmations, cancellations) and analytics on
	// payment events in key order, up to six messages of each group at
	// once, each key's in its order (serve's default).
	keyOrder = mode{"key order", []string{"--concurrency", fmt.Sprint(keyConcurrency)}}
	// batched: analytics commits its confirmations in batches of 50 (the
	// group commit); the other groups in partition order, as the batched
	// rows ran before key order.
	batched = mode{"batched", []string{"--concurrency", "0", "--analytics-batch", "50"}}

	// allModes are the modes of the rows that run in each.
	allModes = []mode{partitionOrder, keyOrder, batched}
	// perEventAndBatched are the modes of the rows that run twice.
	perEventAndBatched = []mode{partitionOrder, batched}
)

// keyConcurrency is keyOrder's --concurrency; serve's window is four times it.
const keyConcurrency = 6

func (m mode) String() string { return m.name }

// eachMode runs a scenario once in each mode, as a subtest named after it.
func eachMode(t *testing.T, modes []mode, run func(t *testing.T, m mode)) {
	for _, m := range modes {
		t.Run(strings.ReplaceAll(m.name, " ", "-"), func(t *testing.T) { run(t, m) })
	}
}

func newScenario(t *testing.T, name string, partitions int32) *scenario {
	t.Helper()
	return newScenarioOn(t, name, partitions, testenv.Brokers(t), 1)
}

// newScenarioOn runs the scenario on other brokers (a cluster), its topics
// with that replication factor.
func newScenarioOn(t *testing.T, name string, partitions int32, brokers []string, replication int16) *scenario {
	t.Helper()
	suffix := ".e2e-" + uuid.NewString()[:8]
	s := &scenario{
		t:        t,
		name:     name,
		pool:     reftest.Postgres(t),
		brokers:  brokers,
		topic:    "order.confirmed.v1" + suffix,
		cancels:  "order.cancelled.v1" + suffix,
		payments: "payment.events.v1" + suffix,
		suffix:   suffix,
		parts:    partitions,
		account:  "acct_e2e_" + uuid.NewString()[:8],
		dir:      t.TempDir(),
		mode:     partitionOrder,
	}
	if keep := os.Getenv("ONCE_E2E_LOGS"); keep != "" {
		// Logs survive the test there, for a person to read after a failure.
		s.dir = filepath.Join(keep, strings.ReplaceAll(t.Name(), "/", "_"))
		if err := os.MkdirAll(s.dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if strings.Join(brokers, ",") != os.Getenv("KAFKA_BROKERS") {
		s.env = append(s.env, "KAFKA_BROKERS="+strings.Join(brokers, ","))
	}
	s.dlq = s.topic + ".dlq"
	admin := testenv.AdminOn(t, brokers)
	for _, topic := range []string{s.topic, s.cancels, s.payments} {
		if err := admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: partitions, ReplicationFactor: replication}, false); err != nil {
			t.Fatal(err)
		}
		if err := admin.CreateTopic(topic+".dlq", &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: replication}, false); err != nil {
			t.Fatal(err)
		}
	}
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V4_3_1_0
	cfg.Producer.Return.Successes = true
	cfg.Producer.RequiredAcks = sarama.WaitForAll
	cfg.Producer.MaxMessageBytes = 1 << 20
	p, err := sarama.NewSyncProducer(brokers, cfg)
	if err != nil {
		t.Fatal(err)
	}
	s.producer = p
	// Customers of this scenario only: analytics' totals are per customer.
	first := (1 + rand.Int64N(1<<40)) * 100
	for i := range int64(20) {
		s.customers = append(s.customers, first+i)
	}
	t.Cleanup(func() {
		for _, pr := range s.procs {
			pr.kill()
		}
		s.producer.Close()
	})
	return s
}

// row is the scenario's name in the results table: its name and its mode.
func (s *scenario) row() string { return fmt.Sprintf("%s (%s)", s.name, s.mode) }

func (s *scenario) group(name string) string { return name + s.suffix }

// useCustomers makes ids the scenario's customers, whose analytics totals
// verify checks, counting from what they hold now.
func (s *scenario) useCustomers(ids []int64) {
	s.t.Helper()
	s.customers = ids
	s.base = s.analyticsNow()
}

// proc is one running app process.
type proc struct {
	name string
	cmd  *exec.Cmd
	log  string
	done chan struct{}
	err  error
}

func (s *scenario) start(name string, args ...string) *proc {
	s.t.Helper()
	return s.startEnv(name, nil, args...)
}

func (s *scenario) startEnv(name string, env []string, args ...string) *proc {
	s.t.Helper()
	logPath := filepath.Join(s.dir, fmt.Sprintf("%s-%d.log", name, time.Now().UnixNano()))
	f, err := os.Create(logPath)
	if err != nil {
		s.t.Fatal(err)
	}
	cmd := exec.Command(appBinary, args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.Env = append(append(os.Environ(), s.env...), env...)
	if err := cmd.Start(); err != nil {
		s.t.Fatal(err)
	}
	p := &proc{name: name, cmd: cmd, log: logPath, done: make(chan struct{})}
	go func() { p.err = cmd.Wait(); f.Close(); close(p.done) }()
	s.mu.Lock()
	s.procs = append(s.procs, p)
	s.mu.Unlock()
	return p
}

func (p *proc) running() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

func (p *proc) kill() {
	if p.running() {
		_ = p.cmd.Process.Signal(syscall.SIGKILL)
		<-p.done
	}
}

// stop sends SIGTERM and waits; it reports whether the process exited 0.
func (p *proc) stop(t *testing.T) {
	t.Helper()
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(45 * time.Second):
		p.kill()
		t.Errorf("%s did not stop within 45s of SIGTERM", p.name)
		return
	}
	if p.err != nil {
		t.Errorf("%s exited with %v after SIGTERM, want 0; log %s:\n%s", p.name, p.err, p.log, tail(p.log, 20))
	}
}

func tail(path string, n int) string {
	b, _ := os.ReadFile(path)
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// startProvider runs `app payment-provider` with the given fault flags and
// waits until it answers. It reuses the address across restarts.
func (s *scenario) startProvider(flags ...string) {
	s.t.Helper()
	if s.providerURL == "" {
		s.providerURL = "http://" + testenv.FreeAddr(s.t)
	}
	args := append([]string{"payment-provider", "--no-migrate", "--listen", strings.TrimPrefix(s.providerURL, "http://"),
		"--in-flight-timeout", "3s", "--log-level", "warn"}, flags...)
	s.provider = s.startEnv("provider", s.providerEnv, args...)
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		resp, err := http.Get(s.providerURL + "/healthz")
		if err == nil {
			resp.Body.Close()
			return
		}
		if !s.provider.running() {
			s.t.Fatalf("provider exited: %s", tail(s.provider.log, 20))
		}
		time.Sleep(50 * time.Millisecond)
	}
	s.t.Fatal("provider did not answer within 30s")
}

// consumer starts `app serve` for both groups. Extra flags go last.
func (s *scenario) consumer(name string, extra ...string) *proc {
	s.t.Helper()
	return s.consumerEnv(name, nil, extra...)
}

func (s *scenario) consumerEnv(name string, env []string, extra ...string) *proc {
	s.t.Helper()
	env = append([]string{"PAYMENT_API_KEY=" + s.account}, env...) // a secret: never a flag
	if s.consumerDB != "" {
		env = append([]string{"DATABASE_URL=" + s.consumerDB}, env...) // the caller's own wins
	}
	args := []string{"serve", "--no-migrate", "--topic-suffix", s.suffix, "--group-suffix", s.suffix, "--partitions", fmt.Sprint(s.parts),
		"--groups", "billing,analytics", "--payment-url", s.paymentURL(),
		"--session-timeout", cmp.Or(s.sessionTimeout, "6s"), "--maintenance-interval", "0", "--ops-listen", "127.0.0.1:0",
		"--log-level", "debug", "--log-format", "json"}
	args = append(args, s.mode.flags...)
	return s.startEnv(name, env, append(args, extra...)...)
}

func (s *scenario) newEvent(amount decimal.Decimal) orderevents.Confirmed {
	s.t.Helper()
	ev, err := orderevents.NewConfirmed(uuid.Must(uuid.NewV7()), time.Now(), 1+rand.Int64N(1<<62),
		s.customers[len(s.events)%len(s.customers)], amount)
	if err != nil {
		s.t.Fatal(err)
	}
	return ev
}

func (s *scenario) send(key string, payload []byte) {
	s.t.Helper()
	s.sendTo(s.topic, key, payload)
}

// sendTo publishes payload under key; "" publishes it without a key.
func (s *scenario) sendTo(topic, key string, payload []byte) {
	s.t.Helper()
	// Right after a broker restart, or a topic's creation, its partitions
	// may have no leader yet for longer than the producer's own retries: the
	// scenario's producer (not the system under test) keeps trying.
	deadline := time.Now().Add(60 * time.Second)
	for {
		msg := &sarama.ProducerMessage{Topic: topic, Value: sarama.ByteEncoder(payload)}
		if key != "" {
			msg.Key = sarama.StringEncoder(key)
		}
		_, _, err := s.producer.SendMessage(msg)
		if err == nil {
			return
		}
		if time.Now().After(deadline) || !isRetriableKafka(err) {
			s.t.Fatalf("publish to %s: %v", topic, err)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

func isRetriableKafka(err error) bool {
	var kerr sarama.KError
	// Only errors that say the message was not appended: a retry after a
	// timeout could append it twice, and a second copy of a poison message
	// is a second dead letter the scenario would count (review finding).
	return errors.As(err, &kerr) && slices.Contains([]sarama.KError{sarama.ErrNotLeaderForPartition, sarama.ErrUnknownTopicOrPartition,
		sarama.ErrLeaderNotAvailable, sarama.ErrNotEnoughReplicas}, kerr)
}

// cancelWhilePublishing cancels, every interval until done closes, the
// newest order published (most likely before its charge) and an older one
// (most likely after it).
func (s *scenario) cancelWhilePublishing(done <-chan struct{}, interval time.Duration) {
	cancelled := map[int64]bool{}
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case <-done:
			return
		case <-tick.C:
		}
		s.mu.Lock()
		var pick []orderevents.Confirmed
		if n := len(s.events); n > 20 {
			for _, ev := range []orderevents.Confirmed{s.events[n-1], s.events[rand.IntN(n/2)]} {
				if !cancelled[ev.OrderID()] {
					cancelled[ev.OrderID()] = true
					pick = append(pick, ev)
				}
			}
		}
		s.mu.Unlock()
		s.cancel(pick)
	}
}

// copiesIn counts the messages of topic whose event_id is id.
func (s *scenario) copiesIn(topic, id string) int {
	s.t.Helper()
	client, err := sarama.NewClient(s.brokers, nil)
	if err != nil {
		s.t.Fatal(err)
	}
	defer client.Close()
	partitions, err := client.Partitions(topic)
	if err != nil {
		s.t.Fatal(err)
	}
	consumer, err := sarama.NewConsumerFromClient(client)
	if err != nil {
		s.t.Fatal(err)
	}
	defer consumer.Close()
	n := 0
	for _, p := range partitions {
		end, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil || end == 0 {
			continue
		}
		pc, err := consumer.ConsumePartition(topic, p, sarama.OffsetOldest)
		if err != nil {
			s.t.Fatal(err)
		}
		for m := range pc.Messages() {
			if strings.Contains(string(m.Value), `"event_id":"`+id+`"`) {
				n++
			}
			if m.Offset+1 >= end {
				break
			}
		}
		pc.Close()
	}
	return n
}

// recancel publishes the last n cancellations again, with the same bytes.
func (s *scenario) recancel(n int) {
	s.t.Helper()
	for _, c := range s.cancelled[len(s.cancelled)-n:] {
		b, _ := c.MarshalJSON()
		s.sendTo(s.cancels, strconv.FormatInt(c.OrderID(), 10), b)
	}
}

// cancel publishes an order.cancelled.v1 for each event's order, keyed by
// the order id, as the order service would.
func (s *scenario) cancel(events []orderevents.Confirmed) {
	s.t.Helper()
	for _, ev := range events {
		c, err := orderevents.NewCancelled(uuid.Must(uuid.NewV7()), time.Now(), ev.OrderID(), "e2e")
		if err != nil {
			s.t.Fatal(err)
		}
		s.mu.Lock()
		s.cancelled = append(s.cancelled, c)
		s.mu.Unlock()
		b, _ := c.MarshalJSON()
		s.sendTo(s.cancels, strconv.FormatInt(ev.OrderID(), 10), b)
	}
}

// publish sends n fresh valid events, keyed by order id, pausing between them.
func (s *scenario) publish(n int, pause time.Duration) []orderevents.Confirmed {
	s.t.Helper()
	var out []orderevents.Confirmed
	for i := range n {
		ev := s.newEvent(decimal.New(int64(100+(len(s.events)*37)%20000), -2))
		s.sendEvent(ev, &s.events)
		out = append(out, ev)
		if pause > 0 && i%10 == 9 {
			time.Sleep(pause)
		}
	}
	return out
}

// sendEvent remembers ev in list (for the checks) and publishes it under
// its key.
func (s *scenario) sendEvent(ev orderevents.Confirmed, list *[]orderevents.Confirmed) {
	s.t.Helper()
	s.mu.Lock()
	*list = append(*list, ev)
	keyless := list == &s.events && s.keylessEvery > 0 && len(*list)%s.keylessEvery == 0
	s.mu.Unlock()
	b, _ := ev.MarshalJSON()
	key := s.keyOf(ev)
	if keyless {
		key = ""
	}
	s.send(key, b)
}

// keyOf is a confirmation's Kafka key: its order's id, as the order service
// keys it, or its customer's with keyByCustomer.
func (s *scenario) keyOf(ev orderevents.Confirmed) string {
	if s.keyByCustomer {
		return "customer-" + strconv.FormatInt(ev.CustomerID(), 10)
	}
	return strconv.FormatInt(ev.OrderID(), 10)
}

// publishDeclined sends n events the provider declines: billing records them
// as failed and dead-letters them; analytics counts them.
func (s *scenario) publishDeclined(n int) []orderevents.Confirmed {
	s.t.Helper()
	var out []orderevents.Confirmed
	for range n {
		ev := s.newEvent(decimal.RequireFromString("10000.01"))
		s.sendEvent(ev, &s.declined)
		out = append(out, ev)
	}
	return out
}

// republish sends events again as a producer would: same bytes; with
// otherKey the copy lands on another partition, so two consumers race on it.
func (s *scenario) republish(events []orderevents.Confirmed, otherKey bool) {
	s.t.Helper()
	for _, ev := range events {
		b, _ := ev.MarshalJSON()
		key := s.keyOf(ev)
		if otherKey {
			key = "elsewhere-" + key
		}
		s.send(key, b)
	}
}

func (s *scenario) sendPoison(payload []byte) {
	s.t.Helper()
	s.mu.Lock()
	s.poison = append(s.poison, payload)
	s.mu.Unlock()
	s.send("poison", payload)
}

// resetOffsetsToEarliest uses Kafka's own consumer-group tool; the group must
// have no running members.
func (s *scenario) resetOffsetsToEarliest(group string, topics ...string) {
	s.t.Helper()
	args := []string{"tool", "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand",
		"--bootstrap-server", strings.Join(s.brokers, ","), "--group", group}
	for _, t := range topics {
		args = append(args, "--topic", t)
	}
	cmd := exec.Command(filepath.Join(repoRoot, "dev", "kafka.sh"), append(args, "--reset-offsets", "--to-earliest", "--execute")...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		s.t.Fatalf("kafka-consumer-groups --reset-offsets: %v\n%s", err, out)
	}
}

// waitDrained waits until every group committed the end of every partition
// of every topic it reads, and none of the scenario's dead letters waits in
// the database.
func (s *scenario) waitDrained(timeout time.Duration) {
	s.t.Helper()
	client, err := sarama.NewClient(s.brokers, nil)
	if err != nil {
		s.t.Fatal(err)
	}
	defer client.Close()
	admin, err := sarama.NewClusterAdminFromClient(client)
	if err != nil {
		s.t.Fatal(err)
	}
	pairs := [][2]string{{s.group(billingGroup), s.topic}, {s.group(billingGroup), s.cancels},
		{s.group(analyticsGroup), s.topic}, {s.group(analyticsGroup), s.payments}}
	deadline := time.Now().Add(timeout)
	if s.ordersURL != "" {
		s.waitForwarded(deadline)
	}
	var lag, parked int64
	for time.Now().Before(deadline) {
		lag = 0
		_ = client.RefreshMetadata(s.topic, s.cancels, s.payments)
		for _, p := range pairs {
			l, err := pipeline.GroupLag(client, admin, p[0], p[1])
			if err != nil {
				l = 1 << 30 // not known yet: not drained
			}
			lag += l
		}
		if parked, err = s.parked([]string{s.topic + ".dlq", s.cancels + ".dlq", s.payments + ".dlq"}); err != nil {
			parked = 1 << 30
		}
		if lag == 0 && parked == 0 {
			return
		}
		time.Sleep(250 * time.Millisecond)
	}
	s.t.Errorf("consumer lag still %d, %d dead letters waiting, after %s", lag, parked, timeout)
}

// waitForwarded waits until the topic holds every event the order
// service accepted, by id. It accepts an order when the order's outbox
// row commits, and its forwarder publishes the event after: until then
// the groups' lag can be zero with events still on their way: row 14's
// forwarder, held up by the leader's kill, publishes the last orders 5 to
// 9 s after they were all accepted, and one run verified with 247 of 300
// events not yet in the topic. A count of messages would not do: a
// forwarder that retries a send the broker had written (a leader's kill)
// publishes copies, which could make up for events still in the outbox.
func (s *scenario) waitForwarded(deadline time.Time) {
	s.t.Helper()
	s.mu.Lock()
	want := make(map[string]bool, len(s.events))
	for _, ev := range s.events {
		want[ev.EventID().String()] = true
	}
	s.mu.Unlock()
	missing := len(want)
	for {
		if testenv.MessageCount(s.t, s.brokers, s.topic) >= int64(len(want)) {
			if missing = len(missingFrom(testenv.ReadTopic(s.t, s.brokers, s.topic), want)); missing == 0 {
				return
			}
		}
		if time.Now().After(deadline) {
			s.t.Errorf("%s lacks %d of the %d events the order service accepted: its outbox did not forward them", s.topic, missing, len(want))
			return
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// missingFrom are the ids of want that none of msgs carries.
func missingFrom(msgs []*sarama.ConsumerMessage, want map[string]bool) []string {
	seen := map[string]bool{}
	for _, m := range msgs {
		var ev struct {
			ID string `json:"event_id"`
		}
		if json.Unmarshal(m.Value, &ev) == nil {
			seen[ev.ID] = true
		}
	}
	var out []string
	for id := range want {
		if !seen[id] {
			out = append(out, id)
		}
	}
	return out
}

// outcomes reads every consumer process's log: per group and outcome, the
// number of deliveries, and the event ids per outcome.
type outcomes struct {
	count   map[string]map[string]int // group, outcome: over every topic
	ids     map[string]map[string][]string
	byTopic map[string]int // group|topic|outcome
	lines   map[string]int // other log messages of interest, by text
}

func (s *scenario) readOutcomes() outcomes {
	o := outcomes{count: map[string]map[string]int{}, ids: map[string]map[string][]string{}, byTopic: map[string]int{}, lines: map[string]int{}}
	for _, p := range s.procs {
		f, err := os.Open(p.log)
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 1<<20), 4<<20)
		for sc.Scan() {
			var l struct {
				Msg     string `json:"msg"`
				Outcome string `json:"outcome"`
				Group   string `json:"consumer_group"`
				Topic   string `json:"topic"`
				EventID string `json:"event_id"`
			}
			if json.Unmarshal(sc.Bytes(), &l) != nil {
				continue
			}
			if l.Msg != "message" {
				o.lines[l.Msg]++
				continue
			}
			if o.count[l.Group] == nil {
				o.count[l.Group] = map[string]int{}
				o.ids[l.Group] = map[string][]string{}
			}
			o.count[l.Group][l.Outcome]++
			o.byTopic[l.Group+"|"+l.Topic+"|"+l.Outcome]++
			o.ids[l.Group][l.Outcome] = append(o.ids[l.Group][l.Outcome], l.EventID)
		}
		f.Close()
	}
	return o
}

func (o outcomes) total(group string) int {
	n := 0
	for _, c := range o.count[group] {
		n += c
	}
	return n
}

// verify checks the invariants every scenario ends with, records the row and
// reports each violation.
func (s *scenario) verify(drainTimeout time.Duration) {
	t := s.t
	t.Helper()
	s.waitDrained(drainTimeout)
	ctx := context.Background()
	r := result{Scenario: s.row(), Events: len(s.events) + len(s.declined) + len(s.cancelled), Kills: s.kills, Restarts: s.restarts, Rebal: s.rebal}
	o := s.readOutcomes()
	for _, g := range []string{s.group(billingGroup), s.group(analyticsGroup)} {
		r.Deliveries += o.total(g)
		r.Duplicates += o.count[g]["duplicate"]
	}

	client, err := payment.NewClient(payment.ClientConfig{BaseURL: s.providerURL, APIKey: s.account})
	if err != nil {
		t.Fatal(err)
	}
	ledger, err := client.Ledger(ctx)
	if err != nil {
		t.Fatalf("ledger: %v", err)
	}
	key := func(id int64) string { return strconv.FormatInt(id, 10) }
	ids := make([]uuid.UUID, 0, len(s.events))
	for _, ev := range s.events {
		ids = append(ids, ev.EventID())
	}
	cancelIDs := make([]uuid.UUID, 0, len(s.cancelled))
	cancelledOrder := map[string]bool{}
	for _, c := range s.cancelled {
		cancelIDs = append(cancelIDs, c.EventID())
		cancelledOrder[key(c.OrderID())] = true
	}
	// Billing's record of each order: charged, failed, or cancelled before
	// its charge (then it must never be charged).
	status := map[string]string{}
	rows, err := s.dbOf(billingGroup).Query(ctx, `SELECT order_id, status FROM billing.payments WHERE event_id = ANY($1)`,
		append(append([]uuid.UUID(nil), ids...), s.declinedIDs()...))
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id int64
		var st string
		_ = rows.Scan(&id, &st)
		status[key(id)] = st
	}
	rows.Close()

	want := map[string]orderevents.Confirmed{} // orders that must be charged once
	total := decimal.Zero
	for _, ev := range s.events {
		switch st := status[key(ev.OrderID())]; {
		case st == "cancelled" && cancelledOrder[key(ev.OrderID())]:
			continue // its cancellation came first: never charged
		case st != "charged":
			t.Errorf("order %d: billing recorded %q, want charged", ev.OrderID(), st)
		}
		want[key(ev.OrderID())] = ev
		total = total.Add(ev.TotalAmount())
	}
	charged := map[string]int{}
	chargesOf := map[string][]string{} // order → its charges' keys and times, to tell which lock let a double through
	for _, c := range ledger.Charges {
		charged[c.OrderID]++
		chargesOf[c.OrderID] = append(chargesOf[c.OrderID], fmt.Sprintf("%s under key %s at %s", c.ChargeID, c.IdempotencyKey, c.CreatedAt.Format("15:04:05.000000")))
		if _, ok := want[c.OrderID]; !ok {
			t.Errorf("charge %s for an order that must not be charged: %s", c.ChargeID, c.OrderID)
		}
	}
	r.Charges = ledger.Count
	for id, n := range charged {
		if n > 1 {
			r.DoubleCharges++
			t.Errorf("order %s charged %d times: %s", id, n, strings.Join(chargesOf[id], "; "))
		}
	}
	if len(want) > 0 && ledger.Totals["EUR"] != total.StringFixed(2) {
		t.Errorf("charged total %s, ordered total %s", ledger.Totals["EUR"], total.StringFixed(2))
	}

	// Refunds: each cancelled order that was charged, once, in full; none
	// other.
	refunds := map[string]int{}
	refunded := decimal.Zero
	for _, rf := range ledger.Refunds {
		refunds[rf.OrderID]++
		amount := decimal.RequireFromString(rf.Amount)
		refunded = refunded.Add(amount)
		if ev, ok := want[rf.OrderID]; !ok || !cancelledOrder[rf.OrderID] || !amount.Equal(ev.TotalAmount()) {
			t.Errorf("refund %s of order %s: not a cancelled, charged order, or not in full", rf.RefundID, rf.OrderID)
		}
	}
	r.Refunds = ledger.RefundCount
	missingRefunds := 0
	for o := range cancelledOrder {
		if _, ok := want[o]; ok && refunds[o] == 0 {
			missingRefunds++
		}
		if refunds[o] > 1 {
			r.DoubleRefunds++
			t.Errorf("order %s refunded %d times", o, refunds[o])
		}
	}
	var ourRefunds int
	var ourRefunded decimal.Decimal
	if err := s.dbOf(billingGroup).QueryRow(ctx, `SELECT count(*), coalesce(sum(amount), 0) FROM billing.refunds WHERE event_id = ANY($1)`, cancelIDs).Scan(&ourRefunds, &ourRefunded); err != nil {
		t.Fatal(err)
	}
	if ourRefunds != ledger.RefundCount || !ourRefunded.Equal(refunded) {
		t.Errorf("billing recorded %d refunds (%s), the provider made %d (%s)", ourRefunds, ourRefunded, ledger.RefundCount, refunded)
	}

	var failed int
	if err := s.dbOf(billingGroup).QueryRow(ctx, `SELECT count(*) FROM billing.payments WHERE event_id = ANY($1) AND status = 'failed'`, s.declinedIDs()).Scan(&failed); err != nil {
		t.Fatal(err)
	}
	if failed != len(s.declined) {
		t.Errorf("billing recorded %d failed payments for %d declined orders", failed, len(s.declined))
	}
	declinedTotal := decimal.Zero
	for _, ev := range s.declined {
		declinedTotal = declinedTotal.Add(ev.TotalAmount())
		if charged[key(ev.OrderID())] > 0 {
			t.Errorf("declined order %d was charged", ev.OrderID())
		}
	}
	ordered := declinedTotal
	for _, ev := range s.events {
		ordered = ordered.Add(ev.TotalAmount())
	}

	// Billing's payment events, through its outbox, each applied once by
	// analytics: every one billing recorded is claimed, and analytics' counts
	// equal the ledger.
	var outgoing []uuid.UUID
	rows, err = s.dbOf(billingGroup).Query(ctx, `SELECT payment_event_id FROM billing.payments WHERE event_id = ANY($1) AND payment_event_id IS NOT NULL
		UNION ALL SELECT payment_event_id FROM billing.refunds WHERE event_id = ANY($2) AND payment_event_id IS NOT NULL`,
		append(append([]uuid.UUID(nil), ids...), s.declinedIDs()...), cancelIDs)
	if err != nil {
		t.Fatal(err)
	}
	if outgoing, err = pgx.CollectRows(rows, pgx.RowTo[uuid.UUID]); err != nil {
		t.Fatal(err)
	}
	if want := ledger.Count + len(s.declined) + ledger.RefundCount; len(outgoing) != want {
		t.Errorf("billing recorded %d payment events, want one per charge, decline and refund: %d", len(outgoing), want)
	}
	unclaimed := s.waitClaimed(s.group(analyticsGroup), outgoing, 60*time.Second)

	a := s.analyticsNow()
	a.revenue, a.orders = a.revenue.Sub(s.base.revenue), a.orders-s.base.orders
	a.refunded, a.refunds = a.refunded.Sub(s.base.refunded), a.refunds-s.base.refunds
	a.charges, a.failures = a.charges-s.base.charges, a.failures-s.base.failures
	if !a.revenue.Equal(ordered) || a.orders != len(s.events)+len(s.declined) {
		t.Errorf("analytics: %s over %d orders; want %s over %d", a.revenue, a.orders, ordered, len(s.events)+len(s.declined))
	}
	if !a.refunded.Equal(refunded) || a.refunds != ledger.RefundCount || a.charges != ledger.Count || a.failures != len(s.declined) {
		t.Errorf("analytics applied %d charges, %d failures, %d refunds (%s); the ledger has %d charges, %d declined, %d refunds (%s)",
			a.charges, a.failures, a.refunds, a.refunded, ledger.Count, len(s.declined), ledger.RefundCount, refunded)
	}

	lost := map[uuid.UUID]bool{}
	for _, id := range unclaimed {
		lost[id] = true
	}
	claimed := append(append(append([]uuid.UUID(nil), ids...), s.declinedIDs()...), cancelIDs...)
	for _, g := range []string{s.group(billingGroup), s.group(analyticsGroup)} {
		check := claimed
		if g == s.group(analyticsGroup) {
			check = append(append([]uuid.UUID(nil), ids...), s.declinedIDs()...) // analytics reads no cancellations
		}
		for _, id := range s.unclaimed(g, check) {
			lost[id] = true
		}
	}
	for id := range want {
		if charged[id] == 0 {
			lost[want[id].EventID()] = true
		}
	}
	r.Lost = len(lost)
	if r.Lost > 0 {
		t.Errorf("%d events lost (no claim in a group, never charged, never refunded, or a payment event never applied: %d of %d outgoing; %d refunds missing)",
			r.Lost, len(unclaimed), len(outgoing), missingRefunds)
	}
	if missingRefunds > 0 {
		t.Errorf("%d cancelled, charged orders were never refunded", missingRefunds)
	}
	s.verifyPoison()
	if s.calls != nil {
		s.verifyOrder()
	}
	if s.gaps != nil {
		r.Gaps = s.gaps
	}
	// Recorded when the test ends, so checks made after verify count too.
	t.Cleanup(func() {
		r.Pass = !t.Failed()
		record(r)
	})
	t.Logf("%s: %+v", s.name, r)
}

func (s *scenario) declinedIDs() []uuid.UUID {
	ids := make([]uuid.UUID, 0, len(s.declined))
	for _, ev := range s.declined {
		ids = append(ids, ev.EventID())
	}
	return ids
}

// unclaimed returns the ids that group has no claim of.
func (s *scenario) unclaimed(group string, ids []uuid.UUID) []uuid.UUID {
	s.t.Helper()
	rows, err := s.dbOf(group).Query(context.Background(), `SELECT e FROM unnest($1::uuid[]) AS e WHERE NOT EXISTS (
		SELECT 1 FROM processed_event p WHERE p.event_id = e AND p.consumer_group = $2)`, ids, group)
	if err != nil {
		s.t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	if err != nil {
		s.t.Fatal(err)
	}
	return out
}

// waitClaimed waits until group claimed every id (outbox events reach Kafka
// after their transaction, so after the lag said drained), and returns
// those it never claimed.
func (s *scenario) waitClaimed(group string, ids []uuid.UUID, timeout time.Duration) []uuid.UUID {
	s.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		missing := s.unclaimed(group, ids)
		if len(missing) == 0 || time.Now().After(deadline) {
			return missing
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// analyticsFigures are analytics' totals of the scenario's customers.
type analyticsFigures struct {
	revenue, refunded                  decimal.Decimal
	orders, refunds, charges, failures int
}

func (s *scenario) analyticsNow() analyticsFigures {
	s.t.Helper()
	var a analyticsFigures
	if err := s.dbOf(analyticsGroup).QueryRow(context.Background(), `SELECT coalesce(sum(revenue), 0), coalesce(sum(order_count), 0),
		coalesce(sum(refunded), 0), coalesce(sum(refund_count), 0) FROM analytics.customer_daily_revenue WHERE customer_id = ANY($1)`,
		s.customers).Scan(&a.revenue, &a.orders, &a.refunded, &a.refunds); err != nil {
		s.t.Fatal(err)
	}
	if err := s.dbOf(analyticsGroup).QueryRow(context.Background(), `SELECT coalesce(sum(charged_count), 0), coalesce(sum(failed_count), 0)
		FROM analytics.customer_daily_payments WHERE customer_id = ANY($1)`, s.customers).Scan(&a.charges, &a.failures); err != nil {
		s.t.Fatal(err)
	}
	return a
}

// verifyPoison reads the dead-letter topic: every poison message must be
// there, dead-lettered by both groups, with a reason.
func (s *scenario) verifyPoison() {
	t := s.t
	seen := s.deadLetters()
	for _, p := range s.poison {
		for _, g := range []string{s.group(billingGroup), s.group(analyticsGroup)} {
			if len(seen[string(p)][g]) == 0 || seen[string(p)][g][0] == "" {
				t.Errorf("poison message %.60q not dead-lettered with a reason by %s", p, g)
			}
			if s.exactlyOnceDLQ && len(seen[string(p)][g]) > 1 {
				t.Errorf("poison message %.60q dead-lettered %d times by %s, want once", p, len(seen[string(p)][g]), g)
			}
		}
	}
	if s.exactlyOnceDLQ {
		for _, ev := range s.declined {
			b, _ := ev.MarshalJSON()
			if n := len(seen[string(b)][s.group(billingGroup)]); n != 1 {
				t.Errorf("declined order %d dead-lettered %d times by billing, want once", ev.OrderID(), n)
			}
		}
	}
}

// deadLetters reads the scenario's order-confirmed dead-letter topic:
// payload -> group -> the reason of each copy.
func (s *scenario) deadLetters() map[string]map[string][]string {
	t := s.t
	cfg := sarama.NewConfig()
	cfg.Consumer.Fetch.Max = 2 << 20
	c, err := sarama.NewConsumer(s.brokers, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	pc, err := c.ConsumePartition(s.dlq, 0, sarama.OffsetOldest)
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	seen := map[string]map[string][]string{}
	for {
		select {
		case m := <-pc.Messages():
			var reason, group string
			for _, h := range m.Headers {
				switch string(h.Key) {
				case middleware.ReasonForPoisonedKey:
					reason = string(h.Value)
				case middleware.PoisonedHandlerKey:
					group = string(h.Value)
				}
			}
			if seen[string(m.Value)] == nil {
				seen[string(m.Value)] = map[string][]string{}
			}
			seen[string(m.Value)][group] = append(seen[string(m.Value)][group], reason)
			continue
		case <-time.After(3 * time.Second):
		}
		break
	}
	return seen
}

// held counts the attempts held because the environment failed, and the
// messages dead-lettered, over every consumer's log.
func (o outcomes) held() int {
	return o.lines["holding the message: its attempt failed for a reason that is not the message's own; retrying"]
}

// deadLettered counts the library's one line per dead letter: a message
// at fault, or a group's recorded verdict (app serve logs none of its own).
func (o outcomes) deadLettered() int {
	return o.lines["dead-lettered: the message itself is at fault"] + o.lines["rejected for good; recorded and committed"]
}

// stillRunning fails the test for every consumer that exited on its own.
func (s *scenario) stillRunning(procs ...*proc) {
	s.t.Helper()
	for _, p := range procs {
		if !p.running() {
			s.t.Errorf("%s exited during the fault: %s", p.name, tail(p.log, 10))
		}
	}
}

// sql runs statements on a connection of its own to the test database,
// as its superuser, with read-only transactions off for the session.
func (s *scenario) sql(stmts ...string) {
	s.t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		s.t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "SET default_transaction_read_only = off"); err != nil {
		s.t.Fatal(err)
	}
	for _, st := range stmts {
		if _, err := conn.Exec(ctx, st); err != nil {
			s.t.Fatalf("%s: %v", st, err)
		}
	}
}

// devService runs dev/<script>.sh with args and fails the test if it fails;
// scenarios that crash a service skip unless it is the one dev/test.sh runs.
func (s *scenario) devService(script string, args ...string) {
	s.t.Helper()
	out, err := exec.Command(filepath.Join(repoRoot, "dev", script+".sh"), args...).CombinedOutput()
	if err != nil {
		s.t.Fatalf("dev/%s.sh %v: %v\n%s", script, args, err, out)
	}
}

func (s *scenario) requireDevService(script string) {
	s.t.Helper()
	if err := exec.Command(filepath.Join(repoRoot, "dev", script+".sh"), "status").Run(); err != nil {
		if os.Getenv("ONCE_REQUIRE_SERVICES") != "" && os.Getenv("ONCE_EXTERNAL_SERVICES") == "" {
			s.t.Fatalf("dev/%s.sh is not running, but the suite runs under dev/test.sh", script)
		}
		s.t.Skipf("the service is not the one dev/%s.sh runs; this scenario crashes it and cannot crash yours", script)
	}
}

func freshPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		pool := reftest.Postgres(t)
		if err := pool.Ping(context.Background()); err == nil || time.Now().After(deadline) {
			return pool
		}
		time.Sleep(200 * time.Millisecond)
	}
}
