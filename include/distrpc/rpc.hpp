// The public RPC API: init_rpc / shutdown, typed rpc_sync / rpc_async, builtin operators by
// schema name, worker queries, timeouts, barrier / all_gather / wait_all_workers.
//
//   distrpc::init_rpc<distrpc::transport::Tcp>("worker0", rank, world, opts);
//   at::Tensor r = distrpc::rpc_sync<&add>("worker1", x, y);          // checked at compile time
//   distrpc::Future<at::Tensor> f = distrpc::rpc_async<&add>(1, x, y);  // by rank
//   distrpc::shutdown();
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "distrpc/agent.hpp"
#include "distrpc/function_id.hpp"
#include "distrpc/future.hpp"
#include "distrpc/options.hpp"
#include "distrpc/registry.hpp"
#include "distrpc/rpc_error.hpp"
#include "distrpc/rref/context.hpp"
#include "distrpc/store/rendezvous.hpp"
#include "distrpc/wire.hpp"
#include "distrpc/worker_info.hpp"

namespace distrpc {

// Where a call goes: a worker name, a WorkerInfo, or a rank.
class Destination {
 public:
  Destination(const char* name) : v_(std::string(name)) {}  // NOLINT: implicit on purpose
  Destination(std::string name) : v_(std::move(name)) {}    // NOLINT
  Destination(const WorkerInfo& w) : v_(w) {}               // NOLINT
  Destination(int rank) : v_(rank) {}                       // NOLINT
  WorkerInfo resolve(const RpcAgent& agent) const {
    return std::visit([&](const auto& d) { return agent.worker(d); }, v_);
  }

