#!/usr/bin/env bash
# Builds and runs tests/consumer/consumer.cpp (two processes making RPC calls) as a user would:
#  1. a separate Meson project that takes this checkout as a subproject;
#  2. against an installed distrpc (meson install into a temporary prefix), compiled with only
#     `pkg-config --cflags --libs distrpc`;
#  3. against the same installed prefix as a CMake project (tests/consumer/CMakeLists.txt:
#     find_package(distrpc) and the distrpc::tcp target);
# and runs the installed distrpc-run launcher. The three builds are unoptimized and without debug
# information, and run side by side: what they check is that the flags each way gives compile,
# link and run.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
expected="consumer: sum=168 keys=1 rank1=0"

# The three builds are one translation unit each: they run side by side, then each program runs.
# build NAME COMMAND...: in the background, output kept in $work/NAME.log.
build() {
  local name="$1"; shift
  ( "$@" >"$work/$name.log" 2>&1; echo $? >"$work/$name.rc" ) &
}
# built NAME: the build's status; its output when it failed.
built() {
  wait
  if [ "$(cat "$work/$1.rc")" != 0 ]; then
    echo "the $1 build failed:"; tail -40 "$work/$1.log"; return 1
  fi
}

mkdir -p "$work/sub/subprojects"
cp "$repo/tests/consumer/meson.build" "$repo/tests/consumer/consumer.cpp" "$work/sub/"
ln -s "$repo" "$work/sub/subprojects/distrpc"
meson setup "$work/sub/build" "$work/sub" -Dbuildtype=plain >/dev/null
build subproject ninja -C "$work/sub/build" -j 1

meson setup "$work/install-build" "$repo" --prefix="$work/prefix" -Dtests=false \
  -Dexamples=false >/dev/null
meson install -C "$work/install-build" >/dev/null
pc_dir=$(dirname "$(find "$work/prefix" -name distrpc.pc | head -1)")
flags=$(PKG_CONFIG_PATH="$pc_dir" pkg-config --cflags --libs distrpc)
# shellcheck disable=SC2086
build pkg-config ${CXX:-c++} -Wall -Wextra -Werror "$repo/tests/consumer/consumer.cpp" $flags \
  -o "$work/consumer-pc"

cmake -S "$repo/tests/consumer" -B "$work/cmake-build" -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_BUILD_TYPE= >/dev/null
build cmake cmake --build "$work/cmake-build" -j 1

echo "-- as a Meson subproject"
built subproject
out=$(timeout 180 "$work/sub/build/consumer")
echo "$out"
[ "$out" = "$expected" ]

echo "-- installed, through pkg-config"
echo "pkg-config --cflags --libs distrpc: $flags"
built pkg-config
out=$(timeout 180 "$work/consumer-pc")
echo "$out"
[ "$out" = "$expected" ]

echo "-- installed, through CMake's find_package(distrpc)"
built cmake
out=$(timeout 180 "$work/cmake-build/consumer")
echo "$out"
[ "$out" = "$expected" ]

echo "-- the installed distrpc-run"
run="$work/prefix/bin/distrpc-run"
# shellcheck disable=SC2016  # $RANK and $WORLD_SIZE are the ranks' to expand
out=$(timeout 60 "$run" -n 2 sh -c 'echo "rank $RANK of $WORLD_SIZE at $MASTER_ADDR"' | sort)
echo "$out"
[ "$out" = "$(printf '[0] rank 0 of 2 at 127.0.0.1\n[1] rank 1 of 2 at 127.0.0.1')" ]
# A failing rank: its exit code is distrpc-run's, the other rank is stopped.
rc=0
# shellcheck disable=SC2016
timeout 60 "$run" -n 2 --grace 1 sh -c '[ "$RANK" = 1 ] && exit 5; exec sleep 30' 2>"$work/run.err" || rc=$?
cat "$work/run.err"
[ "$rc" -eq 5 ]
[ "$(cat "$work/run.err")" = "distrpc-run: rank 1 exited with code 5; stopped: rank 0 (killed by signal SIGTERM)" ]
