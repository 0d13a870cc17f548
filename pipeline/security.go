package pipeline

import (
	"crypto/tls"
	"errors"
	"fmt"

	"github.com/IBM/sarama"
	"github.com/xdg-go/scram"
)

// SASL mechanisms [KafkaSecurity] speaks.
const (
	SASLScramSHA512 = "SCRAM-SHA-512"
	SASLScramSHA256 = "SCRAM-SHA-256"
	SASLPlain       = "PLAIN"
)

// KafkaSecurity is how every Kafka client of a pipeline (its consumers, its
// producer of dead letters and outbox events, its lag reader) and of the
// tools built on it encrypts and authenticates. The zero value is plaintext
// without authentication.
type KafkaSecurity struct {
	// TLS encrypts every connection; nil for plaintext.
	TLS *tls.Config
	// SASLMechanism: "" (none), SCRAM-SHA-512, SCRAM-SHA-256, or PLAIN
	// (only over TLS: it sends the password as it is).
	SASLMechanism  string
	User, Password string
}

// Validate reports an incomplete or unsafe setting.
func (s KafkaSecurity) Validate() error {
	switch s.SASLMechanism {
	case "":
		if s.User != "" || s.Password != "" {
			return errors.New("a SASL user or password without a SASL mechanism")
		}
		return nil
	case SASLScramSHA512, SASLScramSHA256:
	case SASLPlain:
		if s.TLS == nil {
			return errors.New("SASL PLAIN sends the password in clear: use it over TLS only")
		}
	default:
		return fmt.Errorf("SASL mechanism %q: want %s, %s or %s", s.SASLMechanism, SASLScramSHA512, SASLScramSHA256, SASLPlain)
	}
	if s.User == "" || s.Password == "" {
		return fmt.Errorf("SASL %s needs a user and a password", s.SASLMechanism)
	}
	return nil
}

// Apply sets c's network security.
func (s KafkaSecurity) Apply(c *sarama.Config) {
	if s.TLS != nil {
		c.Net.TLS.Enable = true
		c.Net.TLS.Config = s.TLS.Clone()
	}
	if s.SASLMechanism == "" {
		return
	}
	c.Net.SASL.Enable = true
	c.Net.SASL.Handshake = true
	c.Net.SASL.User = s.User
	c.Net.SASL.Password = s.Password
	c.Net.SASL.Mechanism = sarama.SASLMechanism(s.SASLMechanism)
	switch s.SASLMechanism {
	case SASLScramSHA512:
		c.Net.SASL.SCRAMClientGeneratorFunc = func() sarama.SCRAMClient { return &scramClient{hash: scram.SHA512} }
	case SASLScramSHA256:
		c.Net.SASL.SCRAMClientGeneratorFunc = func() sarama.SCRAMClient { return &scramClient{hash: scram.SHA256} }
	}
}

func (s KafkaSecurity) principal() string {
	if s.User == "" {
		return "the anonymous principal"
	}
	return "principal User:" + s.User
}

// String never shows the password: the settings may be logged.
func (s KafkaSecurity) String() string {
	mech := s.SASLMechanism
	if mech == "" {
		mech = "none"
	}
	return fmt.Sprintf("tls=%t sasl=%s user=%s", s.TLS != nil, mech, s.User)
}

// scramClient is sarama's SCRAM conversation on xdg-go/scram, the library
// sarama's own examples use.
type scramClient struct {
	hash scram.HashGeneratorFcn
	conv *scram.ClientConversation
}

func (c *scramClient) Begin(user, password, authzID string) error {
	client, err := c.hash.NewClient(user, password, authzID)
	if err != nil {
		return err
	}
	c.conv = client.NewConversation()
	return nil
}

func (c *scramClient) Step(challenge string) (string, error) { return c.conv.Step(challenge) }
func (c *scramClient) Done() bool                            { return c.conv.Done() }
