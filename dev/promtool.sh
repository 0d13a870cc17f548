#!/usr/bin/env bash
# Prints the path of a promtool: the one on PATH, else one unpacked from
# Debian's prometheus package into .dev/prometheus (downloaded, never
# installed: no server is started, nothing outside .dev changes).
set -euo pipefail
if command -v promtool >/dev/null; then command -v promtool; exit 0; fi
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${ONCE_DEV_DIR:-$root/.dev}/prometheus
if [[ ! -x $dir/usr/bin/promtool ]]; then
	mkdir -p "$dir/deb"
	(cd "$dir/deb" && apt-get download -q prometheus >&2 2>/dev/null) ||
		{ apt-get update -qq >&2 && (cd "$dir/deb" && apt-get download -q prometheus >&2); }
	dpkg-deb -x "$dir"/deb/prometheus_*.deb "$dir"
	rm -rf "$dir/deb"
fi
echo "$dir/usr/bin/promtool"
