#!/bin/sh
# Builds the app as both images ship it: static (CGO_ENABLED=0, so it runs on
# scratch and distroless/static, which have no libc) and trimmed (-trimpath,
# no symbol table or DWARF). The one definition of that build: the
# Dockerfile's build stage and dev/image.sh both run this script, and
# cmd/app's TestDockerfileBuildsWhatCIBuilds fails if either builds otherwise.
#
#   dev/build-app.sh OUT    build ./cmd/app into the file OUT
#
# POSIX sh, not bash: it runs in the golang image as well as here.
set -eu
if [ $# -ne 1 ] || [ -z "$1" ]; then
	echo "usage: dev/build-app.sh OUT (the binary to write)" >&2
	exit 2
fi
case $1 in
/*) out=$1 ;;
*) out=$PWD/$1 ;;
esac
cd "$(dirname "$0")/.."
export CGO_ENABLED=0
exec go build -trimpath -ldflags="-s -w" -o "$out" ./cmd/app
