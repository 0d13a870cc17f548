// Package orderevents defines the reference service's events as the style guide
// writes them (order.confirmed.v1 is the guide's OrderConfirmedMessage): their
// byte form and their validated, immutable Go values. Producers and every
// consumer share it, so a message is checked against exactly one definition
// at the consumer boundary (R-KFK-EVT-4). Money is a decimal, never a float.
//
// Decoding follows the guide's pydantic models: unknown fields are ignored;
// a missing or mistyped field is a [*FieldError] that names it. Integers must
// be JSON integers and times must carry an offset; amounts may be strings or
// JSON numbers and are parsed from their text, never through a float.
package orderevents
