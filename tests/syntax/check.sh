#!/usr/bin/env bash
# Two compile-only checks sharing one precompiled header (tests/syntax/everything.hpp: libtorch
# and every public distrpc header, parsed once instead of once per file):
#  - tests/compile_fail/*.cpp must FAIL to compile, each with the text its first line names
#    ("// expect: ...");
#  - examples/*.cpp must compile warning-free (-Wall -Wextra -Werror), semantically checked and
#    every template they use instantiated (-fsyntax-only: no code generation; examples/run.sh and
#    DISTRPC_ALL_EXAMPLES=1 bash tests/run.sh build them for real). The soak and distrpc-run are
#    built for real by tests/run.sh and skipped here.
# Prints one line per file and "N passed, M failed".
set -uo pipefail
# Compiler messages in ASCII quotes, whatever the caller's locale, so the expected texts match.
export LC_ALL=C
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cxx=${CXX:-c++}
out_dir=$(mktemp -d)
trap 'rm -rf "$out_dir"' EXIT
jobs=${DISTRPC_JOBS:-2}

# The flags Meson gives the examples. The precompiled header is valid only for these macros, so
# every file of both checks is compiled with them (gloo's switch when its headers are here, as
# Meson's gloo_found would define it).
common=(-std=c++20 -D_FILE_OFFSET_BITS=64 -D_GLIBCXX_USE_CXX11_ABI=1 -DASIO_STANDALONE
        -DASIO_NO_DEPRECATED -pthread -I"$repo/include" -I"$repo/transports/tcp/include"
        -I"$repo/transports/shm/include" -I"$repo/transports/faulty/include"
        -isystem /usr/include/torch/csrc/api/include)
[ -f /usr/include/gloo/context.h ] && common+=(-DUSE_C10D_GLOO)

cp "$here/everything.hpp" "$out_dir/everything.hpp"
if ! "$cxx" "${common[@]}" -Wall -Wextra -Werror -x c++-header "$out_dir/everything.hpp" \
       -o "$out_dir/everything.hpp.gch" >"$out_dir/pch.out" 2>&1; then
  echo "FAIL  the shared precompiled header does not compile:"
  head -30 "$out_dir/pch.out"
  echo "0 passed, 1 failed"
  exit 1
fi
pre=(-Winvalid-pch -include "$out_dir/everything.hpp")

# compile KEY FILE FLAGS...: in the background, DISTRPC_JOBS at a time; output and status kept.
compile() {
  local key="$1" file="$2"; shift 2
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
  ( "$cxx" "${common[@]}" "${pre[@]}" -fsyntax-only "$@" "$file" >"$out_dir/$key.out" 2>&1
    echo $? >"$out_dir/$key.rc" ) &
}

fail_files=("$repo"/tests/compile_fail/*.cpp)
example_files=()
for f in "$repo"/examples/*.cpp; do
  case "$(basename "$f")" in soak.cpp | distrpc_run.cpp) continue ;; esac
  example_files+=("$f")
done
for f in "${fail_files[@]}"; do compile "fail_$(basename "$f")" "$f" -Werror=unused-result; done
for f in "${example_files[@]}"; do
  compile "example_$(basename "$f")" "$f" -Wall -Wextra -Werror -I"$repo/examples"
done
wait

pass=0; fail=0
for f in "${fail_files[@]}"; do
  key="fail_$(basename "$f")"
  want=$(head -1 "$f" | sed -n 's|^// expect: ||p')
  out=$(cat "$out_dir/$key.out")
  rc=$(cat "$out_dir/$key.rc")
  if [ "$rc" -ne 0 ] && grep -qF -- "$want" <<<"$out"; then
    pass=$((pass + 1)); echo "ok    compile_fail/$(basename "$f")"
  else
    fail=$((fail + 1)); echo "FAIL  compile_fail/$(basename "$f"): expected a compile error containing: $want"
    echo "$out" | grep -E "error" | head -5
  fi
done
for f in "${example_files[@]}"; do
  key="example_$(basename "$f")"
  if [ "$(cat "$out_dir/$key.rc")" -eq 0 ] && [ ! -s "$out_dir/$key.out" ]; then
    pass=$((pass + 1)); echo "ok    examples/$(basename "$f")"
  else
    fail=$((fail + 1)); echo "FAIL  examples/$(basename "$f") does not compile cleanly:"
    head -30 "$out_dir/$key.out"
  fi
done
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
