#!/usr/bin/env bash
# Two hosts for real: two network namespaces joined by a veth pair (10.213.0.1 and 10.213.0.2,
# each with its own loopback, so a worker that published 127.0.0.1 could not be reached), one
# worker of build/tests/hosts_worker in each. Where namespaces cannot be made (no CAP_NET_ADMIN),
# it falls back to two extra addresses on lo (then both "hosts" share a loopback, so only what
# the workers publish is checked, not that loopback is unreachable); where neither can be made it
# says so and exits 77 (skipped).
#
#   bash tests/hosts/check.sh [build-dir]      last line: "hosts: ok (<mode>)" or what failed
set -uo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
build="${1:-$repo/build}"
worker="$build/tests/hosts_worker"
[ -x "$worker" ] || { echo "hosts: $worker is not built"; exit 1; }

tag="d$$"
nsA="distrpc-${tag}a" nsB="distrpc-${tag}b"
vA="dr${tag}a" vB="dr${tag}b"
addrA=10.213.0.1 addrB=10.213.0.2
mode=""
cleanup() {
  if [ "$mode" = netns ]; then
    ip netns del "$nsA" 2>/dev/null
    ip netns del "$nsB" 2>/dev/null
  elif [ "$mode" = lo-addresses ]; then
    ip addr del "$addrA/32" dev lo 2>/dev/null
    ip addr del "$addrB/32" dev lo 2>/dev/null
  fi
}
trap cleanup EXIT

# DISTRPC_HOSTS_MODE=lo-addresses tries the fallback first (to check it on a machine that has both).
if [ "${DISTRPC_HOSTS_MODE:-}" != lo-addresses ] && ip netns add "$nsA" 2>/dev/null; then
  if ip netns add "$nsB" && ip link add "$vA" type veth peer name "$vB" &&
    ip link set "$vA" netns "$nsA" && ip link set "$vB" netns "$nsB" &&
    ip -n "$nsA" addr add "$addrA/24" dev "$vA" && ip -n "$nsB" addr add "$addrB/24" dev "$vB" &&
    ip -n "$nsA" link set "$vA" up && ip -n "$nsB" link set "$vB" up &&
    ip -n "$nsA" link set lo up && ip -n "$nsB" link set lo up; then
    mode=netns
  else
    ip netns del "$nsA" 2>/dev/null
    ip netns del "$nsB" 2>/dev/null
  fi
fi
if [ -z "$mode" ] && ip addr add "$addrA/32" dev lo 2>/dev/null; then
  if ip addr add "$addrB/32" dev lo; then
    mode=lo-addresses
  else
    ip addr del "$addrA/32" dev lo
  fi
fi
if [ -z "$mode" ]; then
  echo "hosts: SKIPPED: this machine allows neither network namespaces nor extra addresses on lo"
  exit 77
fi
echo "hosts: mode $mode"

# on HOST CMD...: runs CMD on "host" A or B.
on() {
  local host="$1"; shift
  if [ "$mode" = netns ]; then
    if [ "$host" = A ]; then ip netns exec "$nsA" "$@"; else ip netns exec "$nsB" "$@"; fi
  else
    "$@"
  fi
}

failures=0
port=29500
# run_pair NAME ENV_A ENV_B: rank 0 on A (it hosts the store at $addrA), rank 1 on B; their
# outputs land in $out/NAME.{0,1}.
out=$(mktemp -d)
run_pair() {
  local name="$1" envA="$2" envB="$3"
  port=$((port + 1))
  local common="MASTER_ADDR=$addrA MASTER_PORT=$port WORLD_SIZE=2"
  # shellcheck disable=SC2086
  on A env $common RANK=0 $envA timeout 60 "$worker" >"$out/$name.0" 2>&1 &
  local pa=$!
  # shellcheck disable=SC2086
  on B env $common RANK=1 $envB timeout 60 "$worker" >"$out/$name.1" 2>&1 &
  local pb=$!
  wait $pa; echo $? >"$out/$name.0.rc"
  wait $pb; echo $? >"$out/$name.1.rc"
}
# expect NAME RANK PATTERN: the rank's output has a line matching PATTERN (grep -E).
expect() {
  if grep -qE "$3" "$out/$1.$2"; then
    echo "  ok   $1 rank $2: $(grep -E "$3" "$out/$1.$2" | head -1)"
  else
    echo "  FAIL $1 rank $2: no line matching '$3'; its output:"
    sed 's/^/      /' "$out/$1.$2" | tail -30
    failures=$((failures + 1))
  fi
}
expect_rc() {
  local rc
  rc=$(cat "$out/$1.$2.rc")
  if [ "$rc" "$3" 0 ]; then
    echo "  ok   $1 rank $2: exit $rc"
  else
    echo "  FAIL $1 rank $2: exit $rc"
    failures=$((failures + 1))
  fi
}

if [ "$mode" = netns ]; then
  # 1. Default options: the store on A listens everywhere; each worker publishes its address on
  #    the route to A, and the calls cross between the namespaces.
  run_pair default "" ""
  # 2. An interface named by the environment.
  run_pair ifname "DISTRPC_SOCKET_IFNAME=$vA" "DISTRPC_SOCKET_IFNAME=$vB"
  ifA="interface $vA" ifB="interface $vB"
else
  # Both "hosts" reach 10.213.0.1 through lo from the same address: each is told its own.
  run_pair default "DISTRPC_LISTEN_ADDR=$addrA" "DISTRPC_LISTEN_ADDR=$addrB"
  run_pair ifname "DISTRPC_LISTEN_ADDR=0.0.0.0 DISTRPC_ADVERTISE_ADDR=$addrA" \
    "DISTRPC_LISTEN_ADDR=0.0.0.0 DISTRPC_ADVERTISE_ADDR=$addrB"
  ifA="" ifB=""
fi
expect default 0 "^endpoint 0: listening on $addrA, publishing $addrA "
expect default 1 "^endpoint 1: listening on $addrB, publishing $addrB "
expect default 0 "^call 0 -> 1: ok worker1 greets worker0$"
expect default 1 "^call 1 -> 0: ok worker0 greets worker1$"
expect default 0 "^done 0$"
expect default 1 "^done 1$"
expect_rc default 0 -eq
expect_rc default 1 -eq
expect ifname 0 "^endpoint 0: .*publishing $addrA .*${ifA}"
expect ifname 1 "^endpoint 1: .*publishing $addrB .*${ifB}"
expect ifname 0 "^call 0 -> 1: ok"
expect ifname 1 "^call 1 -> 0: ok"
expect_rc ifname 0 -eq
expect_rc ifname 1 -eq

# 3. A worker told to listen on loopback, in a group whose store is on another host, fails at
#    init with the text saying what to set (its partner gives up after a short init timeout).
run_pair loopback "HOSTS_INIT_TIMEOUT_MS=5000" \
  "DISTRPC_LISTEN_ADDR=127.0.0.1 HOSTS_INIT_TIMEOUT_MS=5000"
expect loopback 1 "^error 1: init_rpc: worker 'worker1': this worker would publish the loopback address 127.0.0.1 to a group whose rendezvous store is on another host \($addrA\), where no peer can reach it; set RpcBackendOptions::interface \(or DISTRPC_SOCKET_IFNAME\)"
expect_rc loopback 1 -ne
expect_rc loopback 0 -ne

rm -rf "$out"
if [ "$failures" -eq 0 ]; then
  echo "hosts: ok ($mode)"
else
  echo "hosts: $failures check(s) FAILED ($mode)"
  exit 1
fi
