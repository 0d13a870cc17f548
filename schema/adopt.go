package schema

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/once-dev/once/pgdb"
)

// A claim table that exists before the library's first migration is
// adopted, not refused: teams that ran the style guide's consumer have its
// processed_event, keyed by (event_id, consumer_group) or, in the guide's
// partitioned variant, by processed_at too, holding the claims that keep a
// redelivery of the next days from running again. Dropping it to get past
// the migration would run those effects twice.
//
// Two ways across, chosen by the table's shape (see adoptionOf):
//   - in place: a plain table keyed by (event_id, consumer_group) gains the
//     fingerprint column (NULL in its rows) and becomes the default
//     partition of the new table, without a row copied;
//   - by copy: any other table with the guide's columns (the variant
//     partitioned by processed_at, a key with more columns, columns of its
//     own) is renamed to ClaimTable + "_guide" and kept; each of its
//     (event_id, consumer_group) is claimed once in the new table, with the
//     latest processed_at it has.
//
// Either way an adopted claim has no fingerprint, so a later delivery of its
// event is a duplicate by its id alone (idempotency's fingerprints.match),
// and it ages out by its processed_at once that is older than the library's
// retention (package retention), which replaces the guide's for every
// claim in the table: it is the guide's only where the two are equal, and
// may not be shorter (retention.Config.GuideRetention). The claims reach
// back only as far as the guide kept them, and the dedup horizon starts
// there (AdoptedCoverage).

// column is one column of an existing table, as the catalog has it.
type column struct {
	Type       string `json:"type"`
	NotNull    bool   `json:"not_null"`
	HasDefault bool   `json:"has_default"`
}

// tableShape is what the catalog says of an existing table.
type tableShape struct {
	kind    string // pg_class.relkind: r a table, p a partitioned table
	owner   string
	columns map[string]column
	key     string // the primary key's columns, comma-separated
	// partitioning is the partition strategy and its columns ("r:event_id"),
	// empty for a table that is not partitioned.
	partitioning string
}

// shapeSQL reads a table's shape in one row (a migration reads through
// database/sql, Check and AdoptClaims through pgx). No row: no such table.
const shapeSQL = `SELECT c.relkind::text, pg_get_userbyid(c.relowner),
  coalesce((SELECT json_object_agg(a.attname, json_build_object('type', format_type(a.atttypid, a.atttypmod),
      'not_null', a.attnotnull, 'has_default', a.atthasdef))
    FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped), '{}')::text,
  coalesce((SELECT string_agg(a.attname, ',' ORDER BY k.n) FROM pg_index i
    CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, n)
    JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
    WHERE i.indrelid = c.oid AND i.indisprimary), ''),
  coalesce((SELECT p.partstrat::text || ':' || coalesce((SELECT string_agg(a.attname, ',' ORDER BY k.n)
      FROM unnest(p.partattrs::int2[]) WITH ORDINALITY AS k(attnum, n)
      JOIN pg_attribute a ON a.attrelid = p.partrelid AND a.attnum = k.attnum), '')
    FROM pg_partitioned_table p WHERE p.partrelid = c.oid), '')
FROM pg_class c WHERE c.oid = to_regclass($1)`

// readShape reads table's shape; ok is false when there is no such table.
func readShape(ctx context.Context, row rowReader, table string) (s tableShape, ok bool, err error) {
	var columns string
	err = row(ctx, shapeSQL, table).Scan(&s.kind, &s.owner, &columns, &s.key, &s.partitioning)
	if noRows(err) {
		return s, false, nil
	}
	if err != nil {
		return s, false, fmt.Errorf("schema: read the shape of %s: %w", table, err)
	}
	if err := json.Unmarshal([]byte(columns), &s.columns); err != nil {
		return s, false, fmt.Errorf("schema: read the columns of %s: %w", table, err)
	}
	return s, true, nil
}

// adoption is how an existing claim table becomes the library's.
type adoption int

const (
	// adoptNone: the library's own layout already (partitioned by event_id,
	// keyed by (event_id, consumer_group), fingerprinted); Check decides
	// the rest.
	adoptNone adoption = iota
	// adoptInPlace: a plain table keyed by (event_id, consumer_group) with
	// no columns but the library's becomes the default partition.
	adoptInPlace
	// adoptByCopy: its claims are copied into a new table; it is kept,
	// renamed.
	adoptByCopy
)

