// Package kafkasend sends one message through a sarama producer and gives up
// waiting when a context ends: sarama's SendMessage takes no context, and on
// a broker that neither answers nor fails it returns only after every retry
// of every request timed out (minutes), which would hold a shutdown up.
package kafkasend

import (
	"context"

	"github.com/IBM/sarama"
)

// Send sends pm and returns its result, or ctx's error as soon as ctx ends.
// A send given up may still reach Kafka: the caller must treat it as not
// sent (and try it again later), never as failed for good. The send goes on
// in the background until the producer answers or is closed.
func Send(ctx context.Context, p sarama.SyncProducer, pm *sarama.ProducerMessage) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() {
		_, _, err := p.SendMessage(pm)
		done <- err
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}
