// distrpc::dist: the process-group front end, with PyTorch's names (torch.distributed).
//
//   dist::init_process_group("distrpc", "env://");          // or a store, rank and world size
//   dist::all_reduce(t);                                     // SUM over the whole world
//   dist::all_reduce(t, {.op = dist::ReduceOp::MAX, .group = g, .async_op = true})->wait();
//   auto g = dist::new_group({0, 2});                        // members meet, nobody else
//   dist::destroy_process_group();
//
// One default group per process (the world), made by init_process_group; new_group makes more.
// Every collective takes single tensors as PyTorch's Python functions do, global ranks for
// src/dst, and an options struct (designated initializers); it returns the operation's Work:
// still running with async_op, already waited otherwise (a failure is thrown), and null where
// this process is not a member of the group (the call then does nothing and warns once per
// operation). Every member must issue the same collectives in the same order.
//
// The store's server lives in rank 0 (tcp://, env://): rank 0's destroy_process_group, or its
// exit, waits (at most the group's timeout) until every rank has destroyed its groups or exited,
// so no rank loses the store while it may still use it. A process may exit without calling
// destroy_process_group: its groups are torn down at exit.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <distrpc/dist/backend.hpp>
#include <distrpc/dist/backend_config.hpp>
#include <distrpc/dist/process_group.hpp>
#include <distrpc/dist/reduce_op.hpp>
#include <distrpc/dist/work.hpp>
#include <distrpc/error.hpp>
#include <distrpc/log.hpp>
#include <distrpc/store/barrier.hpp>
#include <distrpc/store/prefix_store.hpp>
#include <distrpc/store/rendezvous.hpp>
#include <distrpc/store/store.hpp>
#include <distrpc/wire/archive.hpp>

