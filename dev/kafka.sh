#!/usr/bin/env bash
# A real single-node Apache Kafka (KRaft, broker and controller in one JVM) on
# 127.0.0.1, resolved through Maven. No Docker, no system install.
#
#   dev/kafka.sh start    resolve jars, format storage once, start, wait until
#                         a client can list topics, print the bootstrap address
#   dev/kafka.sh stop     stop the broker this script started (by its PID file)
#   dev/kafka.sh status   say whether it runs
#   dev/kafka.sh tool CLASS ARGS...   run a Kafka tool class on the broker's classpath
#
# Settings: ONCE_KAFKA_PORT (19092), ONCE_KAFKA_CONTROLLER_PORT (19093),
# ONCE_DEV_DIR (.dev in the repository), ONCE_KAFKA_HEAP (512m).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dev_dir=${ONCE_DEV_DIR:-$root/.dev}
port=${ONCE_KAFKA_PORT:-19092}
controller_port=${ONCE_KAFKA_CONTROLLER_PORT:-19093}
heap=${ONCE_KAFKA_HEAP:-512m}
kdir=$dev_dir/kafka
lib=$kdir/lib
data=$kdir/data
pidfile=$kdir/kafka.pid
logfile=$kdir/kafka.log
bootstrap=127.0.0.1:$port

log() { echo "kafka: $*" >&2; }

resolve_jars() {
	local stamp=$lib/.pom.sha256 want
	want=$(sha256sum "$root/dev/kafka/pom.xml" | cut -d' ' -f1)
	if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then return; fi
	log "resolving the broker's classpath through Maven (cached in ~/.m2)"
	rm -rf "$lib" && mkdir -p "$lib"
	# Maven's console library prints colour resets even in batch mode; strip them.
	mvn -q -B -Dstyle.color=never -f "$root/dev/kafka/pom.xml" dependency:copy-dependencies \
		-DincludeScope=runtime -DoutputDirectory="$lib" 2>&1 | sed 's/\x1b\[[0-9;]*m//g' >&2
	echo "$want" >"$stamp"
}

java_run() { java -Xmx256m -cp "$lib/*" -Dorg.slf4j.simpleLogger.defaultLogLevel=warn "$@"; }

write_config() {
	mkdir -p "$data"
	cat >"$kdir/server.properties" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$controller_port
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$controller_port
advertised.listeners=PLAINTEXT://127.0.0.1:$port
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$data
num.partitions=3
offsets.topic.num.partitions=4
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
PROPS
}

running_pid() {
	[[ -f $pidfile ]] || return 1
	local pid
	pid=$(cat "$pidfile")
	if kill -0 "$pid" 2>/dev/null && grep -q kafka.Kafka "/proc/$pid/cmdline" 2>/dev/null; then
		echo "$pid"
		return 0
	fi
	log "removing stale PID file (process $pid is gone)"
	rm -f "$pidfile"
	return 1
}

ready() { java_run org.apache.kafka.tools.TopicCommand --bootstrap-server "$bootstrap" --list >/dev/null 2>&1; }

start() {
	if pid=$(running_pid); then
		log "reusing running broker (pid $pid)"
		echo "$bootstrap"
		return
	fi
	if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
		log "port $port is taken by a process this script did not start; set ONCE_KAFKA_PORT"
		exit 1
	fi
	resolve_jars
	write_config
	if [[ ! -f $data/meta.properties ]]; then
		local cluster_id
		cluster_id=$(java_run kafka.tools.StorageTool random-uuid)
		java_run kafka.tools.StorageTool format --ignore-formatted \
			-t "$cluster_id" -c "$kdir/server.properties" >"$kdir/format.log" 2>&1 ||
			{ log "formatting the storage failed:"; cat "$kdir/format.log" >&2; exit 1; }
	fi
	local t0=$SECONDS
	# setsid: the broker must not die with the shell that started it, and
	# must not hold that shell's terminal or pipes open.
	setsid java -Xms"$heap" -Xmx"$heap" -XX:+UseG1GC \
		-Dorg.slf4j.simpleLogger.defaultLogLevel=info \
		-cp "$lib/*" kafka.Kafka "$kdir/server.properties" \
		</dev/null >"$logfile" 2>&1 &
	echo $! >"$pidfile"
	for _ in $(seq 1 120); do
		if ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then
			log "broker exited during start-up; last lines of $logfile:"
			tail -20 "$logfile" >&2
			rm -f "$pidfile"
			exit 1
		fi
		if ready; then
			log "ready in $((SECONDS - t0))s (pid $(cat "$pidfile"))"
			echo "$bootstrap"
			return
		fi
		sleep 1
	done
	log "not ready after 120s; see $logfile"
	stop
	exit 1
}

stop() {
	local pid
	if ! pid=$(running_pid); then
		log "not running"
		return
	fi
	kill "$pid"
	for _ in $(seq 1 60); do
		kill -0 "$pid" 2>/dev/null || break
		sleep 0.5
	done
	if kill -0 "$pid" 2>/dev/null; then
		log "did not stop in 30s; killing"
		kill -9 "$pid" 2>/dev/null || true
	fi
	rm -f "$pidfile"
	log "stopped (pid $pid)"
}

case ${1:-} in
start) start ;;
stop) stop ;;
status) if pid=$(running_pid); then echo "running (pid $pid) on $bootstrap"; else echo "not running"; exit 1; fi ;;
tool) shift; resolve_jars; java_run "$@" ;;
*) echo "usage: $0 start|stop|status|tool CLASS ARGS..." >&2; exit 2 ;;
esac
