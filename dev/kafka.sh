#!/usr/bin/env bash
# A real single-node Apache Kafka (KRaft, broker and controller in one JVM) on
# 127.0.0.1, resolved through Maven. No Docker, no system install.
#
#   dev/kafka.sh start    resolve jars, format storage once, start, wait until
#                         a client can list topics, print the bootstrap address
#   dev/kafka.sh stop     stop the broker this script started (by its PID file)
#   dev/kafka.sh status   say whether it runs
#   dev/kafka.sh kill     kill -9 the broker (a crash); start recovers its data
#   dev/kafka.sh pause|resume   SIGSTOP / SIGCONT the broker: it neither
#                         answers nor fails while paused
#   dev/kafka.sh tool CLASS ARGS...   run a Kafka tool class on the broker's classpath
#
#   dev/kafka.sh cluster start|stop|status    a three-broker KRaft cluster (each
#                         broker also a controller; replication factor 3,
#                         min.insync.replicas 2), printing its bootstrap list
#   dev/kafka.sh cluster kill N|start N       kill -9 broker N (1-3), start it again
#   dev/kafka.sh secure start|stop|status    a broker with SASL/SCRAM-SHA-512 and
#                         ACLs (see the section below), printing its address
#
# Settings: ONCE_KAFKA_PORT (19092), ONCE_KAFKA_CONTROLLER_PORT (19093),
# ONCE_DEV_DIR (.dev in the repository), ONCE_KAFKA_HEAP (512m); the cluster:
# ONCE_KAFKA_CLUSTER_PORT (19192: brokers on 19192, 19194, 19196, controllers
# one above each), ONCE_KAFKA_CLUSTER_HEAP (256m).
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

# topic_props PARTITIONS OFFSETS_PARTITIONS REPLICAS MIN_ISR: the
# partitions and replication of the topics and of Kafka's internal ones, no
# rebalance delay, and no topic made by accident.
topic_props() {
	cat <<PROPS
num.partitions=$1
offsets.topic.num.partitions=$2
offsets.topic.replication.factor=$3
transaction.state.log.replication.factor=$3
transaction.state.log.min.isr=$4
share.coordinator.state.topic.replication.factor=$3
share.coordinator.state.topic.min.isr=$4
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
PROPS
}

# single_node_props PARTITIONS OFFSETS_PARTITIONS: what a one-broker
# cluster needs (replication factor 1 everywhere).
single_node_props() { topic_props "$1" "$2" 1 1; }

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
PROPS
	single_node_props 3 4 >>"$kdir/server.properties"
}

# broker_pid FILE: the PID of the broker FILE names, if it still runs; a
# stale file is removed.
broker_pid() {
	local f=$1 pid
	[[ -f $f ]] || return 1
	pid=$(cat "$f")
	if kill -0 "$pid" 2>/dev/null && grep -q kafka.Kafka "/proc/$pid/cmdline" 2>/dev/null; then
		echo "$pid"
		return 0
	fi
	log "removing stale PID file $f (process $pid is gone)"
	rm -f "$f"
	return 1
}

running_pid() { broker_pid "$pidfile"; }

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

# stop_broker FILE NAME: stop the broker FILE names, kill -9 after 30s.
stop_broker() {
	local pid
	if ! pid=$(broker_pid "$1"); then
		log "$2: not running"
		return
	fi
	kill "$pid"
	for _ in $(seq 1 60); do
		kill -0 "$pid" 2>/dev/null || break
		sleep 0.5
	done
	if kill -0 "$pid" 2>/dev/null; then
		log "$2: did not stop in 30s; killing"
		kill -9 "$pid" 2>/dev/null || true
	fi
	rm -f "$1"
	log "$2: stopped (pid $pid)"
}

stop() { stop_broker "$pidfile" broker; }

kill_broker() {
	local pid
	if ! pid=$(running_pid); then
		log "not running"
		exit 1
	fi
	kill -9 "$pid"
	for _ in $(seq 1 50); do
		kill -0 "$pid" 2>/dev/null || break
		sleep 0.1
	done
	log "killed (pid $pid)"
}