namespace distrpc::dist {

// PyTorch's default_pg_timeout: how long a collective, and the rendezvous, may take.
inline constexpr std::chrono::milliseconds kDefaultPgTimeout{30 * 60 * 1000};

// ---- Options of the calls (aggregates: use designated initializers, in this order).

// Every member has a default initializer, so a designated initializer may leave any out
// (GCC's -Wmissing-field-initializers warns for members without one).
struct InitOptions {
  std::string backend{};      // "" or "undefined": distrpc (else gloo) for cpu, nccl for cuda
  std::string init_method{};  // "" means env:// unless a store is given
  std::shared_ptr<store::Store> store{};  // instead of init_method; rank and world_size required
  int rank = -1;                          // -1: from the URL or RANK
  int world_size = -1;                    // -1: from the URL or WORLD_SIZE
  std::chrono::milliseconds timeout = kDefaultPgTimeout;
};

struct NewGroupOptions {
  std::chrono::milliseconds timeout = kUnsetTimeout;  // unset: the default group's
  std::string backend{};                              // "": the default group's backend string
  // true: only members need to call new_group, and non-members get null. false (PyTorch's
  // default): every process calls new_group for every group in the same order, and non-members
  // get ProcessGroup::non_member(). Either way only the members meet.
  bool use_local_synchronization = false;
};

// all_reduce, all_reduce_coalesced, reduce, reduce_scatter, reduce_scatter_tensor.
struct ReduceCollectiveOptions {
  ReduceOp op{};
  std::shared_ptr<ProcessGroup> group{};  // null: the default group
  bool async_op = false;
  std::chrono::milliseconds timeout = kUnsetTimeout;  // unset: the group's
};
// broadcast, all_gather, all_gather_into_tensor, all_to_all, barrier.
struct CollectiveOptions {
  std::shared_ptr<ProcessGroup> group{};
  bool async_op = false;
  std::chrono::milliseconds timeout = kUnsetTimeout;
};
struct GatherCollectiveOptions {
  int dst = 0;  // global rank
  std::shared_ptr<ProcessGroup> group{};
  bool async_op = false;
  std::chrono::milliseconds timeout = kUnsetTimeout;
};
struct ScatterCollectiveOptions {
  int src = 0;  // global rank
  std::shared_ptr<ProcessGroup> group{};
  bool async_op = false;
  std::chrono::milliseconds timeout = kUnsetTimeout;
};
struct AllToAllSingleOptions {
  std::vector<std::int64_t> output_split_sizes{};  // empty: equal slices
  std::vector<std::int64_t> input_split_sizes{};
  std::shared_ptr<ProcessGroup> group{};
  bool async_op = false;
  std::chrono::milliseconds timeout = kUnsetTimeout;
};
// send, recv, isend, irecv.
struct PointToPointOptions {
  std::shared_ptr<ProcessGroup> group{};
  int tag = 0;
};
// all_gather_object, broadcast_object_list (always blocking).
struct ObjectCollectiveOptions {
  std::shared_ptr<ProcessGroup> group{};
  std::chrono::milliseconds timeout = kUnsetTimeout;
};

// ---- Environment settings.

enum class DebugLevel { OFF = 0, INFO = 1, DETAIL = 2 };

inline const char* to_string(DebugLevel level) noexcept {
  switch (level) {
    case DebugLevel::OFF:
      return "OFF";
    case DebugLevel::INFO:
      return "INFO";
    case DebugLevel::DETAIL:
      return "DETAIL";
  }
  return "?";
}

// TORCH_DISTRIBUTED_DEBUG, read now: unset or empty is OFF; OFF, INFO, DETAIL in any case.
inline DebugLevel debug_level() {
  const char* v = std::getenv("TORCH_DISTRIBUTED_DEBUG");
  if (v == nullptr || *v == '\0') return DebugLevel::OFF;
  const std::string s = detail::upper(v);
  if (s == "OFF") return DebugLevel::OFF;
  if (s == "INFO") return DebugLevel::INFO;
  if (s == "DETAIL") return DebugLevel::DETAIL;
  throw std::invalid_argument(
      "The value of TORCH_DISTRIBUTED_DEBUG must be OFF, INFO, or DETAIL. Got '" + std::string(v) +
      "'.");
}

// This process's rank among those of its host: LOCAL_RANK (set by torchrun and distrpc-run) when
// set, else fallback, else an error naming LOCAL_RANK (PyTorch's get_node_local_rank).
inline int node_local_rank(std::optional<int> fallback = std::nullopt) {
  if (const char* v = std::getenv("LOCAL_RANK"); v != nullptr && *v != '\0') {
    int out = 0;
    if (!store::detail::parse_int(v, 0, 1 << 30, out)) {
      throw std::invalid_argument(std::string("LOCAL_RANK='") + v +
                                  "' is not a non-negative integer");
    }
    return out;
  }
  if (fallback) return *fallback;
  throw std::runtime_error(
      "LOCAL_RANK is not in the environment. Set it (torchrun and distrpc-run do) or pass a "
      "fallback rank to node_local_rank() to run locally.");
}

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

// ---- Initialization.

// Makes the default group: every process of the world calls it once (again after
// destroy_process_group). With init_method (file://, tcp://host:port, env://; "" = env://) the
// store comes from the rendezvous; with a store, rank and world_size must be given. All ranks
// meet in a store-based barrier before it returns.
inline void init_process_group(const InitOptions& opts) {
  if (opts.store && !opts.init_method.empty()) {
    throw std::invalid_argument("init_process_group: Cannot specify both init_method and store.");
  }
  if (opts.store && (opts.rank < 0 || opts.world_size < 1)) {
    throw std::invalid_argument(
        "init_process_group: rank (>= 0) and world_size (>= 1) must be given with a store, got "
        "rank " +
        std::to_string(opts.rank) + " and world_size " + std::to_string(opts.world_size));
  }
  if (opts.timeout <= std::chrono::milliseconds::zero()) {
    throw std::invalid_argument("init_process_group: the timeout must be positive, got " +
                                std::to_string(opts.timeout.count()) + " ms");
  }
  const std::string backend = detail::resolve_backend(opts.backend);
  const BackendConfig config = detail::config_of(backend, "init_process_group");
  detail::World& w = detail::world();
  std::uint64_t generation = 0;
  {
    std::lock_guard<std::mutex> lock(w.mu);
    if (w.default_pg) {
      throw std::logic_error("trying to initialize the default process group twice!");
    }
    generation = ++w.generation;
  }

  std::shared_ptr<store::Store> store = opts.store;
  int rank = opts.rank;
  int world_size = opts.world_size;
  if (!store) {
    const std::string url = opts.init_method.empty() ? "env://" : opts.init_method;
    store::RendezvousResult r = store::rendezvous(url, rank, world_size, opts.timeout);
    store = std::move(r.store);
    rank = r.rank;
    world_size = r.world_size;
  } else if (opts.rank >= opts.world_size) {
    throw std::invalid_argument("init_process_group: rank " + std::to_string(opts.rank) +
                                " is not below world_size " + std::to_string(opts.world_size));
  }

  const std::string name = "default_pg";
  auto group_store =
      std::make_shared<store::PrefixStore>(detail::prefix_of(generation, name), store);
  auto pg =
      std::make_shared<ProcessGroup>(group_store, rank, world_size, config, opts.timeout, name);
  store::store_based_barrier(*group_store, rank, world_size, "init", opts.timeout);

  bool hook = false;
  {
    std::lock_guard<std::mutex> lock(w.mu);
    if (w.default_pg) {
      throw std::logic_error("trying to initialize the default process group twice!");
    }
    w.default_pg = pg;
    w.store = store;
    w.owns_store = !opts.store;
    w.rank = rank;
    w.world_size = world_size;
    w.timeout = opts.timeout;
    w.backend = backend;
    w.groups.push_back(pg);
    hook = !w.exit_hook;
    w.exit_hook = true;
  }
  if (hook) std::atexit(detail::at_exit_teardown);
}

inline void init_process_group(std::string_view backend = "", std::string init_method = "",
                               int rank = -1, int world_size = -1,
                               std::chrono::milliseconds timeout = kDefaultPgTimeout) {
  init_process_group(InitOptions{std::string(backend), std::move(init_method), nullptr, rank,
                                 world_size, timeout});
}

inline void init_process_group(std::string_view backend, std::shared_ptr<store::Store> store,
                               int rank, int world_size,
                               std::chrono::milliseconds timeout = kDefaultPgTimeout) {
  if (!store) throw std::invalid_argument("init_process_group: the store is null");
  init_process_group(
      InitOptions{std::string(backend), "", std::move(store), rank, world_size, timeout});
}

inline bool is_initialized() {
  detail::World& w = detail::world();
  std::lock_guard<std::mutex> lock(w.mu);
  return w.default_pg != nullptr;
}

// Null: every group, the default one included (then init_process_group may be called again).
// A group: that one alone is shut down and forgotten.
inline void destroy_process_group(const std::shared_ptr<ProcessGroup>& group = nullptr) {
  detail::World& w = detail::world();
  detail::Teardown all;
  {
    std::lock_guard<std::mutex> lock(w.mu);
    if (!w.default_pg) detail::not_initialized();
    if (group && group != w.default_pg) {
      auto it = std::find(w.groups.begin(), w.groups.end(), group);
      if (it == w.groups.end()) {
        throw std::invalid_argument("destroy_process_group: Group " + group->group_name() +
                                    " is not registered, please create group with "
                                    "distrpc::dist::new_group");
      }
      w.groups.erase(it);
    } else {
      // The default group goes with everything, as in PyTorch.
      all = detail::take_all_locked(w);
    }
  }
  // Outside the lock: backends stop their threads, rank 0 waits for the others to check out.
  if (group && all.groups.empty()) {
    group->shutdown();
    return;
  }
  all.run();
}

// ---- The group and its members.

// This process's rank in group (default: the world); -1 where it is not a member.
inline int get_rank(const std::shared_ptr<ProcessGroup>& group = nullptr) {
  if (group && !group->is_member()) return -1;
  return detail::registered(group, "get_rank")->rank();
}
// The group's size; -1 where this process is not a member.
inline int get_world_size(const std::shared_ptr<ProcessGroup>& group = nullptr) {
  if (group && !group->is_member()) return -1;
  return detail::registered(group, "get_world_size")->size();
}
// The group's backend string ("distrpc", "dummy", "cpu:gloo,cuda:nccl").
inline std::string get_backend(const std::shared_ptr<ProcessGroup>& group = nullptr) {
  if (group && !group->is_member()) {
    throw std::invalid_argument(
        "get_backend: Invalid process group specified: this process is "
        "not a member of it");
  }
  return detail::registered(group, "get_backend")->name();
}
// The default group (the world), as an object (PyTorch's _get_default_group()).
inline std::shared_ptr<ProcessGroup> get_default_group() {
  return detail::default_group();
}

// The store init_process_group was given or made (unprefixed; each group has its own prefix).
inline std::shared_ptr<store::Store> get_default_store() {
  detail::World& w = detail::world();
  std::lock_guard<std::mutex> lock(w.mu);
  if (!w.default_pg) detail::not_initialized();
  return w.store;
}

inline int get_group_rank(const std::shared_ptr<ProcessGroup>& group, int global_rank) {
  if (group && !group->is_member()) {
    throw std::invalid_argument("get_group_rank: Group NON_GROUP_MEMBER is not registered");
  }
  return detail::registered(group, "get_group_rank")->group_rank(global_rank);
}
inline int get_global_rank(const std::shared_ptr<ProcessGroup>& group, int group_rank) {
  if (group && !group->is_member()) {
    throw std::invalid_argument("get_global_rank: Group NON_GROUP_MEMBER is not registered");
  }
  return detail::registered(group, "get_global_rank")->global_rank(group_rank);
}
// The members' global ranks, ascending.
inline std::vector<int> get_process_group_ranks(const std::shared_ptr<ProcessGroup>& group) {
  if (group && !group->is_member()) {
    throw std::invalid_argument(
        "get_process_group_ranks: Group NON_GROUP_MEMBER is not registered");
  }
  return detail::registered(group, "get_process_group_ranks")->global_ranks();
}

// A group of the given world ranks (empty: all). Only members meet (in a store-based barrier on
// the group's own store); see NewGroupOptions for what non-members do and get. Groups with the
// same members are distinct groups: their names and store prefixes differ.
inline std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks = {},
                                               const NewGroupOptions& opts = {}) {
  detail::World& w = detail::world();
  std::string name;
  std::shared_ptr<store::Store> store;
  std::uint64_t generation = 0;
  int my_rank = -1;
  std::chrono::milliseconds timeout{0};
  std::string backend;
  {
    std::lock_guard<std::mutex> lock(w.mu);
    if (!w.default_pg) detail::not_initialized();
    ranks = detail::checked_ranks(std::move(ranks), w.world_size);
    my_rank = w.rank;
    const bool member = std::binary_search(ranks.begin(), ranks.end(), my_rank);
    if (opts.use_local_synchronization) {
      if (!member) return nullptr;
      // Named by its members and how many groups of these members this process made: members
      // agree without talking to anyone, and non-members need not call at all.
      std::string members;
      for (int r : ranks) members += (members.empty() ? "" : ",") + std::to_string(r);
      name = "local[" + members + "]#" + std::to_string(w.local_group_count[ranks]++);
    } else {
      // Every process calls new_group in the same order (PyTorch's rule), so this counter agrees.
      name = "group" + std::to_string(++w.group_count);
      if (!member) return ProcessGroup::non_member();
    }
    store = w.store;
    generation = w.generation;
    timeout = opts.timeout == kUnsetTimeout ? w.timeout : opts.timeout;
    backend = opts.backend.empty() ? w.backend : detail::lower(opts.backend);
  }
  if (timeout <= std::chrono::milliseconds::zero()) {
    throw std::invalid_argument("new_group: the timeout must be positive, got " +
                                std::to_string(timeout.count()) + " ms");
  }
  const BackendConfig config = detail::config_of(backend, "new_group");
  const int group_rank =
      static_cast<int>(std::lower_bound(ranks.begin(), ranks.end(), my_rank) - ranks.begin());
  const int size = static_cast<int>(ranks.size());
  auto group_store =
      std::make_shared<store::PrefixStore>(detail::prefix_of(generation, name), std::move(store));
  auto pg =
      std::make_shared<ProcessGroup>(group_store, group_rank, size, config, timeout, name, ranks);
  store::store_based_barrier(*group_store, group_rank, size, "new_group", timeout);
  std::lock_guard<std::mutex> lock(w.mu);
  if (!w.default_pg || w.generation != generation) {
    throw std::logic_error("new_group: the default process group was destroyed meanwhile");
  }
  w.groups.push_back(pg);
  return pg;
}

