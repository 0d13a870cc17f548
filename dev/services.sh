#!/usr/bin/env bash
# Sourced by dev/test.sh, dev/run.sh and .ci/run: makes KAFKA_BROKERS and
# DATABASE_URL point at working services. Where a variable is already set, that
# service is used as it is and nothing is started for it.
#
# Ownership: a service this shell starts is stopped by stop_services. One that
# was already running is used and left alone, unless the run that started it
# is gone (killed before its cleanup): then it is adopted and stopped here, so
# an interrupted run leaves nothing behind after the next one.

ONCE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ONCE_DEV=${ONCE_DEV_DIR:-$ONCE_ROOT/.dev}
ONCE_STARTED=""

# _alive: the process exists and is not a zombie (a killed run may linger as
# one where nothing reaps it, and kill -0 succeeds on zombies).
_alive() { [[ -r /proc/$1/stat ]] && [[ $(cut -d' ' -f3 "/proc/$1/stat") != Z ]]; }

_own() { # service
	local s=$1 owner=$ONCE_DEV/$1.owner prev
	mkdir -p "$ONCE_DEV"
	if "$ONCE_ROOT/dev/$s.sh" status >/dev/null 2>&1; then
		prev=$(cat "$owner" 2>/dev/null || true)
		if [[ -z $prev ]] || _alive "$prev"; then
			return # started by hand, or by a run still going: not ours to stop
		fi
		echo "$s: adopting the instance left by interrupted run $prev" >&2
	fi
	echo $$ >"$owner"
	ONCE_STARTED+=" $s"
}

start_services() {
	if [[ -z ${KAFKA_BROKERS:-} ]]; then
		_own kafka
		KAFKA_BROKERS=$("$ONCE_ROOT/dev/kafka.sh" start) || return 1
	fi
	if [[ -z ${DATABASE_URL:-} ]]; then
		_own postgres
		DATABASE_URL=$("$ONCE_ROOT/dev/postgres.sh" start) || return 1
		# PgBouncer in transaction pooling in front of it, for the tests
		# that run every statement behind a pooler. With a DATABASE_URL of
		# your own, set ONCE_PGBOUNCER_URL to a pooler in front of it.
		if [[ -z ${ONCE_PGBOUNCER_URL:-} ]]; then
			_own pgbouncer
			ONCE_PGBOUNCER_URL=$("$ONCE_ROOT/dev/pgbouncer.sh" start) || return 1
		fi
	fi
	export KAFKA_BROKERS DATABASE_URL
	[[ -n ${ONCE_PGBOUNCER_URL:-} ]] && export ONCE_PGBOUNCER_URL
	echo "using KAFKA_BROKERS=$KAFKA_BROKERS DATABASE_URL=$DATABASE_URL ONCE_PGBOUNCER_URL=${ONCE_PGBOUNCER_URL:-}" >&2
}

stop_services() {
	local s
	# The pooler before the database it pools.
	for s in $(tr ' ' '\n' <<<"$ONCE_STARTED" | tac); do
		"$ONCE_ROOT/dev/$s.sh" stop || true
		rm -f "$ONCE_DEV/$s.owner"
	done
	ONCE_STARTED=""
}

# browser: the console's browser test drives a headless Chromium (Debian's
# package, installed with apt-get where it is missing).
browser() {
	command -v chromium >/dev/null && return
	echo "chromium is not installed; installing the Debian package (the console's browser test)" >&2
	DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >&2
}

# image_tools: the image test (cmd/app's TestTheImageRuns) builds and runs
# the app's image with podman and runc (Debian's packages, which
# dev/image.sh installs where they are missing).
image_tools() {
	"$ONCE_ROOT/dev/image.sh" install
}

# seedpeer_python makes the style guide's Python venv (pydantic, aiokafka,
# from PyPI, once) and exports ONCE_SEEDPEER_DIR and ONCE_SEEDPEER_PYTHON for
# the cross-language tests and the benchmark's peer: dev/seedpeer's scripts
# (see its README), or the style guide's own when the checkout sits beside
# them, whose differences from dev/seedpeer are reported (comments aside).
seedpeer_python() {
	local dir=$ONCE_ROOT/dev/seedpeer shared=$ONCE_ROOT/../shared/bench/seedpeer f
	if [[ -f $shared/produce.py ]]; then
		for f in produce.py consume.py setup.sh; do
			cmp -s <(grep -v '^#' "$shared/$f") <(grep -v '^#' "$dir/$f") || echo "seedpeer: $shared/$f differs from dev/seedpeer/$f; using the former" >&2
		done
		dir=$shared
	fi
	mkdir -p "$ONCE_DEV"
	ONCE_SEEDPEER_PYTHON=$("$dir/setup.sh" "$ONCE_DEV/seedpeer-venv") || return 1
	ONCE_SEEDPEER_DIR=$dir
	export ONCE_SEEDPEER_DIR ONCE_SEEDPEER_PYTHON
}