// guideColumns are what a claim table must have to be adopted: the style
// guide's processed_event.
var guideColumns = []struct{ name, typ, fix string }{
	{"event_id", "uuid", "ALTER TABLE %[1]s ALTER COLUMN event_id TYPE uuid USING event_id::uuid"},
	{"consumer_group", "text", "ALTER TABLE %[1]s ALTER COLUMN consumer_group TYPE text"},
	{"processed_at", "timestamp with time zone",
		"ALTER TABLE %[1]s ALTER COLUMN processed_at TYPE timestamptz USING processed_at AT TIME ZONE '<the zone its values were written in>'"},
}

// missingFix is the fix of a missing column of guideColumns.
var missingFix = map[string]string{
	"event_id": "none: a claim table without event_id is not the style guide's; give the library's claim table another name " +
		"(schema.Config.ClaimTable or Schema) or rename this one",
	"consumer_group": "ALTER TABLE %[1]s ADD COLUMN consumer_group text; UPDATE %[1]s SET consumer_group = '<the consumer group whose claims these are>'; " +
		"ALTER TABLE %[1]s ALTER COLUMN consumer_group SET NOT NULL",
	"processed_at": "ALTER TABLE %[1]s ADD COLUMN processed_at timestamptz NOT NULL DEFAULT now()",
}

// adoptionOf decides how a table of shape s becomes the library's claim
// table t, or why it cannot, with the SQL that fixes it.
func adoptionOf(t Table, s tableShape) (adoption, error) {
	if s.kind != "r" && s.kind != "p" {
		return 0, fmt.Errorf("schema: %s exists and is not a table (relkind %q): rename it, or give the library's claim table another name (schema.Config.ClaimTable or Schema)", t, s.kind)
	}
	var problems, fixes []string
	for _, c := range guideColumns {
		got, ok := s.columns[c.name]
		switch {
		case !ok:
			problems = append(problems, "no column "+c.name)
			fixes = append(fixes, fmt.Sprintf(missingFix[c.name], t.Qualified))
		case got.Type != c.typ:
			problems = append(problems, fmt.Sprintf("%s is %s, want %s", c.name, got.Type, c.typ))
			fixes = append(fixes, fmt.Sprintf(c.fix, t.Qualified))
		}
	}
	for _, name := range []string{"payload_sha256", "values_sha256"} {
		if got, ok := s.columns[name]; ok && got.Type != "bytea" {
			problems = append(problems, fmt.Sprintf("%s is %s, want bytea (the library's fingerprint)", name, got.Type))
			fixes = append(fixes, fmt.Sprintf("ALTER TABLE %s RENAME COLUMN %s TO %s_before_once", t.Qualified, name, name))
		}
	}
	if len(problems) > 0 {
		return 0, fmt.Errorf("schema: %s exists with another shape: %s; the migration adopts a claim table of the style guide's shape "+
			"(event_id uuid, consumer_group text, processed_at timestamptz), so fix it and migrate again (app migrate): %s",
			t, strings.Join(problems, "; "), strings.Join(fixes, "; "))
	}
	_, fingerprinted := s.columns["payload_sha256"]
	switch {
	case s.kind == "p" && s.partitioning == "r:event_id" && s.key == "event_id,consumer_group" && fingerprinted:
		return adoptNone, nil
	case s.kind == "r" && s.key == "event_id,consumer_group" && onlyLibraryColumns(s):
		return adoptInPlace, nil
	default:
		return adoptByCopy, nil
	}
}

// onlyLibraryColumns: a partition may have no column its parent lacks.
func onlyLibraryColumns(s tableShape) bool {
	for name := range s.columns {
		if _, ok := claimColumns[name]; !ok {
			return false
		}
	}
	return true
}

// guideTableName is where a claim table adopted by copy is kept.
func guideTableName(cfg Config) string { return cfg.ClaimTable + "_guide" }

