// Package testenv connects tests to the real services dev/test.sh starts: a
// PostgreSQL (DATABASE_URL) and a Kafka broker (KAFKA_BROKERS). Run without
// them, integration tests skip with a message naming the command to use; under
// dev/test.sh and .ci/run (ONCE_REQUIRE_SERVICES=1) a missing service fails.
package testenv

import (
	"context"
	"flag"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/once-dev/once/schema"
)

func need(t testing.TB, name string) string {
	t.Helper()
	v := os.Getenv(name)
	if v != "" {
		return v
	}
	if os.Getenv("ONCE_REQUIRE_SERVICES") != "" {
		t.Fatalf("%s is not set, but ONCE_REQUIRE_SERVICES is: the services were not started", name)
	}
	announceSkip(t, name)
	t.Skipf("%s is not set: run the suite with dev/test.sh, which starts real Kafka and PostgreSQL", name)
	return ""
}

var skipOnce sync.Once

// announceSkip says, once per package and loudly, that its integration tests
// did not run: go test prints "ok" for a package whose tests all skipped, and
// hides what they logged. The line goes to the terminal when there is one,
// which go test does not capture.
func announceSkip(t testing.TB, name string) {
	skipOnce.Do(func() {
		announce(fmt.Sprintf("%s: integration tests SKIPPED, %s is not set; run dev/test.sh, which starts Kafka and PostgreSQL", packageOf(t), name))
	})
}

// announce says line where a person sees it: the terminal when there is
// one, which go test does not capture (it hides a passing package's output).
func announce(line string) {
	out := os.Stderr
	if tty, err := os.OpenFile("/dev/tty", os.O_WRONLY, 0); err == nil {
		defer tty.Close()
		out = tty
	}
	fmt.Fprintf(out, "*** %s ***\n", line)
}

func packageOf(t testing.TB) string {
	if wd, err := os.Getwd(); err == nil {
		return filepath.Base(filepath.Dir(wd)) + "/" + filepath.Base(wd)
	}
	return t.Name()
}

var migrateOnce sync.Once
var migrateErr error

// Postgres returns a new pool on the test database with the library's
// tables migrated (package schema, in public). The reference service's
// tables are reftest.Postgres's.
func Postgres(t testing.TB) *pgxpool.Pool {
	t.Helper()
	url := need(t, "DATABASE_URL")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatalf("DATABASE_URL: %v", err)
	}
	// A consumer holds a connection per partition in flight (its transaction
	// spans the handler); pgx's default of 4 would starve tests that run
	// several groups, or a provider simulator sharing the pool.
	cfg.MaxConns = 20
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("connect to DATABASE_URL: %v", err)
	}
	t.Cleanup(pool.Close)
	migrateOnce.Do(func() { _, migrateErr = schema.Migrate(ctx, pool, schema.Config{}) })
	if migrateErr != nil {
		t.Fatalf("migrate: %v", migrateErr)
	}
	return pool
}

// Brokers returns the Kafka bootstrap addresses.
func Brokers(t testing.TB) []string {
	t.Helper()
	return strings.Split(need(t, "KAFKA_BROKERS"), ",")
}

// Topic creates a topic of its own for one test, so tests never see each
// other's messages.
func Topic(t testing.TB, brokers []string, partitions int32) string {
	t.Helper()
	name := fmt.Sprintf("test.%s.%s", strings.NewReplacer("/", ".", " ", "_").Replace(t.Name()), uuid.NewString()[:8])
	admin := Admin(t, brokers)
	if err := admin.CreateTopic(name, &sarama.TopicDetail{NumPartitions: partitions, ReplicationFactor: 1}, false); err != nil {
		t.Fatalf("create topic %s: %v", name, err)
	}
	// CreateTopic returns before every partition has a leader: a broker just
	// started answered a first publish "topic does not exist" past the
	// producer's retries.
	Eventually(t, 30*time.Second, "topic "+name+" has a leader for each partition", func() bool {
		md, err := admin.DescribeTopics([]string{name})
		if err != nil || len(md) != 1 || md[0].Err != sarama.ErrNoError || len(md[0].Partitions) != int(partitions) {
			return false
		}
		for _, p := range md[0].Partitions {
			if p.Err != sarama.ErrNoError || p.Leader < 0 {
				return false
			}
		}
		return true
	})
	return name
}

