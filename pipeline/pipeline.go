package pipeline

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"

	"github.com/once-dev/once/middleware/idempotency"
	"github.com/once-dev/once/service/order"
)

// Handler is the business logic of one consumer group. It runs at most once
// per event and group to completion: tx holds the event's claim, and every
// write that must happen once goes through it. Return an error marked
// [idempotency.Permanent] for an event that can never succeed.
type Handler interface {
	Handle(ctx context.Context, tx pgx.Tx, ev order.Confirmed) error
}

// HandlerFunc adapts a function to [Handler].
type HandlerFunc func(ctx context.Context, tx pgx.Tx, ev order.Confirmed) error

func (f HandlerFunc) Handle(ctx context.Context, tx pgx.Tx, ev order.Confirmed) error {
	return f(ctx, tx, ev)
}

// Group is one consumer group on the topic.
type Group struct {
	Name    string
	Handler Handler
	// TooOld is the group's policy for events beyond Config.MaxEventAge.
	// Default: idempotency.RejectTooOld.
	TooOld idempotency.TooOldPolicy
}

// Config configures a [Pipeline]. Optional fields have working zero values.
type Config struct {
	Brokers  []string
	Topic    string
	DLQTopic string
	Groups   []Group
	DB       idempotency.TxBeginner

	// KafkaVersion is the broker's version, e.g. "4.3.1". Default: [DefaultKafkaVersion].
	KafkaVersion string
	// CommitMode: [CommitInterval] (default) or [CommitSync].
	CommitMode     CommitMode
	CommitInterval time.Duration // default 1s

	// MaxRetries of a failing message before it is dead-lettered. Default 5;
	// set NoRetries for none.
	MaxRetries int
	// RetryInitialInterval doubles per retry up to RetryMaxInterval.
	// Defaults: 100ms and 2s.
	RetryInitialInterval time.Duration
	RetryMaxInterval     time.Duration

	// SessionTimeout of the consumer-group membership: how long the broker
	// waits for a crashed member before giving its partitions to others.
	// Default: sarama's 10s; the broker allows 6s at least.
	SessionTimeout time.Duration

	// CloseTimeout bounds how long closing waits for in-flight messages.
	// Default: 30s.
	CloseTimeout time.Duration

	// MaxEventAge is the dedup horizon (the claim retention minus
	// MaxClockSkew); MaxClockSkew bounds ids from the future. 0 disables each.
	// See idempotency.Config.
	MaxEventAge  time.Duration
	MaxClockSkew time.Duration

	// OnResult receives the idempotency outcome of every message of every group.
	OnResult func(idempotency.Result)
	// OnDelivered is called for every message a group's handler chain receives.
	OnDelivered func(group string)
	// OnDeadLetter is called after a message was published to the dead-letter topic.
	OnDeadLetter func(group, reason string)

	Logger *slog.Logger

	kafkaVersion sarama.KafkaVersion
}

// NoRetries as [Config.MaxRetries] dead-letters a failing message at once.
const NoRetries = -1

