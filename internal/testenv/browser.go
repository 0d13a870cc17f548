package testenv

import (
	"os"
	"os/exec"
	"testing"
)

// Chromium returns the path of a headless-capable Chromium (the Debian
// package chromium, which .ci/run installs). Without one a test skips,
// saying how to get it; under ONCE_REQUIRE_SERVICES it fails instead.
func Chromium(t testing.TB) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if path, err := exec.LookPath(name); err == nil {
			return path
		}
	}
	if os.Getenv("ONCE_REQUIRE_SERVICES") != "" {
		t.Fatal("no chromium on PATH, but ONCE_REQUIRE_SERVICES is set: the browser tests need it (apt-get install -y chromium; .ci/run installs it)")
	}
	t.Skip("no chromium on PATH: apt-get install -y chromium to run the browser tests")
	return ""
}