 private:
  std::variant<std::string, WorkerInfo, int> v_;
};

// Per-call options.
struct CallOptions {
  // kUnsetRpcTimeout: the agent's default at the moment of the call; 0: no limit.
  std::chrono::milliseconds timeout = kUnsetRpcTimeout;
};

inline CallOptions with_timeout(std::chrono::milliseconds t) {
  return CallOptions{t};
}

namespace detail {

struct Runtime {
  std::mutex mu;
  std::shared_ptr<RpcAgent> agent;
  bool was_shut_down = false;
  // At exit without shutdown(): stop while the agent is still owned here, so a stop that
  // abandons a blocked handler can keep the agent alive for it (RpcAgent::stop()).
  ~Runtime() {
    if (!agent) return;
    try {
      agent->stop(/*sync_exit=*/false, kNoRpcTimeout);
    } catch (...) {
      // stop(false) does no store work; nothing to report at exit.
    }
  }
};

inline Runtime& runtime() {
  static Runtime r;
  return r;
}

inline std::shared_ptr<RpcAgent> current_agent() {
  auto& rt = runtime();
  std::lock_guard<std::mutex> lk(rt.mu);
  if (rt.agent) return rt.agent;
  if (rt.was_shut_down) {
    throw RpcError(
        "RPC has not been initialized: the agent was shut down (call distrpc::init_rpc again to "
        "start a new one)");
  }
  throw RpcError(
      "Current RPC agent is not set! Did you initialize the RPC framework (e.g. by calling "
      "`distrpc::init_rpc`)?");
}

// The typed result of a call to worker `from` (RRefs in it were forked by `from`).
template <class T>
Future<T> decode_reply(const Future<wire::Message>& reply, const std::shared_ptr<RpcAgent>& agent,
                       int from) {
  Future<T> typed =
      reply.then([ctx = rref_context_of(*agent), from](const Future<wire::Message>& done) {
        if constexpr (std::is_void_v<T>) {
          done.value();
        } else {
          T out{};
          RRefDecodeScope scope{ctx, from, {}};
          DecodeScopeGuard guard(tls_rref_decode, &scope);
          wire::decode(done.value(), out);
          return out;
        }
      });
  // The reply completes on a transport I/O thread: user callbacks on `typed` go to the pool. A
  // thread that waits for it reads the transport meanwhile (sync_wait_spin).
  set_callback_executor(typed, agent->callback_executor());
  set_wait_driver(typed, agent);
  return typed;
}

template <auto F, class... A>
constexpr void check_call() {
  static_assert(free_function<F>,
                "distrpc: the template argument must be a pointer to a function or static member "
                "function, e.g. distrpc::rpc_sync<&add>(\"worker1\", x, y)");
  if constexpr (free_function<F>) {
    using Traits = fn_traits<decltype(F)>;
    static_assert(sizeof...(A) == Traits::arity,
                  "distrpc::rpc_sync/rpc_async/remote<&f>(to, args...): wrong number of "
                  "arguments for f (see f's signature in the 'required from' line)");
    static_assert(std::is_invocable_v<decltype(F), A...>,
                  "distrpc::rpc_sync/rpc_async/remote<&f>(to, args...): an argument does not "
                  "convert to the type of f's parameter at the same position");
    static_assert((!is_future_v<std::decay_t<A>> && ...),
                  "distrpc: a Future cannot be sent as an argument (it is not serializable): pass "
                  "future.value() instead");
  }
}

// What a call of F yields at the caller. Defined (as void) even when F is not a function
// pointer, so that check_call's readable static_assert fires instead of an overload failure.
template <auto F, bool = free_function<F>>
struct call_result {
  using type = void;
};
template <auto F>
struct call_result<F, true> {
  using type = unwrap_future_t<typename fn_traits<decltype(F)>::result>;
};
template <auto F>
using call_result_t = typename call_result<F>::type;

// Encodes (header, packed arguments) for `dst` and sends it. RRefs among the arguments are forked
// to `dst`; the forks are undone if encoding fails or the message is never sent.
template <class Packed>
Future<wire::Message> send_packed(const std::shared_ptr<RpcAgent>& agent, const WorkerInfo& dst,
                                  std::chrono::milliseconds timeout, const RequestHeader& header,
                                  const Packed& packed, const std::string& what) {
  wire::Message m;
  auto scope = std::make_shared<RRefEncodeScope>();
  scope->ctx = rref_context_of(*agent);
  scope->dst = dst.id;
  {
    EncodeScopeGuard guard(tls_rref_encode, scope.get());
    try {
      wire::encode(m, header, packed);
    } catch (...) {
      scope->rollback();
      throw;
    }
  }
  std::function<void()> undo;
  if (!scope->undo.empty()) undo = [scope] { scope->rollback(); };
  return agent->call(dst, std::move(m), timeout, header.internal, what, wire::MessageType::Request,
                     undo);
}

template <auto F, class... A>
Future<wire::Message> send_call(const std::shared_ptr<RpcAgent>& agent, const WorkerInfo& dst,
                                CallOptions opts, bool internal, A&&... args) {
  ensure_registered<F>();
  const auto timeout = agent->effective_timeout(opts.timeout);
  typename fn_traits<decltype(F)>::args packed(std::forward<A>(args)...);
  RequestHeader h;
  h.name = std::string(function_name<F>());
  h.signature = signature_hash<F>();
  h.internal = internal;
  return send_packed(agent, dst, timeout, h, packed,
                     "call to '" + std::string(function_name<F>()) + "'");
}

}  // namespace detail

// ---- lifecycle ---------------------------------------------------------------------------------

// Starts this process's RPC agent on transport policy T and meets the other `world_size - 1`
// workers through `options.init_method`. rank / world_size -1: read RANK / WORLD_SIZE (env://).
template <class T>
void init_rpc(const std::string& name, int rank, int world_size,
              const RpcBackendOptions& options = {}) {
  validate_worker_name(name);
  auto& rt = detail::runtime();
  std::lock_guard<std::mutex> lk(rt.mu);
  if (rt.agent) {
    throw RpcError("RPC is already initialized on this process (as " + rt.agent->self().str() +
                   "): call distrpc::shutdown() before init_rpc(\"" + name + "\", ...)");
  }
  if (options.num_worker_threads < 1) {
    throw std::invalid_argument("num_worker_threads must be >= 1, got " +
                                std::to_string(options.num_worker_threads));
  }
  if (options.rpc_timeout.count() < 0) {
    throw std::invalid_argument("rpc_timeout must be >= 0 ms (0 means no limit), got " +
                                std::to_string(options.rpc_timeout.count()) + " ms");
  }
  if (options.sync_wait_spin.count() < 0) {
    throw std::invalid_argument("sync_wait_spin must be >= 0 us (0: never poll), got " +
                                std::to_string(options.sync_wait_spin.count()) + " us");
  }
  if (options.shutdown_grace.count() < 0) {
    throw std::invalid_argument("shutdown_grace must be >= 0 ms (0: abandon at once), got " +
                                std::to_string(options.shutdown_grace.count()) + " ms");
  }
  auto rdzv = store::rendezvous(options.init_method, rank, world_size, options.init_timeout);
  auto agent = std::make_shared<Agent<T>>(WorkerInfo{rdzv.rank, name}, rdzv.world_size, options);
  agent->set_store(rdzv.store);
  try {
    agent->join_group();
  } catch (...) {
    agent->stop(/*sync_exit=*/false, std::chrono::milliseconds(0));
    throw;
  }
  rt.agent = std::move(agent);
  rt.was_shut_down = false;
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

namespace detail {

// Runs the ATen operator `schema` ("aten::add.Tensor", or "aten::add" for the overload "")
// through the dispatcher. Defaults fill missing trailing arguments.
inline c10::IValue run_builtin(std::string schema, std::vector<c10::IValue> args) {
  std::string op = schema, overload;
  if (auto dot = schema.find('.'); dot != std::string::npos) {
    op = schema.substr(0, dot);
    overload = schema.substr(dot + 1);
  }
  auto handle = c10::Dispatcher::singleton().findSchema({op, overload});
  if (!handle) {
    throw std::invalid_argument("unknown builtin operator '" + schema +
                                "': expected a schema name such as 'aten::add.Tensor'");
  }
  const auto& fs = handle->schema();
  const auto& params = fs.arguments();
  if (args.size() > params.size()) {
    std::ostringstream s;
    s << fs;
    throw std::invalid_argument(schema + " takes at most " + std::to_string(params.size()) +
                                " arguments but got " + std::to_string(args.size()) +
                                " (schema: " + s.str() + ")");
  }
  torch::jit::Stack stack(args.begin(), args.end());
  for (std::size_t i = args.size(); i < params.size(); ++i) {
    if (!params[i].default_value()) {
      std::ostringstream s;
      s << fs;
      throw std::invalid_argument(schema + ": missing value for argument '" + params[i].name() +
                                  "' (schema: " + s.str() + ")");
    }
    stack.push_back(*params[i].default_value());
  }
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (!args[i].type()->isSubtypeOf(*params[i].type()) &&
        !(params[i].type()->kind() == c10::TypeKind::NumberType && args[i].isScalar()) &&
        !(params[i].type()->kind() == c10::TypeKind::OptionalType)) {
      std::ostringstream s;
      s << fs;
      throw std::invalid_argument(schema + ": argument '" + params[i].name() + "' (position " +
                                  std::to_string(i) + ") expected " + params[i].type()->str() +
                                  " but got " + args[i].type()->str() + " (schema: " + s.str() +
                                  ")");
    }
  }
  handle->callBoxed(stack);
  if (stack.size() == 1) return std::move(stack[0]);
  return c10::ivalue::Tuple::create(std::move(stack));
}

}  // namespace detail

// PyTorch's builtin calls: rpc_async("worker1", "aten::add.Tensor", {a, b}).
inline Future<c10::IValue> rpc_async(const Destination& to, const std::string& op,
                                     std::vector<c10::IValue> args, CallOptions opts = {}) {
  auto agent = detail::current_agent();
  const WorkerInfo dst = to.resolve(*agent);
  auto reply =
      detail::send_call<&detail::run_builtin>(agent, dst, opts, false, op, std::move(args));
  auto typed = detail::decode_reply<c10::IValue>(reply, agent, dst.id);
  detail::register_in_scope(typed);
  return typed;
}
inline c10::IValue rpc_sync(const Destination& to, const std::string& op,
                            std::vector<c10::IValue> args, CallOptions opts = {}) {
  return rpc_async(to, op, std::move(args), opts).value();
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
inline std::map<std::string, std::string> get_debug_info() {
  return detail::current_agent()->debug_info();
}
inline bool is_initialized() {
  auto& rt = detail::runtime();
  std::lock_guard<std::mutex> lk(rt.mu);
  return rt.agent != nullptr;
}

// ---- all_gather, barrier, wait_all_workers ----------------------------------------------------

namespace detail {

// ---- the group protocol ------------------------------------------------------------------------
// An all-gather over a set of members, led by the first member (in name order) not known lost.
// Members send their contribution to the leader, which decides the outcome once (GatherTable) and
// answers everyone alike. The leader watches the members it still waits for: one whose
// connection breaks is lost at once, and one that never connected is probed (gather_status) so a
// dead one is found within about a second; a probe also learns the outcome a member already got
// from an earlier leader that died between its replies. A member whose leader is lost goes on
// with the next one. See docs/rpc.md, "When workers are lost".

// Leader side, called by the members through RPC (internal, asynchronous by type).
inline Future<GatherOutcome> gather_contribute(std::string key, std::uint64_t seq,
                                               std::vector<std::string> names, bool tolerant,
                                               std::string op, std::string name, std::string blob,
                                               std::vector<std::string> lost) {
  return current_agent()->gathers().contribute(key, seq, names, tolerant, op, name, std::move(blob),
                                               lost);
}

// A leader asks a member that has not contributed: the outcome, if the member already has it.
inline std::optional<GatherOutcome> gather_status(std::string key, std::uint64_t seq) {
  return current_agent()->gathers().completed(key, seq);
}

inline std::string seconds_text(std::chrono::milliseconds t) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", static_cast<double>(t.count()) / 1000.0);
  return buf;
}

// The members of `names` known lost here.
inline std::vector<std::string> lost_among(const RpcAgent& agent,
                                           const std::vector<std::string>& names) {
  std::vector<std::string> out;
  for (const auto& n : agent.lost_names()) {
    if (std::binary_search(names.begin(), names.end(), n)) out.push_back(n);
  }
  return out;
}

// The leader's side of one gather: contributes, then waits for the others, watching and probing
// the missing ones, until the table decides or `deadline` passes.
inline GatherOutcome lead_gather(const std::shared_ptr<RpcAgent>& agent, const std::string& key,
                                 std::uint64_t seq, const std::vector<std::string>& names,
                                 bool tolerant, const std::string& op, std::string blob,
                                 std::chrono::steady_clock::time_point deadline,
                                 std::chrono::milliseconds limit) {
  using Clock = std::chrono::steady_clock;
  using std::chrono::milliseconds;
  auto& table = agent->gathers();
  auto fut = table.contribute(key, seq, names, tolerant, op, agent->self().name, std::move(blob),
                              lost_among(*agent, names));
  struct Probe {
    Clock::time_point next;
    milliseconds interval{100};
    std::optional<Future<wire::Message>> pending;
  };
  std::map<std::string, Probe> probes;
  while (!fut.wait_for(milliseconds(10))) {
    table.note_lost(key, seq, lost_among(*agent, names));
    const auto now = Clock::now();
    if (now >= deadline) {
      GatherOutcome o;
      o.status = GatherOutcome::Status::timed_out;
      o.text =
          "timed out in _all_gather after " + seconds_text(limit) +
          " seconds. The following workers did not respond: " + join_names(table.missing(key, seq));
      table.decide(key, seq, std::move(o));
      continue;
    }
    for (const auto& m : table.missing(key, seq)) {
      auto [it, fresh] = probes.try_emplace(m);
      Probe& p = it->second;
      if (fresh) p.next = now + p.interval;  // most members arrive on their own, unprobed
      if (p.pending && p.pending->done()) {
        try {
          std::optional<GatherOutcome> known;
          wire::decode(p.pending->value(), known);
          if (known) table.decide(key, seq, std::move(*known));
        } catch (const DistNetworkError& e) {
          agent->mark_lost(agent->worker(m).id, e.what());
        } catch (const std::exception&) {
          // A slow answer (timeout) or a member shutting down: asked again at the next turn.
        }
        p.pending.reset();
      }
      if (!p.pending && now >= p.next) {
        p.pending =
            send_call<&gather_status>(agent, agent->worker(m), CallOptions{milliseconds(2000)},
                                      /*internal=*/true, key, seq);
        p.interval = std::min(p.interval * 2, milliseconds(1000));
        p.next = now + p.interval;
      }
    }
  }
  GatherOutcome out = fut.value();
  out.led = true;
  return out;
}

// One gather of `blob` over `names` (empty: every worker). Strict (`tolerant` false): fails with
// a DistNetworkError naming the members lost before they contributed. Tolerant: completes among
// the survivors and lists the lost ones. Either way the outcome is the same on every member, and
// the lost members are marked lost here too.
inline GatherOutcome group_gather(const std::shared_ptr<RpcAgent>& agent, std::string blob,
                                  std::vector<std::string> names, std::chrono::milliseconds timeout,
                                  bool tolerant, const std::string& op) {
  using Clock = std::chrono::steady_clock;
  const std::string me = agent->self().name;
  if (names.empty()) {
    for (const auto& w : agent->workers()) names.push_back(w.name);
  }
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  if (!std::binary_search(names.begin(), names.end(), me)) {
    throw std::invalid_argument("all_gather: this worker (" + me +
                                ") is not in the list of participants");
  }
  for (const auto& n : names) agent->worker(n);  // unknown names fail here, clearly
  std::string key;
  for (const auto& n : names) key += n + ",";
  const std::uint64_t seq = agent->gathers().next_seq(key);
  const auto limit = agent->effective_timeout(timeout);
  const auto deadline = limit.count() > 0 ? Clock::now() + limit : Clock::time_point::max();
  GatherOutcome out;
  for (;;) {
    const auto lost = lost_among(*agent, names);
    const std::string leader = *std::find_if(names.begin(), names.end(), [&](const std::string& n) {
      return n == me || !std::binary_search(lost.begin(), lost.end(), n);
    });
    if (leader == me) {
      out = lead_gather(agent, key, seq, names, tolerant, op, std::move(blob), deadline, limit);
      break;
    }
    // The leader's verdict comes first: the member's own limit is a little longer, so it fires
    // only when the leader itself does not answer.
    std::chrono::milliseconds call_limit{0};
    if (limit.count() > 0) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      call_limit = std::max(left, std::chrono::milliseconds(1)) +
                   std::max(std::chrono::milliseconds(1000), limit / 2);
    }
    auto reply = send_call<&gather_contribute>(
        agent, agent->worker(leader), CallOptions{call_limit},
        /*internal=*/true, key, seq, names, tolerant, op, me, blob, lost);
    try {
      wire::decode(reply.value(), out);
    } catch (const DistNetworkError& e) {
      // The leader's verdicts are values: a network error means the leader is gone. The next
      // member in name order leads the same gather.
      agent->mark_lost(agent->worker(leader).id, e.what());
      continue;
    }
    agent->gathers().remember(key, seq, out);
    break;
  }
  for (const auto& n : out.lost) {
    agent->mark_lost(agent->worker(n).id, "lost during " + op + " (reported by the group)");
  }
  if (out.status == GatherOutcome::Status::lost_members) throw DistNetworkError(out.text);
  if (out.status == GatherOutcome::Status::timed_out) throw RpcTimeoutError(out.text);
  return out;
}

// all_gather of opaque blobs (strict); the typed all_gather encodes and decodes around it.
inline std::map<std::string, std::string> all_gather_blobs(const std::shared_ptr<RpcAgent>& agent,
                                                           std::string blob,
                                                           std::vector<std::string> names,
                                                           std::chrono::milliseconds timeout,
                                                           const std::string& op = "all_gather") {
  return group_gather(agent, std::move(blob), std::move(names), timeout, /*tolerant=*/false, op)
      .values;
}

template <class V>
std::string to_blob(const V& value) {
  wire::Message m;
  wire::encode(m, value);
  if (!m.buffers.empty()) {
    throw std::invalid_argument(
        "all_gather: values carrying tensors are not supported; gather plain data");
  }
  return std::move(m.payload);
}

template <class V>
V from_blob(std::string blob) {
  wire::Message m;
  m.payload = std::move(blob);
  V v{};
  wire::decode(m, v);
  return v;
}

}  // namespace detail

