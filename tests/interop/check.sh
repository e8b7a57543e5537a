#!/usr/bin/env bash
# Runs tests/interop/torchrun_rpc under PyTorch's torchrun: two ranks meet through env:// (the
# store torchrun's agent hosts, a PyTorch TCPStore speaking c10d's protocol), call each other and
# print checked lines. Usage: tests/interop/check.sh [build dir]
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
build="${1:-$repo/build}"
prog="$build/tests/torchrun_rpc"
py="${DISTRPC_TEST_PYTHON:-/usr/bin/python3}"
if ! "$py" -c 'import torch.distributed.run' 2>/dev/null; then
  echo "FAILED: $py cannot import torch.distributed.run (install python3-torch)"
  exit 1
fi
[ -x "$prog" ] || { echo "FAILED: $prog not built (needs libtorch)"; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# --redirects 1 --tee 1: the ranks' stdout goes to files and to ours, prefixed "[defaultN]:". (Also
# sidesteps Debian's torch 1.13 under Python 3.11, which cannot parse the default "0".)
out=$(timeout 300 "$py" -m torch.distributed.run --nproc_per_node 2 --no_python \
  --redirects 1 --tee 1 --log_dir "$work/logs" \
  --master_addr 127.0.0.1 --master_port "$port" "$prog" 2>&1) || {
  echo "$out"
  echo "FAILED: torchrun exited with an error"
  exit 1
}
echo "$out"
grep -q "torchrun_rpc rank 0: worker1 answered 40 (expected 40), agent store yes" <<<"$out"
grep -q "torchrun_rpc rank 1: worker0 answered 60 (expected 60), agent store yes" <<<"$out"
echo "torchrun check passed"
