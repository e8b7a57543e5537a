#!/usr/bin/env bash
# Keeps the layering true: a header may include only headers of its own layer or of a layer below
# it (docs/architecture.md lists the layers; the map below mirrors that table). Includes that go
# up and are not listed in known_exceptions.txt fail the check, and so does a listed exception
# that no longer occurs (the list can only shrink). Last line: "N passed, M failed".
set -uo pipefail
cd "$(dirname "$0")/../.."

# layer_of HEADER (as included: distrpc/...): prints the layer's rank, bottom-up.
layer_of() {
  case "$1" in
    distrpc/future.hpp | distrpc/error.hpp | distrpc/rpc_error.hpp | distrpc/worker_info.hpp | \
      distrpc/options.hpp | distrpc/bounded_thread.hpp | distrpc/thread_pool.hpp | \
      distrpc/function_id.hpp | distrpc/function_ref.hpp | distrpc/log.hpp | \
      distrpc/log_c10.hpp | distrpc/tls_options.hpp | distrpc/device_map.hpp | \
      distrpc/torch_compat.hpp | distrpc/device_future.hpp | distrpc/entry_gate.hpp | \
      distrpc/cuda_device_scope.hpp | distrpc/cuda_event_poll.hpp) echo 0 ;; # values
    distrpc/net/* | distrpc/launch.hpp) echo 1 ;;                             # net (OS helpers)
    distrpc/wire.hpp | distrpc/wire/*) echo 2 ;;                              # wire
    distrpc/store.hpp | distrpc/store/*) echo 3 ;;                            # store
    # transport: the concept, Auto, and each policy's headers under transports/<name>/include
    # (tcp.hpp, shm.hpp and shm/*, faulty.hpp)
    distrpc/transport/* | distrpc/transport/faulty.hpp) echo 4 ;;             # transport
    distrpc/agent.hpp | distrpc/agent/* | distrpc/registry.hpp | distrpc/rpc.hpp | \
      distrpc/backends.hpp | distrpc/declare.hpp | distrpc/rpc_store.hpp) echo 5 ;;                                         # agent
    # Process groups (distrpc::dist) stand beside the agent, on the store and transport layers.
    distrpc/dist.hpp | distrpc/dist/*) echo 5 ;;                               # dist (beside agent)
    distrpc/rref.hpp | distrpc/rref/*) echo 6 ;;                              # refs
    distrpc/nn/*) echo 7 ;;                                                   # modules
    distrpc/dist_autograd.hpp | distrpc/autograd/* | distrpc/dist_optim.hpp | \
      distrpc/optim/*) echo 8 ;;                                              # autograd
    distrpc/ddp.hpp | distrpc/ddp/*) echo 9 ;;                                # parallel (DDP)
    distrpc/distrpc.hpp) echo 10 ;;                                           # everything
    *) echo "?" ;;
  esac
}
names=(values net wire store transport agent refs modules autograd parallel umbrella)

exceptions=tests/layering/known_exceptions.txt
declare -A known=()
while read -r line; do
  case "$line" in "" | "#"*) continue ;; esac
  known["$line"]=1
done <"$exceptions"

passed=0
failed=0
declare -A seen=()
while IFS= read -r file; do
  # The header's own name as it is included: the path below include/.
  self="${file#*include/}"
  from=$(layer_of "$self")
  if [ "$from" = "?" ]; then
    echo "layering: $self belongs to no layer: add it to tests/layering/check.sh and docs/architecture.md"
    failed=$((failed + 1))
    continue
  fi
  while IFS= read -r inc; do
    to=$(layer_of "$inc")
    if [ "$to" = "?" ]; then
      echo "layering: $self includes $inc, which belongs to no layer"
      failed=$((failed + 1))
    elif [ "$to" -gt "$from" ]; then
      edge="$self -> $inc"
      if [ -n "${known[$edge]:-}" ]; then
        seen["$edge"]=1
      else
        echo "layering: $self (${names[$from]}) includes $inc (${names[$to]}), a layer above it"
        failed=$((failed + 1))
      fi
    fi
  done < <(sed -nE 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"](distrpc\/[^>"]+)[>"].*/\1/p' "$file")
  passed=$((passed + 1))
done < <(find include transports -name '*.hpp' | sort)

for edge in "${!known[@]}"; do
  if [ -z "${seen[$edge]:-}" ]; then
    echo "layering: '$edge' is listed in $exceptions but no longer occurs: remove it from the list"
    failed=$((failed + 1))
  fi
done
echo "layering: ${#seen[@]} known exception(s) left (see $exceptions)"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
