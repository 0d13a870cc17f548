#!/usr/bin/env bash
# The app's OCI image, built and run on this machine with Debian's podman and
# runc (installed with apt-get where they are missing): no Docker daemon, and
# no registry to pull a base image from, so the image is the Dockerfile's
# runtime stage on scratch (dev/image/Containerfile) around the binary
# dev/build-app.sh builds, the Dockerfile's own build.
#
#   dev/image.sh build            build the binary and the image $ONCE_IMAGE
#   dev/image.sh run [ARGS...]    run the image in the foreground; ARGS go to
#                                 the app (default: serve); SIGTERM or Ctrl-C
#                                 reach it (a drain, exit 0)
#   dev/image.sh context DIR      only assemble the build context in DIR: the
#                                 binary, CA certificates, passwd and group,
#                                 the Containerfile (for another builder)
#   dev/image.sh podman ARGS...   podman on this script's storage and
#                                 configuration: ps, images, logs, kill, stop ...
#   dev/image.sh install          install podman and runc where missing
#   dev/image.sh clean            remove the images, containers and storage
#
# run passes the app's environment into the container by name (values never
# appear on a command line): KAFKA_*, DATABASE_URL, PG*, PAYMENT_*,
# BILLING_*, ORDERS_*, OTEL_* and ONCE_* (not this script's or the dev
# services' own). A file such a variable names (*_FILE, KAFKA_TLS_CA,
# PGPASSFILE, PGSSL*) is mounted read-only at the same path; it must be
# readable by the image's user, nonroot (65532). The container uses the
# host's network (--network=host: 127.0.0.1 is this machine's), so
# ONCE_OPS_LISTEN defaults to 127.0.0.1:9464 here, not the image's 0.0.0.0.
#
# How podman runs here, and why: the runtime is runc (--runtime runc; crun
# is not needed), cgroups are managed by podman itself (cgroup_manager =
# "cgroupfs": these machines run no systemd), the container gets no default
# ulimits (podman's default raises nofile to 1048576, which runc may not set
# without CAP_SYS_RESOURCE: "error setting rlimit type 7: operation not
# permitted") but the explicit ones below, and storage is the vfs driver in
# $ONCE_DEV_DIR/podman (no mount to leave behind, works on any file system,
# overlayfs included; the image is some 35 MB), with podman's state (not
# /run/libpod, /var/lib/containers or /etc/cni). What stays outside, empty
# or nearly: runc's state directory /run/runc (podman's --runtime-flag
# root=... is not passed on to the cleanup of an exited container, which
# then leaves runc's state behind), the cgroup libpod_parent, and podman
# build's blob-info cache (/var/lib/containers/cache, 64 KB). Podman reads
# the package's /etc/containers (policy.json, registries.conf) as it is.
#
# Settings: ONCE_IMAGE (once-app:dev), ONCE_IMAGE_CONTAINER (the container's
# name; once-app-PID), ONCE_IMAGE_NOFILE (open files, 65536 or the hard limit
# if lower), ONCE_IMAGE_NPROC (processes of the user, 4096 or the hard limit
# if lower), ONCE_IMAGE_STOP_TIMEOUT (seconds podman stop waits before
# SIGKILL, 45: longer than the default drain of 30 s), ONCE_DEV_DIR (.dev in
# the repository).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dev_dir=${ONCE_DEV_DIR:-$root/.dev}
store=$dev_dir/podman
image=${ONCE_IMAGE:-once-app:dev}

log() { echo "image: $*" >&2; }
die() {
	log "$*"
	exit 1
}

usage() {
	sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
}

have_tools() {
	command -v podman >/dev/null && { command -v runc >/dev/null || [[ -x /usr/sbin/runc ]]; }
}

install_tools() {
	have_tools && return
	log "podman or runc is not installed; installing Debian's packages (podman runc)"
	command -v apt-get >/dev/null || die "no apt-get here: install podman and runc with this system's package manager"
	[[ $(id -u) == 0 ]] || die "installing podman and runc needs root: apt-get install -y --no-install-recommends podman runc"
	export DEBIAN_FRONTEND=noninteractive
	# Without recommends: no crun, slirp4netns, fuse-overlayfs or uidmap,
	# which a root podman with --network=host and vfs storage does not use.
	apt-get update -qq >&2 && apt-get install -y -qq --no-install-recommends podman runc >&2
}

need_tools() {
	have_tools || die "podman or runc is not installed: run dev/image.sh install (apt-get install -y --no-install-recommends podman runc)"
}

# configure writes podman's configuration and storage settings under
# $store and points podman at them through the environment.
configure() {
	mkdir -p "$store/tmp" "$store/networks"
	cat >"$store/containers.conf" <<-EOF
		# Written by dev/image.sh; see its header for why each is set.
		[containers]
		default_ulimits = []
		[engine]
		cgroup_manager = "cgroupfs"
		runtime = "runc"
		events_logger = "file"
		tmp_dir = "$store/tmp"
		[network]
		network_config_dir = "$store/networks"
	EOF
	cat >"$store/storage.conf" <<-EOF
		# Written by dev/image.sh.
		[storage]
		driver = "vfs"
		graphroot = "$store/storage"
		runroot = "$store/run"
	EOF
	export CONTAINERS_CONF=$store/containers.conf CONTAINERS_STORAGE_CONF=$store/storage.conf
}

