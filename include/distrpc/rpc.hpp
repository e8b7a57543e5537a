// The public RPC API: init_rpc / shutdown, typed rpc_sync / rpc_async, builtin operators by
// schema name, worker queries, timeouts, barrier / all_gather / wait_all_workers.
//
//   distrpc::init_rpc<distrpc::transport::Tcp>("worker0", rank, world, opts);
//   at::Tensor r = distrpc::rpc_sync<&add>("worker1", x, y);          // checked at compile time
//   distrpc::Future<at::Tensor> f = distrpc::rpc_async<&add>(1, x, y);  // by rank
//   distrpc::shutdown();
#pragma once

#include <ATen/core/ivalue.h>

#include <chrono>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "distrpc/agent.hpp"
#include "distrpc/agent/builtin.hpp"
#include "distrpc/agent/calls.hpp"
#include "distrpc/agent/elastic.hpp"
#include "distrpc/agent/group_protocol.hpp"
#include "distrpc/agent/runtime.hpp"
#include "distrpc/future.hpp"
#include "distrpc/options.hpp"
#include "distrpc/registry.hpp"
#include "distrpc/rpc_error.hpp"
#include "distrpc/worker_info.hpp"

namespace distrpc {

// ---- lifecycle ---------------------------------------------------------------------------------

namespace detail {
// init_rpc's common part: one process agent at a time; `start` makes it (under the runtime's lock,
// so two concurrent init_rpc calls cannot both start one).
template <class Start>
void install_runtime_agent(const std::string& name, Start&& start) {
  validate_worker_name(name);
  auto& rt = runtime();
  std::lock_guard<std::mutex> lk(rt.mu);
  if (rt.agent) {
    throw RpcError("RPC is already initialized on this process (as " + rt.agent->self().str() +
                   "): call distrpc::shutdown() before init_rpc(\"" + name + "\", ...)");
  }
  rt.agent = start();
  rt.was_shut_down = false;
}
}  // namespace detail

// Starts this process's RPC agent on transport policy T and meets the other `world_size - 1`
// workers through `options.init_method`. rank / world_size -1: read RANK / WORLD_SIZE (env://).
// (A program that holds agents itself, or more than one: RpcGroup::join.)
template <class T>
void init_rpc(const std::string& name, int rank, int world_size,
              const RpcBackendOptions& options = {}) {
  detail::install_runtime_agent(
      name, [&] { return detail::start_agent<T>(name, rank, world_size, options, nullptr); });
}

// Without a world size: joins (or starts) the dynamic group of `options.init_method` as worker
// `name` of rank `rank` (-1: the URL's ?rank=, or RANK for env://). Members join and leave at any
// time; every member sees the current set (get_worker_infos()) and can call every other. A
// worker that died can be replaced by a new process under its name. shutdown() leaves the group
// without waiting for the others. See docs/rpc.md, "Elastic membership".
template <class T>
void init_rpc(const std::string& name, int rank, const RpcBackendOptions& options = {}) {
  detail::install_runtime_agent(
      name, [&] { return detail::start_dynamic_agent<T>(name, rank, options, nullptr); });
}

// ---- typed calls -------------------------------------------------------------------------------

// Runs f(args...) on `to` and returns a future of its result. A function returning Future<U>
// runs asynchronously on the callee and gives Future<U> here.
template <auto F, class... A>
Future<detail::call_result_t<F>> rpc_async(const Destination& to, CallOptions opts, A&&... args) {
  detail::check_call<F, A...>();
  auto agent = detail::current_agent();
  const WorkerInfo dst = to.resolve(*agent);
  auto reply = detail::send_call<F>(agent, dst, opts, /*internal=*/false, std::forward<A>(args)...);
  auto typed = detail::decode_reply<detail::call_result_t<F>>(reply, agent, dst.id);
  detail::register_in_scope(typed);
  return typed;
}
template <auto F, class... A>
Future<detail::call_result_t<F>> rpc_async(const Destination& to, A&&... args) {
  return rpc_async<F>(to, CallOptions{}, std::forward<A>(args)...);
}

// Runs f(args...) on `to` and returns its result (rethrowing the remote exception).
template <auto F, class... A>
detail::call_result_t<F> rpc_sync(const Destination& to, CallOptions opts, A&&... args) {
  auto f = rpc_async<F>(to, opts, std::forward<A>(args)...);
  if constexpr (std::is_void_v<detail::call_result_t<F>>) {
    f.value();
  } else {
    return f.value();
  }
}
template <auto F, class... A>
detail::call_result_t<F> rpc_sync(const Destination& to, A&&... args) {
  return rpc_sync<F>(to, CallOptions{}, std::forward<A>(args)...);
}

// ---- builtin operators by schema name ----------------------------------------------------------

// PyTorch's builtin calls: rpc_async("worker1", "aten::add.Tensor", {a, b}). CallOptions go
// first, as for every call (rpc_sync("worker1", distrpc::with_timeout(100ms), "aten::mm", {a, b}));
// the trailing form (..., {a, b}, opts) is also accepted.
inline Future<c10::IValue> rpc_async(const Destination& to, CallOptions opts, const std::string& op,
                                     std::vector<c10::IValue> args) {
  // The library's own: served by every agent (whether it runs `op` is its builtin_operators').
  detail::ensure_library_registered<&detail::run_builtin>();
  auto agent = detail::current_agent();
  const WorkerInfo dst = to.resolve(*agent);
  auto reply = detail::send_named_call<&detail::run_builtin>(
      agent, dst, opts, false, "call to '" + op + "'", op, std::move(args));
  auto typed = detail::decode_reply<c10::IValue>(reply, agent, dst.id);
  detail::register_in_scope(typed);
  return typed;
}
inline Future<c10::IValue> rpc_async(const Destination& to, const std::string& op,
                                     std::vector<c10::IValue> args, CallOptions opts = {}) {
  return rpc_async(to, opts, op, std::move(args));
}
inline c10::IValue rpc_sync(const Destination& to, CallOptions opts, const std::string& op,
                            std::vector<c10::IValue> args) {
  return rpc_async(to, opts, op, std::move(args)).value();
}
inline c10::IValue rpc_sync(const Destination& to, const std::string& op,
                            std::vector<c10::IValue> args, CallOptions opts = {}) {
  return rpc_async(to, opts, op, std::move(args)).value();
}

// ---- queries -----------------------------------------------------------------------------------

inline WorkerInfo get_worker_info() {
  return detail::current_agent()->self();
}
inline WorkerInfo get_worker_info(const std::string& name) {
  return detail::current_agent()->worker(name);
}
inline std::vector<WorkerInfo> get_worker_infos() {
  return detail::current_agent()->workers();
}
inline std::chrono::milliseconds get_rpc_timeout() {
  return detail::current_agent()->default_timeout();
}
inline void set_rpc_timeout(std::chrono::milliseconds t) {
  detail::current_agent()->set_default_timeout(t);
}
// This worker's device map towards `to` (empty: none), as the group accepted it.
inline DeviceMap get_device_map(const Destination& to) {
  auto agent = detail::current_agent();
  return agent->device_map(to.resolve(*agent));
}
// The CUDA devices this worker uses: RpcBackendOptions::devices, else those the group's device
// maps name for it.
inline std::vector<DeviceName> get_devices() {
  return detail::current_agent()->devices();
}
inline std::map<std::string, std::string> get_debug_info() {
  return detail::current_agent()->debug_info();
}
inline bool is_initialized() {
  auto& rt = detail::runtime();
  std::lock_guard<std::mutex> lk(rt.mu);
  return rt.agent != nullptr;
}

// ---- all_gather, barrier, wait_all_workers ----------------------------------------------------

// Every worker in `names` (default: all) contributes `value`; each gets {name: value}.
template <class V>
std::map<std::string, V> all_gather(const V& value, std::vector<std::string> names = {},
                                    std::chrono::milliseconds timeout = kUnsetRpcTimeout) {
  using detail::GroupProtocol;
  auto blobs = GroupProtocol(detail::current_agent())
                   .all_gather(GroupProtocol::to_blob(value), std::move(names), timeout);
  std::map<std::string, V> out;
  for (auto& [n, b] : blobs) out.emplace(n, GroupProtocol::from_blob<V>(std::move(b)));
  return out;
}

// Returns once every worker in `names` (default: all) has reached the barrier.
// all_gather, barrier and wait_all_workers fail with a DistNetworkError naming the members lost
// before they arrived (the same error on every member), and with an RpcTimeoutError naming those
// that did not arrive within `timeout`.
inline void barrier(std::vector<std::string> names = {},
                    std::chrono::milliseconds timeout = kUnsetRpcTimeout) {
  detail::GroupProtocol(detail::current_agent())
      .all_gather(std::string(), std::move(names), timeout, "barrier");
}

// Returns once every worker of the group has called it.
inline void wait_all_workers(std::chrono::milliseconds timeout = kUnsetRpcTimeout) {
  detail::GroupProtocol(detail::current_agent())
      .all_gather(std::string(), {}, timeout, "wait_all_workers");
}

// ---- shutdown ----------------------------------------------------------------------------------

// Stops this process's agent. Graceful (the default): wait for every worker, then until no call
// is outstanding anywhere in the group, then release every user RRef (and wait until every
// worker did), check for leaked RRefs, and stop locally; if a step fails its error reaches the
// caller and the local stop still runs. Not graceful: local stop only, never waits on peers.
// Members lost (dead, or their connections broke) do not stop a graceful shutdown: the others
// complete it among themselves without waiting for a timeout, then a DistNetworkError naming the
// lost members is raised once, after the local stop (the text is the same on every survivor).
// `timeout`, when positive, bounds the graceful part as a whole.
// Leaked RRefs (forks still recorded on an owner) fail a graceful shutdown with "Leaking RRef"
// unless set_ignore_rref_leak(true).
// Bounded: the local stop waits for handlers and callbacks still running up to `timeout` when it
// is positive, else up to RpcBackendOptions::shutdown_grace (2 s by default); threads still in
// user code then are abandoned (detached, named on stderr), and queued requests that never started
// are dropped (not graceful). A graceful shutdown reaches its local stop with every call finished,
// so the bound changes nothing there.
// shutdown() stops the process's agent (init_rpc); an agent held in an RpcGroup stops with
// RpcGroup::shutdown().
inline void shutdown(bool graceful = true, std::chrono::milliseconds timeout = kNoRpcTimeout) {
  auto agent = detail::runtime_agent();
  std::exception_ptr error = detail::GroupProtocol(agent).shutdown(graceful, timeout);
  {
    auto& rt = detail::runtime();
    std::lock_guard<std::mutex> lk(rt.mu);
    rt.agent.reset();
    rt.was_shut_down = true;
  }
  if (error) std::rethrow_exception(error);
}

// ---- an agent the program holds ----------------------------------------------------------------

// This process's membership in one RPC group, held by the program: the calls of the free
// functions, on this agent. A process may hold several (two groups, or several workers of one
// group in one process, as tests do), beside or instead of the one init_rpc() starts.
//
//   auto registry = std::make_shared<distrpc::Registry>();
//   registry->add<&add>();  // what this agent serves (default: DISTRPC_REGISTER)
//   auto g = distrpc::RpcGroup::join<distrpc::transport::Tcp>("ps", 0, 2, opts, registry);
//   at::Tensor y = g.rpc_sync<&mul>("trainer", x, x);
//   g.shutdown();
//
// Handlers and callbacks run for the agent that runs them: inside them the free functions
// (rpc_sync, remote, RRef(value), ...) use that agent. On a thread of the program, use() makes
// one the current agent for a scope. Copies share the agent; it stops (not gracefully) when the
// last copy goes without shutdown().
class RpcGroup {
 public:
  // Starts an agent on transport policy T, as init_rpc<T>() does, serving what `registry` holds
  // (null: the process's registry, where DISTRPC_REGISTER and call sites add functions).
  template <class T>
  static RpcGroup join(const std::string& name, int rank, int world_size,
                       const RpcBackendOptions& options = {},
                       std::shared_ptr<const Registry> registry = nullptr) {
    RpcGroup g;
    g.s_->agent = detail::start_agent<T>(name, rank, world_size, options, std::move(registry));
    return g;
  }
  // Joins a dynamic group (no world size), as init_rpc<T>(name, rank, options) does.
  template <class T>
  static RpcGroup join(const std::string& name, int rank, const RpcBackendOptions& options,
                       std::shared_ptr<const Registry> registry = nullptr) {
    RpcGroup g;
    g.s_->agent = detail::start_dynamic_agent<T>(name, rank, options, std::move(registry));
    return g;
  }

