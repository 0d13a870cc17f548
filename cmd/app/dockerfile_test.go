package main

import (
	"bytes"
	"crypto/sha256"
	"debug/elf"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// Docker is not on the machines this is developed and tested on, and the
// Dockerfile's base images cannot be pulled there; what can be checked
// without them is: the Dockerfile is multi-stage and runs as a non-root
// user; its build line, run here as written, makes a static, trimmed,
// stripped binary; dev/image.sh (the image built and run here, see
// TestTheImageRuns) builds the very same bytes; and the two runtime stages
// configure the image alike (user, port, environment, entry point).
func TestDockerfileBuildsWhatCIBuilds(t *testing.T) {
	raw, err := os.ReadFile("../../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	df := string(raw)
	if n := len(regexp.MustCompile(`(?m)^FROM `).FindAllString(df, -1)); n != 2 {
		t.Errorf("%d FROM lines; want a build stage and a runtime stage", n)
	}
	// By number: Kubernetes' runAsNonRoot refuses an image whose user is a
	// name, which it cannot check.
	if user := regexp.MustCompile(`(?m)^USER ([0-9]+):[0-9]+$`).FindStringSubmatch(df); user == nil || user[1] == "0" {
		t.Error("the image does not run as a non-root user given by number (USER uid:gid)")
	}
	build := regexp.MustCompile(`(?m)^RUN ([^\n]* /out/app(?: [^\n]*)?)$`).FindStringSubmatch(df)
	if build == nil {
		t.Fatal("no RUN line building /out/app")
	}
	dir := t.TempDir()
	dockerBin := filepath.Join(dir, "app")
	line := strings.Replace(build[1], "/out/app", dockerBin, 1)
	cmd := exec.Command("sh", "-c", line) // as the image's shell runs it, from the repository's root
	cmd.Dir = "../.."
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", line, err, b)
	}
	if b, err := exec.Command(dockerBin, "--help").CombinedOutput(); err != nil || !strings.Contains(string(b), "Usage: app") {
		t.Fatalf("the built binary: %v\n%s", err, b)
	}
	checkImageBinary(t, dockerBin)

	// dev/image.sh's build context: its binary is the Dockerfile's, byte
	// for byte (Go builds reproducibly: one toolchain, one source, one set
	// of flags give one binary).
	ctx := filepath.Join(dir, "context")
	script := exec.Command("../../dev/image.sh", "context", ctx)
	if b, err := script.CombinedOutput(); err != nil {
		t.Fatalf("dev/image.sh context: %v\n%s", err, b)
	}
	if a, b := fileHash(t, dockerBin), fileHash(t, filepath.Join(ctx, "app")); a != b {
		t.Errorf("dev/image.sh builds another binary than the Dockerfile (sha256 %x, Dockerfile's %x): build settings\n%s\nDockerfile's\n%s",
			b, a, buildSettings(t, filepath.Join(ctx, "app")), buildSettings(t, dockerBin))
	}
	for _, f := range []string{"etc/passwd", "etc/group", "etc/ssl/certs/ca-certificates.crt", "Containerfile"} {
		if fi, err := os.Stat(filepath.Join(ctx, f)); err != nil || fi.Size() == 0 {
			t.Errorf("dev/image.sh context lacks %s: %v", f, err)
		}
	}
	if passwd, _ := os.ReadFile(filepath.Join(ctx, "etc/passwd")); !bytes.Contains(passwd, []byte("\nnonroot:x:65532:65532:")) || !strings.Contains(df, "\nUSER 65532:65532\n") {
		t.Errorf("the image's user is not /etc/passwd's nonroot (65532), as distroless has it:\n%s", passwd)
	}

	// The runtime stages: from the last FROM on, everything but the COPY
	// lines (what differs: distroless gives certificates and users, scratch
	// gets them copied in) and comments is the same, in the same order.
	cf, err := os.ReadFile("../../dev/image/Containerfile")
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`(?m)^FROM scratch$`).Match(cf) {
		t.Error("dev/image/Containerfile is not FROM scratch: no base image can be pulled here")
	}
	if d, c := runtimeConfig(df), runtimeConfig(string(cf)); !slices.Equal(d, c) || len(d) == 0 {
		t.Errorf("the runtime stages differ:\nDockerfile:    %q\nContainerfile: %q", d, c)
	}
	for name, text := range map[string]string{"Dockerfile": df, "dev/image/Containerfile": string(cf)} {
		if !regexp.MustCompile(`(?m)^COPY [^\n]* /app$`).MatchString(text) {
			t.Errorf("%s does not put the binary at /app", name)
		}
	}
}

// checkImageBinary fails t unless path is the app as the images ship it:
// static (CGO_ENABLED=0: no ELF interpreter, which scratch and distroless
// lack), built with -trimpath, and stripped (-ldflags="-s -w": no symbol
// table, no DWARF). Go leaves the ldflags out of a -trimpath binary's build
// info, so the ELF sections say that part.
func checkImageBinary(t *testing.T, path string) {
	t.Helper()
	settings := buildSettings(t, path)
	for _, want := range []string{"CGO_ENABLED=0", "-trimpath=true"} {
		if !slices.Contains(settings, want) {
			t.Errorf("%s was not built with %s: %q", path, want, settings)
		}
	}
	f, err := elf.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Errorf("%s is dynamically linked (it names an ELF interpreter)", path)
		}
	}
	for _, s := range f.Sections {
		if s.Name == ".symtab" || strings.HasPrefix(s.Name, ".debug_") || strings.HasPrefix(s.Name, ".zdebug_") {
			t.Errorf("%s keeps section %s: not built with -ldflags=\"-s -w\"", path, s.Name)
		}
	}
}

// buildSettings are the "build" lines of go version -m: flags, CGO_ENABLED,
// GOOS, GOARCH, and the VCS stamp.
func buildSettings(t *testing.T, path string) []string {
	t.Helper()
	out, err := exec.Command("go", "version", "-m", path).Output()
	if err != nil {
		t.Fatalf("go version -m %s: %v", path, err)
	}
	var settings []string
	for _, l := range strings.Split(string(out), "\n") {
		if f := strings.SplitN(strings.TrimSpace(l), "\t", 2); len(f) == 2 && f[0] == "build" {
			settings = append(settings, f[1])
		}
	}
	return settings
}

func fileHash(t *testing.T, path string) [32]byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return sha256.Sum256(b)
}

// runtimeConfig is a Dockerfile's last stage without its FROM, COPY lines
// and comments.
func runtimeConfig(df string) []string {
	stage := df[strings.LastIndex(df, "\nFROM ")+1:]
	var out []string
	for _, l := range strings.Split(stage, "\n")[1:] {
		l = strings.TrimSpace(l)
		if l == "" || strings.HasPrefix(l, "#") || strings.HasPrefix(l, "COPY ") {
			continue
		}
		out = append(out, l)
	}
	return out
}
