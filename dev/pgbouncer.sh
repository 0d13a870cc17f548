#!/usr/bin/env bash
# PgBouncer in transaction pooling in front of the test PostgreSQL
# (dev/postgres.sh), from the Debian package (installed with apt-get where it
# is missing), on 127.0.0.1: the way PostgreSQL is reached at scale, and how
# managed poolers (RDS Proxy, Supabase's, Neon's, Cloud SQL's) behave: a
# server connection belongs to a client for one transaction only, and named
# prepared statements and session settings do not follow the client.
#
#   dev/pgbouncer.sh start    write the config, start, wait, print the URL to use
#   dev/pgbouncer.sh stop     stop the PgBouncer this script started
#   dev/pgbouncer.sh kill     kill -9 it (every client and server connection cut)
#   dev/pgbouncer.sh status
#
# The URL it prints carries default_query_exec_mode=exec: pgx's default mode
# keeps named prepared statements on a server connection, which the pooler
# hands to others (see docs/guarantees.md, "Behind a connection pooler").
#
# Settings: ONCE_PGBOUNCER_PORT (16432), ONCE_PG_PORT (15432, the server),
# ONCE_DEV_DIR (.dev in the repository).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dev_dir=${ONCE_DEV_DIR:-$root/.dev}
port=${ONCE_PGBOUNCER_PORT:-16432}
pg_port=${ONCE_PG_PORT:-15432}
bdir=$dev_dir/pgbouncer
pidfile=$bdir/pgbouncer.pid
url="postgres://once@127.0.0.1:$port/once?sslmode=disable&default_query_exec_mode=exec"

log() { echo "pgbouncer: $*" >&2; }

binary() {
	if ! command -v pgbouncer >/dev/null && [[ ! -x /usr/sbin/pgbouncer ]]; then
		log "PgBouncer is not installed; installing the Debian package"
		export DEBIAN_FRONTEND=noninteractive
		apt-get update -qq >&2 && apt-get install -y -qq pgbouncer >&2
		# The package enables a system service; this script runs its own.
		service pgbouncer stop >/dev/null 2>&1 || true
	fi
	command -v pgbouncer 2>/dev/null || echo /usr/sbin/pgbouncer
}

# PgBouncer refuses to run as root; run it as the postgres user then.
as_owner() {
	if [[ $(id -u) == 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi
}

running_pid() {
	local pid
	[[ -f $pidfile ]] || return 1
	pid=$(cat "$pidfile")
	if kill -0 "$pid" 2>/dev/null && grep -q pgbouncer "/proc/$pid/cmdline" 2>/dev/null; then
		echo "$pid"
		return 0
	fi
	rm -f "$pidfile"
	return 1
}

write_config() {
	mkdir -p "$bdir"
	# Every client is the test cluster's user "once" (trust, as the cluster
	# itself), or one of the login roles of docs/operating.md's "Least
	# privilege" (its tests log in as them); any database name goes to the
	# server of the same name.
	printf '"%s" ""\n' once billing_svc analytics_svc >"$bdir/users.txt"
	cat >"$bdir/pgbouncer.ini" <<INI
[databases]
* = host=127.0.0.1 port=$pg_port

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir =
auth_type = trust
auth_file = $bdir/users.txt
pool_mode = transaction
; Fewer server connections than clients ask for, as in production: a client's
; statements outside a transaction land on whichever server is free.
default_pool_size = 40
max_client_conn = 1000
max_db_connections = 120
server_reset_query =
; A client that sends session settings in its start-up packet
; (statement_timeout, options) is refused, as PgBouncer does by default:
; they would apply to whichever client gets that server connection next.
ignore_startup_parameters =
pidfile = $pidfile
logfile = $bdir/pgbouncer.log
log_connections = 0
log_disconnections = 0
INI
	if [[ $(id -u) == 0 ]]; then
		chown -R postgres: "$bdir"
		local d=$bdir
		while [[ $d != / ]]; do d=$(dirname "$d"); chmod o+x "$d" 2>/dev/null || true; done
	fi
}

start() {
	local bin pid
	bin=$(binary)
	if pid=$(running_pid); then
		# Its users as this script writes them now (PgBouncer reads the
		# file again on SIGHUP).
		write_config
		kill -HUP "$pid"
		log "reusing running PgBouncer (pid $pid)"
		echo "$url"
		return
	fi
	if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
		log "port $port is taken by a process this script did not start; set ONCE_PGBOUNCER_PORT"
		exit 1
	fi
	write_config
	as_owner "$bin" -d -q "$bdir/pgbouncer.ini"
	for _ in $(seq 1 100); do
		if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
			log "started on 127.0.0.1:$port in front of 127.0.0.1:$pg_port (transaction pooling)"
			echo "$url"
			return
		fi
		sleep 0.1
	done
	log "did not listen within 10s; see $bdir/pgbouncer.log"
	exit 1
}

stop() {
	local pid
	pid=$(running_pid) || { log "not running"; return; }
	kill -INT "$pid"
	for _ in $(seq 1 100); do
		kill -0 "$pid" 2>/dev/null || { log "stopped"; return; }
		sleep 0.1
	done
	kill -9 "$pid" 2>/dev/null || true
	log "stopped (killed)"
}

kill_it() {
	local pid
	pid=$(running_pid) || { log "not running"; exit 1; }
	kill -9 "$pid"
	for _ in $(seq 1 50); do
		kill -0 "$pid" 2>/dev/null || break
		sleep 0.1
	done
	rm -f "$pidfile"
	log "killed (pid $pid)"
}

case ${1:-} in
start) start ;;
stop) stop ;;
kill) kill_it ;;
status) if pid=$(running_pid); then echo "running (pid $pid) at $url"; else echo "not running"; exit 1; fi ;;
*) echo "usage: $0 start|stop|kill|status" >&2; exit 2 ;;
esac
