package main

import (
	"context"
	"strings"
	"testing"

	"github.com/google/uuid"

	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/schema"
)

// maintain prunes the forwarded rows of the consumer outbox, as serve does
// beside retention: a serve that runs no maintenance of its own relies on
// it (review finding: with --maintenance-interval 0 nothing pruned them).
func TestMaintainPrunesTheForwardedOutbox(t *testing.T) {
	ctx := context.Background()
	pool := reftest.Postgres(t)
	tables := schema.Config{}
	box, offsets := tables.OutboxTable().Qualified, tables.OutboxOffsetsTable().Qualified
	if _, err := pool.Exec(ctx, `INSERT INTO `+offsets+` (consumer_group, offset_acked, last_processed_transaction_id)
		VALUES ('kafka_forwarder', 0, '2') ON CONFLICT (consumer_group) DO NOTHING`); err != nil {
		t.Fatal(err)
	}
	id := uuid.NewString()
	// Forwarded (a transaction before the forwarder's last) two days ago.
	if _, err := pool.Exec(ctx, `INSERT INTO `+box+` (uuid, created_at, payload, metadata, transaction_id)
		VALUES ($1, LOCALTIMESTAMP - interval '2 days', '{}', '{}', '1')`, id); err != nil {
		t.Fatal(err)
	}
	out, err := runApp(t, "maintain", "--database-url", pool.Config().ConnString())
	if err != nil || !strings.Contains(out, "forwarded outbox rows") {
		t.Fatalf("maintain: %v\n%s", err, out)
	}
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+box+` WHERE uuid = $1`, id).Scan(&left); err != nil || left != 0 {
		t.Fatalf("the forwarded row of two days ago is still there (%d, %v)\n%s", left, err, out)
	}
}