podman_() {
	need_tools
	configure
	podman "$@"
}

# context DIR: what the Containerfile copies, in DIR.
context() {
	local dir=$1 certs=/etc/ssl/certs/ca-certificates.crt
	[[ -r $certs ]] || die "$certs is missing: apt-get install -y ca-certificates (the image's CA certificates)"
	mkdir -p "$dir/etc/ssl/certs"
	cp "$root/dev/image/Containerfile" "$dir/Containerfile"
	cp "$root/dev/image/etc/passwd" "$root/dev/image/etc/group" "$dir/etc/"
	cp "$certs" "$dir/etc/ssl/certs/ca-certificates.crt"
	log "building the binary (dev/build-app.sh)"
	"$root/dev/build-app.sh" "$dir/app"
}

build() {
	need_tools
	configure
	build_ctx=$(mktemp -d "$store/context.XXXXXX")
	trap 'rm -rf "$build_ctx"' EXIT
	context "$build_ctx"
	log "building the image $image"
	# --layers=false: no intermediate images to pile up in the storage.
	podman build --quiet --layers=false -f "$build_ctx/Containerfile" -t "$image" "$build_ctx" >/dev/null
	# The image this tag named before is unnamed now: remove it.
	podman image prune -f >/dev/null
	log "$image: $(podman image inspect --format '{{.Size}}' "$image" | awk '{printf "%.1f MB", $1/1e6}') ($store)"
}

# limit NAME DEFAULT HARD: the ulimit to set, at most the hard limit this
# shell has unless it may raise it (CAP_SYS_RESOURCE).
limit() {
	local name=$1 want=$2 hard=$3 set=${!1:-}
	[[ $hard == unlimited ]] && hard=$((1 << 62))
	if [[ -z $set ]]; then
		((want <= hard)) && echo "$want" || echo "$hard"
		return
	fi
	[[ $set =~ ^[0-9]+$ ]] || die "$name=$set: want a number"
	if ((set > hard)) && ! may_raise_limits; then
		die "$name=$set is above this shell's hard limit $hard, which runc cannot raise without CAP_SYS_RESOURCE; set it to $hard or less"
	fi
	echo "$set"
}

may_raise_limits() {
	local eff
	eff=$(awk '/^CapEff:/ {print $2}' /proc/self/status 2>/dev/null) || return 1
	(((16#$eff >> 24) & 1)) # CAP_SYS_RESOURCE is capability 24
}

run() {
	need_tools
	configure
	podman image exists "$image" || die "no image $image in $store: run dev/image.sh build first"
	local nofile nproc name=${ONCE_IMAGE_CONTAINER:-once-app-$$} v val
	nofile=$(limit ONCE_IMAGE_NOFILE 65536 "$(ulimit -Hn)")
	nproc=$(limit ONCE_IMAGE_NPROC 4096 "$(ulimit -Hu)")
	local args=(--rm --name "$name" --network=host --runtime runc
		--ulimit "nofile=$nofile:$nofile" --ulimit "nproc=$nproc:$nproc"
		--stop-timeout "${ONCE_IMAGE_STOP_TIMEOUT:-45}"
		--env "ONCE_OPS_LISTEN=${ONCE_OPS_LISTEN:-127.0.0.1:9464}")
	for v in $(compgen -e); do
		case $v in
		ONCE_DEV_DIR | ONCE_REQUIRE_SERVICES | ONCE_EXTERNAL_SERVICES | ONCE_IMAGE* | ONCE_SEEDPEER_* | ONCE_E2E_* | ONCE_*_PORT | ONCE_OPS_LISTEN) continue ;;
		ONCE_* | KAFKA_* | DATABASE_URL | PG* | PAYMENT_* | BILLING_* | ORDERS_* | OTEL_*) ;;
		*) continue ;;
		esac
		val=${!v}
		case $v in
		*_FILE | KAFKA_TLS_CA | PGPASSFILE | PGSSLCERT | PGSSLKEY | PGSSLROOTCERT)
			if [[ -n $val ]]; then
				[[ -f $val ]] || die "$v=$val: no such file"
				val=$(realpath "$val")
				args+=(--volume "$val:$val:ro" --env "$v=$val")
				continue
			fi
			;;
		esac
		args+=(--env "$v")
	done
	log "running $image as $name (nofile $nofile, nproc $nproc, host network)"
	# exec: a signal to this script is podman's, which passes it on to the app.
	exec podman run "${args[@]}" "$image" "$@"
}

clean() {
	if [[ ! -d $store ]]; then
		return
	fi
	if have_tools; then
		configure
		podman rm --all --force >/dev/null 2>&1 || true
		podman rmi --all --force >/dev/null 2>&1 || true
	fi
	rm -rf "$store"
	log "removed $store"
}

cmd=${1:-}
[[ $# -gt 0 ]] && shift
case $cmd in
build) build ;;
run) run "$@" ;;
context)
	[[ $# == 1 && -n $1 ]] || die "usage: dev/image.sh context DIR"
	context "$1"
	;;
podman) podman_ "$@" ;;
install) install_tools ;;
clean) clean ;;
-h | --help | help) usage ;;
"") usage >&2 && exit 2 ;;
*)
	log "unknown command $cmd"
	usage >&2
	exit 2
	;;
esac
