// Package tracing carries W3C trace context through what once touches:
// message metadata (and so Kafka headers and outbox rows), and sets up the
// process's OpenTelemetry tracer provider.
package tracing

import (
	"context"
	"fmt"
	"net/url"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.26.0"
)

// MetadataCarrier reads and writes trace context in a Watermill message's
// metadata: Kafka headers on the wire.
type MetadataCarrier message.Metadata

func (c MetadataCarrier) Get(key string) string { return message.Metadata(c).Get(key) }
func (c MetadataCarrier) Set(key, value string) { message.Metadata(c).Set(key, value) }
func (c MetadataCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}

// Setup installs the W3C trace-context propagator (always: a process that
// records nothing still passes its callers' traces on) and, when endpoint
// is set, a tracer provider exporting over OTLP/HTTP. Shut it down to
// flush the last spans.
func Setup(ctx context.Context, service, endpoint string) (shutdown func(context.Context) error, err error) {
	otel.SetTextMapPropagator(propagation.TraceContext{})
	if endpoint == "" {
		return func(context.Context) error { return nil }, nil
	}
	if _, err := url.ParseRequestURI(endpoint); err != nil {
		return nil, fmt.Errorf("--otlp-endpoint (OTEL_EXPORTER_OTLP_ENDPOINT) %q: %w", endpoint, err)
	}
	exp, err := otlptracehttp.New(ctx, otlptracehttp.WithEndpointURL(endpoint))
	if err != nil {
		return nil, fmt.Errorf("--otlp-endpoint (OTEL_EXPORTER_OTLP_ENDPOINT): %w", err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp),
		sdktrace.WithResource(resource.NewSchemaless(semconv.ServiceName(service))))
	otel.SetTracerProvider(tp)
	return tp.Shutdown, nil
}
