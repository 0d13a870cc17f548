package pipeline

// DecidedDirectly is how many messages p's batches acknowledged on the
// direct path (see Batch), for the tests that must know which path ran.
func DecidedDirectly(p *Pipeline) int64 {
	var n int64
	for _, b := range p.batchers {
		n += b.decided.Load()
	}
	return n
}
