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
