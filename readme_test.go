package once_test

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

var goBlock = regexp.MustCompile("(?s)```go\n(.*?)```")

// Every Go block of the README and of docs/ is a whole file that builds
// against this module as it is: a newcomer copies them. (review finding:
// the README's code did not compile as written.)
func TestTheDocsGoBlocksBuild(t *testing.T) {
	files, _ := filepath.Glob("docs/*.md")
	files = append([]string{"README.md"}, files...)
	dir := t.TempDir()
	overlay := map[string]string{}
	var pkgs, testPkgs []string
	for _, f := range files {
		allowed, known := knownOutside[f]
		if known && allowed == "" {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		last := "" // the package of the file's last non-test block
		for i, m := range goBlock.FindAllSubmatch(b, -1) {
			src := string(m[1])
			if !strings.HasPrefix(src, "package ") {
				t.Errorf("%s, Go block %d is not a whole file (it must start with its package clause):\n%s", f, i+1, src)
				continue
			}
			// A package of its own inside the module, seen only by this
			// build; a test block joins the block before it, which it tests.
			pkg := filepath.Join("internal", "docscheck", strings.NewReplacer("/", "_", ".", "_").Replace(f)+"_"+string(rune('a'+i)))
			name := "block.go"
			if strings.Contains(src, "\"testing\"") {
				if last == "" {
					t.Errorf("%s, Go block %d is a test with no block before it to test", f, i+1)
					continue
				}
				pkg, name = last, "block_test.go"
				testPkgs = append(testPkgs, "./"+pkg)
			} else {
				pkgs = append(pkgs, "./"+pkg)
				last = pkg
			}
			real := filepath.Join(dir, strings.ReplaceAll(pkg, "/", "_")+"_"+name)
			if err := os.WriteFile(real, m[1], 0o644); err != nil {
				t.Fatal(err)
			}
			abs, _ := filepath.Abs(filepath.Join(pkg, name))
			overlay[abs] = real
		}
	}
	if len(pkgs) == 0 || len(testPkgs) == 0 {
		t.Fatalf("%d Go blocks and %d test blocks found; want both", len(pkgs), len(testPkgs))
	}
	ov, _ := json.Marshal(map[string]any{"Replace": overlay})
	ovFile := filepath.Join(dir, "overlay.json")
	if err := os.WriteFile(ovFile, ov, 0o644); err != nil {
		t.Fatal(err)
	}
	build := exec.Command("go", append([]string{"build", "-o", os.DevNull, "-overlay", ovFile}, pkgs...)...)
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("the docs' Go blocks do not build: %v\n%s", err, out)
	}
	compile := exec.Command("go", append([]string{"test", "-c", "-vet=off", "-o", dir + "/", "-overlay", ovFile}, testPkgs...)...)
	if out, err := compile.CombinedOutput(); err != nil {
		t.Fatalf("the docs' test blocks do not compile: %v\n%s", err, out)
	}
	// And they pass, against the test database (oncetest skips without it).
	for _, tp := range testPkgs {
		bin := filepath.Join(dir, filepath.Base(tp)+".test")
		out, err := exec.Command(bin, "-test.count=1", "-test.v").CombinedOutput()
		switch {
		case err != nil:
			t.Fatalf("the docs' test block of %s fails: %v\n%s", tp, err, out)
		case os.Getenv("DATABASE_URL") != "" && !strings.Contains(string(out), "--- PASS"):
			t.Fatalf("the docs' test block of %s did not run:\n%s", tp, out)
		}
	}
	t.Logf("%d Go blocks build, %d test blocks compile and pass", len(pkgs), len(testPkgs))
}

// outside is a path into the folder beside the checkout that the project
// was written next to: a reader of the repository does not have it.
var outside = regexp.MustCompile(`\.\./shared\b`)

// knownOutside are the lines that may name it, by file: code that uses the
// style guide's own copy of the Python peer when it lies there, and falls
// back to the repository's (dev/seedpeer); no text sends a reader there.
// This file names it to look for it.
var knownOutside = map[string]string{
	"cmd/app/benchthroughput.go": `[]string{"../shared/bench/seedpeer", "dev/seedpeer"}`,
	"readme_test.go":             "",
}