func (c *Config) setDefaults() {
	if c.KafkaVersion == "" {
		c.KafkaVersion = DefaultKafkaVersion
	}
	if c.CommitMode == "" {
		c.CommitMode = CommitInterval
	}
	if c.CommitInterval == 0 {
		c.CommitInterval = time.Second
	}
	if c.MaxRetries == 0 {
		c.MaxRetries = 5
	}
	if c.MaxRetries == NoRetries {
		c.MaxRetries = 0
	}
	if c.RetryInitialInterval == 0 {
		c.RetryInitialInterval = 100 * time.Millisecond
	}
	if c.RetryMaxInterval == 0 {
		c.RetryMaxInterval = 2 * time.Second
	}
	if c.CloseTimeout == 0 {
		c.CloseTimeout = 30 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Validate reports the first missing or impossible setting.
func (c *Config) Validate() error {
	var err error
	if c.kafkaVersion, err = ParseKafkaVersion(c.KafkaVersion); err != nil {
		return fmt.Errorf("pipeline: KafkaVersion: %w", err)
	}
	switch {
	case len(c.Brokers) == 0:
		return errors.New("pipeline: Brokers is empty")
	case c.Topic == "":
		return errors.New("pipeline: Topic is empty")
	case c.DLQTopic == "" || c.DLQTopic == c.Topic:
		return errors.New("pipeline: DLQTopic must be set and differ from Topic")
	case c.DB == nil:
		return errors.New("pipeline: DB is nil")
	case len(c.Groups) == 0:
		return errors.New("pipeline: no consumer groups")
	case c.CommitMode != CommitInterval && c.CommitMode != CommitSync:
		return fmt.Errorf("pipeline: CommitMode %q: want %q or %q", c.CommitMode, CommitInterval, CommitSync)
	case c.MaxRetries < 0:
		return errors.New("pipeline: MaxRetries must not be negative")
	}
	seen := map[string]bool{}
	for _, g := range c.Groups {
		if g.Name == "" || g.Handler == nil {
			return errors.New("pipeline: every group needs a name and a handler")
		}
		if seen[g.Name] {
			return fmt.Errorf("pipeline: group %q listed twice", g.Name)
		}
		seen[g.Name] = true
	}
	return nil
}

// Pipeline is a Watermill router with one handler per consumer group.
type Pipeline struct {
	router  *message.Router
	closers []func() error
}

// New builds the router. It connects to nothing until [Pipeline.Run].
func New(cfg Config) (*Pipeline, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	wlog := watermill.NewSlogLoggerWithLevelMapping(cfg.Logger, map[slog.Level]slog.Level{
		slog.LevelInfo: slog.LevelDebug, // Watermill's info lines are per subscription detail
	})
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: cfg.CloseTimeout}, wlog)
	if err != nil {
		return nil, err
	}
	p := &Pipeline{router: router}

	dlq, err := kafka.NewPublisher(kafka.PublisherConfig{
		Brokers:               cfg.Brokers,
		Marshaler:             kafka.DefaultMarshaler{},
		OverwriteSaramaConfig: PublisherSaramaConfig(cfg.kafkaVersion),
	}, wlog)
	if err != nil {
		return nil, fmt.Errorf("pipeline: dead-letter publisher: %w", err)
	}
	p.closers = append(p.closers, dlq.Close)

	for _, g := range cfg.Groups {
		if err := p.addGroup(cfg, g, dlq, wlog); err != nil {
			p.Close()
			return nil, err
		}
	}
	return p, nil
}

func (p *Pipeline) addGroup(cfg Config, g Group, dlq message.Publisher, wlog watermill.LoggerAdapter) error {
	owners := newSessions()
	sub, err := kafka.NewSubscriber(kafka.SubscriberConfig{
		Brokers:               cfg.Brokers,
		Unmarshaler:           unmarshaler{},
		OverwriteSaramaConfig: subscriberSaramaConfig(cfg),
		ConsumerGroup:         g.Name,
		Tracer:                owners,
	}, wlog)
	if err != nil {
		return fmt.Errorf("pipeline: subscriber for group %s: %w", g.Name, err)
	}
	p.closers = append(p.closers, sub.Close)

	idem, err := idempotency.New(idempotency.Config{
		DB:               cfg.DB,
		ConsumerGroup:    g.Name,
		PartitionRevoked: owners.revoked,
		MaxEventAge:      cfg.MaxEventAge,
		MaxClockSkew:     cfg.MaxClockSkew,
		TooOld:           g.TooOld,
		OnResult:         cfg.OnResult,
		Logger:           cfg.Logger,
		LogAttrs:         kafkaLogAttrs,
	})
	if err != nil {
		return err
	}

	deadLetters := dlq
	if cfg.OnDeadLetter != nil {
		deadLetters = observedPublisher{dlq, func(m *message.Message) {
			cfg.OnDeadLetter(g.Name, m.Metadata.Get(middleware.ReasonForPoisonedKey))
		}}
	}
	poison, err := middleware.PoisonQueueWithFilter(deadLetters, cfg.DLQTopic, shouldDeadLetter)
	if err != nil {
		return err
	}

	h := p.router.AddConsumerHandler(g.Name, cfg.Topic, sub, adapt(g.Handler))
	delivered := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			if cfg.OnDelivered != nil {
				cfg.OnDelivered(g.Name)
			}
			return h(msg)
		}
	}
	h.AddMiddleware(
		delivered,
		releaseRevoked,
		middleware.CorrelationID,
		poison,
		shutdownGuard,
		middleware.Retry{
			MaxRetries:      cfg.MaxRetries,
			InitialInterval: cfg.RetryInitialInterval,
			MaxInterval:     cfg.RetryMaxInterval,
			Multiplier:      2,
			ShouldRetry:     func(p middleware.RetryParams) bool { return retryable(p.Err) },
			Logger:          wlog,
		}.Middleware,
		middleware.Recoverer,
		validate,
		idem.Middleware,
	)
	return nil
}

