# Sourced by tests/run.sh and tests/run_gpu.sh: runs the doctest suites of a build directory and
# tallies them. The caller sets `passed`, `failed` (counts so far) and `logdir` (a scratch folder).

# header TEXT: a stage's title with the time since the start (minutes:seconds), so a log shows
# where the run's time goes.
header() { printf '== %s  [%d:%02d]\n' "$1" $((SECONDS / 60)) $((SECONDS % 60)); }

# add_tally LOG: adds the counts of a stage whose last line is "N passed, M failed" (any other
# last line, e.g. the stage died, is one failure); the stage's failures are left in $stage_failed.
add_tally() {
  local last p f
  last=$(tail -1 "$1")
  p=$(echo "$last" | sed -nE 's/^([0-9]+) passed, ([0-9]+) failed$/\1/p')
  f=$(echo "$last" | sed -nE 's/^([0-9]+) passed, ([0-9]+) failed$/\2/p')
  if [ -z "$p" ]; then p=0; f=1; fi
  passed=$((passed + p)); failed=$((failed + f)); stage_failed=$f
  echo "   $last"
}

# run_suite NAME CMD...: runs a doctest binary under a wall-clock limit and adds its counts.
run_suite() {
  local name="$1"; shift
  local log="$logdir/${name//:/_}.log"
  header "$name"
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
  # Cases that skipped themselves (no GPU, no second GPU, ...) say so.
  grep -hE 'skipped: ' "$log" | sed -E 's|^.*/(tests/)|\1|' | sort | uniq -c | sed 's/^/   /'
  if [ $rc -ne 0 ]; then
    echo "---- $name output (last 200 lines) ----"
    tail -200 "$log"
    echo "---- end of $name output ----"
  fi
}

# The RPC suite runs on every transport policy (whole on the first, its transport-relevant cases on
# the others), so a transport cannot pass by being untested.
transports="${DISTRPC_TEST_TRANSPORTS:-tcp shm auto}"

# run_suites DIR PREFIX: every test binary of a build directory (the RPC one per transport).
run_suites() {
  local dir="$1" prefix="$2" t name tr
  for t in "$dir"/tests/test_*; do
    [ -x "$t" ] && [ -f "$t" ] || continue
    name="$prefix$(basename "$t")"
    if [ "$(basename "$t")" = test_rpc ]; then
      # Whole on the first transport listed (tcp); on the others the cases where the transport
      # matters: the core calls and their failures, shutdown, member loss, elastic membership and
      # peers killed mid-call (RRefs and RemoteModule above them are transport-agnostic).
      # DISTRPC_RPC_WHOLE=1 runs the whole suite on every transport.
      local first=1
      for tr in $transports; do  # none listed: not run (see the sanitizer build)
        if [ $first = 1 ] || [ "${DISTRPC_RPC_WHOLE:-0}" = "1" ]; then
          DISTRPC_TEST_TRANSPORT=$tr run_suite "$name[$tr]" "$t"
        else
          DISTRPC_TEST_TRANSPORT=$tr run_suite "$name[$tr]" "$t" \
            -tc='rpc: *,member loss: *,elastic: *,*killed*'
        fi
        first=0
      done
    elif [ "$(basename "$t")" = test_autograd ]; then
      # Whole on TCP; the end-to-end cases named "every transport" on the others too.
      for tr in $transports; do
        if [ "$tr" = tcp ]; then
          DISTRPC_TEST_TRANSPORT=$tr run_suite "$name[$tr]" "$t"
        else
          DISTRPC_TEST_TRANSPORT=$tr run_suite "$name[$tr]" "$t" -tc='*every transport*'
        fi
      done
    else
      run_suite "$name" "$t"
    fi
  done
}