var (
	fenced     = regexp.MustCompile("(?ms)^\\s*```.*?^\\s*```")
	codeSpan   = regexp.MustCompile("`[^`\n]*`")
	mdLink     = regexp.MustCompile(`\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)`)
	mdRefLink  = regexp.MustCompile(`(?m)^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)`)
	htmlLink   = regexp.MustCompile(`(?i)\b(?:href|src)="([^"]+)"`)
	goUpPath   = regexp.MustCompile(`(?:\.\./)+[\w.\-/]*`)
	urlPattern = regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9+.\-]*:`)
)

// repoFiles are the repository's files with one of exts: those git
// tracks, and new ones it does not ignore; without git, the tree's, less
// the dot folders (the development services' data).
func repoFiles(t *testing.T, exts ...string) []string {
	t.Helper()
	var all []string
	if out, err := exec.Command("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard").Output(); err == nil {
		all = strings.Split(strings.TrimRight(string(out), "\x00"), "\x00")
	} else if err := filepath.WalkDir(".", func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && p != "." && strings.HasPrefix(d.Name(), ".") {
			return filepath.SkipDir
		}
		if !d.IsDir() {
			all = append(all, p)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, f := range all {
		for _, ext := range exts {
			if strings.HasSuffix(f, ext) {
				if _, err := os.Stat(f); err == nil { // deleted, not yet staged
					out = append(out, filepath.ToSlash(f))
				}
				break
			}
		}
	}
	return out
}

// Issue 28, item 9: the README sent its reader to a specification in a
// folder beside the checkout, which a user of the repository does not
// have (docs/specification.md now). No Markdown
// or Go file names that folder, no relative link or path leaves the
// repository's root, and every relative link of the Markdown files reaches
// a file that is there.
func TestTheDocsStandAlone(t *testing.T) {
	files := repoFiles(t, ".md", ".go")
	var mds int
	for _, f := range files {
		allowed, known := knownOutside[f]
		if known && allowed == "" {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		text := string(b)
		for i, line := range strings.Split(text, "\n") {
			if outside.MatchString(line) && (!known || !strings.Contains(line, allowed)) {
				t.Errorf("%s:%d names a folder outside the repository: %s", f, i+1, strings.TrimSpace(line))
			}
		}
		dir := filepath.Dir(f)
		if strings.HasSuffix(f, ".go") {
			// A relative path in Go is the package's folder's (a test's
			// files, a comment's pointer to a doc).
			for _, p := range goUpPath.FindAllString(text, -1) {
				if leaves(dir, p) {
					t.Errorf("%s: path %q leaves the repository", f, p)
				}
			}
			continue
		}
		mds++
		prose := codeSpan.ReplaceAllString(fenced.ReplaceAllString(text, ""), "")
		var targets []string
		for _, re := range []*regexp.Regexp{mdLink, mdRefLink, htmlLink} {
			for _, m := range re.FindAllStringSubmatch(prose, -1) {
				targets = append(targets, m[1])
			}
		}
		for _, target := range targets {
			if urlPattern.MatchString(target) || strings.HasPrefix(target, "#") {
				continue
			}
			p, _, _ := strings.Cut(target, "#")
			p, _, _ = strings.Cut(p, "?")
			base := dir
			if strings.HasPrefix(p, "/") { // GitHub's: from the repository's root
				base, p = ".", strings.TrimLeft(p, "/")
			}
			if leaves(base, p) {
				t.Errorf("%s: link %q leaves the repository", f, target)
				continue
			}
			if _, err := os.Stat(filepath.Join(base, p)); err != nil {
				t.Errorf("%s: link %q points at nothing: %v", f, target, err)
			}
		}
	}
	if mds < 2 {
		t.Fatalf("%d Markdown files found; want the README and docs/", mds)
	}
}

// leaves reports whether p, relative to the folder dir of the
// repository, is outside the repository.
func leaves(dir, p string) bool {
	rel := filepath.Clean(filepath.Join(dir, filepath.FromSlash(p)))
	return rel == ".." || strings.HasPrefix(rel, ".."+string(filepath.Separator))
}
