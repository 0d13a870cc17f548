#!/usr/bin/env bash
# Runs the system: starts Kafka and PostgreSQL (unless KAFKA_BROKERS /
# DATABASE_URL name your own), builds the app, applies migrations, starts the
# payment provider simulator and serves both consumer groups until Ctrl-C.
# Extra arguments go to `app serve`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/services.sh"
cd "$ONCE_ROOT"
provider=""
cleanup() {
	[[ -n $provider ]] && kill "$provider" 2>/dev/null && wait "$provider" 2>/dev/null
	stop_services
}
trap cleanup EXIT
start_services
go build -o .dev/app ./cmd/app
.dev/app migrate
.dev/app payment-provider --no-migrate &
provider=$!
.dev/app serve --no-migrate "$@"
