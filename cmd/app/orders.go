package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/IBM/sarama"
	"github.com/shopspring/decimal"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"

	"github.com/once-dev/once/orderevents"
	"github.com/once-dev/once/orderservice"
	"github.com/once-dev/once/outbox"
)

type ordersCmd struct {
	Kafka  kafkaSettings `embed:""`
	DB     dbSettings    `embed:""`
	Listen string        `name:"listen" env:"ORDERS_LISTEN" default:"127.0.0.1:18081" help:"Address of the order API (POST /v1/orders)."`

	OutboxRetention time.Duration `name:"outbox-retention" env:"ORDERS_OUTBOX_RETENTION" default:"24h" help:"Forwarded outbox rows older than this are deleted (every 10 minutes)."`
}

// every runs f now and then every interval until ctx ends.
func every(ctx context.Context, interval time.Duration, f func()) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		f()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (c *ordersCmd) Validate() error {
	if _, _, err := net.SplitHostPort(c.Listen); err != nil {
		return fmt.Errorf("--listen (ORDERS_LISTEN): %w", err)
	}
	if c.OutboxRetention <= 0 {
		return fmt.Errorf("--outbox-retention (ORDERS_OUTBOX_RETENTION) must be positive")
	}
	return nil
}

// Run serves POST /v1/orders {"customer_id","total_amount"} and
// POST /v1/orders/{id}/cancel {"reason"}, and forwards
// the outbox to Kafka until stopped.
func (c *ordersCmd) Run(ctx context.Context, d deps) error {
	pool, err := c.DB.open(ctx, d, true)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := c.Kafka.ensureTopics(ctx); err != nil {
		return fmt.Errorf("KAFKA_BROKERS: %w", err)
	}
	svc, err := orderservice.NewService(orderservice.Config{DB: pool, Topic: c.Kafka.confirmed(), CancelledTopic: c.Kafka.cancelled(), Logger: d.log})
	if err != nil {
		return err
	}
	if err := svc.Init(ctx); err != nil {
		return err
	}
	producer, err := sarama.NewSyncProducer(c.Kafka.Brokers, c.Kafka.saramaConfig())
	if err != nil {
		return fmt.Errorf("KAFKA_BROKERS: %w", err)
	}
	defer producer.Close()
	// The forwarder is restarted when it stops on an error: orders keep
	// being accepted meanwhile, and must not wait in the outbox for good.
	errc := make(chan error, 1)
	go func() {
		for ctx.Err() == nil {
			fw, err := svc.NewForwarder(outbox.KafkaPublisher{Producer: producer})
			if err == nil {
				err = fw.Run(ctx)
			}
			if err != nil && ctx.Err() == nil {
				d.log.Error("outbox forwarder stopped; restarting it", "err", err)
			}
			select {
			case <-ctx.Done():
			case <-time.After(time.Second):
			}
		}
		errc <- nil
	}()
	go every(ctx, 10*time.Minute, func() {
		if n, err := svc.PruneOutbox(ctx, c.OutboxRetention, 5000); err != nil {
			d.log.Error("prune outbox", "err", err)
		} else if n > 0 {
			d.log.Info("pruned forwarded outbox rows", "rows", n)
		}
	})

	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/orders", func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			CustomerID  int64       `json:"customer_id"`
			TotalAmount json.Number `json:"total_amount"`
		}
		dec := json.NewDecoder(r.Body)
		dec.UseNumber()
		if err := dec.Decode(&body); err != nil {
			http.Error(w, "body: want {\"customer_id\": <integer>, \"total_amount\": \"<decimal>\"}: "+err.Error(), http.StatusBadRequest)
			return
		}
		amount, err := decimal.NewFromString(body.TotalAmount.String())
		if err != nil {
			http.Error(w, "total_amount: "+err.Error(), http.StatusBadRequest)
			return
		}
		ev, err := svc.Confirm(r.Context(), orderservice.ConfirmRequest{CustomerID: body.CustomerID, TotalAmount: amount})
		if errors.Is(err, orderevents.ErrInvalid) {
			http.Error(w, err.Error(), http.StatusUnprocessableEntity)
			return
		}
		if err != nil {
			d.log.Error("confirm order", "err", err)
			http.Error(w, "could not confirm the order", http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(ev)
	})
	mux.HandleFunc("POST /v1/orders/{id}/cancel", func(w http.ResponseWriter, r *http.Request) {
		id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
		if err != nil {
			http.Error(w, "order id: want an integer", http.StatusBadRequest)
			return
		}
		var body struct {
			Reason string `json:"reason"`
		}
		if r.ContentLength != 0 {
			if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
				http.Error(w, "body: want {\"reason\": \"...\"}: "+err.Error(), http.StatusBadRequest)
				return
			}
		}
		ev, err := svc.Cancel(r.Context(), id, body.Reason)
		switch {
		case errors.Is(err, orderservice.ErrNotFound):
			http.Error(w, err.Error(), http.StatusNotFound)
			return
		case errors.Is(err, orderservice.ErrAlreadyCancelled):
			http.Error(w, err.Error(), http.StatusConflict)
			return
		case err != nil:
			d.log.Error("cancel order", "order_id", id, "err", err)
			http.Error(w, "could not cancel the order", http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusAccepted)
		_ = json.NewEncoder(w).Encode(ev)
	})
	// A caller's trace (its traceparent header) continues into the order
	// and its event.
	traced := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mux.ServeHTTP(w, r.WithContext(otel.GetTextMapPropagator().Extract(r.Context(), propagation.HeaderCarrier(r.Header))))
	})
	httpErr := serveHTTP(ctx, d, "order API", c.Listen, traced)
	return errors.Join(httpErr, <-errc)
}