  // Makes this agent the calling thread's current one while the returned guard lives: the free
  // functions (and remote(), RRef(value), RemoteModule) called on this thread use it.
  class Use {
   public:
    Use(Use&&) = delete;
    Use& operator=(Use&&) = delete;

   private:
    friend class RpcGroup;
    explicit Use(std::shared_ptr<RpcAgent> agent)
        : agent_(std::move(agent)), scope_(agent_.get()) {}
    std::shared_ptr<RpcAgent> agent_;  // alive while it is current
    detail::CurrentAgentScope scope_;
  };
  [[nodiscard]] Use use() const { return Use(live()); }

  // ---- calls (as the free functions of the same names) ------------------------------------------
  template <auto F, class... A>
  [[nodiscard]] Future<detail::call_result_t<F>> rpc_async(const Destination& to,
                                                           A&&... args) const {
    const auto current = use();
    return ::distrpc::rpc_async<F>(to, std::forward<A>(args)...);
  }
  template <auto F, class... A>
  detail::call_result_t<F> rpc_sync(const Destination& to, A&&... args) const {
    const auto current = use();
    return ::distrpc::rpc_sync<F>(to, std::forward<A>(args)...);
  }
  [[nodiscard]] Future<c10::IValue> rpc_async(const Destination& to, CallOptions opts,
                                              const std::string& op,
                                              std::vector<c10::IValue> args) const {
    const auto current = use();
    return ::distrpc::rpc_async(to, opts, op, std::move(args));
  }
  c10::IValue rpc_sync(const Destination& to, CallOptions opts, const std::string& op,
                       std::vector<c10::IValue> args) const {
    const auto current = use();
    return ::distrpc::rpc_sync(to, opts, op, std::move(args));
  }
  [[nodiscard]] Future<c10::IValue> rpc_async(const Destination& to, const std::string& op,
                                              std::vector<c10::IValue> args,
                                              CallOptions opts = {}) const {
    const auto current = use();
    return ::distrpc::rpc_async(to, op, std::move(args), opts);
  }
  c10::IValue rpc_sync(const Destination& to, const std::string& op, std::vector<c10::IValue> args,
                       CallOptions opts = {}) const {
    const auto current = use();
    return ::distrpc::rpc_sync(to, op, std::move(args), opts);
  }

