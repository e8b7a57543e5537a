#!/usr/bin/env bash
# One side-by-side round of DistributedDataParallel, as docs/benchmarks.md quotes it: PyTorch's
# own DDP (Python, ProcessGroupGloo; its ddp_step_ms, local_step_ms and ddp_overhead_ms keys),
# then bench_ddp on the distrpc backend (shm and tcp) and on gloo where this build has it, world 2.
# Run from the repository root; it builds what it runs into ./build. PyTorch's reference needs
# `apt-get install -y python3-torch`. Prints one JSON line per program.
set -euo pipefail
cd "$(dirname "$0")/../.."
source .ci/deps.sh
distrpc_install_deps >&2
DISTRPC_TARGETS="examples/bench_ddp" distrpc_build build >&2
/usr/bin/python3 examples/reference/torch_c10d_ref.py 2 29640
build/examples/bench_ddp --backend distrpc --transport shm --world 2
build/examples/bench_ddp --backend distrpc --transport tcp --world 2
if build/examples/bench_ddp --backend gloo --world 1 2>&1 | grep -q "this build has: distrpc$"; then
  echo '{"backend": "gloo", "note": "not built (no gloo headers)"}'
else
  build/examples/bench_ddp --backend gloo --world 2
fi