// ---- Collectives. Ranks (src, dst) are global ranks.

inline std::shared_ptr<Work> all_reduce(at::Tensor& tensor,
                                        const ReduceCollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "all_reduce");
  if (!g) return nullptr;
  std::vector<at::Tensor> ts{tensor};
  return detail::finish(g->allreduce(ts, {opts.op, opts.timeout}), opts.async_op, "all_reduce");
}

inline std::shared_ptr<Work> all_reduce_coalesced(std::vector<at::Tensor>& tensors,
                                                  const ReduceCollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "all_reduce_coalesced");
  if (!g) return nullptr;
  return detail::finish(g->allreduce_coalesced(tensors, {opts.op, opts.timeout}), opts.async_op,
                        "all_reduce_coalesced");
}

inline std::shared_ptr<Work> broadcast(at::Tensor& tensor, int src,
                                       const CollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "broadcast");
  if (!g) return nullptr;
  std::vector<at::Tensor> ts{tensor};
  BroadcastOptions o;
  o.root_rank = detail::group_rank_of(*g, src, "broadcast", "src:");
  o.timeout = opts.timeout;
  return detail::finish(g->broadcast(ts, o), opts.async_op, "broadcast");
}

inline std::shared_ptr<Work> reduce(at::Tensor& tensor, int dst,
                                    const ReduceCollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "reduce");
  if (!g) return nullptr;
  std::vector<at::Tensor> ts{tensor};
  ReduceOptions o;
  o.op = opts.op;
  o.root_rank = detail::group_rank_of(*g, dst, "reduce", "dst:");
  o.timeout = opts.timeout;
  return detail::finish(g->reduce(ts, o), opts.async_op, "reduce");
}

