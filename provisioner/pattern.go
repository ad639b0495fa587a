package provisioner

import (
	"fmt"
	"strings"
	"unicode"

	"github.com/dirpv/dirpv/volume"
	"github.com/dirpv/dirpv/volume/export"
)

// DefaultPathPattern names each volume after its claim and PV, so a directory is unique to
// one PV and a retried Provision finds its own directory again.
const DefaultPathPattern = "${pvc.metadata.namespace}-${pvc.metadata.name}-${pv.metadata.name}"

// pattern is a parsed pathPattern: one template per path component, so a substituted value
// can never add or remove a component.
type pattern struct {
	components [][]token
}

// token is literal text or a variable reference.
type token struct {
	literal string
	// variable is one of the var* kinds; key is the label or annotation key.
	variable varKind
	key      string
}

type varKind int

const (
	varNone varKind = iota
	varNamespace
	varPVCName
	varPVName
	varLabel
	varAnnotation
)

// pathVars are the values a pattern is expanded with.
type pathVars struct {
	namespace, pvcName, pvName string
	labels, annotations        map[string]string
}

func parsePattern(s string) (*pattern, error) {
	if s == "" {
		return nil, fmt.Errorf("pathPattern is empty")
	}
	if strings.HasPrefix(s, "/") {
		return nil, fmt.Errorf("pathPattern %s is absolute: it is relative to the share or base path", volume.Quote(s))
	}
	p := &pattern{}
	for _, comp := range splitComponents(s) {
		if comp == "" || comp == "." || comp == ".." {
			return nil, fmt.Errorf("pathPattern %s has an empty, \".\" or \"..\" component", volume.Quote(s))
		}
		toks, err := parseComponent(comp)
		if err != nil {
			return nil, fmt.Errorf("pathPattern %s: %w", volume.Quote(s), err)
		}
		p.components = append(p.components, toks)
	}
	return p, nil
}

// splitComponents splits s at each slash outside ${...}: a label or annotation key may hold
// one (nfs.io/storage-path).
func splitComponents(s string) []string {
	var comps []string
	start, inVar := 0, false
	for i := 0; i < len(s); i++ {
		switch {
		case !inVar && strings.HasPrefix(s[i:], "${"):
			inVar = true
		case inVar && s[i] == '}':
			inVar = false
		case !inVar && s[i] == '/':
			comps = append(comps, s[start:i])
			start = i + 1
		}
	}
	return append(comps, s[start:])
}

func parseComponent(comp string) ([]token, error) {
	var toks []token
	for comp != "" {
		i := strings.Index(comp, "${")
		if i < 0 {
			toks = append(toks, token{literal: comp})
			break
		}
		if i > 0 {
			toks = append(toks, token{literal: comp[:i]})
		}
		end := strings.IndexByte(comp[i:], '}')
		if end < 0 {
			return nil, fmt.Errorf("unterminated ${ in %s", volume.Quote(comp))
		}
		t, err := parseVariable(comp[i+2 : i+end])
		if err != nil {
			return nil, err
		}
		toks = append(toks, t)
		comp = comp[i+end+1:]
	}
	for _, t := range toks {
		if t.variable == varNone && (strings.ContainsRune(t.literal, 0) || strings.Contains(t.literal, "$")) {
			return nil, fmt.Errorf("literal %s may not contain NUL or a bare $", volume.Quote(t.literal))
		}
	}
	return toks, nil
}

func parseVariable(v string) (token, error) {
	switch v {
	case "pvc.metadata.namespace":
		return token{variable: varNamespace}, nil
	case "pvc.metadata.name":
		return token{variable: varPVCName}, nil
	case "pv.metadata.name":
		return token{variable: varPVName}, nil
	}
	for prefix, kind := range map[string]varKind{"pvc.metadata.labels[": varLabel, "pvc.metadata.annotations[": varAnnotation} {
		rest, ok := strings.CutPrefix(v, prefix)
		if !ok {
			continue
		}
		key, ok := strings.CutSuffix(rest, "]")
		if !ok || len(key) < 3 || (key[0] != '\'' && key[0] != '"') || key[len(key)-1] != key[0] {
			return token{}, fmt.Errorf("%s: want ${%s'key']}", volume.Quote("${"+v+"}"), prefix)
		}
		return token{variable: kind, key: key[1 : len(key)-1]}, nil
	}
	return token{}, fmt.Errorf("unknown variable %s; known: ${pvc.metadata.namespace}, ${pvc.metadata.name}, "+
		"${pv.metadata.name}, ${pvc.metadata.labels['key']}, ${pvc.metadata.annotations['key']}", volume.Quote("${"+v+"}"))
}

// expand renders the pattern for one claim. Every value is checked on its own before it is
// joined, so no claim's metadata can reach outside the base: a value holding a slash, NUL or
// control character, or a component that comes out empty, "." or "..", is refused rather than
// rewritten, and the claim's event says which. No component may start with volume.ReservedPrefix.
func (p *pattern) expand(v pathVars) (string, error) {
	comps := make([]string, 0, len(p.components))
	for _, toks := range p.components {
		var b strings.Builder
		for _, t := range toks {
			val, what, err := t.value(v)
			if err != nil {
				return "", err
			}
			if t.variable != varNone {
				if err := checkValue(what, val); err != nil {
					return "", err
				}
			}
			b.WriteString(val)
		}
		comp := b.String()
		switch comp {
		case "", ".", "..":
			return "", fmt.Errorf("pathPattern component expands to %s, which is not a directory name", volume.Quote(comp))
		}
		if strings.HasPrefix(comp, volume.ReservedPrefix) {
			return "", fmt.Errorf("pathPattern component %s %w (volume records, volumes being made, and %s, which holds deleted volumes)",
				volume.Quote(comp), volume.ErrReservedName, export.TrashDir)
		}
		if len(comp) > volume.MaxComponentLength {
			return "", fmt.Errorf("pathPattern component expands to %d bytes, more than the %d a directory name may have",
				len(comp), volume.MaxComponentLength)
		}
		comps = append(comps, comp)
	}
	return volume.CleanRelPath(strings.Join(comps, "/"))
}

func (t token) value(v pathVars) (val, what string, err error) {
	switch t.variable {
	case varNone:
		return t.literal, "", nil
	case varNamespace:
		return v.namespace, "namespace", nil
	case varPVCName:
		return v.pvcName, "claim name", nil
	case varPVName:
		return v.pvName, "PV name", nil
	case varLabel:
		val, ok := v.labels[t.key]
		if !ok {
			return "", "", fmt.Errorf("pathPattern uses label %s, which the claim does not have", volume.Quote(t.key))
		}
		return val, "label " + volume.Quote(t.key), nil
	case varAnnotation:
		val, ok := v.annotations[t.key]
		if !ok {
			return "", "", fmt.Errorf("pathPattern uses annotation %s, which the claim does not have", volume.Quote(t.key))
		}
		return val, "annotation " + volume.Quote(t.key), nil
	}
	return "", "", fmt.Errorf("unknown variable kind %d", t.variable)
}

func checkValue(what, val string) error {
	for _, r := range val {
		if r == '/' || r == 0 || unicode.IsControl(r) || r == unicode.ReplacementChar {
			return fmt.Errorf("%s value %s contains %q, which may not appear in a directory name", what, volume.Quote(val), r)
		}
	}
	return nil
}
