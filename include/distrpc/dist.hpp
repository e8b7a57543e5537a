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
#include <chrono>
#include <cstdint>
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

#include <distrpc/dist/backend.hpp>
#include <distrpc/dist/backend_config.hpp>
#include <distrpc/dist/collectives.hpp>
#include <distrpc/dist/detail/world.hpp>
#include <distrpc/dist/environment.hpp>
#include <distrpc/dist/object_collectives.hpp>
#include <distrpc/dist/process_group.hpp>
#include <distrpc/dist/reduce_op.hpp>
#include <distrpc/dist/work.hpp>
#include <distrpc/store/barrier.hpp>
#include <distrpc/store/prefix_store.hpp>
#include <distrpc/store/rendezvous.hpp>
#include <distrpc/store/store.hpp>
#include <distrpc/tls_options.hpp>

namespace distrpc::dist {

// ---- Options (aggregates: use designated initializers, in this order).

// Every member has a default initializer, so a designated initializer may leave any out
// (GCC's -Wmissing-field-initializers warns for members without one).
struct InitOptions {
  std::string backend{};      // "" or "undefined": distrpc (else gloo) for cpu, nccl for cuda
  std::string init_method{};  // "" means env:// unless a store is given
  std::shared_ptr<store::Store> store{};  // instead of init_method; rank and world_size required
  int rank = -1;                          // -1: from the URL or RANK
  int world_size = -1;                    // -1: from the URL or WORLD_SIZE
  std::chrono::milliseconds timeout = kDefaultPgTimeout;
  // The rendezvous TCPStore's shared secret (docs/security.md); empty: DISTRPC_AUTH_SECRET_FILE's
  // file, else DISTRPC_AUTH_SECRET, else none. The distrpc backend's own connections take theirs
  // from DistrpcBackendOptions::auth_token or the same variables.
  std::string auth_secret{};
  // The rendezvous TCPStore's TLS files (docs/security.md, "TLS"); empty: DISTRPC_TLS_CERT / _KEY /
  // _CA, else plain TCP. The distrpc backend's connections take DistrpcBackendOptions::tls.
  TlsOptions tls{};
};

struct NewGroupOptions {
  std::chrono::milliseconds timeout = kUnsetTimeout;  // unset: the default group's
  std::string backend{};                              // "": the default group's backend string
  // true: only members need to call new_group, and non-members get null. false (PyTorch's
  // default): every process calls new_group for every group in the same order, and non-members
  // get ProcessGroup::non_member(). Either way only the members meet through the store; without
  // local synchronization, a backend that splits its communicator (Backend::can_split, the nccl
  // backend) has every process of the default group take part in the split, members or not.
  bool use_local_synchronization = false;
};

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
    // Taken for good only once this init succeeds, so that a failed attempt (a bad URL, a peer
    // that never came) does not put this process's key names out of step with the others'.
    generation = w.generation + 1;
  }

  std::shared_ptr<store::Store> store = opts.store;
  int rank = opts.rank;
  int world_size = opts.world_size;
  if (!store) {
    const std::string url = opts.init_method.empty() ? "env://" : opts.init_method;
    store::RendezvousResult r =
        store::rendezvous(url, rank, world_size, opts.timeout, opts.auth_secret, opts.tls);
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
    w.generation = generation;
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

namespace detail {

// The backends of a new group of the world's `ranks` that the default group's backends split
// from their own communicators (Backend::can_split), by name: for each backend of `config` that
// also serves that device in `parent` and can split, every process calls split() in the order of
// `config` (the same everywhere), members and not (`new_rank` -1). Others are made as usual.
inline std::map<std::string, std::shared_ptr<Backend>> split_from(
    const ProcessGroup& parent, const BackendConfig& config, const std::vector<int>& ranks,
    int new_rank, std::chrono::milliseconds timeout) {
  std::map<std::string, std::shared_ptr<Backend>> out;
  std::set<std::string> seen;
  for (const auto& [device, name] : config.device_backend_map()) {
    if (seen.count(name) != 0 || !parent.has_backend(device)) continue;
    const std::shared_ptr<Backend> b = parent.backend(device);
    if (!b->can_split() || lower(parent.backend_config().backend_for(device)) != name) continue;
    seen.insert(name);
    std::shared_ptr<Backend> mine = b->split(ranks, new_rank, timeout);
    if (new_rank >= 0) out.emplace(name, std::move(mine));
  }
  return out;
}

}  // namespace detail

// A group of the given world ranks (empty: all). Only members meet (in a store-based barrier on
// the group's own store), except in a split (see NewGroupOptions); see NewGroupOptions for what
// non-members do and get. Groups with the same members are distinct groups: their names and store
// prefixes differ.
inline std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks = {},
                                               const NewGroupOptions& opts = {}) {
  detail::World& w = detail::world();
  std::string name;
  std::shared_ptr<store::Store> store;
  std::uint64_t generation = 0;
  int my_rank = -1;
  bool member = false;
  std::chrono::milliseconds timeout{0};
  std::string backend;
  std::shared_ptr<ProcessGroup> parent;  // the default group, when the new one may be split from it
  {
    std::lock_guard<std::mutex> lock(w.mu);
    if (!w.default_pg) detail::not_initialized();
    ranks = detail::checked_ranks(std::move(ranks), w.world_size);
    my_rank = w.rank;
    member = std::binary_search(ranks.begin(), ranks.end(), my_rank);
    if (opts.use_local_synchronization) {
      if (!member) return nullptr;
      // Named by its members and how many groups of these members this process made: members
      // agree without talking to anyone, and non-members need not call at all.
      std::string members;
      for (int r : ranks) members += (members.empty() ? "" : ",") + std::to_string(r);
      name = "local[" + members + "]#" + std::to_string(w.local_group_count[ranks]++);
    } else {
      // Every process calls new_group in the same order (PyTorch's rule), so this counter agrees,
      // and a backend that splits its communicator can do so with every process taking part.
      name = "group" + std::to_string(++w.group_count);
      parent = w.default_pg;
    }
    store = w.store;
    generation = w.generation;
    timeout = opts.timeout == kUnsetTimeout ? w.timeout : opts.timeout;
    backend = opts.backend.empty() ? w.backend : detail::lower(opts.backend);
  }
  if (timeout <= std::chrono::milliseconds::zero()) {
    if (!member) return ProcessGroup::non_member();
    throw std::invalid_argument("new_group: the timeout must be positive, got " +
                                std::to_string(timeout.count()) + " ms");
  }
  std::optional<BackendConfig> config;
  try {
    config.emplace(detail::config_of(backend, "new_group"));
  } catch (...) {
    // Every process fails alike here, before any split: a non-member just is not in the group.
    if (!member) return ProcessGroup::non_member();
    throw;
  }
  const int group_rank =
      member
          ? static_cast<int>(std::lower_bound(ranks.begin(), ranks.end(), my_rank) - ranks.begin())
          : -1;
  auto made = parent ? detail::split_from(*parent, *config, ranks, group_rank, timeout)
                     : std::map<std::string, std::shared_ptr<Backend>>{};
  if (!member) return ProcessGroup::non_member();
  const int size = static_cast<int>(ranks.size());
  auto group_store =
      std::make_shared<store::PrefixStore>(detail::prefix_of(generation, name), std::move(store));
  auto pg = std::make_shared<ProcessGroup>(group_store, group_rank, size, *config, timeout, name,
                                           ranks, std::move(made));
  store::store_based_barrier(*group_store, group_rank, size, "new_group", timeout);
  std::lock_guard<std::mutex> lock(w.mu);
  if (!w.default_pg || w.generation != generation) {
    throw std::logic_error("new_group: the default process group was destroyed meanwhile");
  }
  w.groups.push_back(pg);
  return pg;
}

}  // namespace distrpc::dist
