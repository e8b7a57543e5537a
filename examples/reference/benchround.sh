#!/usr/bin/env bash
# One side-by-side round, as docs/benchmarks.md quotes them: the machine's raw limits, PyTorch's
# own RPC (the reference), then bench_rpc on each transport. Run from the repository root; it
# builds what it runs into ./build. PyTorch's reference needs `apt-get install -y python3-torch`.
# Prints one JSON line per program.
set -euo pipefail
cd "$(dirname "$0")/../.."
source .ci/deps.sh
distrpc_install_deps >&2
DISTRPC_TARGETS="examples/bench_rpc" distrpc_build build >&2
g++ -O2 -o build/limits examples/reference/limits.cpp
build/limits
/usr/bin/python3 examples/reference/torch_rpc_ref.py
for t in tcp shm auto; do build/examples/bench_rpc --transport "$t"; done