// tensor_list must hold one tensor per member of the group; tensor_list[r] receives member r's.
inline std::shared_ptr<Work> all_gather(std::vector<at::Tensor>& tensor_list,
                                        const at::Tensor& tensor,
                                        const CollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "all_gather");
  if (!g) return nullptr;
  std::vector<std::vector<at::Tensor>> out{tensor_list};  // handles: the user's tensors
  std::vector<at::Tensor> in{tensor};
  return detail::finish(g->allgather(out, in, {opts.timeout}), opts.async_op, "all_gather");
}

inline std::shared_ptr<Work> all_gather_into_tensor(at::Tensor& output, const at::Tensor& input,
                                                    const CollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "all_gather_into_tensor");
  if (!g) return nullptr;
  at::Tensor in = input;
  return detail::finish(g->allgather_into_tensor(output, in, {opts.timeout}), opts.async_op,
                        "all_gather_into_tensor");
}

// On dst, gather_list holds one tensor per member; elsewhere it must be empty.
inline std::shared_ptr<Work> gather(const at::Tensor& tensor, std::vector<at::Tensor> gather_list,
                                    const GatherCollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "gather");
  if (!g) return nullptr;
  GatherOptions o;
  o.root_rank = detail::group_rank_of(*g, opts.dst, "gather", "dst:");
  o.timeout = opts.timeout;
  detail::check_same_dtype(tensor, gather_list);
  std::vector<std::vector<at::Tensor>> out;
  if (g->rank() == o.root_rank || !gather_list.empty()) out.push_back(std::move(gather_list));
  std::vector<at::Tensor> in{tensor};
  return detail::finish(g->gather(out, in, o), opts.async_op, "gather");
}

