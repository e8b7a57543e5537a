#!/usr/bin/env bash
# One side-by-side round, as docs/benchmarks.md quotes them: the machine's raw limits, PyTorch's
# own RPC (the reference), then bench_rpc on each transport. Run from the repository root after
# `bash examples/run.sh` (which builds build/examples/bench_rpc); PyTorch's reference needs
# `apt-get install -y python3-torch`. Prints one JSON line per program.
set -euo pipefail
cd "$(dirname "$0")/../.."
g++ -O2 -o build/limits examples/reference/limits.cpp
build/limits
/usr/bin/python3 examples/reference/torch_rpc_ref.py
for t in tcp shm auto; do build/examples/bench_rpc --transport "$t"; done
