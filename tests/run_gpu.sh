#!/usr/bin/env bash
# Builds distrpc against the libtorch inside this machine's PyTorch (2.x; with CUDA when it has it)
# and runs every test suite there: the CPU ones and the GPU ones, which run when a GPU is present.
# Needs no network: libtorch comes from PyTorch, the header-only dependencies from the system or
# from subprojects/ (tests/tools/prepare_offline.sh fills it on a machine that has them; carry
# those folders along). Nothing is installed.
#   DISTRPC_TORCH_DIR  another libtorch folder (holding include/ and lib/) instead of PyTorch's
#   DISTRPC_GPU_BUILD  the build directory (build-gpu)
#   DISTRPC_GPU_QUICK  1: run only the cases about devices, CUDA and GPUs (a short GPU session:
#                      the whole build still shows that everything compiles against this libtorch)
#   DISTRPC_GPU_BENCH  0: skip the GPU benchmarks at the end (bench_rpc --cuda beside
#                      examples/reference/torch_cuda_rpc_ref.py, one JSON line each)
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
targets="$(distrpc_test_targets "$build") examples/bench_rpc"
DISTRPC_JOBS=${DISTRPC_JOBS:-$(nproc)} DISTRPC_TARGETS="$targets" distrpc_build "$build" ||
  fail_build "build"

passed=0
failed=0
logdir=$(mktemp -d)
if [ "${DISTRPC_GPU_QUICK:-0}" = "1" ]; then
  # doctest's -tc is case-insensitive: every case naming a device, CUDA or a GPU, and those of
  # what differs between libtorch versions (tensor hooks, the c10d store adapter).
  for t in "$build"/tests/test_*; do
    [ -x "$t" ] && [ -f "$t" ] || continue
    DISTRPC_TEST_TRANSPORT=tcp run_suite "$(basename "$t")[devices]" "$t" \
      -tc='*device*,*cuda*,*gpu*,*hook*,*C10dStoreAdapter*'
  done
else
  run_suites "$build" ""
fi
rm -rf "$logdir"

# The GPU benchmarks, side by side with PyTorch's own stack in the same run (docs/benchmarks.md).
if [ "${DISTRPC_GPU_BENCH:-1}" = "1" ]; then
  header "GPU benchmarks (bench_rpc --cuda, then PyTorch's RPC with a device map)"
  # A benchmark that fails (not one that skips for want of a GPU) counts as a failure.
  for tr in shm tcp; do
    timeout 300 "$build/examples/bench_rpc" --cuda --transport "$tr" || failed=$((failed + 1))
  done
  timeout 300 "$python" examples/reference/torch_cuda_rpc_ref.py || failed=$((failed + 1))
fi
header "end"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
