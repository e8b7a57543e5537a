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
# DISTRPC_PARALLEL_SUITES=1 runs them all at once (a machine with many cores) and prints their
# reports in order once the last one ends.
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
          DISTRPC_TEST_TRANSPORT=$tr launch_suite "$name[$tr]" "$t"
        else
          DISTRPC_TEST_TRANSPORT=$tr launch_suite "$name[$tr]" "$t" \
            -tc='rpc: *,member loss: *,elastic: *,*killed*'
        fi
        first=0
      done
    elif [ "$(basename "$t")" = test_autograd ]; then
      # Whole on TCP; the end-to-end cases named "every transport" on the others too.
      for tr in $transports; do
        if [ "$tr" = tcp ]; then
          DISTRPC_TEST_TRANSPORT=$tr launch_suite "$name[$tr]" "$t"
        else
          DISTRPC_TEST_TRANSPORT=$tr launch_suite "$name[$tr]" "$t" -tc='*every transport*'
        fi
      done
    else
      launch_suite "$name" "$t"
    fi
  done
  finish_suites
}

parallel_outs=()

# launch_suite NAME CMD...: run_suite now, or (DISTRPC_PARALLEL_SUITES=1) in the background, its
# report and counts kept for finish_suites.
launch_suite() {
  if [ "${DISTRPC_PARALLEL_SUITES:-0}" != "1" ]; then
    run_suite "$@"
    return
  fi
  # test_wire's transport cases time themselves and look at machine-wide state (sockets and
  # /dev/shm entries left by dead processes): it runs alone, once the others are done.
  case "$1" in
    *test_wire*)
      finish_suites
      run_suite "$@"
      return
      ;;
  esac
  [ ${#parallel_outs[@]} -eq 0 ] && trap 'kill $(jobs -p) 2>/dev/null' INT TERM
  local out="$logdir/parallel.${#parallel_outs[@]}"
  parallel_outs+=("$out")
  (
    passed=0
    failed=0
    run_suite "$@"
    echo "tally $passed $failed"
  ) >"$out" 2>&1 &
}

# finish_suites: waits for the suites launch_suite started, prints their reports in the order
# they were started and adds their counts (a suite that left no count is one failure).
finish_suites() {
  [ ${#parallel_outs[@]} -eq 0 ] && return 0
  wait
  local out p f
  for out in "${parallel_outs[@]}"; do
    grep -v '^tally ' "$out"
    read -r _ p f < <(grep '^tally ' "$out" | tail -1)
    passed=$((passed + ${p:-0}))
    failed=$((failed + ${f:-1}))
  done
  parallel_outs=()
}

# check_link_order DIR [PROGRAM...]: each program (paths relative to DIR; none given: every
# program in DIR) that needs libtorch (or c10) lists libstdc++ before it among the libraries it
# needs, so that std:: calls never bind to the libstdc++ copies that PyTorch's pip wheels export
# (meson.build says why). A compiler that links libstdc++ statically leaves it out of that list:
# such a program passes when it imports no std:: symbol at all (its own copy answers them all).
# One pass or one failure.
check_link_order() {
  local dir="$1" t needed first bad="" checked=0 static=0 imports symbols
  shift
  header "link order (libstdc++ before libtorch)"
  if ! command -v readelf >/dev/null || ! command -v nm >/dev/null; then
    echo "   readelf or nm (binutils) is missing: cannot check"
    failed=$((failed + 1))
    return
  fi
  while IFS= read -r t; do
    needed=$(readelf -d "$t" 2>/dev/null | sed -nE 's/.*\(NEEDED\).*\[(.*)\]/\1/p')
    echo "$needed" | grep -qE '^lib(torch|c10)' || continue
    checked=$((checked + 1))
    first=$(echo "$needed" | grep -E '^lib(stdc\+\+|torch|c10)' | head -1)
    if [[ "$first" == libstdc++* ]]; then
      continue
    elif ! echo "$needed" | grep -q '^libstdc++'; then
      # libstdc++ linked in: no std:: name may be left to another library. Mangled, those are
      # St (std::), Sa Sb Ss Si So Sd (std::allocator, basic_string, string, istream, ostream,
      # iostream), after N and any qualifiers (K, V, R, O, r), and behind the vtable, typeinfo,
      # VTT, guard and thread-local prefixes.
      if ! symbols=$(nm -D --undefined-only "$t" 2>&1); then
        bad="$bad ${t#"$dir"/}(nm failed: ${symbols%%$'\n'*})"
        continue
      fi
      imports=$(echo "$symbols" | awk '{print $NF}' |
        grep -cE '^_Z(T[ISVT]|GV|TH|TW)?N?[rVKRO]*S[tabsiod]' || true)
      if [ "$imports" -eq 0 ]; then
        static=$((static + 1))
        continue
      fi
      bad="$bad ${t#"$dir"/}($imports std:: imports, no libstdc++)"
    else
      bad="$bad ${t#"$dir"/}"
    fi
  done < <(if [ $# -gt 0 ]; then
    for t in "$@"; do [ -f "$dir/$t" ] && [ -x "$dir/$t" ] && echo "$dir/$t"; done
  else
    find "$dir" -type f -perm -u+x ! -name '*.so*' ! -path '*/meson-*' ! -path '*.p/*'
  fi)
  if [ -n "$bad" ]; then
    echo "   libtorch or c10 comes before libstdc++ in:$bad"
    failed=$((failed + 1))
  else
    echo "   ok ($checked programs; $static of them carry libstdc++ linked in)"
    passed=$((passed + 1))
  fi
}
