#!/usr/bin/env bash
# Compile-time checks that must fail with a readable message: each .cpp here names the text its
# compilation must produce on its first line ("// expect: ..."). Prints "N passed, M failed".
set -uo pipefail
# Compiler messages in ASCII quotes, whatever the caller's locale, so the expected texts match.
export LC_ALL=C
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
flags=(-std=c++20 -fsyntax-only -Werror=unused-result -DASIO_STANDALONE -I"$repo/include"
       -I"$repo/transports/tcp/include" -isystem /usr/include/torch/csrc/api/include)
# Each check is a libtorch-heavy -fsyntax-only compile: run them DISTRPC_JOBS (2) at a time.
out_dir=$(mktemp -d)
trap 'rm -rf "$out_dir"' EXIT
jobs=${DISTRPC_JOBS:-2}
for f in "$here"/*.cpp; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
  ( ${CXX:-c++} "${flags[@]}" "$f" >"$out_dir/$(basename "$f").out" 2>&1; echo $? >"$out_dir/$(basename "$f").rc" ) &
done
wait
pass=0; fail=0
for f in "$here"/*.cpp; do
  want=$(head -1 "$f" | sed -n 's|^// expect: ||p')
  out=$(cat "$out_dir/$(basename "$f").out")
  rc=$(cat "$out_dir/$(basename "$f").rc")
  if [ "$rc" -ne 0 ] && grep -qF -- "$want" <<<"$out"; then
    pass=$((pass + 1)); echo "ok    $(basename "$f")"
  else
    fail=$((fail + 1)); echo "FAIL  $(basename "$f"): expected a compile error containing: $want"
    echo "$out" | grep -E "error" | head -5
  fi
done
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
