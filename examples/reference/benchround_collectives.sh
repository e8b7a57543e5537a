#!/usr/bin/env bash
# One side-by-side round of collectives, as docs/benchmarks.md quotes them: the machine's raw
# limits (memcpy is the ceiling of a shared-memory all-reduce), PyTorch's own process groups
# (Python + ProcessGroupGloo, the reference), then bench_collectives for each backend and world.
# Run from the repository root; it builds what it runs into ./build. PyTorch's reference needs
# `apt-get install -y python3-torch`. Prints one JSON line per program.
set -euo pipefail
cd "$(dirname "$0")/../.."
source .ci/deps.sh
distrpc_install_deps >&2
DISTRPC_TARGETS="examples/bench_collectives" distrpc_build build >&2
g++ -O2 -o build/limits examples/reference/limits.cpp
build/limits
for w in 2 4; do
  /usr/bin/python3 examples/reference/torch_c10d_ref.py "$w" $((29633 + w))
  build/examples/bench_collectives --backend distrpc --transport shm --world "$w"
  build/examples/bench_collectives --backend distrpc --transport tcp --world "$w"
  if build/examples/bench_collectives --backend gloo --world 1 2>&1 | grep -q "this build has: distrpc$"; then
    echo '{"backend": "gloo", "note": "not built (no gloo headers)"}'
  else
    build/examples/bench_collectives --backend gloo --world "$w"
  fi
done
