#!/usr/bin/env bash
# A throwaway PostgreSQL cluster in the repository's .dev folder, from the
# Debian package (installed with apt-get where it is missing), on 127.0.0.1.
#
#   dev/postgres.sh start   initdb once, start, wait, create the database, print its URL
#   dev/postgres.sh stop    stop the cluster this script started
#   dev/postgres.sh restart restart it (fast shutdown: every connection is cut)
#   dev/postgres.sh kill    kill -9 the postmaster and every backend: a crash,
#                           without the shutdown checkpoint; start recovers
#   dev/postgres.sh status
#
# Settings: ONCE_PG_PORT (15432), ONCE_DEV_DIR (.dev in the repository).
# ONCE_PG_DURABLE=1 runs a second, durable cluster instead (.dev/pg-durable,
# port 15433, fsync and full_page_writes on as every production database
# has them), for benchmarks: the test cluster runs with fsync=off.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dev_dir=${ONCE_DEV_DIR:-$root/.dev}
if [[ -n ${ONCE_PG_DURABLE:-} ]]; then
	port=${ONCE_PG_PORT:-15433}
	pgdir=$dev_dir/pg-durable
	speed_opts=""
else
	port=${ONCE_PG_PORT:-15432}
	pgdir=$dev_dir/pg
	speed_opts="-c fsync=off -c full_page_writes=off"
fi
data=$pgdir/data
db=once
url="postgres://once@127.0.0.1:$port/$db?sslmode=disable"

log() { echo "postgres: $*" >&2; }

bindir() {
	local d
	d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
	if [[ -z $d ]]; then
		log "PostgreSQL is not installed; installing the Debian package"
		export DEBIAN_FRONTEND=noninteractive
		apt-get update -qq >&2 && apt-get install -y -qq postgresql >&2
		d=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
	fi
	echo "$d"
}

# initdb and postgres refuse to run as root; run them as the postgres user then.
as_owner() {
	if [[ $(id -u) == 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi
}

running_pid() {
	local pidfile=$data/postmaster.pid pid
	[[ -f $pidfile ]] || return 1
	pid=$(head -1 "$pidfile")
	if kill -0 "$pid" 2>/dev/null && grep -q postgres "/proc/$pid/cmdline" 2>/dev/null; then
		echo "$pid"
		return 0
	fi
	log "removing stale postmaster.pid (process $pid is gone)"
	rm -f "$pidfile"
	return 1
}

start() {
	local bin
	bin=$(bindir)
	mkdir -p "$pgdir"
	if [[ $(id -u) == 0 ]]; then
		chown postgres: "$pgdir"
		# The postgres user must be able to reach the folder through its parents.
		local d=$pgdir
		while [[ $d != / ]]; do d=$(dirname "$d"); chmod o+x "$d" 2>/dev/null || true; done
	fi
	if [[ ! -f $data/PG_VERSION ]]; then
		as_owner "$bin/initdb" -D "$data" -U once --auth=trust -E UTF8 --no-locale >/dev/null
	fi
	if pid=$(running_pid); then
		log "reusing running cluster (pid $pid)"
	else
		if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
			log "port $port is taken by a process this script did not start; set ONCE_PG_PORT"
			exit 1
		fi
		as_owner "$bin/pg_ctl" -D "$data" -l "$pgdir/postgres.log" -w -t 60 start \
			-o "-c listen_addresses=127.0.0.1 -p $port -k $pgdir -c max_connections=200 $speed_opts" >/dev/null
		log "started on 127.0.0.1:$port"
	fi
	if ! as_owner "$bin/psql" -h 127.0.0.1 -p "$port" -U once -d postgres -tAc "select 1 from pg_database where datname='$db'" | grep -q 1; then
		as_owner "$bin/createdb" -h 127.0.0.1 -p "$port" -U once "$db"
	fi
	echo "$url"
}

stop() {
	local bin
	if ! running_pid >/dev/null; then log "not running"; return; fi
	bin=$(bindir)
	as_owner "$bin/pg_ctl" -D "$data" -m fast -w stop >/dev/null
	log "stopped"
}

# kill is a crash: no checkpoint, no WAL flushed on the way down. Commits that
# returned are in the WAL (synchronous_commit is on; fsync is off, which only
# matters when the machine itself goes down), and recovery replays them.
kill_cluster() {
	local pid
	pid=$(running_pid) || { log "not running"; exit 1; }
	pkill -9 -P "$pid" 2>/dev/null || true
	kill -9 "$pid"
	for _ in $(seq 1 50); do
		kill -0 "$pid" 2>/dev/null || break
		sleep 0.1
	done
	log "killed (pid $pid and its backends)"
}

restart() {
	local bin
	bin=$(bindir)
	running_pid >/dev/null || { log "not running"; exit 1; }
	as_owner "$bin/pg_ctl" -D "$data" -l "$pgdir/postgres.log" -m fast -w restart >/dev/null
	log "restarted"
}

case ${1:-} in
start) start ;;
restart) restart ;;
kill) kill_cluster ;;
stop) stop ;;
status) if pid=$(running_pid); then echo "running (pid $pid) at $url"; else echo "not running"; exit 1; fi ;;
*) echo "usage: $0 start|stop|restart|kill|status" >&2; exit 2 ;;
esac
