#!/usr/bin/env bash
# The whole test suite against a real Kafka and a real PostgreSQL, started here
# unless KAFKA_BROKERS / DATABASE_URL name your own. Extra arguments go to go test
# (e.g. -run Kill). ONCE_E2E_SOAK=1 makes the e2e scenarios five times longer.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/services.sh"
cd "$ONCE_ROOT"
trap stop_services EXIT
start_services
seedpeer_python
browser
image_tools
# Integration tests skip without these; under this script they must not.
export ONCE_REQUIRE_SERVICES=1
unformatted=$(gofmt -l .)
if [[ -n $unformatted ]]; then echo "gofmt needed: $unformatted" >&2; exit 1; fi
go vet ./...
mkdir -p "$ONCE_DEV"
export ONCE_E2E_RESULTS=$ONCE_DEV/e2e-results.txt
rm -f "$ONCE_E2E_RESULTS"
status=0
go test -count=1 -timeout 20m -p 1 ./... "$@" || status=$?
if [[ -f $ONCE_E2E_RESULTS ]]; then echo; cat "$ONCE_E2E_RESULTS"; fi
exit $status
