#!/usr/bin/env bash
# Sourced by dev/test.sh, dev/run.sh and .ci/run: makes KAFKA_BROKERS and
# DATABASE_URL point at working services. Where a variable is already set, that
# service is used as it is and nothing is started for it. ONCE_STARTED lists
# what this shell started, so that stop_services stops exactly that.

ONCE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ONCE_STARTED=""

start_services() {
	if [[ -z ${KAFKA_BROKERS:-} ]]; then
		KAFKA_BROKERS=$("$ONCE_ROOT/dev/kafka.sh" start) || return 1
		ONCE_STARTED+=" kafka"
	fi
	if [[ -z ${DATABASE_URL:-} ]]; then
		DATABASE_URL=$("$ONCE_ROOT/dev/postgres.sh" start) || return 1
		ONCE_STARTED+=" postgres"
	fi
	export KAFKA_BROKERS DATABASE_URL
	echo "using KAFKA_BROKERS=$KAFKA_BROKERS DATABASE_URL=$DATABASE_URL" >&2
}

stop_services() {
	local s
	for s in $ONCE_STARTED; do "$ONCE_ROOT/dev/$s.sh" stop || true; done
	ONCE_STARTED=""
}
