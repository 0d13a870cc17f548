package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/orderevents"
	"github.com/once-dev/once/retention"
)

// window is how long a fault lasts: short in the suite, longer when soaking.
func window(d time.Duration) time.Duration {
	if *soak {
		return 3 * d
	}
	return d
}

// publishInBackground publishes n events over about d and returns a channel
// closed when it is done.
func (s *scenario) publishInBackground(n int, d time.Duration) <-chan struct{} {
	done := make(chan struct{})
	pause := d / time.Duration(max(n/10, 1))
	go func() { defer close(done); s.publish(n, pause) }()
	return done
}

// 7. PostgreSQL read-only for a while (what clients see during a failover
// or switchover): every write fails with SQLSTATE 25006. Events are held, not
// one is dead-lettered, and all are processed once the database takes writes.
func TestReadOnlyDatabase(t *testing.T) {
	eachMode(t, perEventAndBatched, testReadOnlyDatabase)
}

func testReadOnlyDatabase(t *testing.T, m mode) {
	s := newScenario(t, "7 postgres read-only", 6)
	s.mode = m
	s.requireDevService("postgres")
	s.startProvider()
	a, b := s.consumer("consumer-a"), s.consumer("consumer-b")
	done := s.publishInBackground(scale(300), window(12*time.Second))
	time.Sleep(2 * time.Second)
	s.sql("ALTER SYSTEM SET default_transaction_read_only = on", "SELECT pg_reload_conf()")
	t.Cleanup(func() { s.sql("ALTER SYSTEM RESET default_transaction_read_only", "SELECT pg_reload_conf()") })
	// An instance (re)started during the failover: its first retention pass
	// fails on the read-only database, and it consumes anyway.
	time.Sleep(time.Second)
	c := s.consumer("consumer-c")
	time.Sleep(window(10 * time.Second))
	s.sql("ALTER SYSTEM RESET default_transaction_read_only", "SELECT pg_reload_conf()")
	<-done
	s.verify(120 * time.Second)
	if len(s.logLines("retention pass failed; consuming anyway")) == 0 {
		t.Error("consumer-c's start-up retention pass did not meet the read-only database: the fault did not happen")
	}
	s.stillRunning(c)
	o := s.readOutcomes()
	if o.held() == 0 || !strings.Contains(strings.Join(s.logLines("holding the message"), "\n"), "25006") {
		t.Errorf("no attempt was held with SQLSTATE 25006: the fault did not happen")
	}
	if n := o.deadLettered(); n != 0 {
		t.Errorf("%d good events were dead-lettered while the database was read-only", n)
	}
	s.stillRunning(a, b)
}

// 8. A network black hole between one consumer and PostgreSQL: the proxy
// keeps its connections open and forwards nothing. A second instance joins:
// the stuck one gives its partitions up (its attempts under way are
// cancelled once the revocation grace is spent), so the rebalance
// completes within the session timeout and the grace, and the newcomer
// processes its share at once; the stuck one catches up when the network
// does.
func TestDatabaseBlackHole(t *testing.T) {
	eachMode(t, perEventAndBatched, testDatabaseBlackHole)
}

