package main

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/google/uuid"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/migrations"
	"github.com/once-dev/once/orderevents"
	"github.com/once-dev/once/pipeline"
)

// secureBroker starts dev/kafka.sh's broker with SASL/SCRAM and ACLs and
// returns its address and an admin client on it.
func secureBroker(t *testing.T) (string, sarama.ClusterAdmin, sarama.SyncProducer) {
	t.Helper()
	testenv.Brokers(t) // skips, or fails under ONCE_REQUIRE_SERVICES, like every Kafka test
	running := exec.Command("../../dev/kafka.sh", "secure", "status").Run() == nil
	out, err := exec.Command("../../dev/kafka.sh", "secure", "start").Output()
	if err != nil {
		t.Fatalf("dev/kafka.sh secure start: %v", err)
	}
	if !running {
		t.Cleanup(func() { _ = exec.Command("../../dev/kafka.sh", "secure", "stop").Run() })
	}
	addr := strings.TrimSpace(string(out))
	cfg := pipeline.PublisherSaramaConfig(sarama.V3_6_0_0)
	pipeline.KafkaSecurity{SASLMechanism: pipeline.SASLScramSHA512, User: "admin", Password: "admin-secret"}.Apply(cfg)
	admin, err := sarama.NewClusterAdmin([]string{addr}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = admin.Close() })
	producer, err := sarama.NewSyncProducer([]string{addr}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = producer.Close() })
	return addr, admin, producer
}

func allow(principal string, rtype sarama.AclResourceType, name string, ops ...sarama.AclOperation) *sarama.ResourceAcls {
	r := &sarama.ResourceAcls{Resource: sarama.Resource{ResourceType: rtype, ResourceName: name, ResourcePatternType: sarama.AclPatternLiteral}}
	for _, op := range ops {
		r.Acls = append(r.Acls, &sarama.Acl{Principal: principal, Host: "*", Operation: op, PermissionType: sarama.AclPermissionAllow})
	}
	return r
}