// Admin returns a cluster admin closed with the test.
func Admin(t testing.TB, brokers []string) sarama.ClusterAdmin {
	t.Helper()
	return AdminOn(t, brokers)
}

// AdminOn is Admin on any brokers.
func AdminOn(t testing.TB, brokers []string) sarama.ClusterAdmin {
	t.Helper()
	admin, err := sarama.NewClusterAdmin(brokers, saramaConfig())
	if err != nil {
		t.Fatalf("kafka admin: %v", err)
	}
	t.Cleanup(func() { admin.Close() })
	return admin
}

func saramaConfig() *sarama.Config {
	c := sarama.NewConfig()
	c.Version = sarama.V4_3_1_0
	c.Producer.Return.Successes = true
	c.Producer.RequiredAcks = sarama.WaitForAll
	return c
}

// Producer returns a plain sarama producer: tests publish raw bytes as any
// Kafka client would, with no Watermill headers.
func Producer(t testing.TB, brokers []string) sarama.SyncProducer {
	t.Helper()
	p, err := sarama.NewSyncProducer(brokers, saramaConfig())
	if err != nil {
		t.Fatalf("kafka producer: %v", err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// Publish sends payload to topic with key.
func Publish(t testing.TB, p sarama.SyncProducer, topic, key string, payload []byte) {
	t.Helper()
	msg := &sarama.ProducerMessage{Topic: topic, Value: sarama.ByteEncoder(payload)}
	if key != "" {
		msg.Key = sarama.StringEncoder(key)
	}
	if _, _, err := p.SendMessage(msg); err != nil {
		t.Fatalf("publish to %s: %v", topic, err)
	}
}

// Eventually polls cond every 50ms until it holds or timeout passes.
func Eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for: %s", timeout, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// CommittedOffsets returns the group's committed offset per partition of topic
// (-1 where none was committed).
func CommittedOffsets(t testing.TB, admin sarama.ClusterAdmin, group, topic string) map[int32]int64 {
	t.Helper()
	resp, err := admin.ListConsumerGroupOffsets(group, nil)
	if err != nil {
		t.Fatalf("list offsets of %s: %v", group, err)
	}
	out := map[int32]int64{}
	for partition, block := range resp.Blocks[topic] {
		out[partition] = block.Offset
	}
	return out
}

// OtherPostgres returns a pool on a second database of the test cluster,
// created on first use, for tests of groups that keep their claims and
// tables in databases of their own. Nothing is migrated there.
func OtherPostgres(t testing.TB, name string) *pgxpool.Pool {
	t.Helper()
	main := Postgres(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var exists bool
	if err := main.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)`, name).Scan(&exists); err != nil {
		t.Fatal(err)
	}
	if !exists {
		// Two packages may race to create it; losing that race is fine.
		if _, err := main.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil && !strings.Contains(err.Error(), "already exists") {
			t.Fatalf("create database %s: %v", name, err)
		}
	}
	cfg := main.Config().Copy()
	cfg.ConnConfig.Database = name
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("connect to database %s: %v", name, err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// PoolAs connects to admin's database as role: every session SET ROLE to
// it, as a login role granted role would be. Closed when the test ends.
func PoolAs(t testing.TB, admin *pgxpool.Pool, role string) *pgxpool.Pool {
	t.Helper()
	cfg := admin.Config().Copy()
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, "SET ROLE "+pgx.Identifier{role}.Sanitize())
		return err
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// FreeAddr is a loopback address no listener holds at the moment, for a
// server a test starts (or, for a while, does not).
func FreeAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// Where says how a test reaches PostgreSQL: directly, or through PgBouncer
// in transaction pooling (dev/pgbouncer.sh), in one of pgx's query exec
// modes.
type Where struct {
	Pooled bool
	Mode   pgx.QueryExecMode
}

func (w Where) String() string {
	if w.Pooled {
		return "pgbouncer/" + w.ModeName()
	}
	return "direct/" + w.ModeName()
}

// ModeName is the mode as default_query_exec_mode names it in a URL.
func (w Where) ModeName() string { return strings.ReplaceAll(w.Mode.String(), " ", "_") }

// EveryWay is every way the library must work: each of pgx's five query exec
// modes directly, and behind PgBouncer in transaction pooling each mode that
// can work there (pgdb.CheckPooler refuses the other two at start-up).
var EveryWay = []Where{
	{false, pgx.QueryExecModeCacheStatement}, {false, pgx.QueryExecModeCacheDescribe}, {false, pgx.QueryExecModeDescribeExec},
	{false, pgx.QueryExecModeExec}, {false, pgx.QueryExecModeSimpleProtocol},
	{true, pgx.QueryExecModeExec}, {true, pgx.QueryExecModeSimpleProtocol}, {true, pgx.QueryExecModeCacheDescribe},
}

// URL is the test database's URL reached as w says.
func (w Where) URL(t testing.TB) string {
	t.Helper()
	base := need(t, "DATABASE_URL")
	if w.Pooled {
		base = need(t, "ONCE_PGBOUNCER_URL")
	}
	return WithParam(base, "default_query_exec_mode", w.ModeName())
}

// Pool connects as w says to the migrated test database; closed with the test.
func (w Where) Pool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	Postgres(t) // migrated
	cfg, err := pgxpool.ParseConfig(w.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 20
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("connect %s: %v", w, err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// WithParam sets one query parameter of a PostgreSQL URL.
func WithParam(databaseURL, key, value string) string {
	u, err := url.Parse(databaseURL)
	if err != nil {
		return databaseURL
	}
	q := u.Query()
	q.Set(key, value)
	u.RawQuery = q.Encode()
	return u.String()
}

// WithoutParam drops one query parameter of a PostgreSQL URL.
func WithoutParam(databaseURL, key string) string {
	u, err := url.Parse(databaseURL)
	if err != nil {
		return databaseURL
	}
	q := u.Query()
	q.Del(key)
	u.RawQuery = q.Encode()
	return u.String()
}

// PoolAt connects to a database URL; closed with the test.
func PoolAt(t testing.TB, databaseURL string) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), databaseURL)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// RepoRoot is the repository's top directory.
func RepoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Dir(filepath.Dir(filepath.Dir(file)))
}

// RequireDevService skips a test that breaks a service unless the service
// is the one dev/<script>.sh runs (under dev/test.sh it must be: then it
// fails instead); a test must never break a service of yours.
func RequireDevService(t testing.TB, script string) {
	t.Helper()
	if err := exec.Command(filepath.Join(RepoRoot(), "dev", script+".sh"), "status").Run(); err != nil {
		if os.Getenv("ONCE_REQUIRE_SERVICES") != "" && os.Getenv("ONCE_EXTERNAL_SERVICES") == "" {
			t.Fatalf("dev/%s.sh is not running, but the suite runs under dev/test.sh", script)
		}
		t.Skipf("the service is not the one dev/%s.sh runs; this test breaks it and cannot break yours", script)
	}
}

// DevService runs dev/<script>.sh with args, failing the test if it fails.
func DevService(t testing.TB, script string, args ...string) {
	t.Helper()
	out, err := exec.Command(filepath.Join(RepoRoot(), "dev", script+".sh"), args...).CombinedOutput()
	if err != nil {
		t.Fatalf("dev/%s.sh %v: %v\n%s", script, args, err, out)
	}
}

// WaitForKafka waits until the brokers take a new topic and a message on it
// again (after a test paused or killed one), so that the tests after it
// meet a broker at work.
func WaitForKafka(t testing.TB, brokers []string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		err := func() error {
			admin, err := sarama.NewClusterAdmin(brokers, saramaConfig())
			if err != nil {
				return err
			}
			defer admin.Close()
			topic := "test.kafka-ready." + uuid.NewString()[:8]
			if err := admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1}, false); err != nil {
				return err
			}
			defer admin.DeleteTopic(topic)
			p, err := sarama.NewSyncProducer(brokers, saramaConfig())
			if err != nil {
				return err
			}
			defer p.Close()
			_, _, err = p.SendMessage(&sarama.ProducerMessage{Topic: topic, Value: sarama.StringEncoder("ready?")})
			return err
		}()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("Kafka did not come back within %s: %v", timeout, err)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// MainWithServices runs a package's tests and examples. Examples cannot
// skip themselves: without the services (and without
// ONCE_REQUIRE_SERVICES, which makes their absence a failure) they are left
// out, and a line says so, as the tests skip.
func MainWithServices(m *testing.M, services ...string) {
	flag.Parse()
	for _, name := range services {
		if os.Getenv(name) != "" {
			continue
		}
		if os.Getenv("ONCE_REQUIRE_SERVICES") != "" {
			fmt.Fprintf(os.Stderr, "%s is not set, but ONCE_REQUIRE_SERVICES is: the services were not started\n", name)
			os.Exit(1)
		}
		if run := flag.Lookup("test.run"); run != nil && run.Value.String() == "" {
			_ = run.Value.Set("^(Test|Fuzz)")
			announce(fmt.Sprintf("%s is not set: this package's examples are not run (dev/test.sh starts the services)", name))
		}
		break
	}
	os.Exit(m.Run())
}

// UseOwnDatabase points DATABASE_URL, and ONCE_PGBOUNCER_URL if set, at a
// database of the calling package's own on the same server, made afresh
// (its name: the database's, then "_", then name). Call it from TestMain
// before m.Run. Test packages otherwise share one database, and what one
// leaves there is another's starting point: outbox rows of topics long
// gone, row-level security a migration test turned on, forwarder progress
// rows. A package whose tests run consumers end to end, or change the
// schema's security, gets a database no other package touched. Without
// DATABASE_URL it does nothing.
func UseOwnDatabase(name string) error {
	base := os.Getenv("DATABASE_URL")
	if base == "" {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, base)
	if err != nil {
		return fmt.Errorf("testenv: connect to DATABASE_URL: %w", err)
	}
	defer conn.Close(ctx)
	own := conn.Config().Database + "_" + name
	for _, stmt := range []string{"DROP DATABASE IF EXISTS " + pgx.Identifier{own}.Sanitize() + " WITH (FORCE)",
		"CREATE DATABASE " + pgx.Identifier{own}.Sanitize()} {
		if _, err := conn.Exec(ctx, stmt); err != nil {
			return fmt.Errorf("testenv: a database of the package's own: %s: %w", stmt, err)
		}
	}
	for _, v := range []string{"DATABASE_URL", "ONCE_PGBOUNCER_URL"} {
		if u := os.Getenv(v); u != "" {
			moved, err := withDatabase(u, own)
			if err != nil {
				return fmt.Errorf("testenv: %s: %w", v, err)
			}
			os.Setenv(v, moved)
		}
	}
	return nil
}

// withDatabase is databaseURL naming database db instead.
func withDatabase(databaseURL, db string) (string, error) {
	u, err := url.Parse(databaseURL)
	if err != nil {
		return "", err
	}
	if u.Scheme != "postgres" && u.Scheme != "postgresql" {
		return "", fmt.Errorf("want a postgres:// URL, not keyword/value settings")
	}
	u.Path = "/" + db
	return u.String(), nil
}
