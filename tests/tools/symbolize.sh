#!/usr/bin/env bash
# Names the frames of the backtraces in a test log (tests/main.cpp prints them when a test
# crashes): each "BINARY(+0xOFFSET)" frame of a file that is still there becomes its function and
# file:line (addr2line, from binutils). Usage: bash tests/tools/symbolize.sh LOG...  (or stdin)
set -uo pipefail
grep -ho '[^ []*(+0x[0-9a-f]*)' "$@" | awk '!seen[$0]++' | while read -r frame; do
  bin=${frame%%(*}
  off=${frame##*(+}
  off=${off%)}
  [ -f "$bin" ] || continue
  printf '%s  %s\n' "$frame" "$(addr2line -Cfpe "$bin" "$off" 2>/dev/null)"
done