// On src, scatter_list holds one tensor per member; elsewhere it must be empty.
inline std::shared_ptr<Work> scatter(at::Tensor& tensor, std::vector<at::Tensor> scatter_list,
                                     const ScatterCollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "scatter");
  if (!g) return nullptr;
  ScatterOptions o;
  o.root_rank = detail::group_rank_of(*g, opts.src, "scatter", "src:");
  o.timeout = opts.timeout;
  detail::check_same_dtype(tensor, scatter_list);
  std::vector<std::vector<at::Tensor>> in;
  if (g->rank() == o.root_rank || !scatter_list.empty()) in.push_back(std::move(scatter_list));
  std::vector<at::Tensor> out{tensor};
  return detail::finish(g->scatter(out, in, o), opts.async_op, "scatter");
}

// output receives the reduction of every member's input_list[my group rank].
inline std::shared_ptr<Work> reduce_scatter(at::Tensor& output,
                                            const std::vector<at::Tensor>& input_list,
                                            const ReduceCollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "reduce_scatter");
  if (!g) return nullptr;
  std::vector<at::Tensor> out{output};
  std::vector<std::vector<at::Tensor>> in{input_list};
  return detail::finish(g->reduce_scatter(out, in, {opts.op, opts.timeout}), opts.async_op,
                        "reduce_scatter");
}

