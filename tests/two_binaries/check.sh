#!/usr/bin/env bash
# Runs the two-binary check: the server (implements and exposes api.hpp's declarations, serves only
# what it exposes) and the client (declarations only) meet through a file:// rendezvous on the Tcp
# transport; the client checks values, the signature-mismatch and unknown-name errors and a
# RemoteModule forward. Then the start-up conflict program must have its init_rpc refused with
# both origins named. Each program runs under a wall-clock limit.
#   tests/two_binaries/check.sh [BUILD_DIR]   (default: build)   exit 0: passed
set -uo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
build="${1:-$repo/build}"
bin="$build/tests/two_binaries"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
limit=${DISTRPC_TWO_BINARIES_LIMIT:-120}
fail=0

for b in two_binaries_server two_binaries_client two_binaries_conflict; do
  [ -x "$bin/$b" ] || { echo "missing $bin/$b (build it first)"; exit 1; }
done

echo "-- server and client"
url="file://$work/rendezvous"
timeout --kill-after=5 "$limit" "$bin/two_binaries_server" "$url" >"$work/server.log" 2>&1 &
server=$!
timeout --kill-after=5 "$limit" "$bin/two_binaries_client" "$url" >"$work/client.log" 2>&1
client_rc=$?
wait "$server"
server_rc=$?
cat "$work/client.log"
cat "$work/server.log"
if [ $client_rc -ne 0 ] || ! grep -qE '^client: 11 checks passed, 0 failed$' "$work/client.log"; then
  echo "FAIL: client (exit $client_rc)"; fail=1
fi
if [ $server_rc -ne 0 ] || ! grep -qx 'server: done' "$work/server.log"; then
  echo "FAIL: server (exit $server_rc)"; fail=1
fi

echo "-- conflicts registered while the program starts"
timeout --kill-after=5 "$limit" "$bin/two_binaries_conflict" "file://$work/conflict" \
  >"$work/conflict.log" 2>&1
conflict_rc=$?
cat "$work/conflict.log"
out=$(cat "$work/conflict.log")
want_twice="two implementations are registered under the function name '{anonymous}::twice': '{anonymous}::twice' at 0x"
want_scale_a="two implementations are registered under the function name 'math.scale': '{anonymous}::scale_"
# The compiler's path of the file, as the build passed it, then its line.
want_files=("tests/two_binaries/conflict_a.cpp:28)" "tests/two_binaries/conflict_b.cpp:18)")
if [ $conflict_rc -ne 0 ]; then echo "FAIL: conflict program (exit $conflict_rc)"; fail=1; fi
for w in "$want_twice" "$want_scale_a" "${want_files[@]}"; do
  grep -qF -- "$w" <<<"$out" || { echo "FAIL: the refusal does not contain: $w"; fail=1; }
done

[ $fail -eq 0 ] && echo "two binaries: ok"
exit $fail
