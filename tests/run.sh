#!/usr/bin/env bash
# Installs what is missing, builds, runs every test suite, the consumer check and the torchrun check.
# Last line: "N passed, M failed" (doctest test cases summed over the suites); exit non-zero on any failure.
set -uo pipefail
cd "$(dirname "$0")/.."
source .ci/deps.sh
source tests/suites.sh

distrpc_install_deps || { echo "dependency installation failed"; echo "0 passed, 1 failed"; exit 1; }
# The test binaries, the programs the checks below run, and the soak; the other examples are
# compiled by the examples check below (syntax only, all of them as one translation unit: a
# full build of every example would cost about 13 more minutes on 2 cores) and built for real
# by examples/run.sh. DISTRPC_ALL_EXAMPLES=1 builds every example here as well.
header "main build (test programs, the programs the checks run, the soak)"
distrpc_configure build || { echo "configure failed"; echo "0 passed, 1 failed"; exit 1; }
targets=""  # empty: everything
[ "${DISTRPC_ALL_EXAMPLES:-0}" = "1" ] || targets=$(distrpc_test_targets build)
DISTRPC_TARGETS="$targets" distrpc_build build || { echo "build failed"; echo "0 passed, 1 failed"; exit 1; }

passed=0
failed=0
logdir=$(mktemp -d)

# shellcheck disable=SC2086  # $targets: one program per word (empty: every program)
check_link_order build $targets
run_suites build ""

# Without libtorch (-Dtorch=disabled): what a program that only rendezvous or launches builds on,
# the store layer, launch_local and distrpc-run, with test_core (no libtorch header: quick).
header "build without libtorch (-Dtorch=disabled)"
if DISTRPC_TARGETS="tests/test_core" distrpc_build build-notorch -Dtorch=disabled \
     -Dexamples=false >"$logdir/notorch-build.log" 2>&1; then
  run_suites build-notorch "notorch:"
else
  failed=$((failed + 1)); echo "   build without libtorch FAILED"; tail -50 "$logdir/notorch-build.log"
fi

# AddressSanitizer + UndefinedBehaviorSanitizer build (DISTRPC_SANITIZE=0 skips it for a quick local
# run). By default it builds and runs test_core (stores, futures, harness) and test_wire (the wire
# codec, its fuzzing, and the Tcp, Shm and Auto transports: the code that parses untrusted bytes and
# manages raw memory). DISTRPC_ASAN_RPC="tcp"
# (or "tcp shm auto") also builds test_rpc under the sanitizers and runs it on those transports.
# At -O0: instrumented code optimized at -O1 took twice as long to compile, and these suites'
# run time is process start-up and waits, not code speed.
# Leak checking is off: libtorch keeps allocations alive until exit. GCC's -Wmaybe-uninitialized
# gives false positives on sanitizer-instrumented code (inside libtorch's intrusive_ptr): it is off
# for this build only.
if [ "${DISTRPC_SANITIZE:-1}" != "0" ]; then
  header "sanitizer build (address,undefined)"
  asan_targets=(tests/test_core tests/test_wire)
  [ -n "${DISTRPC_ASAN_RPC:-}" ] && asan_targets+=(tests/test_rpc)
  if DISTRPC_CPP_ARGS=-Wno-maybe-uninitialized DISTRPC_TARGETS="${asan_targets[*]}" \
       distrpc_build build-asan -Db_sanitize=address,undefined -Db_lundef=false -Dexamples=false \
       -Doptimization=0 >"$logdir/asan-build.log" 2>&1; then
    transports="${DISTRPC_ASAN_RPC:-}" \
      ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
      run_suites build-asan "asan:"
  else
    failed=$((failed + 1)); echo "   sanitizer build FAILED"; tail -50 "$logdir/asan-build.log"
  fi
fi

