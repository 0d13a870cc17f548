package once

import (
	"testing"
	"time"
)

// The horizon's default is the retention less the clock skew, not 0 (which
// turns it off): the claim statement's fallback to the recorded retention
// would hide the difference from a test through a database (review
// finding: a test that could not fail).
func TestTheHorizonDefaultsToTheRetentionLessTheSkew(t *testing.T) {
	var c Config
	c.setDefaults()
	if c.MaxEventAge != DefaultRetention-DefaultMaxClockSkew || c.MaxEventAge <= 0 {
		t.Fatalf("MaxEventAge defaults to %s; want %s", c.MaxEventAge, DefaultRetention-DefaultMaxClockSkew)
	}
	c = Config{Retention: 72 * time.Hour, MaxClockSkew: time.Minute}
	c.setDefaults()
	if c.MaxEventAge != 72*time.Hour-time.Minute {
		t.Fatalf("with Retention 72h and MaxClockSkew 1m, MaxEventAge defaults to %s", c.MaxEventAge)
	}
}