// adoptStatements are the statements that make the existing table t of
// shape s ready for createClaimTable's: the in-place changes before it
// becomes the default partition, or the renames before the copy.
func adoptStatements(cfg Config, s tableShape, how adoption, partitions [][2]string) []string {
	claims := cfg.Claims().Qualified
	switch how {
	case adoptInPlace:
		var stmts []string
		if _, ok := s.columns["payload_sha256"]; !ok {
			// NULL in every adopted claim: it was made without a
			// fingerprint, and matches by its id.
			stmts = append(stmts, `ALTER TABLE `+claims+` ADD COLUMN payload_sha256 bytea`)
		}
		if at := s.columns["processed_at"]; !at.NotNull {
			// A claim with no processed_at never aged out under the
			// guide's retention; here it is kept one retention from now.
			stmts = append(stmts, `UPDATE `+claims+` SET processed_at = now() WHERE processed_at IS NULL`,
				`ALTER TABLE `+claims+` ALTER COLUMN processed_at SET NOT NULL`)
		}
		if !s.columns["processed_at"].HasDefault {
			stmts = append(stmts, `ALTER TABLE `+claims+` ALTER COLUMN processed_at SET DEFAULT now()`)
		}
		return stmts
	case adoptByCopy:
		guide := guideTableName(cfg)
		stmts := []string{
			`ALTER TABLE ` + claims + ` RENAME TO ` + pgx.Identifier{guide}.Sanitize(),
			// Its key's index and an index named as the library names
			// its own would keep the library's from being made.
			`ALTER INDEX IF EXISTS ` + pgx.Identifier{cfg.Schema, cfg.ClaimTable + "_pkey"}.Sanitize() + ` RENAME TO ` + pgx.Identifier{guide + "_pkey"}.Sanitize(),
			`ALTER INDEX IF EXISTS ` + pgx.Identifier{cfg.Schema, cfg.ClaimTable + "_processed_at_idx"}.Sanitize() + ` RENAME TO ` + pgx.Identifier{guide + "_processed_at_idx"}.Sanitize(),
		}
		// Partitions named as the library names its own (ClaimTable +
		// "_default", "_pYYYYMMDD") would be taken for them: the default
		// partition's CREATE ... IF NOT EXISTS would find the guide's, and
		// retention would attach or drop a day of the guide's.
		daily := regexp.MustCompile(`^` + regexp.QuoteMeta(cfg.ClaimTable) + `_p\d{8}$`)
		for _, p := range partitions {
			if p[1] == cfg.ClaimTable+"_default" || daily.MatchString(p[1]) {
				stmts = append(stmts, `ALTER TABLE `+pgx.Identifier{p[0], p[1]}.Sanitize()+` RENAME TO `+
					pgx.Identifier{guide + strings.TrimPrefix(p[1], cfg.ClaimTable)}.Sanitize())
			}
		}
		return stmts
	}
	return nil
}

// partitionsSQL lists a table's partitions as [schema, name] pairs.
const partitionsSQL = `SELECT coalesce(json_agg(json_build_array(n.nspname, c.relname)), '[]')::text
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE i.inhparent = to_regclass($1)`

func readPartitions(ctx context.Context, row rowReader, table string) ([][2]string, error) {
	var list string
	if err := row(ctx, partitionsSQL, table).Scan(&list); err != nil {
		return nil, fmt.Errorf("schema: list the partitions of %s: %w", table, err)
	}
	var out [][2]string
	if err := json.Unmarshal([]byte(list), &out); err != nil {
		return nil, fmt.Errorf("schema: list the partitions of %s: %w", table, err)
	}
	return out, nil
}

// copyClaimsSQL claims each (event_id, consumer_group) of the guide's table
// (%[1]s) once in the library's (%[2]s), with the latest processed_at it
// has: in the guide's variant keyed by processed_at too an event may have
// been claimed twice (the trap), and its latest claim is the one a
// redelivery must still find. No fingerprint: the claim matches by its id.
// A claim already there stays as it is, so a second copy adds only what
// was claimed since.
const copyClaimsSQL = `INSERT INTO %[2]s (event_id, consumer_group, processed_at)
SELECT DISTINCT ON (event_id, consumer_group) event_id, consumer_group, coalesce(processed_at, now())
FROM %[1]s WHERE event_id IS NOT NULL AND consumer_group IS NOT NULL
ORDER BY event_id, consumer_group, coalesce(processed_at, now()) DESC
ON CONFLICT (event_id, consumer_group) DO NOTHING`

// privilegesSQL lists who may do what on a table, its owner's implicit
// privileges included, as [privilege, role] pairs ("" is PUBLIC); the
// migrating role owns the library's table and needs no grant.
const privilegesSQL = `SELECT coalesce(json_agg(json_build_array(a.privilege_type, coalesce(r.rolname, ''))), '[]')::text
FROM pg_class c CROSS JOIN LATERAL aclexplode(coalesce(c.relacl, acldefault('r', c.relowner))) a
LEFT JOIN pg_roles r ON r.oid = a.grantee
WHERE c.oid = to_regclass($1) AND a.grantee IS DISTINCT FROM (SELECT oid FROM pg_roles WHERE rolname = current_user)`

var privilege = regexp.MustCompile(`^[A-Z ]+$`)