# ThreadSanitizer builds (opt-in: DISTRPC_TSAN=1). First test_core configured without libtorch
# (stores and rendezvous, futures, thread pools, the group protocol's decisions, the transports'
# connection layer, the launcher), then test_wire and test_rpc on libtorch (below). Reports make
# a binary exit non-zero (a failure); known false positives are suppressed, each with its reason,
# in tests/tsan.supp. GCC warns (-Wtsan) that
# TSan does not model the atomic_thread_fence of asio's fenced blocks (the store server's
# io_context); asio orders those handlers with its own mutex too, so the warning is off for this
# build only.
if [ "${DISTRPC_TSAN:-0}" = "1" ]; then
  tsan_options="suppressions=$PWD/tests/tsan.supp:second_deadlock_stack=1:history_size=4"
  header "thread sanitizer build (thread, test_core without libtorch)"
  if DISTRPC_CPP_ARGS=-Wno-tsan DISTRPC_TARGETS="tests/test_core" distrpc_build build-tsan -Dtorch=disabled -Dexamples=false \
       -Db_sanitize=thread -Db_lundef=false -Doptimization=1 >"$logdir/tsan-build.log" 2>&1; then
    TSAN_OPTIONS="$tsan_options" \
      run_suites build-tsan "tsan:"
  else
    failed=$((failed + 1)); echo "   thread sanitizer build FAILED"; tail -50 "$logdir/tsan-build.log"
  fi
  # The agent over libtorch: test_wire (codec, transports' conformance) and test_rpc on tcp and
  # shm (DISTRPC_TSAN_TRANSPORTS). libtorch itself is not instrumented: what it does inside its
  # own code (kernels, refcounts dropped there, its allocator) is invisible to TSan, so
  # tests/tsan.supp ignores the interceptors called from its libraries and reports whose every
  # frame is there; a race in our code, which is instrumented, is still reported.
  header "thread sanitizer build (thread, test_wire and test_rpc on libtorch)"
  if DISTRPC_CPP_ARGS=-Wno-tsan DISTRPC_TARGETS="tests/test_wire tests/test_rpc" \
       distrpc_build build-tsan-torch -Dexamples=false -Db_sanitize=thread -Db_lundef=false \
       -Doptimization=1 >"$logdir/tsan-torch-build.log" 2>&1; then
    transports="${DISTRPC_TSAN_TRANSPORTS:-tcp shm}" \
      TSAN_OPTIONS="$tsan_options" \
      run_suites build-tsan-torch "tsan:"
  else
    failed=$((failed + 1)); echo "   thread sanitizer build FAILED"; tail -50 "$logdir/tsan-torch-build.log"
  fi
fi

# Coverage-guided fuzzing (libFuzzer, under ASan and UBSan) of the decoders that read what a peer
# sends: frames, the handshake, tensors, IValues, message payloads, TCPStore requests and the
# shared-memory ring's header, records and segments (tests/fuzz/run.sh: its own build in
# build-fuzz, regression inputs replayed first, then DISTRPC_FUZZ_SECONDS per target, 15 by
# default, two targets at a time: under 2 minutes in all). One pass or fail per target.
# DISTRPC_FUZZ=0 skips it.
if [ "${DISTRPC_FUZZ:-1}" != "0" ]; then
  header "fuzzing (libFuzzer: tests/fuzz/run.sh)"
  bash tests/fuzz/run.sh >"$logdir/fuzz.log" 2>&1
  grep -E '^fuzz_[a-z_]+: ' "$logdir/fuzz.log" | sed 's/^/   /'
  add_tally "$logdir/fuzz.log"
  if [ "$stage_failed" -ne 0 ]; then
    echo "---- fuzzing output (last 150 lines) ----"
    tail -150 "$logdir/fuzz.log"
    echo "---- end of fuzzing output ----"
  fi
fi

header "compile-only checks (a wrong remote call must not compile, with a readable message; every example compiles: tests/syntax/check.sh)"
if bash tests/syntax/check.sh >"$logdir/syntax.log" 2>&1; then :; fi
add_tally "$logdir/syntax.log"
[ "$stage_failed" -eq 0 ] || cat "$logdir/syntax.log"