// Every worker in `names` (default: all) contributes `value`; each gets {name: value}.
template <class V>
std::map<std::string, V> all_gather(const V& value, std::vector<std::string> names = {},
                                    std::chrono::milliseconds timeout = kUnsetRpcTimeout) {
  auto agent = detail::current_agent();
  auto blobs = detail::all_gather_blobs(agent, detail::to_blob(value), std::move(names), timeout);
  std::map<std::string, V> out;
  for (auto& [n, b] : blobs) out.emplace(n, detail::from_blob<V>(std::move(b)));
  return out;
}

// Returns once every worker in `names` (default: all) has reached the barrier.
// all_gather, barrier and wait_all_workers fail with a DistNetworkError naming the members lost
// before they arrived (the same error on every member), and with an RpcTimeoutError naming those
// that did not arrive within `timeout`.
inline void barrier(std::vector<std::string> names = {},
                    std::chrono::milliseconds timeout = kUnsetRpcTimeout) {
  auto agent = detail::current_agent();
  detail::all_gather_blobs(agent, std::string(), std::move(names), timeout, "barrier");
}

// Returns once every worker of the group has called it.
inline void wait_all_workers(std::chrono::milliseconds timeout = kUnsetRpcTimeout) {
  auto agent = detail::current_agent();
  detail::all_gather_blobs(agent, std::string(), {}, timeout, "wait_all_workers");
}

