package volume

import (
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"
)

// MaxQuoted is how many bytes of a user's value an event or error quotes. Claim annotations
// and class parameters can be hundreds of KiB; quoted whole, one bad value would become an
// event that large in etcd and a log line that large on every retry.
const MaxQuoted = 64

// Quote returns s quoted as %q does, cut to its first MaxQuoted bytes followed by "…(N bytes)"
// when it is longer. Every value that comes from a claim, a class or a PV goes through it
// before it reaches an event or an error.
func Quote(s string) string {
	if len(s) <= MaxQuoted {
		return strconv.Quote(s)
	}
	cut := MaxQuoted
	// Cut at a rune boundary so the prefix stays readable; invalid UTF-8 is cut anywhere.
	for i := 0; i < utf8.UTFMax && cut > 0 && !utf8.RuneStart(s[cut]); i++ {
		cut--
	}
	return fmt.Sprintf("%s…(%d bytes)", strconv.Quote(s[:cut]), len(s))
}

// maxQuotedList is how many values QuoteList shows.
const maxQuotedList = 8

// QuoteList quotes each value with Quote, as %q does for a slice, showing at most a few.
func QuoteList(ss []string) string {
	shown := ss
	if len(ss) > maxQuotedList {
		shown = ss[:maxQuotedList]
	}
	q := make([]string, len(shown))
	for i, s := range shown {
		q[i] = Quote(s)
	}
	more := ""
	if len(ss) > len(shown) {
		more = fmt.Sprintf(" …(%d more)", len(ss)-len(shown))
	}
	return "[" + strings.Join(q, " ") + more + "]"
}