func testDatabaseBlackHole(t *testing.T, m mode) {
	s := newScenario(t, "8 database black hole", 6)
	s.mode = m
	_, proxy := testenv.ProxiedPostgres(t, s.pool)
	s.startProvider()
	a := s.consumerEnv("consumer-a", []string{"DATABASE_URL=" + proxy.URL(os.Getenv("DATABASE_URL"))},
		"--db-statement-timeout", "15s", "--attempt-timeout", "30s", "--revocation-grace", "3s")
	s.publish(scale(60), 0)
	s.waitDrained(60 * time.Second)

	proxy.BlackHole(true)
	more := s.publish(scale(120), 0)
	time.Sleep(3 * time.Second) // consumer-a is now stuck on a silent database
	b := s.consumer("consumer-b")
	s.rebal++
	joined := time.Now()
	// Nothing can be claimed through the black hole: every claim of the new
	// events is consumer-b's, once the rebalance gave it partitions.
	took, claimed := time.Duration(0), 0
	for time.Since(joined) < 30*time.Second {
		if claimed = s.analyticsClaimsOf(more); claimed > 0 {
			took = time.Since(joined)
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if claimed == 0 {
		t.Fatal("consumer-b processed nothing within 30s of joining: the stuck consumer held the rebalance up")
	}
	t.Logf("with a consumer stuck on a black-holed database, the newcomer processed its first event %s after joining", took.Round(time.Millisecond))
	// The stuck attempts are under way: the revocation lets them go on for
	// the grace (3s here; serve's 10s made the rebalance take 11.7 to
	// 12.2s, against a bound written before the grace) before it cancels
	// them. Their statements began before consumer-b joined, so the 15s
	// statement timeout ends them 12s after it at the latest: below that,
	// only the revocation can have cancelled them.
	if took > 12*time.Second {
		t.Errorf("the rebalance took %s; want it within the 6s session timeout and the 3s revocation grace, plus a margin", took)
	}
	if !proxy.Swallowed() {
		t.Fatal("the black hole swallowed nothing: the fault did not happen")
	}
	proxy.BlackHole(false)
	s.verify(120 * time.Second)
	s.stillRunning(a, b)
}

// 9. The dead-letter topic is gone for a while, then back: every poison
// message and every declined charge is in it exactly once per group, and the
// partitions kept flowing meanwhile.
func TestDeadLetterTopicUnavailable(t *testing.T) {
	s := newScenario(t, "9 dead-letter topic unavailable", 3)
	s.exactlyOnceDLQ = true
	s.startProvider()
	a := s.consumer("consumer-a")
	s.publish(20, 0)
	s.waitDrained(60 * time.Second)
	admin := testenv.AdminOn(t, s.brokers)
	if err := admin.DeleteTopic(s.dlq); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Second)
	s.sendPoison([]byte(`{"event_id": "not json`))
	s.publishDeclined(3)
	s.sendPoison([]byte(`{"event_id":"0190a1b2-0000-7000-8000-000000000000","event_type":"order.confirmed.v1"}`))
	after := s.publish(30, 0)
	// The partitions kept flowing: the events behind the poison are done
	// while the dead letters wait in the database.
	if err := s.waitAnalyticsClaims(after, 60*time.Second); err != nil {
		t.Fatal(err)
	}
	var parked int
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		if err := s.pool.QueryRow(context.Background(), `SELECT count(*) FROM once_dead_letter WHERE topic = $1 AND attempts > 0`, s.dlq).Scan(&parked); err == nil && parked >= 7 {
			break
		}
	}
	if parked < 7 {
		t.Fatalf("%d dead letters parked and tried while their topic was gone; want the 2x2 poison and 3 declined", parked)
	}
	if err := admin.CreateTopic(s.dlq, &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1}, false); err != nil {
		t.Fatal(err)
	}
	s.verify(120 * time.Second)
	s.stillRunning(a)
}

// 10. The provider answers 401 for a while (its key being rotated): nothing
// is recorded as failed, nothing dead-lettered; every order is charged once
// when it answers again.
func TestProviderUnauthorized(t *testing.T) {
	s := newScenario(t, "10 provider answers 401", 3)
	s.startProvider("--fault-401-rate", "1")
	a := s.consumer("consumer-a", "--payment-attempts", "2")
	s.publish(scale(100), 0)
	time.Sleep(window(10 * time.Second))
	var failed int
	if err := s.pool.QueryRow(context.Background(), `SELECT count(*) FROM billing.payments WHERE event_id = ANY($1) AND status = 'failed'`, s.eventIDs()).Scan(&failed); err != nil || failed != 0 {
		t.Fatalf("%d orders recorded failed during the 401s (%v)", failed, err)
	}
	s.provider.kill()
	s.startProvider()
	s.restarts++
	s.verify(120 * time.Second)
	o := s.readOutcomes()
	if o.held() == 0 || !strings.Contains(strings.Join(s.logLines("holding the message"), "\n"), "401") {
		t.Error("no attempt was held with a 401: the fault did not happen")
	}
	if n := o.deadLettered(); n != 0 {
		t.Errorf("%d orders dead-lettered because of the 401s", n)
	}
	s.stillRunning(a)
}

