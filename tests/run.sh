#!/usr/bin/env bash
# Installs what is missing, builds, runs every test suite and the consumer check.
# Last line: "N passed, M failed" (doctest test cases summed over the suites); exit non-zero on any failure.
set -uo pipefail
cd "$(dirname "$0")/.."
source .ci/deps.sh

distrpc_install_deps || { echo "dependency installation failed"; echo "0 passed, 1 failed"; exit 1; }
distrpc_build build || { echo "build failed"; echo "0 passed, 1 failed"; exit 1; }

passed=0
failed=0
logdir=$(mktemp -d)

# run_suite NAME CMD...: runs a doctest binary under a wall-clock limit and adds its counts.
run_suite() {
  local name="$1"; shift
  local log="$logdir/$name.log"
  echo "== $name"
  local start=$SECONDS
  timeout --kill-after=10 "${DISTRPC_SUITE_LIMIT:-1500}" "$@" >"$log" 2>&1
  local rc=$?
  local line
  line=$(grep -E '^\[doctest\] test cases:' "$log" | tail -1)
  local p f
  p=$(echo "$line" | sed -nE 's/.*\| *([0-9]+) passed.*/\1/p')
  f=$(echo "$line" | sed -nE 's/.*\| *([0-9]+) failed.*/\1/p')
  p=${p:-0}; f=${f:-0}
  # A crash, a hang killed by timeout, or a non-zero exit without a counted failure is a failure too.
  if [ $rc -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi
  passed=$((passed + p)); failed=$((failed + f))
  echo "   $line (exit $rc, $((SECONDS - start)) s)"
  if [ $rc -ne 0 ]; then
    echo "---- $name output (last 200 lines) ----"
    tail -200 "$log"
    echo "---- end of $name output ----"
  fi
}

for t in build/tests/test_*; do
  [ -x "$t" ] && [ -f "$t" ] && run_suite "$(basename "$t")" "$t"
done

echo "== consumer (distrpc as a Meson subproject)"
if timeout 900 bash tests/consumer/check.sh >"$logdir/consumer.log" 2>&1; then
  passed=$((passed + 1)); echo "   ok"
else
  failed=$((failed + 1)); echo "   FAILED"; tail -50 "$logdir/consumer.log"
fi

rm -rf "$logdir"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
