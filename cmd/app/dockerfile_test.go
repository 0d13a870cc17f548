package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// Docker is not on the machines this is developed and tested on; what can
// be checked without it is: the Dockerfile is multi-stage, runs as a
// non-root user, builds a static binary, and its build command (flags and
// package) compiles here exactly as written.
func TestDockerfileBuildsWhatCIBuilds(t *testing.T) {
	raw, err := os.ReadFile("../../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	df := string(raw)
	if n := len(regexp.MustCompile(`(?m)^FROM `).FindAllString(df, -1)); n != 2 {
		t.Errorf("%d FROM lines; want a build stage and a runtime stage", n)
	}
	if !regexp.MustCompile(`(?m)^USER nonroot`).MatchString(df) {
		t.Error("the image does not run as a non-root user")
	}
	build := regexp.MustCompile(`(?m)^RUN (CGO_ENABLED=0 go build [^\n]*)$`).FindStringSubmatch(df)
	if build == nil {
		t.Fatal("no static (CGO_ENABLED=0) go build line")
	}
	out := filepath.Join(t.TempDir(), "app")
	line := strings.Replace(build[1], "/out/app", out, 1)
	cmd := exec.Command("sh", "-c", line) // as the image's shell runs it, from the repository's root
	cmd.Dir = "../.."
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", line, err, b)
	}
	if b, err := exec.Command(out, "--help").CombinedOutput(); err != nil || !strings.Contains(string(b), "Usage: app") {
		t.Fatalf("the built binary: %v\n%s", err, b)
	}
	if b, err := exec.Command("go", "version", "-m", out).Output(); err != nil || !strings.Contains(string(b), "CGO_ENABLED=0") || !strings.Contains(string(b), "-trimpath=true") {
		t.Fatalf("the binary is not static and trimmed: %v\n%s", err, b)
	}
}
