package volume

import (
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"
)

func TestQuoteBoundsLongValues(t *testing.T) {
	huge := strings.Repeat("ü", 1<<19) // 1 MiB of two-byte runes
	got := Quote(huge)
	if len(got) > MaxQuoted+40 {
		t.Errorf("Quote of 1 MiB is %d bytes: %.100s", len(got), got)
	}
	if !strings.HasSuffix(got, "…(1048576 bytes)") {
		t.Errorf("Quote = %.100s…, want it to end with the value's size", got)
	}
	prefix, err := strconv.Unquote(strings.TrimSuffix(got, "…(1048576 bytes)"))
	if err != nil || !strings.HasPrefix(huge, prefix) || !utf8.ValidString(prefix) || len(prefix) < MaxQuoted-utf8.UTFMax {
		t.Errorf("quoted prefix %q (%v): want a valid UTF-8 prefix of about %d bytes", prefix, err, MaxQuoted)
	}

	if got, want := Quote("short\n"), `"short\n"`; got != want {
		t.Errorf("Quote(short) = %s, want %s", got, want)
	}
	// Invalid UTF-8 is still cut, and still quoted safely.
	if got := Quote(strings.Repeat("\xbf", 1<<20)); len(got) > 4*MaxQuoted+40 || !strings.HasSuffix(got, "(1048576 bytes)") {
		t.Errorf("Quote of invalid UTF-8 = %.100s (%d bytes)", got, len(got))
	}
	list := QuoteList([]string{huge, "a", "b", "c", "d", "e", "f", "g", "h", "i"})
	if len(list) > 3*MaxQuoted+100 || !strings.Contains(list, "(2 more)") {
		t.Errorf("QuoteList = %.300s (%d bytes)", list, len(list))
	}
}
