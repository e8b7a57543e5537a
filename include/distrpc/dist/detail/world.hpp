// The process's process groups (PyTorch's _world) and what the free functions of
// <distrpc/dist.hpp> share: finding the group of a call, the non-member warning, teardown.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <distrpc/dist/backend_config.hpp>
#include <distrpc/dist/process_group.hpp>
#include <distrpc/dist/work.hpp>
#include <distrpc/log.hpp>
#include <distrpc/store/rendezvous.hpp>
#include <distrpc/store/store.hpp>

namespace distrpc::dist {

// PyTorch's default_pg_timeout: how long a collective, and the rendezvous, may take.
inline constexpr std::chrono::milliseconds kDefaultPgTimeout{30 * 60 * 1000};

namespace detail {

inline constexpr const char* kLogWho = "distrpc::dist";

// The process's process groups: PyTorch's _world.
struct World {
  std::mutex mu;
  std::shared_ptr<ProcessGroup> default_pg;
  std::shared_ptr<store::Store> store;  // as given or made by the rendezvous, unprefixed
  bool owns_store = false;              // made by our rendezvous: checked out at teardown
  int rank = -1;
  int world_size = -1;
  std::chrono::milliseconds timeout{0};
  std::string backend;           // the backend string of the default group
  std::uint64_t generation = 0;  // init_process_group calls: names each init's keys apart
  std::vector<std::shared_ptr<ProcessGroup>> groups;  // every group made here, the default first
  std::uint64_t group_count = 0;                      // new_group calls without local sync
  std::map<std::vector<int>, std::uint64_t> local_group_count;  // local-sync groups by members
  std::set<std::string> warned_ops;
  bool exit_hook = false;
};

// Never destroyed: the teardown at exit is an atexit handler registered after the first init,
// so it runs before the statics the stores and backends started using are destroyed.
inline World& world() {
  static World* w = new World();
  return *w;
}

inline std::string prefix_of(std::uint64_t generation, const std::string& group_name) {
  return "pg" + std::to_string(generation) + "/" + group_name;
}

// Stops the groups and checks this rank out of the store; rank 0 (the TCP server's host, where
// the rendezvous made one) returns once every rank has checked out or the timeout passed.
struct Teardown {
  std::vector<std::shared_ptr<ProcessGroup>> groups;
  std::shared_ptr<store::Store> store;
  bool owns_store = false;
  int rank = -1;
  int world_size = -1;
  std::chrono::milliseconds timeout{0};
  std::uint64_t generation = 0;

