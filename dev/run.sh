#!/usr/bin/env bash
# Runs the system: starts Kafka and PostgreSQL (unless KAFKA_BROKERS /
# DATABASE_URL name your own), builds the app, applies migrations and serves
# the consumer groups until Ctrl-C. Extra arguments go to `app serve`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/services.sh"
cd "$ONCE_ROOT"
trap stop_services EXIT
start_services
go build -o .dev/app ./cmd/app
.dev/app migrate
.dev/app serve "$@"
