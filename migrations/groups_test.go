package migrations_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/migrations"
	"github.com/once-dev/once/outbox"
	"github.com/once-dev/once/schema"
)

// Finding 1 of priv's review: in the database both groups share, the
// consumer outbox is each group's own. Logged in as analytics_svc (never
// SET ROLE), it cannot insert an event billing's forwarder would publish,
// nor read, change or delete billing's rows or billing's forwarder
// progress; billing_svc's forwarder still sends every row billing wrote,
// in a database where analytics' rows come first and it cannot see them.
func TestAGroupsRoleCannotReachAnotherGroupsOutbox(t *testing.T) {
	ctx := context.Background()
	admin := reftest.Postgres(t)
	testenv.LoginRole(t, admin, "billing_svc", "once_billing")
	testenv.LoginRole(t, admin, "analytics_svc", "once_analytics")
	box, err := outbox.New(schema.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	brokers := testenv.Brokers(t)

	for _, where := range testenv.EveryWay {
		t.Run(where.String(), func(t *testing.T) {
			billing := testenv.PoolAt(t, testenv.URLAs(where.URL(t), "billing_svc", ""))
			analytics := testenv.PoolAt(t, testenv.URLAs(where.URL(t), "analytics_svc", ""))
			topic := testenv.Topic(t, brokers, 1)

			publish := func(pool pgx.Tx, id string) error {
				return box.Publish(ctx, pool, outbox.Message{Topic: topic, Key: "k", ID: id, Payload: []byte(`"` + id + `"`)})
			}
			// Analytics writes first: rows billing's forwarder cannot see
			// lie before billing's.
			var analyticsIDs, billingIDs []string
			for range 3 {
				id := uuid.NewString()
				if err := pgx.BeginFunc(ctx, analytics, func(tx pgx.Tx) error { return publish(tx, id) }); err != nil {
					t.Fatalf("analytics' role writes its outbox: %v", err)
				}
				analyticsIDs = append(analyticsIDs, id)
			}
			for range 3 {
				id := uuid.NewString()
				if err := pgx.BeginFunc(ctx, billing, func(tx pgx.Tx) error { return publish(tx, id) }); err != nil {
					t.Fatalf("billing's role writes its outbox: %v", err)
				}
				billingIDs = append(billingIDs, id)
			}
			var tagged int
			if err := admin.QueryRow(ctx, `SELECT count(*) FROM once_outbox WHERE payload->>'uuid' = ANY($1) AND group_role = 'once_billing'`, billingIDs).Scan(&tagged); err != nil || tagged != 3 {
				t.Errorf("billing's rows tagged once_billing: %d (%v); want 3", tagged, err)
			}

			// As analytics_svc against billing's rows and progress.
			forged := uuid.NewString()
			for _, st := range []struct {
				what string
				sql  string
				args []any
			}{
				{"insert a row as billing's", `INSERT INTO once_outbox (uuid, payload, transaction_id, group_role) VALUES ($1, '{}', pg_current_xact_id(), 'once_billing')`, []any{forged}},
				{"insert a row of no group", `INSERT INTO once_outbox (uuid, payload, transaction_id, group_role) VALUES ($1, '{}', pg_current_xact_id(), NULL)`, []any{forged}},
				{"insert billing's progress", `INSERT INTO once_outbox_offsets (consumer_group, offset_acked, last_processed_transaction_id) VALUES ('kafka_forwarder:once_billing', 0, '0') ON CONFLICT DO NOTHING`, nil},
				{"insert the shared progress", `INSERT INTO once_outbox_offsets (consumer_group, offset_acked, last_processed_transaction_id) VALUES ('kafka_forwarder', 0, '0') ON CONFLICT DO NOTHING`, nil},
				{"move its rows to billing", `UPDATE once_outbox SET group_role = 'once_billing' WHERE payload->>'uuid' = ANY($1)`, []any{analyticsIDs}},
			} {
				if _, err := analytics.Exec(ctx, st.sql, st.args...); !refused(err) {
					t.Errorf("analytics' role may %s: %v; want it refused (42501)", st.what, err)
				}
			}
			for _, st := range []struct {
				what string
				sql  string
				args []any
			}{
				{"read billing's rows", `SELECT count(*) FROM once_outbox WHERE payload->>'uuid' = ANY($1)`, []any{billingIDs}},
				{"read billing's progress", `SELECT count(*) FROM once_outbox_offsets WHERE consumer_group <> 'kafka_forwarder:once_analytics'`, nil},
			} {
				var n int
				if err := analytics.QueryRow(ctx, st.sql, st.args...).Scan(&n); err != nil || n != 0 {
					t.Errorf("analytics' role could %s: %d rows (%v); want none", st.what, n, err)
				}
			}
			for _, st := range []struct {
				what string
				sql  string
				args []any
			}{
				{"delete billing's rows", `DELETE FROM once_outbox WHERE payload->>'uuid' = ANY($1)`, []any{billingIDs}},
				{"change billing's rows", `UPDATE once_outbox SET payload = '{}' WHERE payload->>'uuid' = ANY($1)`, []any{billingIDs}},
				{"move billing's progress", `UPDATE once_outbox_offsets SET offset_acked = offset_acked + 1000000 WHERE consumer_group = 'kafka_forwarder:once_billing'`, nil},
				{"delete billing's progress", `DELETE FROM once_outbox_offsets WHERE consumer_group = 'kafka_forwarder:once_billing'`, nil},
			} {
				tag, err := analytics.Exec(ctx, st.sql, st.args...)
				if !refused(err) && (err != nil || tag.RowsAffected() != 0) {
					t.Errorf("analytics' role could %s: %d rows (%v); want none", st.what, tag.RowsAffected(), err)
				}
			}
			var rows, forgedRows int
			if err := admin.QueryRow(ctx, `SELECT count(*) FILTER (WHERE payload->>'uuid' = ANY($1) AND payload::text <> '{}'), count(*) FILTER (WHERE uuid = $2)
				FROM once_outbox`, billingIDs, forged).Scan(&rows, &forgedRows); err != nil || rows != 3 || forgedRows != 0 {
				t.Errorf("after analytics' attempts: billing's rows intact %d, forged %d (%v); want 3 and 0", rows, forgedRows, err)
			}

			// Billing's forwarder under billing_svc sends each of billing's
			// rows, though analytics' come first and it sees none of them.
			fw, err := box.Forwarder(billing, outbox.KafkaPublisher{Producer: testenv.Producer(t, brokers)})
			if err != nil {
				t.Fatal(err)
			}
			runCtx, stop := context.WithCancel(ctx)
			done := make(chan error, 1)
			go func() { done <- fw.Run(runCtx) }()
			// Until billing's progress acknowledges its rows (each is sent,
			// then acknowledged): a stop before that sends them again later.
			acked := func() bool {
				var all bool
				err := admin.QueryRow(ctx, `SELECT bool_and(m.transaction_id < o.last_processed_transaction_id
					OR (m.transaction_id = o.last_processed_transaction_id AND m."offset" <= o.offset_acked))
					FROM once_outbox m, once_outbox_offsets o WHERE o.consumer_group = 'kafka_forwarder:once_billing' AND m.payload->>'uuid' = ANY($1)`, billingIDs).Scan(&all)
				return err == nil && all
			}
			deadline := time.Now().Add(30 * time.Second)
			for !acked() && time.Now().Before(deadline) {
				time.Sleep(100 * time.Millisecond)
			}
			stop()
			<-done
			var sent []string
			for _, m := range testenv.ReadTopic(t, brokers, topic) {
				sent = append(sent, strings.Trim(string(m.Value), `"`))
			}
			slices.Sort(sent)
			if want := slices.Sorted(slices.Values(billingIDs)); !slices.Equal(sent, want) {
				t.Errorf("billing's forwarder sent %v; want billing's rows %v", sent, want)
			}
			// Pruning, as the owner (app maintain): billing's forwarded rows
			// go by billing's progress; analytics' rows, which no forwarder
			// sent, stay, though the shared progress may stand past them.
			if _, err := admin.Exec(ctx, `UPDATE once_outbox SET created_at = created_at - interval '2 days' WHERE payload->>'uuid' = ANY($1) OR payload->>'uuid' = ANY($2)`, billingIDs, analyticsIDs); err != nil {
				t.Fatal(err)
			}
			// The shared progress moved past every row, then put back.
			var savedAcked *int64
			var savedTx *string
			_ = admin.QueryRow(ctx, `SELECT offset_acked, last_processed_transaction_id::text FROM once_outbox_offsets WHERE consumer_group = 'kafka_forwarder'`).Scan(&savedAcked, &savedTx)
			t.Cleanup(func() {
				if savedTx == nil {
					_, _ = admin.Exec(ctx, `DELETE FROM once_outbox_offsets WHERE consumer_group = 'kafka_forwarder'`)
					return
				}
				_, _ = admin.Exec(ctx, `UPDATE once_outbox_offsets SET offset_acked = $1, last_processed_transaction_id = $2::xid8 WHERE consumer_group = 'kafka_forwarder'`, savedAcked, *savedTx)
			})
			if _, err := admin.Exec(ctx, `INSERT INTO once_outbox_offsets (consumer_group, offset_acked, last_processed_transaction_id)
				VALUES ('kafka_forwarder', 0, pg_current_xact_id()) ON CONFLICT (consumer_group) DO UPDATE SET last_processed_transaction_id = excluded.last_processed_transaction_id, offset_acked = 0`); err != nil {
				t.Fatal(err)
			}
			if _, err := box.Prune(ctx, admin, time.Hour, 1000); err != nil {
				t.Fatalf("prune as the owner: %v", err)
			}
			var billingLeft, analyticsLeft int
			if err := admin.QueryRow(ctx, `SELECT count(*) FILTER (WHERE payload->>'uuid' = ANY($1)), count(*) FILTER (WHERE payload->>'uuid' = ANY($2)) FROM once_outbox`,
				billingIDs, analyticsIDs).Scan(&billingLeft, &analyticsLeft); err != nil || billingLeft != 0 || analyticsLeft != 3 {
				t.Errorf("after the owner's prune: billing's forwarded rows left %d, analytics' unforwarded rows left %d (%v); want 0 and 3", billingLeft, analyticsLeft, err)
			}
			_, _ = admin.Exec(ctx, `DELETE FROM once_outbox WHERE payload->>'uuid' = ANY($1) OR payload->>'uuid' = ANY($2)`, billingIDs, analyticsIDs)
		})
	}
}

// Finding 2 of priv's review: a dead letter of no group (group_role NULL:
// parked by the owner, or before 00013 with no group to backfill) is no
// group role's: billing_svc cannot read, re-tag or delete it, nor park a
// letter of no group, which another group's drainer would publish.
func TestALetterOfNoGroupIsNoGroupRoles(t *testing.T) {
	ctx := context.Background()
	admin := reftest.Postgres(t)
	testenv.LoginRole(t, admin, "billing_svc", "once_billing")
	billing := testenv.PoolAt(t, testenv.URLAs(testenv.Where{Mode: pgx.QueryExecModeExec, Pooled: true}.URL(t), "billing_svc", ""))
	var letter int64
	if err := admin.QueryRow(ctx, `INSERT INTO once_dead_letter (topic, payload, headers, group_role) VALUES ('t', '\x00', '\x5b5d', NULL) RETURNING id`).Scan(&letter); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = admin.Exec(ctx, `DELETE FROM once_dead_letter WHERE id = $1`, letter) })
	var n int
	if err := billing.QueryRow(ctx, `SELECT count(*) FROM once_dead_letter WHERE id = $1`, letter).Scan(&n); err != nil || n != 0 {
		t.Errorf("billing's role reads a letter of no group: %d (%v); want none", n, err)
	}
	for _, sql := range []string{`UPDATE once_dead_letter SET group_role = 'once_billing' WHERE id = $1`, `DELETE FROM once_dead_letter WHERE id = $1`} {
		if tag, err := billing.Exec(ctx, sql, letter); !refused(err) && (err != nil || tag.RowsAffected() != 0) {
			t.Errorf("billing's role: %s: %d rows (%v); want none", sql, tag.RowsAffected(), err)
		}
	}
	if _, err := billing.Exec(ctx, `INSERT INTO once_dead_letter (topic, payload, headers, group_role) VALUES ('t', '\x00', '\x5b5d', NULL)`); !refused(err) {
		t.Errorf("billing's role parks a letter of no group: %v; want it refused (42501)", err)
	}
	var left int
	if err := admin.QueryRow(ctx, `SELECT count(*) FROM once_dead_letter WHERE id = $1 AND group_role IS NULL`, letter).Scan(&left); err != nil || left != 1 {
		t.Errorf("the letter of no group after billing's attempts: %d (%v); want it untouched", left, err)
	}
}

