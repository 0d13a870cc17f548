package main

import (
	"context"
	neturl "net/url"
	"strings"
	"testing"

	"github.com/google/uuid"

	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/schema"
)

// maintain prunes the forwarded rows of the consumer outbox, as serve does
// beside retention: a serve that runs no maintenance of its own relies on
// it (review finding: with --maintenance-interval 0 nothing pruned them).
//
// In a database of its own: the row it stages is no forwarder's envelope,
// and in the shared database's outbox it would hold every forwarder of
// the packages tested after this one (it did, in CI).
func TestMaintainPrunesTheForwardedOutbox(t *testing.T) {
	ctx := context.Background()
	shared := reftest.Postgres(t)
	pool := testenv.OtherPostgres(t, "once_maintain_test")
	u, err := neturl.Parse(shared.Config().ConnString())
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + pool.Config().ConnConfig.Database
	url := u.String()
	if out, err := runApp(t, "migrate", "--database-url", url); err != nil {
		t.Fatalf("migrate: %v\n%s", err, out)
	}
	tables := schema.Config{}
	box, offsets := tables.OutboxTable().Qualified, tables.OutboxOffsetsTable().Qualified
	// The database is this test's alone: what an earlier run left goes.
	if _, err := pool.Exec(ctx, `DELETE FROM `+box+`; DELETE FROM `+offsets+`;
		INSERT INTO `+offsets+` (consumer_group, offset_acked, last_processed_transaction_id) VALUES ('kafka_forwarder', 0, '2')`); err != nil {
		t.Fatal(err)
	}
	id := uuid.NewString()
	// Forwarded (a transaction before the forwarder's last) two days ago.
	if _, err := pool.Exec(ctx, `INSERT INTO `+box+` (uuid, created_at, payload, metadata, transaction_id)
		VALUES ($1, LOCALTIMESTAMP - interval '2 days', '{}', '{}', '1')`, id); err != nil {
		t.Fatal(err)
	}
	out, err := runApp(t, "maintain", "--database-url", url)
	if err != nil || !strings.Contains(out, "pruned 1 forwarded outbox rows") {
		t.Fatalf("maintain: %v\n%s", err, out)
	}
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+box+` WHERE uuid = $1`, id).Scan(&left); err != nil || left != 0 {
		t.Fatalf("the forwarded row of two days ago is still there (%d, %v)\n%s", left, err, out)
	}
}