inline std::shared_ptr<Work> reduce_scatter_tensor(at::Tensor& output, const at::Tensor& input,
                                                   const ReduceCollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "reduce_scatter_tensor");
  if (!g) return nullptr;
  at::Tensor in = input;
  return detail::finish(g->reduce_scatter_tensor(output, in, {opts.op, opts.timeout}),
                        opts.async_op, "reduce_scatter_tensor");
}

// input_list[i] goes to member i; output_list[j] comes from member j.
inline std::shared_ptr<Work> all_to_all(std::vector<at::Tensor>& output_list,
                                        const std::vector<at::Tensor>& input_list,
                                        const CollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "all_to_all");
  if (!g) return nullptr;
  std::vector<at::Tensor> in(input_list);
  return detail::finish(g->alltoall(output_list, in, {opts.timeout}), opts.async_op, "all_to_all");
}

inline std::shared_ptr<Work> all_to_all_single(at::Tensor& output, const at::Tensor& input,
                                               const AllToAllSingleOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "all_to_all_single");
  if (!g) return nullptr;
  at::Tensor in = input;
  return detail::finish(
      g->alltoall_base(output, in, opts.output_split_sizes, opts.input_split_sizes, {opts.timeout}),
      opts.async_op, "all_to_all_single");
}

inline std::shared_ptr<Work> barrier(const CollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "barrier");
  if (!g) return nullptr;
  return detail::finish(g->barrier({opts.timeout}), opts.async_op, "barrier");
}

// ---- Point to point. dst/src are global ranks.

inline std::shared_ptr<Work> isend(at::Tensor& tensor, int dst,
                                   const PointToPointOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "isend");
  if (!g) return nullptr;
  std::vector<at::Tensor> ts{tensor};
  return detail::finish(g->send(ts, detail::group_rank_of(*g, dst, "send", "dst:"), opts.tag), true,
                        "isend");
}

inline std::shared_ptr<Work> send(at::Tensor& tensor, int dst,
                                  const PointToPointOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "send");
  if (!g) return nullptr;
  std::vector<at::Tensor> ts{tensor};
  return detail::finish(g->send(ts, detail::group_rank_of(*g, dst, "send", "dst:"), opts.tag),
                        false, "send");
}