// Run consumes until ctx is cancelled or a handler stops, then closes the
// router, letting in-flight messages finish (their commits survive the
// cancellation; see the idempotency package).
func (p *Pipeline) Run(ctx context.Context) error {
	defer p.Close()
	return p.router.Run(ctx)
}

// Running is closed once every consumer group's handler is subscribed.
func (p *Pipeline) Running() chan struct{} { return p.router.Running() }

// Close stops the router and releases the Kafka clients.
func (p *Pipeline) Close() error {
	errs := []error{p.router.Close()}
	for _, c := range p.closers {
		errs = append(errs, c())
	}
	return errors.Join(errs...)
}

// errShutdown replaces an error that happened because the router is closing.
var errShutdown = errors.New("pipeline: stopped while processing; the message stays uncommitted")

func retryable(err error) bool {
	return !idempotency.IsPermanent(err) && !errors.Is(err, errShutdown) && !errors.Is(err, idempotency.ErrRevoked)
}

func shouldDeadLetter(err error) bool {
	return !errors.Is(err, errShutdown) && !errors.Is(err, idempotency.ErrRevoked)
}

func releaseRevoked(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		if errors.Is(err, idempotency.ErrRevoked) {
			return nil, nil // see the package documentation: not marked, redelivered to the new owner
		}
		return out, err
	}
}

func shutdownGuard(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		if err != nil && msg.Context().Err() != nil {
			return nil, fmt.Errorf("%w: %w", errShutdown, err)
		}
		return out, err
	}
}

type eventKey struct{}

// validate decodes the payload at the edge, before any database work: an
// invalid event is permanent and never claims anything.
func validate(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ev, err := order.Decode(msg.Payload)
		if err != nil {
			return nil, idempotency.Permanent(err)
		}
		ctx := msg.Context()
		msg.SetContext(context.WithValue(ctx, eventKey{}, ev))
		defer msg.SetContext(ctx)
		return h(msg)
	}
}

func adapt(h Handler) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		ctx := msg.Context()
		tx, err := idempotency.TxFromContext(ctx)
		if err != nil {
			return err
		}
		ev, ok := ctx.Value(eventKey{}).(order.Confirmed)
		if !ok {
			return errors.New("pipeline: no decoded event in the message context")
		}
		return h.Handle(ctx, tx, ev)
	}
}

func kafkaLogAttrs(msg *message.Message) []any {
	return []any{"partition", msg.Metadata.Get(MetaKafkaPartition), "offset", msg.Metadata.Get(MetaKafkaOffset)}
}

type observedPublisher struct {
	message.Publisher
	published func(*message.Message)
}

func (o observedPublisher) Publish(topic string, msgs ...*message.Message) error {
	if err := o.Publisher.Publish(topic, msgs...); err != nil {
		return err
	}
	for _, m := range msgs {
		o.published(m)
	}
	return nil
}