// 11. A retention pass while a claim transaction stays open: the pass waits
// for its lock at most its lock timeout at a time, so claims keep flowing;
// it finishes once the transaction ends, or gives up and the next pass does.
func TestRetentionWithALongClaimOpen(t *testing.T) {
	s := newScenario(t, "11 retention beside a long claim", 3)
	s.startProvider()
	a := s.consumer("consumer-a")
	// Consuming first: serve's own start-up pass must be behind it, or it
	// is the pass that waits beside the long claim (and holds the
	// maintenance lock that app maintain below then finds busy).
	if err := s.waitAnalyticsClaims(s.publish(10, 0), 60*time.Second); err != nil {
		t.Fatal(err)
	}
	// An expired day to drop: its partition made as a pass ten days ago would.
	ctx := context.Background()
	past := retention.Config{DB: s.pool, Now: func() time.Time { return time.Now().AddDate(0, 0, -12) }}
	if _, err := retention.Run(ctx, past); err != nil {
		t.Fatal(err)
	}
	long, err := s.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer long.Rollback(ctx)
	if _, err := long.Exec(ctx, `INSERT INTO processed_event (event_id, consumer_group, payload_sha256) VALUES ($1, $2, '\x00')`,
		s.newEvent(decimal.NewFromInt(1)).EventID(), "long-"+s.suffix); err != nil {
		t.Fatal(err)
	}
	done := s.publishInBackground(scale(200), window(8*time.Second))
	maintain := s.start("maintain", "maintain", "--retention-lock-timeout", "300ms", "--retention-lock-retries", "4")
	started := time.Now()
	before := s.analyticsNow().orders
	time.Sleep(2 * time.Second)
	if during := s.analyticsNow().orders; during <= before {
		t.Errorf("no claim went through while the retention pass waited for its lock (%d, then %d)", before, during)
	}
	<-maintain.done
	t.Logf("retention pass with a claim open: exited %v after %s", maintain.err, time.Since(started).Round(time.Millisecond))
	if maintain.err == nil {
		t.Error("the pass claimed success while a claim transaction held the table: it should have given way")
	} else if !strings.Contains(tail(maintain.log, 5), "lock") {
		t.Errorf("the pass failed for another reason than the lock: %s", tail(maintain.log, 5))
	}
	_ = long.Rollback(ctx)
	<-done
	again := s.start("maintain-again", "maintain", "--retention-lock-timeout", "300ms")
	<-again.done
	if again.err != nil || !strings.Contains(tail(again.log, 10), "dropped") {
		t.Errorf("the next pass: %v\n%s", again.err, tail(again.log, 10))
	}
	s.verify(120 * time.Second)
	s.stillRunning(a)
}

// 12. The Kafka broker killed with kill -9 mid-stream, then started again:
// the consumers ride it out without a restart of their own.
func TestBrokerCrash(t *testing.T) {
	s := newScenario(t, "12 kafka broker kill -9", 6)
	s.requireDevService("kafka")
	s.startProvider()
	a, b := s.consumer("consumer-a"), s.consumer("consumer-b")
	s.publish(scale(150), 20*time.Millisecond)
	time.Sleep(time.Second)
	s.devService("kafka", "kill")
	s.kills++
	time.Sleep(window(3 * time.Second))
	s.devService("kafka", "start")
	s.restarts++
	s.reconnectProducer()
	s.publish(scale(150), 20*time.Millisecond)
	s.verify(180 * time.Second)
	s.stillRunning(a, b)
}

// 13. PostgreSQL killed with kill -9 (postmaster and backends, no shutdown)
// mid-stream, then started: crash recovery keeps every commit that returned,
// so nothing acknowledged is lost, nothing is doubled, and the consumers
// ride it out. The server runs with synchronous_commit=off, as a team that
// tuned it for speed would: a commit then returns before its WAL is written,
// and only the consumers' own raise of the setting keeps what they
// acknowledged.
//
// In each mode, the confirmations keyed by customer and the order of
// billing's provider calls checked.
func TestDatabaseCrash(t *testing.T) { eachMode(t, allModes, testDatabaseCrash) }

func testDatabaseCrash(t *testing.T, m mode) {
	s := newScenario(t, "13 postgres kill -9", 6)
	s.mode, s.keyByCustomer = m, true
	s.logCalls()
	s.requireDevService("postgres")
	s.sql("ALTER SYSTEM SET synchronous_commit = off", "SELECT pg_reload_conf()")
	t.Cleanup(func() { s.sql("ALTER SYSTEM RESET synchronous_commit", "SELECT pg_reload_conf()") })
	var lax string
	for deadline := time.Now().Add(10 * time.Second); lax != "off" && time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		_ = s.pool.QueryRow(context.Background(), "SELECT current_setting('synchronous_commit')").Scan(&lax)
	}
	if lax != "off" {
		t.Fatalf("the server's synchronous_commit is %q: the fault is not staged", lax)
	}
	// The simulator stands in for a provider's own, durable, systems.
	s.providerEnv = []string{"DATABASE_URL=" + testenv.WithParam(os.Getenv("DATABASE_URL"), "synchronous_commit", "on")}
	s.startProvider()
	a, b := s.consumer("consumer-a"), s.consumer("consumer-b")
	done := s.publishInBackground(scale(600), window(8*time.Second))
	time.Sleep(3 * time.Second)
	s.devService("postgres", "kill")
	s.kills++
	time.Sleep(time.Second)
	s.devService("postgres", "start")
	s.restarts++
	<-done
	s.pool = freshPool(t)
	s.verify(180 * time.Second)
	if s.readOutcomes().held() == 0 {
		t.Error("no attempt was held while the database was down: the fault did not happen")
	}
	s.stillRunning(a, b)
}

