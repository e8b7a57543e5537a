#!/usr/bin/env bash
# Builds and runs tests/consumer as a separate project that takes this checkout as a subproject.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$repo/tests/consumer/meson.build" "$repo/tests/consumer/consumer.cpp" "$work/"
mkdir -p "$work/subprojects"
ln -s "$repo" "$work/subprojects/distrpc"
meson setup "$work/build" "$work" >/dev/null
ninja -C "$work/build" -j "${DISTRPC_JOBS:-2}" >/dev/null
out=$("$work/build/consumer")
echo "$out"
[ "$out" = "consumer: sum=168 keys=1" ]
