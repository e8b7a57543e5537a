// The store-based barrier c10d runs when a process group starts: every rank counts itself in under
// one key, the last to arrive sets a flag, everyone waits for the flag.
#pragma once

#include <algorithm>
#include <chrono>
#include <string>

#include "distrpc/log.hpp"
#include "distrpc/store/detail/common.hpp"
#include "distrpc/store/store.hpp"

namespace distrpc::store {

inline constexpr const char* kStoreBarrierPrefix = "store_based_barrier_key";

// Blocks until `world_size` callers have entered the barrier named `group_name` on `store`.
// Past `timeout` throws DistStoreError "Timed out initializing process group in store based
// barrier on rank R, for key: K (world_size=N, num_workers_joined=J, timeout=T ms)".
// Every `log_interval` of waiting, one status line is logged (distrpc/log.hpp). A barrier name is
// single-use: the counter it leaves behind is what lets late arrivals pass.
inline void store_based_barrier(Store& store, int rank, int world_size,
                                const std::string& group_name, std::chrono::milliseconds timeout,
                                std::chrono::milliseconds log_interval = std::chrono::seconds(10)) {
  using std::chrono::milliseconds;
  const std::string key = std::string(kStoreBarrierPrefix) + ":" + group_name;
  const std::string last_worker = key + ":last_worker";
  store.add(key, 1);
  if (store.add(key, 0) == world_size) store.set(last_worker, "1");

  const auto start = detail::Clock::now();
  if (log_interval <= milliseconds(0)) log_interval = std::chrono::seconds(10);
  for (;;) {
    const auto elapsed = std::chrono::duration_cast<milliseconds>(detail::Clock::now() - start);
    // Wait in slices no longer than what is left, so the barrier fails on time, not a slice late.
    milliseconds slice = log_interval;
    if (timeout > Store::kNoTimeout)
      slice = std::min(slice, std::max(timeout - elapsed, milliseconds(1)));
    try {
      store.wait({last_worker}, slice);
      return;
    } catch (const DistStoreError& e) {
      // Only a timeout means "not yet"; anything else (a lost server, a broken file) is the answer.
      const bool is_timeout = dynamic_cast<const StoreTimeoutError*>(&e) != nullptr ||
                              std::string_view(e.what()).find("Timeout") != std::string_view::npos;
      if (!is_timeout) throw;
    }
    const std::int64_t joined = store.add(key, 0);
    const auto waited = std::chrono::duration_cast<milliseconds>(detail::Clock::now() - start);
    if (timeout > Store::kNoTimeout && waited >= timeout) {
      throw DistStoreError("Timed out initializing process group in store based barrier on rank " +
                           std::to_string(rank) + ", for key: " + key +
                           " (world_size=" + std::to_string(world_size) +
                           ", num_workers_joined=" + std::to_string(joined) +
                           ", timeout=" + std::to_string(timeout.count()) + " ms)");
    }
    if (slice == log_interval) {
      distrpc::detail::log_warning("store_based_barrier",
                                   "rank " + std::to_string(rank) + " waiting on " + key + ": " +
                                       std::to_string(joined) + "/" + std::to_string(world_size) +
                                       " joined after " + std::to_string(waited.count()) + " ms");
    }
  }
}

}  // namespace distrpc::store
