// Package retention keeps processed_event from growing forever without ever
// breaking dedup (R-KFK-IDEM-2).
//
// processed_event is range-partitioned by event_id: a UUIDv7 starts with its
// 48-bit Unix millisecond timestamp, so one day of events is one range of ids,
// and every delivery of an event, whenever it arrives, hits the same partition
// and the same primary key (event_id, consumer_group). A maintenance pass
// ([Run]), serialised across instances by an advisory lock and idempotent:
//
//   - in [Partitioned] mode creates the daily partitions of today and the
//     next days ahead, so no claim waits for one;
//   - drops daily partitions whose whole day is older than the retention:
//     dropping a partition is instant, deleting its rows is not;
//   - deletes expired rows from the default partition in bounded batches. In
//     [Delete] mode the default partition is the whole table: this is the
//     plain-table variant, for small streams.
//
// Claims older than the retention may be gone, so consumers must bound the age
// of what they accept; see idempotency.Config.MaxEventAge.
//
// A claim without a fingerprint (adopted from the style guide's table, or made
// by the guide's consumer, which keeps claiming there for the groups not moved
// yet) comes from a consumer that bounded no age: it expires by its
// processed_at instead, by this retention, which replaces the guide's
// (Config.GuideRetention may not be longer), and an expired day's partition
// holding one processed within the retention is kept until it aged out
// ([Report].Kept).
package retention
