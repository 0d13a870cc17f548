package testenv

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// Podman makes sure podman and runc are here to build and run the app's
// image (dev/image.sh; Debian's packages, which dev/image.sh install,
// dev/test.sh and .ci/run install). Without them a test skips, saying what
// is missing; under ONCE_REQUIRE_SERVICES it fails instead.
func Podman(t testing.TB) {
	t.Helper()
	var missing []string
	if _, err := exec.LookPath("podman"); err != nil {
		missing = append(missing, "podman")
	}
	if _, err := exec.LookPath("runc"); err != nil {
		if _, err := os.Stat("/usr/sbin/runc"); err != nil { // off a non-root PATH
			missing = append(missing, "runc")
		}
	}
	if len(missing) == 0 {
		return
	}
	if os.Getenv("ONCE_REQUIRE_SERVICES") != "" {
		t.Fatalf("%s not installed, but ONCE_REQUIRE_SERVICES is set: the image test needs them (dev/image.sh install; dev/test.sh and .ci/run install them)", strings.Join(missing, " and "))
	}
	t.Skipf("%s not installed: dev/image.sh install (apt-get install -y --no-install-recommends podman runc) to build and run the app's image", strings.Join(missing, " and "))
}
