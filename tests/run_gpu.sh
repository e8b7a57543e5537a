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
#                      examples/reference/torch_cuda_rpc_ref.py, bench_nccl beside
#                      examples/reference/torch_nccl_ref.py, one JSON line each)
#   DISTRPC_PARALLEL_SUITES  1 (the default on 8 cores or more): the suites side by side, their
#                      reports printed in order at the end (test_wire, whose transport cases
#                      time themselves and look at machine-wide state, after the others, alone)
#   DISTRPC_BENCH_LIMIT  seconds each GPU benchmark may run (300)
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
echo "   $(${CXX:-c++} --version | head -1); meson $(meson --version); ninja $(ninja --version); $(nproc) cores"

# OpenSSL: a machine with its libraries (libssl.so.3) but not its headers (no libssl-dev) builds
# with the headers tests/tools/prepare_offline.sh copied, linking the libraries through a folder
# that gives them their unversioned names.
if ! echo '#include <openssl/ssl.h>' | ${CXX:-c++} -x c++ -E - >/dev/null 2>&1 &&
  [ -d subprojects/openssl/include ]; then
  find_lib() {  # find_lib NAME: the path of NAME (libssl.so.3, ...) as the dynamic loader sees it
    local p
    p=$(ldconfig -p 2>/dev/null | awk -v n="$1" '$1 == n {print $NF; exit}')
    [ -z "$p" ] && p=$(ldd "$("$python" -c 'import _ssl; print(_ssl.__file__)' 2>/dev/null)" 2>/dev/null |
      awk -v n="$1" '$1 == n {print $3; exit}')
    echo "$p"
  }
  ssl_lib=$(find_lib libssl.so.3)
  crypto_lib=$(find_lib libcrypto.so.3)
  if [ -n "$ssl_lib" ] && [ -n "$crypto_lib" ]; then
    mkdir -p "$build-openssl"
    ln -sf "$ssl_lib" "$build-openssl/libssl.so"
    ln -sf "$crypto_lib" "$build-openssl/libcrypto.so"
    export CPLUS_INCLUDE_PATH="$PWD/subprojects/openssl/include${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
    export LIBRARY_PATH="$PWD/$build-openssl${LIBRARY_PATH:+:$LIBRARY_PATH}"
    echo "   OpenSSL: headers from subprojects/openssl, libraries $ssl_lib and $crypto_lib"
  else
    echo "   OpenSSL: no headers and no libssl.so.3/libcrypto.so.3 here; the build will fail"
  fi
fi

passed=0
failed=0
fail_build() { echo "   $1 failed"; tail -60 "$build/meson-logs/meson-log.txt" 2>/dev/null; echo "0 passed, 1 failed"; exit 1; }
distrpc_configure "$build" -Dtorch_dir="$torch_dir" --wrap-mode=nodownload || fail_build "configure"
# An existing build directory made for another libtorch follows this one. Warnings do not stop
# this build (another compiler or libtorch may warn where ours does not, and the tests still say
# something): they are listed after it and count as one failure.
meson configure "$build" -Dtorch_dir="$torch_dir" -Dwerror=false >/dev/null || fail_build "configure"
targets="$(distrpc_test_targets "$build") examples/bench_rpc"
# The nccl backend's benchmark, where Meson found NCCL.
ninja -C "$build" -t query examples/bench_nccl >/dev/null 2>&1 && targets="$targets examples/bench_nccl"
build_log="$build/build.log"
# -k 0: every error at once; the suites that did build still run. Programs left from an earlier
# build go first, so that one whose sources no longer compile cannot run in its place.
rm -f "$build"/tests/test_* "$build/examples/bench_rpc" 2>/dev/null
DISTRPC_JOBS=${DISTRPC_JOBS:-$(nproc)} DISTRPC_NINJA_ARGS="-k 0" DISTRPC_TARGETS="$targets" \
  distrpc_build "$build" 2>&1 | tee "$build_log"
build_rc=$?
if [ "$build_rc" -ne 0 ]; then
  echo "   the build failed (errors above); the suites that built run below"
  failed=$((failed + 1))
fi
warnings=$(grep -c ' warning: ' "$build_log" || true)
if [ "$warnings" -gt 0 ]; then
  echo "   $warnings compiler warning lines:"
  grep -E ' warning: ' "$build_log" | sort | uniq -c | sort -rn | head -40 | sed 's/^/   /'
  failed=$((failed + 1))
fi

# shellcheck disable=SC2086  # $targets: one program per word
check_link_order "$build" $targets

logdir=$(mktemp -d)
# The CUDA IPC cases expect tensors from plain cudaMalloc blocks, which CUDA IPC can export:
# expandable segments and the cudaMallocAsync backend give memory it cannot (those tensors then
# take the CPU path, correctly, but the cases count channel transfers).
unset PYTORCH_CUDA_ALLOC_CONF
export DISTRPC_PARALLEL_SUITES=${DISTRPC_PARALLEL_SUITES:-$([ "$(nproc)" -ge 8 ] && echo 1 || echo 0)}
if [ "${DISTRPC_GPU_QUICK:-0}" = "1" ]; then
  # doctest's -tc is case-insensitive: every case naming a device, CUDA, NCCL or a GPU, and those of
  # what differs between libtorch versions (tensor hooks, the c10d store adapter).
  for t in "$build"/tests/test_*; do
    [ -x "$t" ] && [ -f "$t" ] || continue
    DISTRPC_TEST_TRANSPORT=tcp launch_suite "$(basename "$t")[devices]" "$t" \
      -tc='*device*,*cuda*,*gpu*,*nccl*,*hook*,*C10dStoreAdapter*'
  done
  finish_suites
else
  run_suites "$build" ""
fi
rm -rf "$logdir"

# The GPU benchmarks, side by side with PyTorch's own stack in the same run (docs/benchmarks.md).
if [ "${DISTRPC_GPU_BENCH:-1}" = "1" ]; then
  header "GPU benchmarks (bench_rpc --cuda, PyTorch's RPC with a device map; bench_nccl, PyTorch's NCCL)"
  # A benchmark that fails (not one that skips for want of a GPU) counts as a failure.
  bench_limit=${DISTRPC_BENCH_LIMIT:-300}
  # cuda_ipc: GPU to GPU through CUDA IPC (built where the CUDA runtime was found); nccl: the
  # Nccl policy, whose CUDA IPC side serves two workers on one GPU.
  for tr in cuda_ipc nccl shm tcp; do
    timeout "$bench_limit" "$build/examples/bench_rpc" --cuda --transport "$tr" || failed=$((failed + 1))
  done
  timeout "$bench_limit" "$python" examples/reference/torch_cuda_rpc_ref.py || failed=$((failed + 1))
  if [ -x "$build/examples/bench_nccl" ]; then
    timeout "$bench_limit" "$build/examples/bench_nccl" || failed=$((failed + 1))
    timeout "$bench_limit" "$python" examples/reference/torch_nccl_ref.py || failed=$((failed + 1))
  fi
fi
header "end"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
