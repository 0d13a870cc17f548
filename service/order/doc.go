// Package order defines the order.confirmed.v1 event: its wire format and its
// validated, immutable Go value. Producers and every consumer share it, so a
// message is checked against exactly one definition at the consumer boundary
// (R-KFK-EVT-4). Money is a decimal, never a float.
package order