// src: a global rank, or nullopt / -1 for whichever member sends first (Work::source_rank()
// then gives its group rank).
inline std::shared_ptr<Work> irecv(at::Tensor& tensor, std::optional<int> src = std::nullopt,
                                   const PointToPointOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "irecv");
  if (!g) return nullptr;
  std::vector<at::Tensor> ts{tensor};
  if (!src || *src == -1) {
    return detail::finish(g->recv_anysource(ts, opts.tag), true, "irecv");
  }
  return detail::finish(g->recv(ts, detail::group_rank_of(*g, *src, "recv", "src:"), opts.tag),
                        true, "irecv");
}

// Blocks until tensor is received; returns the sender's global rank (-1 where this process is
// not a member of the group, as PyTorch returns).
inline int recv(at::Tensor& tensor, std::optional<int> src = std::nullopt,
                const PointToPointOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "recv");
  if (!g) return -1;
  std::vector<at::Tensor> ts{tensor};
  if (!src || *src == -1) {
    auto w = detail::finish(g->recv_anysource(ts, opts.tag), false, "recv");
    return g->global_rank(w->source_rank());
  }
  detail::finish(g->recv(ts, detail::group_rank_of(*g, *src, "recv", "src:"), opts.tag), false,
                 "recv");
  return *src;
}

// ---- Objects: any value distrpc::wire encodes (cereal-serializable; tensors inside travel
// too), exchanged as bytes through the group's backend on its default device.

namespace detail {

// A Message flattened to one byte string: [u64 payload size][payload][u64 buffer count]
// ([u64 size][bytes])*, so an encoded value can travel in a byte tensor.
inline std::string flatten(const wire::Message& m) {
  std::string out;
  auto put = [&](std::uint64_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); };
  put(m.payload.size());
  out += m.payload;
  put(m.buffers.size());
  for (const at::Tensor& b : m.buffers) {
    const at::Tensor c = b.contiguous();
    put(static_cast<std::uint64_t>(c.numel()));
    out.append(static_cast<const char*>(c.data_ptr()), static_cast<std::size_t>(c.numel()));
  }
  return out;
}

inline wire::Message unflatten(const std::uint8_t* data, std::size_t size) {
  std::size_t at = 0;
  auto need = [&](std::uint64_t n) {
    if (n > size - at) {
      throw wire::DecodeError("object collective: truncated object bytes (" + std::to_string(size) +
                              " bytes, " + std::to_string(n) + " more needed at offset " +
                              std::to_string(at) + ")");
    }
  };
  auto get = [&]() {
    need(sizeof(std::uint64_t));
    std::uint64_t v = 0;
    std::memcpy(&v, data + at, sizeof v);
    at += sizeof v;
    return v;
  };
  wire::Message m;
  const std::uint64_t payload = get();
  need(payload);
  m.payload.assign(reinterpret_cast<const char*>(data + at), static_cast<std::size_t>(payload));
  at += static_cast<std::size_t>(payload);
  const std::uint64_t count = get();
  if (count > size) {
    throw wire::DecodeError("object collective: " + std::to_string(count) +
                            " buffers announced in " + std::to_string(size) + " bytes");
  }
  for (std::uint64_t i = 0; i < count; ++i) {
    const std::uint64_t n = get();
    need(n);
    at::Tensor b = at::empty({static_cast<std::int64_t>(n)}, at::kByte);
    std::memcpy(b.data_ptr(), data + at, static_cast<std::size_t>(n));
    at += static_cast<std::size_t>(n);
    m.buffers.push_back(std::move(b));
  }
  if (at != size) {
    throw wire::DecodeError("object collective: " + std::to_string(size - at) +
                            " trailing bytes after the object");
  }
  return m;
}

template <class T>
std::string encode_object(const T& value) {
  static_assert(cereal::traits::is_output_serializable<T, wire::OutputArchive>::value &&
                    cereal::traits::is_input_serializable<T, wire::InputArchive>::value,
                "all_gather_object / broadcast_object_list: T must be serializable with cereal: "
                "give it `template <class Archive> void serialize(Archive& ar) { ar(field1, "
                "field2); }` (tensors, strings, containers and arithmetic types already are)");
  wire::Message m;
  wire::encode(m, value);
  return flatten(m);
}

