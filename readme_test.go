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
	var pkgs []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, m := range goBlock.FindAllSubmatch(b, -1) {
			src := string(m[1])
			if !strings.HasPrefix(src, "package ") {
				t.Errorf("%s, Go block %d is not a whole file (it must start with its package clause):\n%s", f, i+1, src)
				continue
			}
			// A package of its own inside the module, seen only by this build.
			pkg := filepath.Join("internal", "docscheck", strings.NewReplacer("/", "_", ".", "_").Replace(f)+"_"+string(rune('a'+i)))
			real := filepath.Join(dir, filepath.Base(pkg)+".go")
			if err := os.WriteFile(real, m[1], 0o644); err != nil {
				t.Fatal(err)
			}
			abs, _ := filepath.Abs(filepath.Join(pkg, "block.go"))
			overlay[abs] = real
			pkgs = append(pkgs, "./"+pkg)
		}
	}
	if len(pkgs) == 0 {
		t.Fatal("no Go block found")
	}
	ov, _ := json.Marshal(map[string]any{"Replace": overlay})
	ovFile := filepath.Join(dir, "overlay.json")
	if err := os.WriteFile(ovFile, ov, 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("go", append([]string{"build", "-o", os.DevNull, "-overlay", ovFile}, pkgs...)...)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("the docs' Go blocks do not build: %v\n%s", err, out)
	}
	t.Logf("%d Go blocks build", len(pkgs))
}