// Finding 4 of priv's review: Dedicate run by a role that does not own the
// database (REVOKE ... FROM PUBLIC by a non-owner only warns) reported
// success and left CONNECT open to PUBLIC. It now refuses, naming the
// owner to run it as, and CONNECT is as it was.
func TestDedicateByANonOwnerFailsNamingTheOwner(t *testing.T) {
	ctx := context.Background()
	admin := reftest.Postgres(t)
	db := testenv.OtherPostgres(t, "once_dedicate_stranger")
	if _, err := migrations.Up(ctx, db); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(ctx, `GRANT CONNECT ON DATABASE once_dedicate_stranger TO PUBLIC`); err != nil {
		t.Fatal(err)
	}
	testenv.LoginRole(t, admin, "dedicate_stranger")
	stranger := testenv.PoolAt(t, testenv.URLAs(testenv.Where{Mode: pgx.QueryExecModeExec}.URL(t), "dedicate_stranger", "once_dedicate_stranger"))
	var owner string
	if err := db.QueryRow(ctx, `SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = current_database()`).Scan(&owner); err != nil {
		t.Fatal(err)
	}
	// Both groups: no table of another group's to revoke, only CONNECT,
	// whose revoke by a non-owner is a warning.
	err := migrations.Dedicate(ctx, stranger, []string{"analytics", "billing"})
	if err == nil || !strings.Contains(err.Error(), "its owner, "+owner) {
		t.Errorf("Dedicate as a role that does not own the database: %v; want an error naming its owner %s", err, owner)
	}
	var open bool
	if err := db.QueryRow(ctx, `SELECT has_database_privilege('public', current_database(), 'CONNECT')`).Scan(&open); err != nil || !open {
		t.Errorf("PUBLIC CONNECT after the refused Dedicate: %v (%v); want it as it was (granted)", open, err)
	}
}

