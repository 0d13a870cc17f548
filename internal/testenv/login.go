package testenv

import (
	"context"
	"errors"
	"net/url"
	"os"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// LoginRole makes login a role that can log in (the cluster trusts it, as
// it trusts "once") and is granted each of roles, as docs/operating.md's
// "Least privilege" has an operator do; dev/pgbouncer.sh lets billing_svc
// and analytics_svc through. Roles belong to the cluster: one that exists
// already is kept, and the grants are made again.
func LoginRole(t testing.TB, admin *pgxpool.Pool, login string, roles ...string) {
	t.Helper()
	ctx := context.Background()
	_, err := admin.Exec(ctx, "CREATE ROLE "+pgx.Identifier{login}.Sanitize()+" LOGIN")
	var pg *pgconn.PgError
	if err != nil && !(errors.As(err, &pg) && (pg.Code == "42710" || pg.Code == "23505")) {
		t.Fatalf("create login role %s: %v", login, err)
	}
	for _, r := range roles {
		if _, err := admin.Exec(ctx, "GRANT "+pgx.Identifier{r}.Sanitize()+" TO "+pgx.Identifier{login}.Sanitize()); err != nil {
			t.Fatalf("grant %s to %s: %v", r, login, err)
		}
	}
	// The tests log in as it without a password, as the development
	// cluster (dev/postgres.sh) lets them; a cluster of one's own may not.
	cfg := admin.Config().ConnConfig.Copy()
	cfg.User, cfg.Password = login, ""
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		if os.Getenv("ONCE_EXTERNAL_SERVICES") != "" {
			t.Skipf("%s cannot log in to this PostgreSQL without a password (the development cluster trusts local logins): %v", login, err)
		}
		t.Fatalf("log in as %s: %v", login, err)
	}
	_ = conn.Close(ctx)
}

// URLAs is a PostgreSQL URL with its user replaced by user and, when
// database is not empty, its database by database.
func URLAs(databaseURL, user, database string) string {
	u, err := url.Parse(databaseURL)
	if err != nil {
		return databaseURL
	}
	u.User = url.User(user)
	if database != "" {
		u.Path = "/" + database
	}
	return u.String()
}