// On a broker with SASL/SCRAM and ACLs, the service's principal consumes
// its group and publishes a dead letter with exactly the ACLs it needs; a
// principal without ACLs is refused at start-up with an error naming the
// permission it lacks; and no secret (the SASL password, the database
// password, the payment API key) appears in any line either run logged.
func TestSecuredBrokerACLsAndNoSecretInTheLogs(t *testing.T) {
	addr, admin, producer := secureBroker(t)
	pool := reftest.Postgres(t)
	if _, err := migrations.Up(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	suffix := "." + uuid.NewString()[:8]
	svc, intruder, groupless, nowrite := "once-svc-"+uuid.NewString()[:8], "intruder-"+uuid.NewString()[:8], "groupless-"+uuid.NewString()[:8], "nowrite-"+uuid.NewString()[:8]
	svcPassword, intruderPassword, grouplessPassword, nowritePassword := "sasl-"+uuid.NewString(), "sasl-"+uuid.NewString(), "sasl-"+uuid.NewString(), "sasl-"+uuid.NewString()
	dbPassword, apiKey := "db-"+uuid.NewString(), "acct_"+strings.ReplaceAll(uuid.NewString(), "-", "")
	for user, pw := range map[string]string{svc: svcPassword, intruder: intruderPassword, groupless: grouplessPassword, nowrite: nowritePassword} {
		if _, err := admin.UpsertUserScramCredentials([]sarama.AlterUserScramCredentialsUpsert{{
			Name: user, Mechanism: sarama.SCRAM_MECHANISM_SHA_512, Iterations: 8192, Salt: []byte(uuid.NewString()), Password: []byte(pw)}}); err != nil {
			t.Fatalf("scram user %s: %v", user, err)
		}
	}
	var topics []string
	for _, name := range []string{"order.confirmed.v1", "order.cancelled.v1", "payment.events.v1"} {
		topics = append(topics, name+suffix, name+suffix+".dlq")
	}
	for _, topic := range topics {
		if err := admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: 2, ReplicationFactor: 1}, false); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, topic := range topics {
			_ = admin.DeleteTopic(topic)
		}
	})
	// Analytics reads order.confirmed and payment.events, dead-letters to
	// their .dlq topics, and sees the others only to know they exist.
	p := "User:" + svc
	read, write, describe := sarama.AclOperationRead, sarama.AclOperationWrite, sarama.AclOperationDescribe
	acls := []*sarama.ResourceAcls{
		allow(p, sarama.AclResourceTopic, "order.confirmed.v1"+suffix, read, describe),
		allow(p, sarama.AclResourceTopic, "payment.events.v1"+suffix, read, describe),
		allow(p, sarama.AclResourceTopic, "order.confirmed.v1"+suffix+".dlq", write, describe),
		allow(p, sarama.AclResourceTopic, "payment.events.v1"+suffix+".dlq", write, describe),
		allow(p, sarama.AclResourceTopic, "order.cancelled.v1"+suffix, describe),
		allow(p, sarama.AclResourceTopic, "order.cancelled.v1"+suffix+".dlq", describe),
		allow(p, sarama.AclResourceGroup, "analytics"+suffix, read, describe),
	}
	// The same on the topics, nothing on the group.
	for _, a := range acls[:len(acls)-1] {
		b := *a
		b.Acls = nil
		for _, acl := range a.Acls {
			c := *acl
			c.Principal = "User:" + groupless
			b.Acls = append(b.Acls, &c)
		}
		acls = append(acls, &b)
	}
	// Everything but WRITE on one of its dead-letter topics.
	nw := "User:" + nowrite
	acls = append(acls,
		allow(nw, sarama.AclResourceTopic, "order.confirmed.v1"+suffix, read, describe),
		allow(nw, sarama.AclResourceTopic, "payment.events.v1"+suffix, read, describe),
		allow(nw, sarama.AclResourceTopic, "order.confirmed.v1"+suffix+".dlq", describe),
		allow(nw, sarama.AclResourceTopic, "payment.events.v1"+suffix+".dlq", write, describe),
		allow(nw, sarama.AclResourceTopic, "order.cancelled.v1"+suffix, describe),
		allow(nw, sarama.AclResourceTopic, "order.cancelled.v1"+suffix+".dlq", describe),
		allow(nw, sarama.AclResourceGroup, "analytics"+suffix, read, describe))
	if err := admin.CreateACLs(acls); err != nil {
		t.Fatal(err)
	}

	dsn := strings.Replace(pool.Config().ConnString(), "once@", "once:"+dbPassword+"@", 1)
	if !strings.Contains(dsn, dbPassword) {
		t.Fatalf("no password in the DSN %q", dsn)
	}
	t.Setenv("PAYMENT_API_KEY", apiKey)
	serve := func(ctx context.Context, user, password string, logs *testenv.Logs) error {
		t.Setenv("KAFKA_SASL_PASSWORD", password)
		return run(ctx, []string{"serve", "--kafka-brokers", addr, "--kafka-sasl-mechanism", "SCRAM-SHA-512", "--kafka-sasl-user", user,
			"--topic-suffix", suffix, "--group-suffix", suffix, "--groups", "analytics", "--database-url", dsn, "--no-migrate",
			"--ops-listen", "127.0.0.1:0", "--maintenance-interval", "0", "--session-timeout", "6s", "--log-level", "debug"}, logs, logs)
	}

	// Refused before they consume anything, each naming what it lacks.
	refusedLogs := map[string]*testenv.Logs{}
	for _, r := range []struct {
		user, password, what string
		want                 []string
	}{
		{intruder, intruderPassword, "no ACL at all", []string{"User:" + intruder, "DESCRIBE", "order.confirmed.v1" + suffix}},
		{groupless, grouplessPassword, "no ACL on its group", []string{"consumer group analytics" + suffix, "READ and DESCRIBE on the group"}},
		{nowrite, nowritePassword, "no WRITE on a dead-letter topic", []string{"topic order.confirmed.v1" + suffix + ".dlq", "WRITE"}},
	} {
		logs := &testenv.Logs{}
		refusedLogs[r.user] = logs
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		err := serve(ctx, r.user, r.password, logs)
		cancel()
		for _, w := range r.want {
			if err == nil || !strings.Contains(err.Error(), w) {
				t.Fatalf("serve with %s: %v; want a refusal naming %q\n%s", r.what, err, w, logs.String())
			}
		}
		t.Logf("%s: refused: %v", r.what, err)
	}

	// The service: consumes, and dead-letters the poison message.
	const events = 20
	for i := range events {
		ev, err := orderevents.NewConfirmed(uuid.Must(uuid.NewV7()), time.Now(), int64(i+1), 900_000_000+int64(i), decimal.New(int64(100+i), -2))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := ev.MarshalJSON()
		if _, _, err := producer.SendMessage(&sarama.ProducerMessage{Topic: "order.confirmed.v1" + suffix, Key: sarama.StringEncoder(fmt.Sprint(i)), Value: sarama.ByteEncoder(b)}); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, err := producer.SendMessage(&sarama.ProducerMessage{Topic: "order.confirmed.v1" + suffix, Value: sarama.StringEncoder(`{"event_id":`)}); err != nil {
		t.Fatal(err)
	}
	var logs testenv.Logs
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- serve(ctx, svc, svcPassword, &logs) }()
	group := "analytics" + suffix
	testenv.Eventually(t, 90*time.Second, "every event claimed by analytics over SASL", func() bool {
		var n int
		_ = pool.QueryRow(context.Background(), `SELECT count(*) FROM processed_event WHERE consumer_group = $1`, group).Scan(&n)
		return n == events
	})
	testenv.Eventually(t, 60*time.Second, "the dead letter on its topic", func() bool {
		hwm, err := highWatermark(admin, addr, "order.confirmed.v1"+suffix+".dlq")
		return err == nil && hwm == 1
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("serve: %v\n%s", err, logs.String())
	}
	all := logs.String()
	for _, l := range refusedLogs {
		all += l.String()
	}
	if !strings.Contains(all, "dead-lettered") || strings.Count(all, "\n") < 10 {
		t.Fatalf("the logs hold too little to judge (%d lines)", strings.Count(all, "\n"))
	}
	for name, secret := range map[string]string{"the SASL password": svcPassword, "the intruder's SASL password": intruderPassword, "a third SASL password": grouplessPassword, "a fourth SASL password": nowritePassword,
		"the database password": dbPassword, "the payment API key": apiKey} {
		if strings.Contains(all, secret) {
			for _, line := range strings.Split(all, "\n") {
				if strings.Contains(line, secret) {
					t.Errorf("%s in a log line: %s", name, line)
				}
			}
		}
	}
}

func highWatermark(admin sarama.ClusterAdmin, addr, topic string) (int64, error) {
	cfg := pipeline.PublisherSaramaConfig(sarama.V3_6_0_0)
	pipeline.KafkaSecurity{SASLMechanism: pipeline.SASLScramSHA512, User: "admin", Password: "admin-secret"}.Apply(cfg)
	client, err := sarama.NewClient([]string{addr}, cfg)
	if err != nil {
		return 0, err
	}
	defer client.Close()
	var total int64
	parts, err := client.Partitions(topic)
	if err != nil {
		return 0, err
	}
	for _, p := range parts {
		hwm, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return 0, err
		}
		total += hwm
	}
	return total, nil
}