# --- the three-broker cluster -------------------------------------------
cbase=${ONCE_KAFKA_CLUSTER_PORT:-19192}
cheap=${ONCE_KAFKA_CLUSTER_HEAP:-256m}
cdir=$dev_dir/kafka-cluster
cport() { echo $((cbase + 2 * ($1 - 1))); }
ccport() { echo $((cbase + 2 * ($1 - 1) + 1)); }
cbootstrap() { echo "127.0.0.1:$(cport 1),127.0.0.1:$(cport 2),127.0.0.1:$(cport 3)"; }

cluster_config() { # node
	local n=$1 voters="1@127.0.0.1:$(ccport 1),2@127.0.0.1:$(ccport 2),3@127.0.0.1:$(ccport 3)"
	mkdir -p "$cdir/$n/data"
	cat >"$cdir/$n/server.properties" <<PROPS
process.roles=broker,controller
node.id=$n
controller.quorum.voters=$voters
listeners=PLAINTEXT://127.0.0.1:$(cport "$n"),CONTROLLER://127.0.0.1:$(ccport "$n")
advertised.listeners=PLAINTEXT://127.0.0.1:$(cport "$n")
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$cdir/$n/data
default.replication.factor=3
min.insync.replicas=2
unclean.leader.election.enable=false
PROPS
	topic_props 3 4 3 2 >>"$cdir/$n/server.properties"
}

cluster_pid() { broker_pid "$cdir/$1/kafka.pid"; } # node

cluster_start_node() { # node
	local n=$1
	if cluster_pid "$n" >/dev/null; then return; fi
	setsid java -Xms"$cheap" -Xmx"$cheap" -XX:+UseG1GC -XX:TieredStopAtLevel=1 \
		-Dorg.slf4j.simpleLogger.defaultLogLevel=warn \
		-cp "$lib/*" kafka.Kafka "$cdir/$n/server.properties" \
		</dev/null >"$cdir/$n/kafka.log" 2>&1 &
	echo $! >"$cdir/$n/kafka.pid"
}

cluster_ready() {
	java_run org.apache.kafka.tools.TopicCommand --bootstrap-server "$(cbootstrap)" --list >/dev/null 2>&1
}

cluster() {
	case ${1:-} in
	start)
		resolve_jars
		local n cluster_id
		for n in 1 2 3; do cluster_config "$n"; done
		if [[ ! -f $cdir/1/data/meta.properties ]]; then
			cluster_id=$(java_run kafka.tools.StorageTool random-uuid)
			for n in 1 2 3; do
				java_run kafka.tools.StorageTool format --ignore-formatted -t "$cluster_id" -c "$cdir/$n/server.properties" \
					>"$cdir/$n/format.log" 2>&1 || { log "formatting node $n failed:"; cat "$cdir/$n/format.log" >&2; exit 1; }
			done
		fi
		local t0=$SECONDS
		for n in 1 2 3; do cluster_start_node "$n"; done
		for _ in $(seq 1 180); do
			if cluster_ready; then
				log "cluster ready in $((SECONDS - t0))s"
				cbootstrap
				return
			fi
			sleep 1
		done
		log "cluster not ready after 180s; see $cdir/*/kafka.log"
		cluster stop
		exit 1
		;;
	stop)
		local n
		for n in 1 2 3; do stop_broker "$cdir/$n/kafka.pid" "cluster node $n"; done
		;;
	kill)
		local pid
		pid=$(cluster_pid "${2:?node 1-3}") || { log "node $2 not running"; exit 1; }
		kill -9 "$pid"
		for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
		rm -f "$cdir/$2/kafka.pid"
		log "node $2 killed (pid $pid)"
		;;
	start-node)
		cluster_start_node "${2:?node 1-3}"
		log "node $2 starting"
		;;
	status)
		local n up=0
		for n in 1 2 3; do cluster_pid "$n" >/dev/null && up=$((up + 1)); done
		echo "$up of 3 brokers running on $(cbootstrap)"
		[[ $up -gt 0 ]]
		;;
	*) echo "usage: $0 cluster start|stop|status|kill N|start-node N" >&2; exit 2 ;;
	esac
}

