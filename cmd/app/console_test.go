package main

import (
	"context"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"

	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/internal/testenv"
)

// app console serves the dead letters of the reference topics apart from
// the consumers, on loopback only, to the host names it knows; without a
// token it lists them by source, their reasons not shown.
func TestConsoleCommandServesTheDeadLetters(t *testing.T) {
	brokers := testenv.Brokers(t)
	pool := reftest.Postgres(t)
	suffix := "." + uuid.NewString()[:8]
	dlqTopic := "order.confirmed.v1" + suffix + ".dlq"
	if err := testenv.Admin(t, brokers).CreateTopic(dlqTopic, &sarama.TopicDetail{NumPartitions: 1, ReplicationFactor: 1}, false); err != nil {
		t.Fatal(err)
	}
	reason := "price must not be negative " + suffix
	if _, _, err := testenv.Producer(t, brokers).SendMessage(&sarama.ProducerMessage{Topic: dlqTopic, Value: sarama.StringEncoder(`{"event_id":"` + uuid.Must(uuid.NewV7()).String() + `"}`),
		Headers: []sarama.RecordHeader{{Key: []byte(middleware.PoisonedTopicKey), Value: []byte("order.confirmed.v1" + suffix)},
			{Key: []byte(middleware.ReasonForPoisonedKey), Value: []byte(reason)}}}); err != nil {
		t.Fatal(err)
	}
	args := []string{"console", "--kafka-brokers", strings.Join(brokers, ","), "--database-url", pool.Config().ConnString(), "--topic-suffix", suffix}
	var logs testenv.Logs
	if err := run(context.Background(), append(args, "--listen", "0.0.0.0:9465"), &logs, &logs); err == nil || !strings.Contains(logs.String()+err.Error(), "--listen") {
		t.Fatalf("a console on every interface: %v\n%s; want it refused, naming --listen", err, logs.String())
	}

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- run(ctx, append(args, "--listen", addr), &logs, &logs) }()
	var page string
	testenv.Eventually(t, 30*time.Second, "the letter on the console's page", func() bool {
		code, body := get("http://" + addr + "/console/letters")
		page = body
		return code == http.StatusOK && strings.Contains(body, dlqTopic+"/0@0")
	})
	if !strings.Contains(page, `<td><code>order.confirmed.v1`+suffix+`</code></td>`) || strings.Contains(page, reason) || !strings.Contains(page, "this console has no token") {
		t.Fatalf("the letters page without a token: want the letter by its source topic, its reason not shown, and why\n%s", page)
	}
	req, _ := http.NewRequest(http.MethodGet, "http://"+addr+"/console/letters", nil)
	req.Host = "console.evil.example"
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMisdirectedRequest {
		t.Fatalf("a request for another host name: %d; want 421", resp.StatusCode)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("app console: %v\n%s", err, logs.String())
		}
	case <-time.After(15 * time.Second):
		t.Fatal("app console did not stop within 15s of its context's end")
	}
}
