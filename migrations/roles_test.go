package migrations_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/handlers/analytics"
	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/migrations"
	"github.com/once-dev/once/orderevents"
	"github.com/once-dev/once/pipeline"
)

func denied(err error) bool {
	var pg *pgconn.PgError
	return errors.As(err, &pg) && pg.Code == "42501"
}

// Analytics' role runs the real analytics group (claims, its tables, the
// dead letter of a poison message), and can neither read nor write
// billing's tables; billing's role cannot touch analytics'.
func TestEachGroupsRoleWritesOnlyItsOwnTables(t *testing.T) {
	ctx := context.Background()
	admin := reftest.Postgres(t)
	if _, err := migrations.Up(ctx, admin); err != nil {
		t.Fatal(err)
	}
	analyticsPool := testenv.PoolAs(t, admin, "once_analytics")
	billingPool := testenv.PoolAs(t, admin, "once_billing")

	for _, probe := range []struct {
		pool *pgxpool.Pool
		role string
		sql  string
	}{
		{analyticsPool, "once_analytics", `SELECT count(*) FROM billing.payments`},
		{analyticsPool, "once_analytics", `UPDATE billing.charge_intents SET unsettled_reason = 'x' WHERE false`},
		{analyticsPool, "once_analytics", `DELETE FROM billing.refunds WHERE false`},
		{analyticsPool, "once_analytics", `SELECT count(*) FROM payment_provider.charge`},
		{analyticsPool, "once_analytics", `DROP TABLE public.processed_event_default`},
		{billingPool, "once_billing", `SELECT count(*) FROM analytics.customer_daily_revenue`},
		{billingPool, "once_billing", `DELETE FROM analytics.customer_daily_payments WHERE false`},
	} {
		if _, err := probe.pool.Exec(ctx, probe.sql); !denied(err) {
			t.Errorf("%s: %s: %v; want permission denied (42501)", probe.role, probe.sql, err)
		}
	}

	// A table made after the roles (a later migration) is its group's to
	// write, through the default privileges, and still not the other's.
	later := "analytics.later_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	if _, err := admin.Exec(ctx, `CREATE TABLE `+later+` (n int)`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = admin.Exec(context.Background(), `DROP TABLE `+later) })
	if _, err := analyticsPool.Exec(ctx, `INSERT INTO `+later+` VALUES (1)`); err != nil {
		t.Errorf("once_analytics on a table made after the grants: %v; want it writable", err)
	}
	if _, err := billingPool.Exec(ctx, `SELECT count(*) FROM `+later); !denied(err) {
		t.Errorf("once_billing on analytics' later table: %v; want permission denied", err)
	}
	// In public, a table made later is no group's until it is granted by
	// name: it may be meant for one group only.
	public := "public.later_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	if _, err := admin.Exec(ctx, `CREATE TABLE `+public+` (n int)`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = admin.Exec(context.Background(), `DROP TABLE `+public) })
	for _, p := range []*pgxpool.Pool{analyticsPool, billingPool} {
		if _, err := p.Exec(ctx, `SELECT count(*) FROM `+public); !denied(err) {
			t.Errorf("a group role on a table made later in public: %v; want permission denied", err)
		}
	}

	// The analytics group itself, every statement under its role.
	brokers := testenv.Brokers(t)
	topic, dlqTopic := testenv.Topic(t, brokers, 2), testenv.Topic(t, brokers, 1)
	group := "analytics-roles-" + uuid.NewString()[:8]
	p, err := pipeline.New(pipeline.Config{Brokers: brokers, DB: analyticsPool, Topics: []pipeline.Binding{
		pipeline.Topic[orderevents.Confirmed]{Name: topic, DLQ: dlqTopic, Decode: orderevents.DecodeConfirmed,
			Groups: []pipeline.Group[orderevents.Confirmed]{{Name: group, Handle: analytics.Handler{}.OnConfirmed}}}}})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- p.Run(runCtx) }()
	defer func() { stop(); <-done }()
	producer := testenv.Producer(t, brokers)
	customer := 1 + rand.Int64N(1<<50)
	const events = 10
	for i := range events {
		ev, err := orderevents.NewConfirmed(uuid.Must(uuid.NewV7()), time.Now(), 1+rand.Int64N(1<<62), customer, decimal.New(250, -2))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := ev.MarshalJSON()
		testenv.Publish(t, producer, topic, fmt.Sprint(i), b)
	}
	testenv.Publish(t, producer, topic, "poison", []byte(`{"event_id":`))
	testenv.Eventually(t, time.Minute, "the group's effects under its role", func() bool {
		var orders int
		_ = admin.QueryRow(ctx, `SELECT coalesce(sum(order_count), 0) FROM analytics.customer_daily_revenue WHERE customer_id = $1`, customer).Scan(&orders)
		return orders == events
	})
	testenv.Eventually(t, time.Minute, "the dead letter on its topic", func() bool {
		var parked int
		_ = admin.QueryRow(ctx, `SELECT count(*) FROM once_dead_letter WHERE topic = $1`, dlqTopic).Scan(&parked)
		return parked == 0 && messagesIn(t, brokers, dlqTopic) == 1
	})
}

func messagesIn(t *testing.T, brokers []string, topic string) int64 {
	t.Helper()
	client, err := sarama.NewClient(brokers, sarama.NewConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	hwm, err := client.GetOffset(topic, 0, sarama.OffsetNewest)
	if err != nil {
		return -1
	}
	return hwm
}