// 14. A three-broker cluster (replication factor 3, min.insync.replicas 2):
// the leader of the busy partitions is killed mid-stream. The order service's
// outbox forwarder and the consumers fail over to the new leaders; nothing
// is lost or doubled.
func TestClusterLeaderFailover(t *testing.T) {
	if os.Getenv("KAFKA_BROKERS") != "" && os.Getenv("ONCE_EXTERNAL_SERVICES") != "" {
		t.Skip("the cluster scenario runs on the cluster dev/kafka.sh starts")
	}
	kafka := filepath.Join(repoRoot, "dev", "kafka.sh")
	out, err := exec.Command(kafka, "cluster", "start").Output()
	if err != nil {
		t.Fatalf("dev/kafka.sh cluster start: %v", err)
	}
	t.Cleanup(func() { _ = exec.Command(kafka, "cluster", "stop").Run() })
	brokers := strings.Split(strings.TrimSpace(string(out)), ",")
	waitForBrokers(t, brokers, 3, 150*time.Second) // three JVMs starting on two cores
	s := newScenarioOn(t, "14 cluster leader failover", 6, brokers, 3)
	s.startProvider()
	orders := s.startOrders()
	a, b := s.consumer("consumer-a"), s.consumer("consumer-b")

	var placed atomic.Int64
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range scale(300) {
			s.placeOrder(orders, decimal.New(int64(100+i*13%9000), -2))
			placed.Add(1)
			time.Sleep(25 * time.Millisecond)
		}
	}()
	time.Sleep(2 * time.Second)
	leader := s.leaderOf(s.topic, 0)
	if err := exec.Command(kafka, "cluster", "kill", strconv.Itoa(int(leader))).Run(); err != nil {
		t.Fatal(err)
	}
	s.kills++
	t.Logf("killed broker %d, the leader of %s/0, after %d orders", leader, s.topic, placed.Load())
	time.Sleep(window(5 * time.Second))
	if err := exec.Command(kafka, "cluster", "start-node", strconv.Itoa(int(leader))).Run(); err != nil {
		t.Fatal(err)
	}
	s.restarts++
	<-done
	s.verify(180 * time.Second)
	s.stillRunning(a, b, orders)
}

