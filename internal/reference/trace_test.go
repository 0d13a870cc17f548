package reference_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/shopspring/decimal"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/once-dev/once/handlers/billing"
	"github.com/once-dev/once/internal/pipelinetest"
	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/orderevents"
	"github.com/once-dev/once/orderservice"
	"github.com/once-dev/once/outbox"
	"github.com/once-dev/once/payment"
	"github.com/once-dev/once/pipeline"
)

// The trace an order starts in the order service travels with its event
// through the outbox and Kafka into billing's consumer span, and on to the
// payment provider in the charge request's traceparent header.
func TestTheOrdersTraceReachesThePaymentProvider(t *testing.T) {
	spans := tracetest.NewSpanRecorder()
	otel.SetTracerProvider(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans)))
	otel.SetTextMapPropagator(propagation.TraceContext{})
	t.Cleanup(func() { otel.SetTracerProvider(noop.NewTracerProvider()) })

	e := newEnv(t, 2)
	provider, err := payment.NewProvider(payment.ProviderConfig{DB: reftest.Postgres(t)})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var traceparents []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			mu.Lock()
			traceparents = append(traceparents, r.Header.Get("traceparent"))
			mu.Unlock()
		}
		provider.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	client, err := payment.NewClient(payment.ClientConfig{BaseURL: srv.URL, APIKey: "acct_" + uuid.NewString()[:8]})
	if err != nil {
		t.Fatal(err)
	}

	svc, err := orderservice.NewService(orderservice.Config{DB: e.Pool, Topic: e.Topic, OutboxTopic: "trace_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")})
	if err != nil {
		t.Fatal(err)
	}
	if err := svc.Init(context.Background()); err != nil {
		t.Fatal(err)
	}
	fw, err := svc.NewForwarder(outbox.KafkaPublisher{Producer: e.Prod})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = fw.Run(ctx) }()
	billingGroup := pipelinetest.UniqueGroup("billing")
	pipelinetest.Run(t, e.config(pipeline.Group[orderevents.Confirmed]{Name: billingGroup, Handle: billing.Handler{Payments: client, Currency: "EUR", DB: e.Pool}.OnConfirmed}))

	ev, err := svc.Confirm(context.Background(), orderservice.ConfirmRequest{CustomerID: 42, TotalAmount: decimal.New(1999, -2)})
	if err != nil {
		t.Fatal(err)
	}
	var started string
	for _, s := range spans.Ended() {
		if s.Name() == "orders.confirm" {
			started = s.SpanContext().TraceID().String()
		}
	}
	if started == "" {
		t.Fatal("the order service started no span")
	}
	testenv.Eventually(t, time.Minute, "the charge of "+ev.EventID().String(), func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(traceparents) > 0
	})
	mu.Lock()
	got := traceparents[0]
	mu.Unlock()
	if parts := strings.Split(got, "-"); len(parts) != 4 || parts[1] != started {
		t.Fatalf("the provider received traceparent %q; want the order's trace %s", got, started)
	}
	// The consumer span ends when its message is done, after the charge.
	testenv.Eventually(t, 30*time.Second, "the consumer span in the order's trace", func() bool {
		for _, s := range spans.Ended() {
			if s.Name() == "process "+e.Topic && s.SpanContext().TraceID().String() == started {
				return true
			}
		}
		return false
	})
}