// grantStatements give the roles that can use the guide's table the same
// privileges on the library's, made afterwards under the same name: the
// guide's consumers of the groups not moved yet keep claiming there,
// whoever owned the table.
func grantStatements(ctx context.Context, row rowReader, table string) ([]string, error) {
	var list string
	if err := row(ctx, privilegesSQL, table).Scan(&list); err != nil {
		return nil, fmt.Errorf("schema: read the privileges on %s: %w", table, err)
	}
	var grants [][2]string
	if err := json.Unmarshal([]byte(list), &grants); err != nil {
		return nil, fmt.Errorf("schema: read the privileges on %s: %w", table, err)
	}
	var stmts []string
	for _, g := range grants {
		// A privilege type is one of PostgreSQL's keywords, from the
		// catalog; the role is quoted.
		if !privilege.MatchString(g[0]) {
			continue
		}
		grantee := "PUBLIC"
		if g[1] != "" {
			grantee = pgx.Identifier{g[1]}.Sanitize()
		}
		stmts = append(stmts, "GRANT "+g[0]+" ON "+table+" TO "+grantee)
	}
	return stmts, nil
}

// explainOwnerRefusal turns the refusal to alter a table the migrating
// role (migrator) does not own into what to do about it. Not ALTER TABLE
// ... OWNER TO the migrating role: that takes the owner's privileges from
// the table's ACL with it, and the guide's consumer, running as the owner,
// could no longer claim, nor run its start-up DDL; granted the owner's
// role, the migrating role acts as the owner, and the adopted table stays
// the owner's (see handBackSQL).
func explainOwnerRefusal(err error, t Table, owner, migrator string) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42501" {
		return fmt.Errorf("schema: adopting %s, the style guide's claim table, needs its owner (role %s): "+
			"run the migration as that role, or let this one act as it first (GRANT %s TO %s), and keep that grant for app migrate and app maintain; "+
			"the adopted table stays %s's, so the guide's consumer running as it keeps claiming there and running its start-up DDL "+
			"(do not hand the table over with ALTER TABLE ... OWNER TO: the guide's consumer would lose its privileges on it): %w",
			t, owner, pgx.Identifier{owner}.Sanitize(), pgx.Identifier{migrator}.Sanitize(), owner, err)
	}
	return err
}

// handBackSQL says whether the migrating role can give the library's claim
// table, which it makes, to the adopted table's owner ($1), when that is
// another role: as a superuser, or as a member of the owner's role whose
// owner may create in the schema ($2), as PostgreSQL requires of a new
// owner. The guide's consumer, running as the owner, then runs its
// start-up DDL as before (CREATE INDEX ... IF NOT EXISTS on its table
// checks that it owns it first); the migrating role keeps acting as the
// owner through its membership.
const handBackSQL = `SELECT current_user::text, $1 <> current_user AND (
  (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
  OR (pg_has_role(current_user, $1, 'USAGE') AND has_schema_privilege($1, $2, 'CREATE')))`

// fromName is what AdoptClaims takes as its source: schema.table.
var fromName = regexp.MustCompile(`^([A-Za-z_][A-Za-z0-9_$]{0,62})\.([A-Za-z_][A-Za-z0-9_$]{0,62})$`)

