// Package console is a web console for the people who operate a service on
// the library: its consumer groups (lag, owned partitions, held messages),
// its dead letters (parked and on their topics, grouped by reason; their
// payload and headers only for a signed-in person, through
// [Config.Redact]), their replay (one letter, or a filtered group, with
// the replay window checked and a confirmation step), and the claims of an
// event. It is server-rendered HTML with its assets embedded, and calls the
// same functions as app dlq and app inbox (packages dlq and inbox).
//
// It is read-only unless [Config.Token] is set and the person signs in with
// it, and it shows no payload or header to a person who has not signed in:
// dead letters often carry personal data. Replay and forget are POSTs that
// must come from the console's own pages (Origin and Sec-Fetch-Site
// checked, and a CSRF token). It shows no setting: no database URL, broker
// credential or key.
package console
