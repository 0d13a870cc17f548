// Package console is a web console for the people who operate a service on
// the library: its consumer groups (lag, owned partitions, held messages),
// its dead letters (parked and on their topics), their replay (one letter,
// or a filtered group, with the replay window checked and a confirmation
// step), and the claims of an event. It is server-rendered HTML with its
// assets embedded, and calls the same functions as app dlq and app inbox
// (packages dlq and inbox).
//
// It is read-only unless [Config.Token] is set and the person signs in with
// it. What may be personal data it shows to a signed-in person only,
// through [Config.Redact]: a dead letter's reason (a decoder's or a
// handler's error, which may quote the payload), payload and headers, a
// parked letter's last error, a held message's Kafka key and last error. A
// person who has not signed in sees only what the configuration or Kafka
// names: where a letter is (dead-letter topic, partition, offset), its
// source topic when it is one of the routes', its group when it reads as a
// consumer group's name (the two headers the pipeline writes from its
// configuration, which a letter written by anyone else could fill with
// anything), its event id when it is a UUID, its source partition and
// offset when they are numbers, ages, counts, attempts, lag, and claims:
// no text of a payload, a header, a key or an error. The letters are then
// grouped by source topic and group, not by reason, and a reason filter
// is refused (a pattern would read the reason a letter at a time).
//
// A letter whose group recorded its verdict with the event's claim
// (dlq.HeaderVerdict: a declined charge) is marked as such to anyone: a
// replay cannot change it, and its replay's POST is refused unless the
// person ticked, on the confirmation, that they know; a filtered
// replay's confirmation offers the same replay with the verdicts left out
// (counted). Replay links are shown to a signed-in person only.
//
// Replay and forget are POSTs that must come from the console's own pages
// (Origin and Sec-Fetch-Site checked, and a CSRF token). It shows no
// setting: no database URL, broker credential or key.
package console