  // ---- queries ---------------------------------------------------------------------------------
  WorkerInfo get_worker_info() const { return live()->self(); }
  WorkerInfo get_worker_info(const std::string& name) const { return live()->worker(name); }
  std::vector<WorkerInfo> get_worker_infos() const { return live()->workers(); }
  std::chrono::milliseconds get_rpc_timeout() const { return live()->default_timeout(); }
  void set_rpc_timeout(std::chrono::milliseconds t) const { live()->set_default_timeout(t); }
  std::map<std::string, std::string> get_debug_info() const { return live()->debug_info(); }

  // ---- the group -------------------------------------------------------------------------------
  template <class V>
  std::map<std::string, V> all_gather(const V& value, std::vector<std::string> names = {},
                                      std::chrono::milliseconds timeout = kUnsetRpcTimeout) const {
    const auto current = use();
    return ::distrpc::all_gather(value, std::move(names), timeout);
  }
  void barrier(std::vector<std::string> names = {},
               std::chrono::milliseconds timeout = kUnsetRpcTimeout) const {
    const auto current = use();
    ::distrpc::barrier(std::move(names), timeout);
  }
  void wait_all_workers(std::chrono::milliseconds timeout = kUnsetRpcTimeout) const {
    const auto current = use();
    ::distrpc::wait_all_workers(timeout);
  }

