// Package once runs Kafka consumer groups whose effects happen exactly once,
// although Kafka delivers at least once: the front door of the library. A
// team describes its topics, event types and handlers in a [Config], and
// [New] and [Service.Run] do the rest in one place: the pools, the
// library's tables (migrated or checked), the recorded claim retention and
// the dedup horizon that follows it, the topics and their dead-letter
// topics, the Kafka access check, the consumer outbox's forwarder and its
// pruning, the dead-letter drainer, retention, metrics, readiness, and the
// drain on stop.
//
//	svc, err := once.New(ctx, once.Config{
//		Brokers:     []string{"kafka:9092"},
//		DatabaseURL: os.Getenv("DATABASE_URL"),
//		Topics: []once.Binding{once.Topic[Shipped]{Name: "shipment.dispatched.v1", Decode: decodeShipped,
//			Groups: []once.Group[Shipped]{{Name: "parcels", Handle: countParcels}}}},
//	})
//	if err != nil { ... }
//	defer svc.Close()
//	go http.ListenAndServe("127.0.0.1:9464", svc.Handler())
//	err = svc.Run(ctx)
//
// A handler runs in the transaction that claims (event id, group): its
// writes, its [Publish]ed events and the claim commit together, and the
// offset is committed only after. The packages below say how: pipeline (the
// routers and the safety chain), middleware/idempotency (the claim), schema
// (the tables), outbox, dlq, retention, metrics, pgdb (what a pooler needs).
//
// No default turns a guarantee off: the dedup horizon follows the claims'
// retention, a horizon that would outlive the claims is refused with both
// numbers, and a pgx exec mode a pooler breaks is refused at start-up.
package once
