#!/usr/bin/env bash
# Builds distrpc against the libtorch inside this machine's PyTorch (2.x; with CUDA when it has it)
# and runs every test suite there: the CPU ones and the GPU ones, which run when a GPU is present.
# Needs no network: libtorch comes from PyTorch, the header-only dependencies from the system or
# from subprojects/ (tests/tools/prepare_offline.sh fills it on a machine that has them; carry
# those folders along). Nothing is installed.
#   DISTRPC_TORCH_DIR  another libtorch folder (holding include/ and lib/) instead of PyTorch's
#   DISTRPC_GPU_BUILD  the build directory (build-gpu)
#   PYTHON             the Python whose torch is used (python3)
# Last line: "N passed, M failed"; exit non-zero on any failure.
set -uo pipefail
cd "$(dirname "$0")/.."
source .ci/deps.sh
source tests/suites.sh

python=${PYTHON:-python3}
torch_dir=${DISTRPC_TORCH_DIR:-$("$python" -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null)}
build=${DISTRPC_GPU_BUILD:-build-gpu}
if [ -z "$torch_dir" ] || [ ! -d "$torch_dir/lib" ]; then
  echo "run_gpu: no libtorch found ($python cannot import torch; set DISTRPC_TORCH_DIR)"
  echo "0 passed, 1 failed"
  exit 1
fi

header "build against $torch_dir"
"$python" -c 'import torch; print("   PyTorch", torch.__version__, "CUDA", torch.version.cuda,
      "GPUs", torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null
command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | sed 's/^/   /'
fail_build() { echo "   $1 failed"; tail -60 "$build/meson-logs/meson-log.txt" 2>/dev/null; echo "0 passed, 1 failed"; exit 1; }
distrpc_configure "$build" -Dtorch_dir="$torch_dir" --wrap-mode=nodownload || fail_build "configure"
# An existing build directory made for another libtorch follows this one.
meson configure "$build" -Dtorch_dir="$torch_dir" >/dev/null || fail_build "configure"
targets=$(distrpc_test_targets "$build")
DISTRPC_JOBS=${DISTRPC_JOBS:-$(nproc)} DISTRPC_TARGETS="$targets" distrpc_build "$build" ||
  fail_build "build"

passed=0
failed=0
logdir=$(mktemp -d)
run_suites "$build" ""
rm -rf "$logdir"
header "end"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