  // As distrpc::shutdown(), for this agent. Calls made through this object afterwards fail
  // ("RPC has not been initialized: the agent was shut down").
  void shutdown(bool graceful = true, std::chrono::milliseconds timeout = kNoRpcTimeout) {
    std::shared_ptr<RpcAgent> agent;
    {
      std::lock_guard<std::mutex> lk(s_->mu);
      if (!s_->agent) throw RpcError(kShutDownText);
      agent = std::move(s_->agent);
    }
    if (auto error = detail::GroupProtocol(agent).shutdown(graceful, timeout)) {
      std::rethrow_exception(error);
    }
  }
  bool is_shut_down() const {
    std::lock_guard<std::mutex> lk(s_->mu);
    return !s_->agent;
  }

  // The agent itself (advanced: the agent's own interface, e.g. debug counters).
  std::shared_ptr<RpcAgent> agent() const { return live(); }

 private:
  static constexpr const char* kShutDownText =
      "RPC has not been initialized: the agent was shut down (RpcGroup::shutdown() was called)";

  struct State {
    std::mutex mu;
    std::shared_ptr<RpcAgent> agent;  // null once shut down
    // The last copy goes without shutdown(): stop locally while the agent is still owned here
    // (as at the exit of a program that never called shutdown()).
    ~State() {
      if (!agent) return;
      try {
        agent->stop(/*sync_exit=*/false, kNoRpcTimeout);
      } catch (...) {
        // stop(false) does no store work; nothing to report from a destructor.
      }
    }
  };

  RpcGroup() : s_(std::make_shared<State>()) {}

  std::shared_ptr<RpcAgent> live() const {
    std::lock_guard<std::mutex> lk(s_->mu);
    if (!s_->agent) throw RpcError(kShutDownText);
    return s_->agent;
  }

  std::shared_ptr<State> s_;
};

}  // namespace distrpc