# --- a secured broker: SASL/SCRAM and ACLs -------------------------------
# Clients connect to SASL_PLAINTEXT on ONCE_KAFKA_SECURE_PORT (19392) and
# authenticate with SCRAM-SHA-512; the StandardAuthorizer denies what no ACL
# allows. The admin user (password admin-secret, a dev-only credential) is a
# super user and makes the other users and their ACLs (the tests do, through
# the Admin API). Broker-to-broker and controller traffic stays on loopback
# listeners of their own.
sport=${ONCE_KAFKA_SECURE_PORT:-19392}
sdir=$dev_dir/kafka-secure
secure_config() {
	mkdir -p "$sdir/data"
	cat >"$sdir/server.properties" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$((sport + 1))
listeners=SASL_PLAINTEXT://127.0.0.1:$sport,CONTROLLER://127.0.0.1:$((sport + 1)),INTERNAL://127.0.0.1:$((sport + 2))
advertised.listeners=SASL_PLAINTEXT://127.0.0.1:$sport,INTERNAL://127.0.0.1:$((sport + 2))
controller.listener.names=CONTROLLER
inter.broker.listener.name=INTERNAL
listener.security.protocol.map=SASL_PLAINTEXT:SASL_PLAINTEXT,CONTROLLER:PLAINTEXT,INTERNAL:PLAINTEXT
sasl.enabled.mechanisms=SCRAM-SHA-512
listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
super.users=User:admin;User:ANONYMOUS
log.dirs=$sdir/data
PROPS
	single_node_props 1 2 >>"$sdir/server.properties"
}

secure_pid() { broker_pid "$sdir/kafka.pid"; }

secure() {
	case ${1:-} in
	start)
		if secure_pid >/dev/null; then echo "127.0.0.1:$sport"; return; fi
		resolve_jars
		secure_config
		if [[ ! -f $sdir/data/meta.properties ]]; then
			java_run kafka.tools.StorageTool format --ignore-formatted -t "$(java_run kafka.tools.StorageTool random-uuid)" \
				-c "$sdir/server.properties" --add-scram 'SCRAM-SHA-512=[name=admin,password=admin-secret]' >"$sdir/format.log" 2>&1 ||
				{ log "formatting the secured broker failed:"; cat "$sdir/format.log" >&2; exit 1; }
		fi
		printf 'security.protocol=SASL_PLAINTEXT\nsasl.mechanism=SCRAM-SHA-512\nsasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="admin-secret";\n' >"$sdir/admin.properties"
		local t0=$SECONDS
		setsid java -Xms256m -Xmx256m -XX:+UseG1GC -XX:TieredStopAtLevel=1 -Dorg.slf4j.simpleLogger.defaultLogLevel=warn \
			-cp "$lib/*" kafka.Kafka "$sdir/server.properties" </dev/null >"$sdir/kafka.log" 2>&1 &
		echo $! >"$sdir/kafka.pid"
		for _ in $(seq 1 120); do
			if ! secure_pid >/dev/null; then log "secured broker exited; see $sdir/kafka.log"; tail -20 "$sdir/kafka.log" >&2; exit 1; fi
			if java_run org.apache.kafka.tools.TopicCommand --bootstrap-server "127.0.0.1:$sport" --command-config "$sdir/admin.properties" --list >/dev/null 2>&1; then
				log "secured broker ready in $((SECONDS - t0))s"
				echo "127.0.0.1:$sport"
				return
			fi
			sleep 1
		done
		log "secured broker not ready after 120s; see $sdir/kafka.log"
		secure stop
		exit 1
		;;
	stop) stop_broker "$sdir/kafka.pid" "secured broker" ;;
	status) if pid=$(secure_pid); then echo "running (pid $pid) on 127.0.0.1:$sport"; else echo "not running"; exit 1; fi ;;
	*) echo "usage: $0 secure start|stop|status" >&2; exit 2 ;;
	esac
}

case ${1:-} in
start) start ;;
secure) shift; secure "$@" ;;
stop) stop ;;
kill) kill_broker ;;
# pause: the broker neither answers nor fails (SIGSTOP), as a hung or
# partitioned broker; resume lets it go on (SIGCONT).
pause) pid=$(running_pid) || { log "not running"; exit 1; }; kill -STOP "$pid"; log "paused (pid $pid)" ;;
resume) pid=$(running_pid) || { log "not running"; exit 1; }; kill -CONT "$pid"; log "resumed (pid $pid)" ;;
cluster) shift; cluster "$@" ;;
status) if pid=$(running_pid); then echo "running (pid $pid) on $bootstrap"; else echo "not running"; exit 1; fi ;;
tool) shift; resolve_jars; java_run "$@" ;;
*) echo "usage: $0 start|stop|status|kill|pause|resume|tool CLASS ARGS...|cluster ..." >&2; exit 2 ;;
esac