// Finding 7 of priv's review: a role that is a member of both group roles
// (on PostgreSQL 16 and later the CREATEROLE role that created them is) is
// neither group's: once_group_role() is NULL for it, rather than the first
// by name, so a letter or outbox row it writes is refused by the groups'
// policies instead of being given to analytics.
func TestAMemberOfBothGroupRolesActsAsNeither(t *testing.T) {
	ctx := context.Background()
	admin := reftest.Postgres(t)
	testenv.LoginRole(t, admin, "both_svc", "once_billing", "once_analytics")
	both := testenv.PoolAt(t, testenv.URLAs(testenv.Where{Mode: pgx.QueryExecModeExec, Pooled: false}.URL(t), "both_svc", ""))
	var role pgtype.Text
	if err := both.QueryRow(ctx, `SELECT public.once_group_role()::text`).Scan(&role); err != nil || role.Valid {
		t.Errorf("once_group_role() for a member of both: %q (%v); want NULL", role.String, err)
	}
	if _, err := both.Exec(ctx, `INSERT INTO once_dead_letter (topic, payload, headers) VALUES ('t', '\x00', '\x5b5d')`); !refused(err) {
		t.Errorf("a member of both parks a letter: %v; want it refused (42501), not given to either group", err)
	}
	err := pgx.BeginFunc(ctx, both, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO once_outbox (uuid, payload, transaction_id) VALUES ($1, '{}', pg_current_xact_id())`, uuid.NewString())
		return err
	})
	if !refused(err) {
		t.Errorf("a member of both writes the outbox: %v; want it refused (42501)", err)
	}
}
