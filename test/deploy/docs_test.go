package deploy

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode"
)

// TestDocsLinksResolve: every relative link in README.md and docs/*.md leads to a file of the
// repository, and every #anchor to a heading of the file it names, as GitHub renders them. A
// section moved or renamed leaves no link behind that lands on nothing.
func TestDocsLinksResolve(t *testing.T) {
	root := repoPath(t, ".")
	docs, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	must(t, err)
	files := append([]string{filepath.Join(root, "README.md")}, docs...)
	if len(docs) == 0 {
		t.Fatal("no docs/*.md")
	}
	n := 0
	for _, f := range files {
		data, err := os.ReadFile(f)
		must(t, err)
		rel, _ := filepath.Rel(root, f)
		for _, target := range markdownLinks(string(data)) {
			n++
			if err := checkLink(root, f, target); err != nil {
				t.Errorf("%s: link %q: %v", rel, target, err)
			}
		}
	}
	if n == 0 {
		t.Fatal("no links found: the link parser is broken")
	}
}

// checkLink resolves a link target of the Markdown file md: external links are left alone,
// a path must exist inside the repository root, an anchor must be a heading of its file.
func checkLink(root, md, target string) error {
	if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
		return nil
	}
	path, anchor, _ := strings.Cut(target, "#")
	file := md
	if path != "" {
		if strings.HasPrefix(path, "/") {
			return fmt.Errorf("an absolute path does not resolve on GitHub: make it relative")
		}
		file = filepath.Join(filepath.Dir(md), filepath.FromSlash(path))
		if r, err := filepath.Rel(root, file); err != nil || r == ".." || strings.HasPrefix(r, "../") {
			return fmt.Errorf("leads outside the repository")
		}
		if _, err := os.Stat(file); err != nil {
			return err
		}
	}
	if anchor == "" {
		return nil
	}
	if !strings.HasSuffix(file, ".md") {
		return fmt.Errorf("an anchor into %s, which is not Markdown", filepath.Base(file))
	}
	data, err := os.ReadFile(file)
	if err != nil {
		return err
	}
	if anchors := headingAnchors(string(data)); !slices.Contains(anchors, anchor) {
		return fmt.Errorf("%s has no heading #%s (it has %v)", filepath.Base(file), anchor, anchors)
	}
	return nil
}

var (
	// [text](target) and ![alt](target), the target up to a space (a title) or the parenthesis.
	inlineLink = regexp.MustCompile(`\]\(([^)\s]+)(?:\s+"[^"]*")?\)`)
	inlineCode = regexp.MustCompile("`[^`]*`")
)

// markdownLinks returns the targets of a Markdown file's inline links, outside code blocks and
// code spans.
func markdownLinks(md string) []string {
	var out []string
	for _, line := range markdownLines(md) {
		for _, m := range inlineLink.FindAllStringSubmatch(inlineCode.ReplaceAllString(line, ""), -1) {
			out = append(out, m[1])
		}
	}
	return out
}

// markdownLines returns the lines of a Markdown file that are not in fenced code blocks.
func markdownLines(md string) []string {
	var out []string
	inCode := false
	for line := range strings.SplitSeq(md, "\n") {
		if t := strings.TrimSpace(line); strings.HasPrefix(t, "```") || strings.HasPrefix(t, "~~~") {
			inCode = !inCode
			continue
		}
		if !inCode {
			out = append(out, line)
		}
	}
	return out
}

// headingAnchors returns the anchors GitHub gives a Markdown file's ATX headings: the heading's
// text as rendered (code spans and links reduced to their text), lower case, every character
// that is not a letter, a number, '_', '-' or a space dropped, spaces as dashes; a repeated
// anchor gets -1, -2, ... in order.
func headingAnchors(md string) []string {
	var anchors []string
	seen := map[string]int{}
	for _, line := range markdownLines(md) {
		hashes := len(line) - len(strings.TrimLeft(line, "#"))
		if hashes == 0 || hashes > 6 || (len(line) > hashes && line[hashes] != ' ') {
			continue
		}
		text := strings.TrimSpace(line[hashes:])
		text = strings.TrimSpace(strings.TrimRight(text, "#")) // closing sequence
		text = regexp.MustCompile(`\[([^\]]*)\]\([^)]*\)`).ReplaceAllString(text, "$1")
		var b strings.Builder
		for _, r := range strings.ToLower(text) {
			switch {
			case r == ' ':
				b.WriteRune('-')
			case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsNumber(r) || unicode.Is(unicode.Mn, r):
				b.WriteRune(r)
			}
		}
		a := b.String()
		if k := seen[a]; k > 0 {
			seen[a] = k + 1
			a = fmt.Sprintf("%s-%d", a, k)
		} else {
			seen[a] = 1
		}
		anchors = append(anchors, a)
	}
	return anchors
}
