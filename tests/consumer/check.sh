#!/usr/bin/env bash
# Builds and runs tests/consumer/consumer.cpp (two processes making RPC calls) as a user would:
#  1. a separate Meson project that takes this checkout as a subproject;
#  2. against an installed distrpc (meson install into a temporary prefix), compiled with only
#     `pkg-config --cflags --libs distrpc`.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
expected="consumer: sum=168 keys=1 rank1=0"

echo "-- as a Meson subproject"
mkdir -p "$work/sub/subprojects"
cp "$repo/tests/consumer/meson.build" "$repo/tests/consumer/consumer.cpp" "$work/sub/"
ln -s "$repo" "$work/sub/subprojects/distrpc"
meson setup "$work/sub/build" "$work/sub" >/dev/null
ninja -C "$work/sub/build" -j "${DISTRPC_JOBS:-2}" >/dev/null
out=$(timeout 180 "$work/sub/build/consumer")
echo "$out"
[ "$out" = "$expected" ]

echo "-- installed, through pkg-config"
meson setup "$work/install-build" "$repo" --prefix="$work/prefix" -Dtests=false \
  -Dexamples=false >/dev/null
meson install -C "$work/install-build" >/dev/null
pc_dir=$(dirname "$(find "$work/prefix" -name distrpc.pc | head -1)")
flags=$(PKG_CONFIG_PATH="$pc_dir" pkg-config --cflags --libs distrpc)
echo "pkg-config --cflags --libs distrpc: $flags"
# shellcheck disable=SC2086
${CXX:-c++} -Wall -Wextra -Werror "$repo/tests/consumer/consumer.cpp" $flags -o "$work/consumer-pc"
out=$(timeout 180 "$work/consumer-pc")
echo "$out"
[ "$out" = "$expected" ]