  void run() noexcept {
    for (const auto& g : groups) {
      try {
        g->shutdown();
      } catch (const std::exception& e) {
        distrpc::detail::log_warning(kLogWho, std::string("shutting down group ") +
                                                  g->group_name() + " failed: " + e.what());
      }
    }
    groups.clear();
    if (store && owns_store) {
      try {
        store::finalize_rendezvous(*store, rank, world_size, timeout,
                                   "pg" + std::to_string(generation));
      } catch (const std::exception& e) {
        distrpc::detail::log_warning(
            kLogWho, std::string("rank ") + std::to_string(rank) +
                         ": not every rank checked out of the process group's store: " + e.what());
      }
    }
    store.reset();
  }
};

inline Teardown take_all_locked(World& w) {
  Teardown t{std::move(w.groups), std::move(w.store), w.owns_store, w.rank,
             w.world_size,        w.timeout,          w.generation};
  w.groups.clear();
  w.default_pg.reset();
  w.owns_store = false;
  w.rank = -1;
  w.world_size = -1;
  w.backend.clear();
  w.warned_ops.clear();
  w.local_group_count.clear();
  w.group_count = 0;
  return t;
}

inline void at_exit_teardown() {
  Teardown t;
  {
    World& w = world();
    std::lock_guard<std::mutex> lock(w.mu);
    if (!w.default_pg) return;
    t = take_all_locked(w);
  }
  t.run();
}

[[noreturn]] inline void not_initialized() {
  throw std::logic_error(
      "Default process group has not been initialized, please make sure to call "
      "init_process_group.");
}

inline std::shared_ptr<ProcessGroup> default_group() {
  World& w = world();
  std::lock_guard<std::mutex> lock(w.mu);
  if (!w.default_pg) not_initialized();
  return w.default_pg;
}

// The group a call runs on: the default one for null; null where this process is not a member,
// after warning once per operation (PyTorch's _warn_not_in_group).
inline std::shared_ptr<ProcessGroup> group_for(const std::shared_ptr<ProcessGroup>& g,
                                               const char* op) {
  if (!g) return default_group();
  if (g->is_member()) return g;
  World& w = world();
  bool first = false;
  int rank = -1;
  {
    std::lock_guard<std::mutex> lock(w.mu);
    if (!w.default_pg) not_initialized();
    first = w.warned_ops.insert(op).second;
    rank = w.rank;
  }
  if (first) {
    distrpc::detail::log_warning(kLogWho, std::string("Running ") + op + " on global rank " +
                                              std::to_string(rank) +
                                              " which does not belong to the given group.");
  }
  return nullptr;
}

inline bool is_registered(const std::shared_ptr<ProcessGroup>& g) {
  World& w = world();
  std::lock_guard<std::mutex> lock(w.mu);
  return std::find(w.groups.begin(), w.groups.end(), g) != w.groups.end();
}

inline std::shared_ptr<ProcessGroup> registered(const std::shared_ptr<ProcessGroup>& g,
                                                const char* fn) {
  if (!g) return default_group();
  if (!is_registered(g)) {
    throw std::invalid_argument(std::string(fn) + ": Group " + g->group_name() +
                                " is not registered, please create group with "
                                "distrpc::dist::new_group");
  }
  return g;
}

inline std::shared_ptr<Work> finish(std::shared_ptr<Work> work, bool async_op, const char* op) {
  if (!work) {
    throw std::logic_error(std::string(op) + ": the backend returned no Work");
  }
  if (!async_op) work->wait();
  return work;
}

// The config a backend string means, with init_process_group's default for "" / "undefined".
inline std::string resolve_backend(std::string_view backend) {
  const std::string b = lower(backend);
  if (!b.empty() && b != "undefined") return b;
  std::string out;
  if (is_backend_available("distrpc")) {
    out = "cpu:distrpc";
  } else if (is_backend_available("gloo")) {
    out = "cpu:gloo";
  }
  if (is_backend_available("nccl")) out += std::string(out.empty() ? "" : ",") + "cuda:nccl";
  if (out.empty()) {
    throw std::invalid_argument(
        "init_process_group: no backend named and no default available: register 'distrpc' "
        "(register_distrpc_backend<Transport>()) or 'gloo', or name a registered backend");
  }
  // Explicit pairs, so a default backend serves only its default device; a group with one
  // backend still reads as its name ("distrpc") in ProcessGroup::name() and get_backend().
  return out;
}

inline BackendConfig config_of(const std::string& backend, const char* fn) {
  // A bare name that is neither built in nor registered would otherwise be reported as a
  // malformed "device:backend" string.
  if (backend.find(':') == std::string::npos && !is_backend_available(backend)) {
    throw std::invalid_argument(std::string(fn) + ": backend '" + backend +
                                "' is not registered (register_backend(name, creator))");
  }
  return BackendConfig(backend);
}

inline std::vector<int> checked_ranks(std::vector<int> ranks, int world_size) {
  if (ranks.empty()) {
    for (int r = 0; r < world_size; ++r) ranks.push_back(r);
    return ranks;
  }
  std::sort(ranks.begin(), ranks.end());
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 0 || ranks[i] >= world_size) {
      throw std::invalid_argument("new_group: rank " + std::to_string(ranks[i]) +
                                  " is outside the world of size " + std::to_string(world_size));
    }
    if (i > 0 && ranks[i] == ranks[i - 1]) {
      throw std::invalid_argument("new_group: rank " + std::to_string(ranks[i]) +
                                  " is listed more than once");
    }
  }
  return ranks;
}

// A global src/dst rank as a rank of g, with the operation named.
inline int group_rank_of(const ProcessGroup& g, int global_rank, const char* op, const char* what) {
  try {
    return g.group_rank(global_rank);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string(op) + ": " + what + " " + e.what());
  }
}

}  // namespace detail

}  // namespace distrpc::dist