// ---- shutdown ----------------------------------------------------------------------------------

namespace detail {

// Group-wide join among the surviving members: repeat (tolerant) all-gathers of the work
// counters until two consecutive rounds agree, on the totals and on who is lost, and show every
// sent call answered and no call running anywhere. Monotonic counters make a call that slips
// between two workers' reports change the totals, so it cannot go unseen. A lost member's calls
// end on the survivors (they fail naming it), so the survivors' totals balance without it.
// Returns the lost members.
inline std::vector<std::string> join_group_work(
    const std::shared_ptr<RpcAgent>& agent,
    const std::function<std::chrono::milliseconds()>& time_left) {
  std::optional<WorkCounters> previous;
  std::vector<std::string> previous_lost;
  while (true) {
    auto round = group_gather(agent, to_blob(agent->counters()), {}, time_left(),
                              /*tolerant=*/true, "shutdown");
    WorkCounters total;
    for (auto& [n, b] : round.values) {
      auto c = from_blob<WorkCounters>(std::move(b));
      total.client_sent += c.client_sent;
      total.client_done += c.client_done;
      total.server_active += c.server_active;
      total.protocol_pending += c.protocol_pending;
    }
    const bool idle = total.client_sent == total.client_done && total.server_active == 0 &&
                      total.protocol_pending == 0;
    if (idle && previous && *previous == total && previous_lost == round.lost) return round.lost;
    previous = total;
    previous_lost = round.lost;
    if (!idle) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// The error of a graceful shutdown that completed among the survivors of a group that lost
// members: the same text on every survivor.
inline std::string shutdown_lost_text(const std::vector<std::string>& lost) {
  return "shutdown: worker(s) lost from the group: " + join_names(lost) +
         "; the other workers completed their outstanding calls and stopped";
}

}  // namespace detail

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
inline void shutdown(bool graceful = true, std::chrono::milliseconds timeout = kNoRpcTimeout) {
  auto agent = detail::current_agent();
  std::exception_ptr error;
  std::exception_ptr leak_error;  // reported after a complete (synchronized) local stop
  std::vector<std::string> lost;  // agreed by the group: reported after the local stop
  bool led_last = false;          // this worker decided the group's last gather
  if (graceful) {
    try {
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      // What is left of `timeout` (0, no limit, stays 0); at least 1 ms so a late step times
      // out with its own text instead of waiting without limit.
      const auto time_left = [&]() -> std::chrono::milliseconds {
        if (timeout.count() <= 0) return timeout;
        return std::max(std::chrono::milliseconds(1),
                        std::chrono::duration_cast<std::chrono::milliseconds>(
                            deadline - std::chrono::steady_clock::now()));
      };
      detail::group_gather(agent, std::string(), {}, time_left(), /*tolerant=*/true, "shutdown");
      lost = detail::join_group_work(agent, time_left);
      // The layers release what this worker holds of others (RRefs: every user RRef).
      auto limit = timeout.count() > 0 ? time_left() : agent->default_timeout();
      if (limit.count() == 0) limit = std::chrono::seconds(60);
      for (const auto& x : agent->extensions()) x->before_exit(limit);
      // Every worker's releases are answered before anyone checks for leaks.
      const auto last = detail::group_gather(agent, std::string(), {}, time_left(),
                                             /*tolerant=*/true, "shutdown");
      lost = last.lost;
      led_last = last.led;
      for (const auto& x : agent->extensions()) {
        const std::string leaks = x->report_leaks();
        if (!leaks.empty() && !leak_error) leak_error = std::make_exception_ptr(RpcError(leaks));
      }
    } catch (...) {
      error = std::current_exception();
    }
  }
  try {
    agent->stop(graceful && !error, timeout, led_last);
  } catch (...) {
    if (!error) error = std::current_exception();
  }
  {
    auto& rt = detail::runtime();
    std::lock_guard<std::mutex> lk(rt.mu);
    rt.agent.reset();
    rt.was_shut_down = true;
  }
  if (error) std::rethrow_exception(error);
  if (!lost.empty()) throw DistNetworkError(detail::shutdown_lost_text(lost));
  if (leak_error) std::rethrow_exception(leak_error);
}

}  // namespace distrpc

// RRef<T> and remote(): included here so that <distrpc/rpc.hpp> offers all three call modes.
#include "distrpc/rref.hpp"