template <class T>
void decode_object(const at::Tensor& bytes, std::int64_t size, T& out) {
  const at::Tensor c = bytes.to(at::kCPU).contiguous();
  wire::decode(unflatten(c.data_ptr<std::uint8_t>(), static_cast<std::size_t>(size)), out);
}

inline at::TensorOptions object_tensor_options(const ProcessGroup& g, at::ScalarType t) {
  return at::TensorOptions().dtype(t).device(c10::Device(g.default_device()));
}

}  // namespace detail

// out receives one value per member (out[r] is member r's obj); blocking.
template <class T>
void all_gather_object(std::vector<T>& out, const T& obj,
                       const ObjectCollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "all_gather_object");
  if (!g) return;
  const std::string bytes = detail::encode_object(obj);
  const int n = g->size();
  // First the sizes, then every member's bytes padded to the largest.
  at::Tensor my_size = at::full({1}, static_cast<std::int64_t>(bytes.size()),
                                detail::object_tensor_options(*g, at::kLong));
  std::vector<std::vector<at::Tensor>> sizes(1);
  for (int r = 0; r < n; ++r) sizes[0].push_back(at::zeros_like(my_size));
  std::vector<at::Tensor> in{my_size};
  detail::finish(g->allgather(sizes, in, {opts.timeout}), false, "all_gather_object");
  std::vector<std::int64_t> lengths;
  std::int64_t longest = 0;
  for (const at::Tensor& s : sizes[0]) {
    lengths.push_back(s.to(at::kCPU).item<std::int64_t>());
    longest = std::max(longest, lengths.back());
  }
  at::Tensor mine = at::zeros({longest}, at::kByte);
  std::memcpy(mine.data_ptr(), bytes.data(), bytes.size());
  mine = mine.to(detail::object_tensor_options(*g, at::kByte).device());
  std::vector<std::vector<at::Tensor>> all(1);
  for (int r = 0; r < n; ++r) all[0].push_back(at::zeros_like(mine));
  std::vector<at::Tensor> in2{mine};
  detail::finish(g->allgather(all, in2, {opts.timeout}), false, "all_gather_object");
  std::vector<T> result(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    detail::decode_object(all[0][static_cast<std::size_t>(r)], lengths[static_cast<std::size_t>(r)],
                          result[static_cast<std::size_t>(r)]);
  }
  out = std::move(result);
}

// objects on src (a global rank) replace objects on every other member; blocking.
template <class T>
void broadcast_object_list(std::vector<T>& objects, int src,
                           const ObjectCollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "broadcast_object_list");
  if (!g) return;
  BroadcastOptions o;
  o.root_rank = detail::group_rank_of(*g, src, "broadcast_object_list", "src:");
  o.timeout = opts.timeout;
  const bool root = g->rank() == o.root_rank;
  const std::string bytes = root ? detail::encode_object(objects) : std::string();
  std::vector<at::Tensor> size{at::full({1}, static_cast<std::int64_t>(bytes.size()),
                                        detail::object_tensor_options(*g, at::kLong))};
  detail::finish(g->broadcast(size, o), false, "broadcast_object_list");
  const std::int64_t n = size[0].to(at::kCPU).item<std::int64_t>();
  at::Tensor data = at::zeros({n}, at::kByte);
  if (root) std::memcpy(data.data_ptr(), bytes.data(), bytes.size());
  std::vector<at::Tensor> ts{data.to(detail::object_tensor_options(*g, at::kByte).device())};
  detail::finish(g->broadcast(ts, o), false, "broadcast_object_list");
  if (!root) {
    std::vector<T> received;
    detail::decode_object(ts[0], n, received);
    objects = std::move(received);
  }
}

}  // namespace distrpc::dist
