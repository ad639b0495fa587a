package export

// Hooks for the tests of the packages above, which drive background deletes through their own
// API (a PV's Delete) and must hold or count them.

// HoldSteps makes every later step of a background delete call hold first, as a server slow
// to answer would. Call it before the deletes it should hold start.
func (e *Exports) HoldSteps(hold func()) { e.beforeStep = hold }

// RemovalsStarted counts the removals of trash entries started so far.
func (e *Exports) RemovalsStarted() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.removals
}

// ShuttingDown is closed once Close has begun.
func (e *Exports) ShuttingDown() <-chan struct{} { return e.bg.Done() }