header "layering (a header includes only its own layer and those below: docs/architecture.md)"
if bash tests/layering/check.sh >"$logdir/layering.log" 2>&1; then
  passed=$((passed + 1)); echo "   $(tail -2 "$logdir/layering.log" | head -1)"
else
  failed=$((failed + 1)); echo "   FAILED"; cat "$logdir/layering.log"
fi

header "two hosts (network namespaces, else extra addresses on lo: tests/hosts/check.sh)"
timeout 300 bash tests/hosts/check.sh build >"$logdir/hosts.log" 2>&1
rc=$?
if [ $rc -eq 0 ]; then
  passed=$((passed + 1)); echo "   $(tail -1 "$logdir/hosts.log")"
elif [ $rc -eq 77 ]; then
  echo "   $(tail -1 "$logdir/hosts.log")"
else
  failed=$((failed + 1)); echo "   FAILED"; tail -60 "$logdir/hosts.log"
fi

header "consumer (two processes calling each other: distrpc as a Meson subproject, and installed through pkg-config and CMake; the installed distrpc-run)"
if timeout 900 bash tests/consumer/check.sh >"$logdir/consumer.log" 2>&1; then
  passed=$((passed + 1)); echo "   ok"
else
  failed=$((failed + 1)); echo "   FAILED"; tail -50 "$logdir/consumer.log"
fi

header "torchrun (two distrpc ranks launched by PyTorch's torchrun meet through its agent's TCPStore and call each other)"
if timeout 600 bash tests/interop/check.sh build >"$logdir/torchrun.log" 2>&1; then
  passed=$((passed + 1)); echo "   ok"
else
  failed=$((failed + 1)); echo "   FAILED"; tail -50 "$logdir/torchrun.log"
fi

header "two binaries (a server and a client built from different sources, through named declarations)"
if timeout 600 bash tests/two_binaries/check.sh build >"$logdir/two_binaries.log" 2>&1; then
  passed=$((passed + 1)); echo "   ok"
else
  failed=$((failed + 1)); echo "   FAILED"; tail -50 "$logdir/two_binaries.log"
fi

# Chaos soak: a dynamic group of 4 workers per transport, each keeping 1,000 calls in flight for
# 20 s while a worker is killed with SIGKILL every few seconds and replaced (examples/soak; its
# JSON says what each rule measured). DISTRPC_SOAK_SECONDS changes the length.
if [ -x build/examples/soak ]; then
  for tr in $transports; do
    header "chaos soak [$tr] (4 workers, ${DISTRPC_SOAK_SECONDS:-20} s, kills and replacements)"
    start=$SECONDS
    if timeout 300 build/examples/soak --transport "$tr" --seconds "${DISTRPC_SOAK_SECONDS:-20}" \
         --kill-every-ms 3000 --max-growth-pct "${DISTRPC_SOAK_GROWTH:-15}" \
         >"$logdir/soak-$tr.log" 2>&1; then
      passed=$((passed + 1)); rc=0
    else
      failed=$((failed + 1)); rc=1
    fi
    json=$(grep -E '^\{"bench":"soak"' "$logdir/soak-$tr.log" | tail -1)
    json=${json%%,\"workers_final\"*}  # the group's totals, not each worker's
    summary=$(echo "$json" | grep -oE '"(kills|replacements|issued|completed|failed|failed_unnamed|lost|hangs|max_heap_growth_after_warmup_pct|max_rss_growth_after_warmup_pct)":[0-9.e+-]+' | tr '\n' ' ')
    echo "   ${summary:-no report} ($((SECONDS - start)) s)"
    if [ $rc -ne 0 ]; then echo "   FAILED"; tail -40 "$logdir/soak-$tr.log"; fi
  done
fi

rm -rf "$logdir"
header "end"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
