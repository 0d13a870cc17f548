#!/usr/bin/env bash
# Runs the system: starts Kafka and PostgreSQL (unless KAFKA_BROKERS /
# DATABASE_URL name your own), builds the app and runs `app demo`: the order
# service, the payment provider simulator and both consumer groups in one
# process, 10,000 orders with duplicates from every source, and a summary with
# PASS or FAIL at the end. Extra arguments go to `app demo` (see --help).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/services.sh"
cd "$ONCE_ROOT"
trap stop_services EXIT
start_services
go build -o .dev/app ./cmd/app
.dev/app demo "$@"
