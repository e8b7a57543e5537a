#!/usr/bin/env bash
# Two compile-only checks, each one translation unit:
#  - tests/compile_fail/*.cpp must each FAIL to compile with the text their first line names
#    ("// expect: ..."): the error must be reported for that file (its own line, or a
#    "required from here" naming it);
#  - examples/*.cpp must compile warning-free (-Wall -Wextra -Werror), semantically checked and
#    every template they use instantiated (-fsyntax-only: no code generation; examples/run.sh and
#    DISTRPC_ALL_EXAMPLES=1 bash tests/run.sh build them for real). The soak and distrpc-run are
#    built for real by tests/run.sh and skipped here.
# Why one unit per check: what a source costs here is analysing distrpc's inline functions and
# instantiating the templates they name (about 20 s per source on a 2-core VM, paid again by
# every source: a precompiled header does not keep instantiations), not the file itself. 13
# examples analysed one by one took 7 min of compiler time; as one unit, 1 min. Each file is
# included inside a namespace of its own (example_<name>, case_<name>) after every header any of
# them includes, so their file-local names cannot collide and their own #includes are no-ops.
# Prints one line per file and "N passed, M failed".
set -uo pipefail
# Compiler messages in ASCII quotes, whatever the caller's locale, so the expected texts match.
export LC_ALL=C
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cxx=${CXX:-c++}
out_dir=$(mktemp -d)
trap 'rm -rf "$out_dir"' EXIT

# The flags Meson gives the examples (gloo's switch when its headers are here, as Meson's
# gloo_found would define it).
common=(-std=c++20 -D_FILE_OFFSET_BITS=64 -D_GLIBCXX_USE_CXX11_ABI=1 -DASIO_STANDALONE
        -DASIO_NO_DEPRECATED -pthread -I"$repo/include" -I"$repo/transports/tcp/include"
        -I"$repo/transports/shm/include" -I"$repo/transports/faulty/include"
        -I"$repo/transports/device/include" -I"$repo/examples" -isystem /usr/include/torch/csrc/api/include -fsyntax-only)
[ -f /usr/include/gloo/context.h ] && common+=(-DUSE_C10D_GLOO)
# NCCL's and the CUDA runtime's switches and headers where Meson's default -Dnvidia_dir has them
# (bench_nccl and bench_rpc's cuda_ipc need them; without them those parts are left out here, as
# Meson leaves them out of the build).
nccl_inc=/usr/local/cuda/include
have_nccl=0
if [ -f "$nccl_inc/nccl.h" ] && [ -f "$nccl_inc/cuda_runtime_api.h" ]; then
  common+=(-DDISTRPC_HAVE_NCCL -DDISTRPC_HAVE_CUDART -isystem "$nccl_inc")
  have_nccl=1
fi

# unit OUT PREFIX FILES...: one source holding every public header (tests/syntax/everything.hpp),
# the files' own #include lines, then each file inside namespace PREFIX<name>.
unit() {
  local out="$1" prefix="$2"; shift 2
  {
    echo "#include \"$here/everything.hpp\""
    grep -h -E '^#include' "$@" | sort -u
    for f in "$@"; do
      printf 'namespace %s%s {\n#include "%s"\n}  // namespace\n' "$prefix" "$(basename "$f" .cpp)" "$f"
    done
  } >"$out"
}

fail_files=("$repo"/tests/compile_fail/*.cpp)
example_files=()
for f in "$repo"/examples/*.cpp; do
  case "$(basename "$f")" in
    soak.cpp | distrpc_run.cpp) continue ;;
    bench_nccl.cpp) [ "$have_nccl" = 1 ] || continue ;;
  esac
  example_files+=("$f")
done
unit "$out_dir/fail.cpp" case_ "${fail_files[@]}"
unit "$out_dir/examples.cpp" example_ "${example_files[@]}"

# Both units at once (two cores).
"$cxx" "${common[@]}" -Werror=unused-result "$out_dir/fail.cpp" >"$out_dir/fail.out" 2>&1 &
fail_pid=$!
"$cxx" "${common[@]}" -Wall -Wextra -Werror "$out_dir/examples.cpp" >"$out_dir/examples.out" 2>&1
examples_rc=$?
wait "$fail_pid"

pass=0; fail=0
# Each error line of the failure unit goes to the case file named last before it: the line of
# the error itself, or the "required from here" that ends its instantiation context.
awk -v dir="$repo/tests/compile_fail/" '
  index($0, dir) == 1 { name = substr($0, length(dir) + 1); sub(/\.cpp:.*/, "", name); cur = name }
  / error: / && cur != "" { print cur "\t" $0 }
' "$out_dir/fail.out" >"$out_dir/fail.errors"
for f in "${fail_files[@]}"; do
  name=$(basename "$f" .cpp)
  want=$(head -1 "$f" | sed -n 's|^// expect: ||p')
  if [ -n "$want" ] && grep -F -- "$name"$'\t' "$out_dir/fail.errors" | grep -qF -- "$want"; then
    pass=$((pass + 1)); echo "ok    compile_fail/$name.cpp"
  else
    fail=$((fail + 1)); echo "FAIL  compile_fail/$name.cpp: expected a compile error containing: $want"
    grep -F -- "$name"$'\t' "$out_dir/fail.errors" | cut -f2- | head -5
  fi
done

# The examples' unit compiles cleanly, or each example named in its messages fails.
named=0
for f in "${example_files[@]}"; do
  if [ "$examples_rc" -eq 0 ] && [ ! -s "$out_dir/examples.out" ]; then
    pass=$((pass + 1)); echo "ok    examples/$(basename "$f")"
  elif grep -qF -- "$f:" "$out_dir/examples.out"; then
    fail=$((fail + 1)); named=$((named + 1))
    echo "FAIL  examples/$(basename "$f") does not compile cleanly:"
    grep -F -- "$f:" "$out_dir/examples.out" | head -10
  else
    pass=$((pass + 1)); echo "ok    examples/$(basename "$f")"
  fi
done
if { [ "$examples_rc" -ne 0 ] || [ -s "$out_dir/examples.out" ]; } && [ "$named" -eq 0 ]; then
  fail=$((fail + 1)); echo "FAIL  the examples' unit does not compile cleanly, in no example's own lines:"
  head -30 "$out_dir/examples.out"
fi
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