// AdoptClaims copies the claims of a claim table of the style guide's
// shape (event_id uuid, consumer_group text, processed_at timestamptz;
// plain, or partitioned by processed_at), named "schema.table" by from,
// into cfg's claim table, which [Migrate] made. It is the way across when
// the guide's table stays where it is, apart from the library's, because
// the guide's consumers keep claiming there for the groups not moved yet.
// (A guide's table where cfg names the claim table is adopted by Migrate
// itself.)
//
// Each (event_id, consumer_group) is claimed once, with the latest
// processed_at it has, from which retention counts; it carries no
// fingerprint, so a later delivery of its event is a duplicate by its id
// alone. A claim the library's table holds already stays as it is: running
// it again, at each group's switch, copies what was claimed since. It
// returns the number of claims copied. Run it after the guide's consumers
// of the groups that switch stopped, and before their once groups start: a
// claim made after the copy is not in it. The guide's table is not changed.
//
// The copied claims reach back only as far as the guide's table kept them:
// guideRetention, its cleanup job's retention (a table no job cleaned:
// the library's retention), or the time since its oldest claim was
// processed if that is longer ([AdoptedCoverage]). Where the retention is
// recorded (retention.Agree), the claim table's dedup horizon is narrowed
// to that, for every group of the table, and widens again as the library's
// own claims reach back: an event older than it is refused, not run again
// (its claim may have been deleted by the guide's cleanup). A guide's
// table without a claim changes no horizon.
func AdoptClaims(ctx context.Context, db pgdb.DB, cfg Config, from string, guideRetention time.Duration) (int64, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return 0, err
	}
	if guideRetention < 0 {
		return 0, fmt.Errorf("schema: adopt claims from %q: the guide's retention %s is negative", from, guideRetention)
	}
	m := fromName.FindStringSubmatch(from)
	if m == nil {
		return 0, fmt.Errorf("schema: adopt claims from %q: want the guide's table as schema.table", from)
	}
	source := Table{Name: from, Qualified: pgx.Identifier{m[1], m[2]}.Sanitize()}
	claims := cfg.Claims()
	var copied int64
	err := pgdb.InTx(ctx, db, func(tx pgx.Tx) error {
		s, ok, err := readShape(ctx, pgxRows(tx), source.Qualified)
		if err != nil {
			return err
		}
		if !ok {
			return fmt.Errorf("schema: adopt claims from %s: no such table", source)
		}
		var exists, same bool
		if err := tx.QueryRow(ctx, `SELECT to_regclass($2) IS NOT NULL, coalesce(to_regclass($1) = to_regclass($2), false)`,
			source.Qualified, claims.Qualified).Scan(&exists, &same); err != nil {
			return fmt.Errorf("schema: look for %s: %w", claims, err)
		}
		if !exists {
			return fmt.Errorf("%w: %s (migrate the database first: schema.Migrate, app migrate)", ErrMissingTable, claims)
		}
		if same {
			return fmt.Errorf("schema: adopt claims from %s: it is the library's claim table itself", source)
		}
		if _, err := adoptionOf(source, s); err != nil {
			return err
		}
		tag, err := tx.Exec(ctx, fmt.Sprintf(copyClaimsSQL, source.Qualified, claims.Qualified))
		if err != nil {
			return fmt.Errorf("schema: copy the claims of %s into %s: %w", source, claims, err)
		}
		copied = tag.RowsAffected()
		if _, err := tx.Exec(ctx, fmt.Sprintf(narrowCoverageSQL, cfg.RetentionPolicy().Qualified, source.Qualified),
			claims.Name, int64(guideRetention.Seconds())); err != nil {
			return fmt.Errorf("schema: narrow the dedup horizon of %s to what the claims of %s cover: %w", claims, source, err)
		}
		return nil
	})
	return copied, err
}

// narrowCoverageSQL narrows the recorded coverage of the claim table ($1)
// to what the claims of the guide's table (%[2]s) cover, $2 being its
// retention in seconds, when they cover less: covered_seconds from now.
// %[1]s: the retention policy table.
var narrowCoverageSQL = `UPDATE %[1]s AS p SET covered_seconds = a.covered, set_at = now()
FROM (SELECT ` + AdoptedCoverage("$2") + ` AS covered FROM %[2]s) AS a
WHERE p.claim_table = $1 AND a.covered < ` + CoveredRetention("p")

// adoptExisting makes an existing claim table of shape s ready for the
// library's layout (see adoptStatements) and returns the statements to run
// after the library's table exists: the copy, the grants, and the new
// table given to the old one's owner (handBackSQL).
func adoptExisting(ctx context.Context, tx rowReader, exec func(string) error, cfg Config, s tableShape) (after []string, inPlace bool, err error) {
	t := cfg.Claims()
	how, err := adoptionOf(t, s)
	if err != nil || how == adoptNone {
		return nil, false, err
	}
	// Read before the renames (a table's privileges go with it): the
	// roles that could use the guide's table get the same on the new one,
	// its owner too, if the new one cannot be given to it.
	grants, err := grantStatements(ctx, tx, t.Qualified)
	if err != nil {
		return nil, false, err
	}
	var migrator string
	var handBack bool
	if err := tx(ctx, handBackSQL, s.owner, cfg.Schema).Scan(&migrator, &handBack); err != nil {
		return nil, false, fmt.Errorf("schema: read who may own %s: %w", t, err)
	}
	if handBack {
		grants = append(grants, `ALTER TABLE `+t.Qualified+` OWNER TO `+pgx.Identifier{s.owner}.Sanitize())
	}
	var partitions [][2]string
	if how == adoptByCopy {
		if partitions, err = readPartitions(ctx, tx, t.Qualified); err != nil {
			return nil, false, err
		}
	}
	for _, st := range adoptStatements(cfg, s, how, partitions) {
		if err := exec(st); err != nil {
			return nil, false, explainOwnerRefusal(err, t, s.owner, migrator)
		}
	}
	if how == adoptByCopy {
		kept := pgx.Identifier{cfg.Schema, guideTableName(cfg)}.Sanitize()
		after = append(after, fmt.Sprintf(copyClaimsSQL, kept, t.Qualified))
	}
	return append(after, grants...), how == adoptInPlace, nil
}
