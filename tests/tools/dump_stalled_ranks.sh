#!/usr/bin/env bash
# Catches a multi-process case that stalls only now and then: runs beside a test binary and, once
# every rank of the case has run SECONDS, prints the stacks of all their threads (gdb), once per
# run of the case. Ranks are the processes whose environment has DISTRPC_MP_CASE=<case> (the
# harness re-executes the test binary with it).
#
#   tests/tools/dump_stalled_ranks.sh 'elastic target: kill and replace' 50 > stacks.txt &
#   build/tests/test_rpc            # or a loop of runs; stop the watcher with kill %1
set -uo pipefail
if [ $# -ne 2 ]; then
  echo "usage: $0 CASE SECONDS" >&2
  exit 2
fi
case_name="$1"
limit="$2"
command -v gdb >/dev/null || { echo "gdb not found" >&2; exit 1; }
dumped=""
while true; do
  ranks=()
  for env in /proc/[0-9]*/environ; do
    if { tr '\0' '\n' <"$env"; } 2>/dev/null | grep -qxF "DISTRPC_MP_CASE=$case_name"; then
      pid=${env#/proc/}
      ranks+=("${pid%/environ}")
    fi
  done
  if [ ${#ranks[@]} -gt 0 ]; then
    key="${ranks[*]}"
    oldest=0
    for p in "${ranks[@]}"; do
      e=$(ps -o etimes= -p "$p" 2>/dev/null | tr -d ' ')
      [ -n "$e" ] && [ "$e" -gt "$oldest" ] && oldest=$e
    done
    if [ "$oldest" -ge "$limit" ] && [ "$key" != "$dumped" ]; then
      dumped="$key"
      # Every rank's number first: attaching gdb takes seconds per process, and the others may
      # end meanwhile.
      names=()
      for p in "${ranks[@]}"; do
        rank=$({ tr '\0' '\n' <"/proc/$p/environ"; } 2>/dev/null | sed -n 's/^DISTRPC_MP_RANK=//p')
        names+=("rank ${rank:-?} pid $p")
      done
      for i in "${!ranks[@]}"; do
        echo "==== $(date +%T) case '$case_name' ${names[$i]} (the oldest rank: ${oldest} s)"
        timeout 60 gdb -p "${ranks[$i]}" -batch -ex "thread apply all bt 30" 2>&1 |
          grep -vE '^\[New LWP|^$'
      done
    fi
  fi
  sleep 2
done
