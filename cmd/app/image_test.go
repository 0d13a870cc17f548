package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/shopspring/decimal"

	"github.com/once-dev/once/internal/reftest"
	"github.com/once-dev/once/internal/testenv"
	"github.com/once-dev/once/orderevents"
)

// The image dev/image.sh builds (the Dockerfile's runtime stage on scratch
// around dev/build-app.sh's binary) runs the reference service against the
// test Kafka and PostgreSQL the way the script runs it (podman, runc, the
// host's network, explicit ulimits): it answers /readyz, consumes the
// order-confirmed events published to it, runs as nonroot with the limits
// it was given, and a SIGTERM stops it within the drain timeout, exit 0.
func TestTheImageRuns(t *testing.T) {
	brokers := testenv.Brokers(t)
	pool := reftest.Postgres(t)
	testenv.Podman(t)
	script := filepath.Join(testenv.RepoRoot(), "dev", "image.sh")
	id := uuid.NewString()[:8]
	image, container := "once-app:test-"+id, "once-app-test-"+id
	const nofile, nproc, drain = 4096, 2048, 10 * time.Second
	env := append(os.Environ(), "ONCE_IMAGE="+image, "ONCE_IMAGE_CONTAINER="+container,
		fmt.Sprintf("ONCE_IMAGE_NOFILE=%d", nofile), fmt.Sprintf("ONCE_IMAGE_NPROC=%d", nproc))
	podman := func(args ...string) (string, error) {
		cmd := exec.Command(script, append([]string{"podman"}, args...)...)
		cmd.Env = env
		out, err := cmd.CombinedOutput()
		return strings.TrimSpace(string(out)), err
	}

	start := time.Now()
	build := exec.Command(script, "build")
	build.Env = env
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("dev/image.sh build: %v\n%s", err, out)
	}
	t.Cleanup(func() {
		if out, err := podman("rmi", "--force", image); err != nil {
			t.Logf("removing %s: %v: %s", image, err, out)
		}
	})
	size, _ := podman("image", "inspect", "--format", "{{.Size}}", image)
	t.Logf("dev/image.sh build: %s in %s (binary and image)", size+" bytes", time.Since(start).Round(100*time.Millisecond))

	addr := testenv.FreeAddr(t)
	suffix := ".img-" + id
	var logs testenv.Logs
	run := exec.Command(script, "run", "serve", "--topic-suffix", suffix, "--group-suffix", suffix, "--groups", "analytics", "--partitions", "2",
		"--ops-listen", addr, "--watch-interval", "1s", "--maintenance-interval", "0", "--session-timeout", "6s",
		"--drain-timeout", drain.String(), "--log-format", "json")
	run.Env, run.Stdout, run.Stderr = env, &logs, &logs
	if err := run.Start(); err != nil {
		t.Fatal(err)
	}
	var runErr error
	exited := make(chan struct{})
	go func() { runErr = run.Wait(); close(exited) }()
	t.Cleanup(func() {
		// The container is conmon's, not the podman client's: remove it by name.
		_, _ = podman("rm", "--force", "--time", "0", container)
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			_ = run.Process.Kill()
		}
	})
	up := func() bool {
		select {
		case <-exited:
			t.Fatalf("the container exited before it was ready: %v\n%s", runErr, logs.String())
		default:
		}
		return true
	}
	testenv.Eventually(t, 90*time.Second, "/readyz from the container", func() bool {
		code, _ := get("http://" + addr + "/readyz")
		return up() && code == 200
	})

	// What runs is the image's binary, as nonroot, with the script's limits.
	pid, err := podman("inspect", "--format", "{{.State.Pid}}", container)
	if err != nil || pid == "0" || pid == "" {
		t.Fatalf("the container's pid: %q %v", pid, err)
	}
	status, err := os.ReadFile("/proc/" + pid + "/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"Uid:\t65532\t65532\t65532\t65532\n", "Gid:\t65532\t65532\t65532\t65532\n"} {
		if !strings.Contains(string(status), want) {
			t.Errorf("the app does not run as nonroot (65532); want %q in\n%s", want, status)
		}
	}
	limits, err := os.ReadFile("/proc/" + pid + "/limits")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{fmt.Sprintf("Max open files            %-20d %-20d files", nofile, nofile), fmt.Sprintf("Max processes             %-20d %-20d processes", nproc, nproc)} {
		if !strings.Contains(string(limits), want) {
			t.Errorf("the container's limits lack %q:\n%s", want, limits)
		}
	}
	checkImageBinary(t, "/proc/"+pid+"/exe")
	if fi, err := os.Stat("/proc/" + pid + "/root/etc/ssl/certs/ca-certificates.crt"); err != nil || fi.Size() == 0 {
		t.Errorf("the image has no CA certificates: %v", err)
	}

	// It consumes.
	producer := testenv.Producer(t, brokers)
	const events = 20
	ids := make([]string, 0, events)
	for i := range events {
		ev, err := orderevents.NewConfirmed(uuid.Must(uuid.NewV7()), time.Now(), int64(i+1), 910_000_000+int64(i), decimal.New(int64(100+i), -2))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := ev.MarshalJSON()
		testenv.Publish(t, producer, "order.confirmed.v1"+suffix, fmt.Sprint(ev.OrderID()), b)
		ids = append(ids, ev.EventID().String())
	}
	testenv.Eventually(t, 60*time.Second, "analytics in the container claims every event", func() bool {
		var n int
		_ = pool.QueryRow(context.Background(), `SELECT count(*) FROM processed_event WHERE consumer_group = $1 AND event_id = ANY($2::uuid[])`,
			"analytics"+suffix, ids).Scan(&n)
		return up() && n == events
	})

	// SIGTERM: the drain, then exit 0, within the drain timeout.
	stopping := time.Now()
	if out, err := podman("kill", "--signal", "TERM", container); err != nil {
		t.Fatalf("podman kill --signal TERM: %v: %s", err, out)
	}
	select {
	case <-exited:
		took := time.Since(stopping)
		var exit *exec.ExitError
		if errors.As(runErr, &exit) {
			t.Fatalf("the container exited %d after SIGTERM, want 0\n%s", exit.ExitCode(), logs.String())
		} else if runErr != nil {
			t.Fatal(runErr)
		}
		if took > drain {
			t.Errorf("the container took %s to stop after SIGTERM, more than the drain timeout %s", took, drain)
		}
		if !strings.Contains(logs.String(), `"msg":"stopped"`) {
			t.Errorf("no clean stop in the app's log:\n%s", logs.String())
		}
		t.Logf("stopped %s after SIGTERM (drain timeout %s), exit 0; %s in all", took.Round(10*time.Millisecond), drain, time.Since(start).Round(100*time.Millisecond))
	case <-time.After(drain + 20*time.Second):
		t.Fatalf("the container did not stop within %s of SIGTERM\n%s", drain+20*time.Second, logs.String())
	}
	if out, err := podman("container", "exists", container); err == nil {
		t.Errorf("the container is still there after it stopped (run --rm): %s", out)
	}
}