// waitForBrokers waits until the cluster's metadata lists n brokers and each
// answers.
func waitForBrokers(t *testing.T, brokers []string, n int, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		client, err := sarama.NewClient(brokers, nil)
		if err == nil {
			up := 0
			for _, b := range client.Brokers() {
				if ok, _ := b.Connected(); ok || b.Open(client.Config()) == nil {
					if _, err := b.ApiVersions(&sarama.ApiVersionsRequest{}); err == nil {
						up++
					}
				}
			}
			client.Close()
			if up >= n {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the cluster did not have %d brokers answering within %s", n, timeout)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// eventIDs are the ids of the scenario's valid events.
func (s *scenario) eventIDs() []string {
	ids := make([]string, 0, len(s.events))
	for _, ev := range s.events {
		ids = append(ids, ev.EventID().String())
	}
	return ids
}

// waitAnalyticsClaims waits until analytics claimed every one of events.
func (s *scenario) waitAnalyticsClaims(events []orderevents.Confirmed, timeout time.Duration) error {
	s.t.Helper()
	ids := make([]string, 0, len(events))
	for _, ev := range events {
		ids = append(ids, ev.EventID().String())
	}
	deadline := time.Now().Add(timeout)
	for {
		var n int
		if err := s.pool.QueryRow(context.Background(), `SELECT count(*) FROM processed_event WHERE consumer_group = $1 AND event_id = ANY($2::uuid[])`,
			s.group(analyticsGroup), ids).Scan(&n); err == nil && n == len(ids) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("analytics claimed %d of %d events within %s", n, len(ids), timeout)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// waitClaims waits until group (billingGroup, analyticsGroup) has claimed
// at least n events: its consumers are past start-up and at work.
func (s *scenario) waitClaims(group string, n int, timeout time.Duration) {
	s.t.Helper()
	for deadline := time.Now().Add(timeout); ; time.Sleep(100 * time.Millisecond) {
		var claimed int
		if err := s.pool.QueryRow(context.Background(), `SELECT count(*) FROM processed_event WHERE consumer_group = $1`, s.group(group)).Scan(&claimed); err == nil && claimed >= n {
			return
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("%s claimed fewer than %d events within %s: its consumers are not at work", s.group(group), n, timeout)
		}
	}
}

// analyticsClaimsOf counts analytics' claims of events.
func (s *scenario) analyticsClaimsOf(events []orderevents.Confirmed) int {
	ids := make([]string, 0, len(events))
	for _, ev := range events {
		ids = append(ids, ev.EventID().String())
	}
	var n int
	_ = s.pool.QueryRow(context.Background(), `SELECT count(*) FROM processed_event WHERE consumer_group = $1 AND event_id = ANY($2::uuid[])`,
		s.group(analyticsGroup), ids).Scan(&n)
	return n
}

// logLines returns every consumer log line that contains text.
func (s *scenario) logLines(text string) []string {
	var out []string
	for _, p := range s.procs {
		out = append(out, logLinesOf(p, text)...)
	}
	return out
}

// reconnectProducer replaces the harness's producer after a broker crash.
func (s *scenario) reconnectProducer() {
	s.t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		cfg := sarama.NewConfig()
		cfg.Version = sarama.V4_3_1_0
		cfg.Producer.Return.Successes = true
		cfg.Producer.RequiredAcks = sarama.WaitForAll
		cfg.Producer.Retry.Max = 20
		p, err := sarama.NewSyncProducer(s.brokers, cfg)
		if err == nil {
			s.producer.Close()
			s.producer = p
			return
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("no producer after the broker came back: %v", err)
		}
		time.Sleep(time.Second)
	}
}

// leaderOf is the broker that leads a partition.
func (s *scenario) leaderOf(topic string, partition int32) int32 {
	s.t.Helper()
	client, err := sarama.NewClient(s.brokers, nil)
	if err != nil {
		s.t.Fatal(err)
	}
	defer client.Close()
	b, err := client.Leader(topic, partition)
	if err != nil {
		s.t.Fatal(err)
	}
	return b.ID()
}

// startOrders runs the order service (its outbox and forwarder) for the
// scenario's topics and returns its process; placeOrder talks to it.
func (s *scenario) startOrders() *proc {
	s.t.Helper()
	addr := testenv.FreeAddr(s.t)
	p := s.start("orders", "orders", "--listen", addr, "--topic-suffix", s.suffix, "--partitions", fmt.Sprint(s.parts), "--log-level", "warn")
	s.ordersURL = "http://" + addr
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		resp, err := http.Post(s.ordersURL+"/v1/orders", "application/json", strings.NewReader(`{}`))
		if err == nil {
			resp.Body.Close()
			return p
		}
		if !p.running() {
			s.t.Fatalf("orders exited: %s", tail(p.log, 20))
		}
		time.Sleep(100 * time.Millisecond)
	}
	s.t.Fatal("the order service did not answer within 30s")
	return nil
}

// placeOrder confirms an order through the order service, for one of the
// scenario's customers, and records its event for the checks.
func (s *scenario) placeOrder(orders *proc, amount decimal.Decimal) {
	s.t.Helper()
	body, _ := json.Marshal(map[string]any{"customer_id": s.customers[len(s.events)%len(s.customers)], "total_amount": amount.StringFixed(2)})
	for attempt := 0; ; attempt++ {
		resp, err := http.Post(s.ordersURL+"/v1/orders", "application/json", bytes.NewReader(body))
		if err == nil && resp.StatusCode == http.StatusCreated {
			var b bytes.Buffer
			_, _ = b.ReadFrom(resp.Body)
			resp.Body.Close()
			ev, err := orderevents.DecodeConfirmed(b.Bytes())
			if err != nil {
				s.t.Errorf("the order service answered an event we cannot read: %v", err)
				return
			}
			s.mu.Lock()
			s.events = append(s.events, ev)
			s.mu.Unlock()
			return
		}
		if resp != nil {
			resp.Body.Close()
		}
		if attempt > 50 || !orders.running() {
			s.t.Errorf("order not placed: %v", err)
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}
