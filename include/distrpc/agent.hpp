// RpcAgent: the transport-agnostic heart of RPC, and Agent<Transport>, which binds it to a policy.
//
// The agent moves messages, runs requests and tracks calls and the group. Its parts are classes
// of their own: the pending calls, their deadlines and the join's counters (agent/call_table.hpp),
// the worker table and the lost members (agent/membership.hpp), the all-gathers' decisions
// (agent/gather_table.hpp) and messages (agent/group_protocol.hpp). What it does itself: dispatch
// requests through its Registry onto its two executors (a fixed request pool and an elastic
// callback pool), and hand the layers plugged into it (agent/extension.hpp) their messages and
// hooks. It moves only wire::Message values; the typed API (rpc.hpp, agent/calls.hpp) encodes and
// decodes them. See docs/threading.md for which thread runs what.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <c10/core/impl/VirtualGuardImpl.h>

#include "distrpc/agent/call_table.hpp"
#include "distrpc/agent/device_routes.hpp"
#include "distrpc/agent/extension.hpp"
#include "distrpc/agent/gather_table.hpp"
#include "distrpc/agent/membership.hpp"
#include "distrpc/device_future.hpp"
#include "distrpc/error.hpp"
#include "distrpc/future.hpp"
#include "distrpc/log_c10.hpp"
#include "distrpc/options.hpp"
#include "distrpc/registry.hpp"
#include "distrpc/rpc_error.hpp"
#include "distrpc/store/store.hpp"
#include "distrpc/thread_pool.hpp"
#include "distrpc/transport/transport.hpp"
#include "distrpc/wire.hpp"
#include "distrpc/worker_info.hpp"

namespace distrpc {

class RpcAgent;

namespace detail {
class GroupProtocol;
class ElasticProtocol;
// The agent the calling thread works for: set on its pools' threads, while it runs a request or
// a control message (also on a transport reading thread), and by RpcGroup::use(). The free
// functions (rpc_sync, remote, RRef(value), ...) use it before the process's current agent, so a
// handler calls back through the agent that runs it, and one process can hold two agents.
inline thread_local RpcAgent* tls_current_agent = nullptr;

// Makes `agent` the calling thread's current agent while alive.
class CurrentAgentScope {
 public:
  explicit CurrentAgentScope(RpcAgent* agent) : saved_(tls_current_agent) {
    tls_current_agent = agent;
  }
  ~CurrentAgentScope() { tls_current_agent = saved_; }
  CurrentAgentScope(const CurrentAgentScope&) = delete;
  CurrentAgentScope& operator=(const CurrentAgentScope&) = delete;

 private:
  RpcAgent* const saved_;
};
}  // namespace detail

// Shared-owned (init_rpc makes it with make_shared): a stop that abandons threads still running
// user code keeps the agent alive through its own shared_ptr (stop(), keep_alive_forever()).
// `registry`: what this agent runs for its peers (null: the process's Registry::instance()). An
// agent with its own registry still serves the library's own functions (its group protocol,
// builtin operators, RRefs' and modules' helpers) from the process's.
class RpcAgent : public AgentServices,
                 public detail::WaitDriver,
                 public std::enable_shared_from_this<RpcAgent> {
 public:
  using milliseconds = std::chrono::milliseconds;

  RpcAgent(WorkerInfo self, int world_size, const RpcBackendOptions& opts,
           std::shared_ptr<const Registry> registry = nullptr)
      : members_(std::move(self), world_size),
        options_(opts),
        default_timeout_(opts.rpc_timeout),
        registry_(registry ? std::move(registry) : global_registry()),
        request_pool_("rpc-request", static_cast<std::size_t>(std::max(1, opts.num_worker_threads)),
                      static_cast<std::size_t>(std::max(1, opts.num_worker_threads)),
                      std::chrono::seconds(10), [this] { detail::tls_current_agent = this; }),
        // Callbacks may block on nested calls: this pool grows instead of starving them.
        callback_pool_("rpc-callback", 2, 1024, std::chrono::seconds(10),
                       [this] { detail::tls_current_agent = this; }),
        gate_(std::make_shared<detail::HostGate>(*this, members_.self())),
        extensions_(make_agent_extensions(*this)),
        calls_([this](std::function<void()> fn) { return callback_pool_.post(std::move(fn)); }) {}

  // The most derived destructor stops the agent and closes the gate first (Agent<T>): its
  // transport is gone by the time this runs. Closed again here for any other derived class.
  ~RpcAgent() override {
    gate_->close();
    calls_.stop();
  }
  RpcAgent(const RpcAgent&) = delete;
  RpcAgent& operator=(const RpcAgent&) = delete;

  // ---- identity and group ----------------------------------------------------------------
  const WorkerInfo& self() const { return members_.self(); }
  // A dynamic group's (init_rpc without a world size): its current size as this worker sees it.
  int world_size() const { return members_.world_size(); }
  // A member of a dynamic group (docs/rpc.md, "Elastic membership").
  bool dynamic() const { return members_.dynamic(); }
  const Registry& registry() const { return *registry_; }
  const RpcBackendOptions& options() const { return options_; }
  virtual std::string transport_name() const = 0;
  // The policy moves device memory itself: device tensors are encoded without a CPU copy.
  virtual bool transport_carries_device_buffers() const { return false; }

  WorkerInfo worker(const std::string& name) const { return members_.worker(name); }
  WorkerInfo worker(int id) const { return members_.worker(id); }
  WorkerInfo worker(const WorkerInfo& w) const { return members_.worker(w); }
  std::vector<WorkerInfo> workers() const { return members_.workers(); }

  // ---- timeouts ----------------------------------------------------------------------------
  milliseconds default_timeout() const { return default_timeout_.load(); }
  void set_default_timeout(milliseconds t) {
    if (t.count() < 0) {
      throw std::invalid_argument("RPC timeout must be >= 0 ms (0 means no limit), got " +
                                  std::to_string(t.count()) + " ms");
    }
    default_timeout_.store(t);
  }
  // The timeout a call made now uses: an explicit one, or the default read at this moment.
  milliseconds effective_timeout(milliseconds requested) const {
    if (requested == kUnsetRpcTimeout) return default_timeout();
    if (requested.count() < 0) {
      throw std::invalid_argument("RPC timeout must be >= 0 ms (0 means no limit), got " +
                                  std::to_string(requested.count()) + " ms");
    }
    return requested;
  }

  // ---- calls -------------------------------------------------------------------------------
  // Sends a request (header + arguments already encoded) and returns the future of the response
  // message. `what` names the call in error texts. Errors (unreachable peer, shut down, timeout,
  // peer lost, remote exception) arrive through the future. `type` is Request, or a control kind
  // of a layer plugged in (handled on the callee's callback pool). `on_unsent` runs if the message
  // surely never left (the transport refused it), so what encoding it did can be undone.
  Future<wire::Message> call(const WorkerInfo& to, wire::Message&& request, milliseconds timeout,
                             bool internal, const std::string& what,
                             wire::MessageType type = wire::MessageType::Request,
                             const std::function<void()>& on_unsent = {}) {
    // No callback executor here: the typed layer decodes inline (library code) and puts the
    // executor on the future the user sees.
    Future<wire::Message> fut;
    if (stopped_.load()) {
      if (on_unsent) on_unsent();
      fut.set_exception(
          RpcError("RPC has not been initialized or has been shut down: cannot call " + what +
                   " on " + to.str()));
      return fut;
    }
    const std::uint64_t id = calls_.add(to, fut, timeout, internal, what);
    request.type = type;
    request.id = id;
    try {
      deliver(to, std::move(request), what);
    } catch (...) {
      if (on_unsent) on_unsent();
      fail_call(id, std::current_exception());
    }
    return fut;
  }

  // ---- layers and debug info ---------------------------------------------------------------
  std::map<std::string, std::string> debug_info() const {
    std::map<std::string, std::string> out;
    const std::size_t pending = calls_.size();
    const WorkCounters c = calls_.counters();
    out["agent.transport"] = transport_name();
    out["thread_pool_size"] = std::to_string(request_pool_.base_size());
    out["num_idle_threads"] = std::to_string(request_pool_.idle());
    out["num_pending_requests"] = std::to_string(request_pool_.queued());
    out["num_pending_responses"] = std::to_string(pending);
    out["num_active_client_calls"] = std::to_string(c.client_sent - c.client_done);
    out["num_client_calls"] = std::to_string(c.client_sent);
    out["num_active_server_calls"] = std::to_string(c.server_active);
    out["num_pending_protocol_steps"] = std::to_string(c.protocol_pending);
    out["callback_pool_size"] = std::to_string(callback_pool_.size());
    for (const auto& x : extensions_) x->add_debug_info(out);
    return out;
  }

  // The layers plugged into this agent (extension.hpp).
  const std::vector<std::shared_ptr<AgentExtension>>& extensions() const { return extensions_; }
  // Every layer's leak report at a graceful exit (each logs its own); the first as an RpcError,
  // or null when none leaked.
  std::exception_ptr extension_leaks() const {
    std::exception_ptr first;
    for (const auto& x : extensions_) {
      const std::string leaks = x->report_leaks();
      if (!leaks.empty() && !first) first = std::make_exception_ptr(RpcError(leaks));
    }
    return first;
  }
  // The instance of layer E plugged into this agent (null if E registered no extension).
  template <class E>
  std::shared_ptr<E> extension() const {
    for (const auto& x : extensions_) {
      if (auto e = std::dynamic_pointer_cast<E>(x)) return e;
    }
    return nullptr;
  }

  // What the layers attach to a call to worker `dst` made on this thread.
  CallAttachments attach(int dst) {
    CallAttachments out;
    for (const auto& x : extensions_) x->attach(dst, out);
    return out;
  }
  // Encodes a call to worker `dst` carrying `sent` (encode()) inside every layer's scope (e.g.
  // RRefs among the arguments are forked to `dst`). Returns what undoes the layers' work if the
  // message is never sent: empty when there is nothing to undo. If encode() throws, the layers
  // undo their part.
  // Its tensors follow `device_map` when given and not empty, else this worker's map towards
  // `dst` (device_routes.hpp).
  std::function<void()> encode_for(int dst, const CallAttachments& sent, FunctionRef<void()> encode,
                                   const DeviceMap* device_map = nullptr) {
    const auto route = device_routes_.request(dst, device_map, members_);
    wire::DeviceRouteScope in_route(&route);
    wire::DeviceBuffersScope on_device(transport_carries_device_buffers());
    std::vector<std::function<void()>> undo;
    encode_in_layers(0, dst, sent, encode, undo);
    if (undo.empty()) return {};
    return [steps = std::move(undo)]() {
      for (const auto& u : steps) u();
    };
  }
  // Decodes the reply from worker `from` to a call that carried `sent` (decode()) inside every
  // layer's scope.
  void decode_from(int from, const CallAttachments& sent, FunctionRef<void()> decode) {
    decode_in_layers(0, from, sent, decode);
  }
  // Encodes the reply to a request from `peer` that carried `got` inside every layer's scope.
  // Its tensors go back through the inverse of the caller's device map to this worker.
  void encode_reply(int peer, const CallAttachments& got, FunctionRef<void()> encode) {
    const auto route = device_routes_.response(peer, members_);
    wire::DeviceRouteScope in_route(&route);
    wire::DeviceBuffersScope on_device(transport_carries_device_buffers());
    encode_reply_in_layers(0, peer, got, encode);
  }

  // Where user callbacks of the futures this agent hands out run: its callback pool.
  // Kept in the futures handed to users, which may outlive the agent: it reaches the pool through
  // the gate, and refuses ("RPC agent of W is shut down: callback dropped") once the agent is
  // stopped or gone.
  detail::ExecutorFn callback_executor() { return gate_->user_executor(); }

  // The store the group met through; kept for the exit barrier of a graceful shutdown.
  void set_store(std::shared_ptr<store::Store> s) { members_.set_store(std::move(s)); }

  // Publishes this worker in the store (with its device maps), reads everyone else's entry,
  // validates the group (names, then every worker's device maps: all fail alike) and connects the
  // transport to every peer; then runs the requests that arrived meanwhile.
  void join_group() {
    const NodeDevices mine =
        detail::DeviceRoutes::own_entry(self().name, options_.device_maps, options_.devices);
    const auto met = members_.meet(
        transport_address(), options_.init_timeout, mine.serialize(),
        [&](const std::vector<WorkerInfo>& all, const std::vector<std::string>& entries) {
          std::vector<NodeDevices> nodes;
          for (std::size_t r = 0; r < all.size(); ++r) {
            nodes.push_back(NodeDevices::parse(all[r].name, entries[r]));
          }
          device_routes_.set(std::move(nodes), self().id);
        });
    const auto all = members_.workers();
    for (const auto& w : all) {
      if (w.id != self().id) {
        transport_add_peer(w.id, w.name, met.addresses[static_cast<std::size_t>(w.id)]);
      }
    }
    open_for_requests();
  }

  // This worker's device map towards `to` (empty: none), and the CUDA devices it uses: those
  // set, else those its own and its peers' maps name for it.
  DeviceMap device_map(const WorkerInfo& to) const { return device_routes_.map_to(to.id); }
  const std::vector<DeviceName>& devices() const { return device_routes_.devices(); }
  // The same as c10 devices where this libtorch has streams for them: what the futures of this
  // worker's typed calls synchronize on (agent/calls.hpp). Empty: none, or a CPU-only libtorch.
  const std::vector<c10::Device>& stream_devices() const { return device_routes_.stream_devices(); }

  // The worker table is read: the requests held until now run, later ones run as they come.
  void open_for_requests() {
    std::vector<std::pair<int, wire::Message>> early;
    {
      std::lock_guard<std::mutex> lk(early_mu_);
      group_ready_.store(true, std::memory_order_release);
      early.swap(early_requests_);
    }
    for (auto& [peer, m] : early) dispatch_request(peer, std::move(m));
  }

  // Local stop: with `sync_exit`, first a store barrier so no worker closes its transport while
  // another still talks to it, and the rank hosting the store server leaves last. Then the
  // transport stops, pending calls fail, and the pools drain and join. Never waits forever: the
  // threads are joined until one deadline, `timeout` from the start of the local part when it is
  // positive, else options().shutdown_grace; a thread still inside user code then (a handler that
  // never returns, on a pool or on a transport reading thread) is abandoned, and this agent is
  // kept alive for good for it (keep_alive_forever()). Without `sync_exit`, requests queued but
  // not started are dropped: their callers fail through peer loss or their timeout.
  // `led_last`: this worker led the group's last gather (graceful shutdown); it is the one to
  // leave last when the store cannot order the exit.
  void stop(bool sync_exit, milliseconds timeout, bool led_last = false) {
    if (stopped_.exchange(true)) return;
    // No layer sends a protocol message from now on (e.g. user RRefs still alive are dead).
    for (const auto& x : extensions_) x->on_stop();
    std::exception_ptr barrier_error;
    if (sync_exit && members_.store()) {
      try {
        members_.exit_barrier(timeout);
        members_.leave_store();
      } catch (...) {
        // The store may have gone with a lost member (rank 0 hosts a tcp:// or env:// one): then
        // there is nobody left to synchronize with through it, and the loss is what shutdown()
        // reports. The last gather's leader then leaves last, so its answers reach the others
        // before its connections close (they leave as soon as they have the answer).
        if (!members_.any_lost()) barrier_error = std::current_exception();
        if (led_last) members_.wait_others_gone(std::chrono::seconds(5));
      }
    }
    // Only an agent someone owns can outlive this call; one already being destroyed (no owner
    // left) waits without bound rather than leave threads behind that would use freed memory.
    auto owned = weak_from_this().lock();
    const milliseconds grace = timeout.count() > 0 ? timeout : options_.shutdown_grace;
    const auto deadline = owned ? Clock::now() + grace : Clock::time_point::max();
    // No user request starts from now on (without sync_exit, queued ones are dropped; the
    // library's own calls still run on the callback pool until it stops); offers from the
    // transport meet a refusal and drop theirs too.
    request_pool_.close(/*drop_queued=*/!sync_exit);
    // Pending calls fail before the transport stops too: a request running on a reading thread
    // (leader/follower) may wait on one of them, and the transport joins that thread. And after,
    // for a call that raced past the `stopped_` check.
    fail_pending_calls();
    const std::size_t on_readers = transport_shutdown(deadline);
    fail_pending_calls();
    const std::size_t on_requests = request_pool_.shutdown(deadline, /*drop_queued=*/!sync_exit);
    // Callbacks still queued run (they complete futures users may wait on), within the bound.
    const std::size_t on_callbacks = callback_pool_.shutdown(deadline);
    calls_.stop();
    if (const std::size_t n = on_readers + on_requests + on_callbacks; n > 0) {
      detail::log_warning(
          self().name,
          "shutdown abandoned " + std::to_string(n) + " thread(s) still running user code after " +
              std::to_string(grace.count()) + " ms (" + std::to_string(on_requests) +
              " request handler(s) on the request pool, " + std::to_string(on_readers) +
              " on transport reading threads, " + std::to_string(on_callbacks) +
              " callback(s)); they are detached and this agent stays in memory");
      keep_alive_forever(std::move(owned));
    }
    members_.drop_store();
    if (barrier_error) std::rethrow_exception(barrier_error);
  }

  bool stopped() const { return stopped_.load(); }

 protected:
  // Destructors only, after stop(): closes the gate (detail::HostGate), then fails every call
  // still in the table. One that raced past stop()'s check and was added after stop() failed the
  // pending ones (its send met the closing transport without an error) would otherwise never
  // complete; nobody can add one now.
  void close_gate() {
    gate_->close();
    fail_pending_calls();
  }

 public:
  // The store this agent met through (null once stopped): rpc_store.hpp shares it with process
  // groups.
  const std::shared_ptr<store::Store>& store() const { return members_.store(); }

 protected:
  using Clock = std::chrono::steady_clock;

  // Polls done() until `until`, yielding the CPU each round (a small call's reply arrives within
  // microseconds, and waking a sleeping thread costs more); a policy with drive() reads the
  // transport meanwhile.
  virtual void transport_drive(const std::function<bool()>& done,
                               std::chrono::steady_clock::time_point until) {
    while (!done() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
  }

  // ---- transport callbacks (Agent<T> wires them to its policy) ---------------------------------
  // Transport callback (I/O thread): never runs user code, never blocks on it.
  void on_message(int peer, wire::Message&& m) {
    if (wire::is_control_message_type(m.type)) {
      hold_or_dispatch(peer, std::move(m));
      return;
    }
    switch (m.type) {
      case wire::MessageType::Request:
        hold_or_dispatch(peer, std::move(m));
        break;
      case wire::MessageType::Response:
      case wire::MessageType::Exception:
        complete_call(peer, std::move(m));
        break;
      default:
        detail::log_warning(self().name, "ignoring a message of unexpected type " +
                                             std::to_string(static_cast<int>(m.type)) +
                                             " from worker " + std::to_string(peer));
    }
  }

  // Fails `calls` (from calls_.calls_to) to `who`: "RPC <what> to <who> failed: <why>".
  void fail_calls(const std::vector<std::pair<std::uint64_t, std::string>>& calls,
                  const WorkerInfo& who, const std::string& why) {
    for (const auto& [id, what] : calls) {
      fail_call(id, std::make_exception_ptr(
                        DistNetworkError("RPC " + what + " to " + who.str() + " failed: " + why)));
    }
  }

  // Transport callback (I/O thread): every pending call to `peer` fails now, naming it.
  void on_peer_lost(int peer, const std::string& reason) {
    const WorkerInfo who = members_.describe(peer);
    const auto lost = calls_.calls_to(peer);
    // Counted before the peer shows as lost: a joiner that replaces it waits for these.
    {
      std::lock_guard<std::mutex> lk(loss_notices_mu_);
      loss_notices_[peer] += static_cast<int>(extensions_.size());
    }
    members_.mark_lost(peer, reason);
    fail_calls(lost, who, "connection lost (" + reason + ")");
    // Forks the lost peer held are released; values may be destroyed, so not on this thread.
    for (const auto& x : extensions_) {
      const bool posted = callback_pool_.post([this, x, peer] {
        struct Done {  // counted down however the layer's handler ends
          RpcAgent* agent;
          int peer;
          ~Done() { agent->loss_notice_done(peer); }
        } done{this, peer};
        const auto failed = [&](const char* why) {
          detail::log_error(self().name, "a layer's handling of the loss of worker " +
                                             std::to_string(peer) + " failed: " + why);
        };
        try {
          x->on_peer_lost(peer);
        } catch (const std::exception& e) {
          failed(e.what());
        } catch (...) {
          failed("an exception not derived from std::exception");
        }
      });
      if (!posted) loss_notice_done(peer);  // stopping: it never runs
    }
  }

  void loss_notice_done(int peer) {
    std::lock_guard<std::mutex> lk(loss_notices_mu_);
    if (--loss_notices_[peer] == 0) {
      loss_notices_.erase(peer);
      loss_notices_cv_.notify_all();
    }
  }

  // Until the layers have handled every loss of worker `peer` reported so far (or `limit`
  // passed; false then, logged): a joiner taking its rank is admitted after them, so no layer
  // mistakes what the joiner holds for what the lost process held. The callback pool is FIFO and
  // grows when busy, so notices queued before this runs there are running or done, never
  // waiting behind it.
  bool wait_loss_notices(int peer, milliseconds limit) {
    std::unique_lock<std::mutex> lk(loss_notices_mu_);
    if (loss_notices_cv_.wait_for(lk, limit, [&] { return loss_notices_.count(peer) == 0; })) {
      return true;
    }
    lk.unlock();
    detail::log_warning(self().name, "the layers' handling of the loss of worker " +
                                         std::to_string(peer) + " did not end within " +
                                         std::to_string(limit.count()) + " ms");
    return false;
  }

  virtual void transport_send(int peer, wire::Message&& m) = 0;
  virtual std::string transport_address() const = 0;
  virtual void transport_add_peer(int id, const std::string& name, const std::string& address) = 0;
  // Stops the transport, waiting for a reading thread that runs a handed-back request no later
  // than `deadline`; returns how many such threads it abandoned (transport::shutdown_until()).
  virtual std::size_t transport_shutdown(Clock::time_point deadline) = 0;

 private:
  friend class detail::GroupProtocol;    // the group protocol's state and steps
  friend class detail::ElasticProtocol;  // a dynamic group's joins and leaves

  // ---- the group protocol's state (agent/group_protocol.hpp) ---------------------------------
  // The all-gather state of the group protocol (barrier, all_gather, the shutdown join).
  detail::GatherTable& gathers() { return gathers_; }

  // Worker `id` is gone: its connection broke (on_peer_lost) or it no longer accepts one. The
  // first reason is kept. Group operations stop waiting for a lost member (group_protocol.hpp).
  void mark_lost(int id, const std::string& reason) { members_.mark_lost(id, reason); }
  bool is_lost(int id) const { return members_.is_lost(id); }
  // The names of the members known lost, sorted.
  std::vector<std::string> lost_names() const { return members_.lost_names(); }

  // The join's counters of this worker's calls (monotonic).
  WorkCounters counters() const { return calls_.counters(); }

  // ---- AgentServices (what the layers plugged in use) ------------------------------------------
  std::shared_ptr<detail::HostGate> host_gate() const override { return gate_; }
  const WorkerInfo& host_self() const override { return self(); }
  std::int64_t host_incarnation() const override { return members_.incarnation(); }
  WorkerInfo host_worker(int id) const override { return worker(id); }
  milliseconds host_timeout(milliseconds requested) const override {
    return effective_timeout(requested);
  }
  Future<wire::Message> host_control_call(int to, wire::MessageType kind, wire::Message&& m,
                                          milliseconds timeout, const std::string& what) override {
    WorkerInfo dst;
    try {
      dst = worker(to);
    } catch (...) {
      return make_exceptional_future<wire::Message>(std::current_exception());
    }
    return call(dst, std::move(m), timeout, /*internal=*/false, what, kind);
  }
  void host_control_notify(int to, wire::MessageType kind, wire::Message&& m,
                           const std::string& what) override {
    const WorkerInfo dst = worker(to);
    if (stopped_.load()) {
      throw RpcError("RPC has not been initialized or has been shut down: cannot send " + what +
                     " to " + dst.str());
    }
    m.type = kind;
    m.id = kNoAnswer;
    deliver(dst, std::move(m), what);
  }
  Future<wire::Message> host_control_call_retrying(int to, wire::MessageType kind,
                                                   wire::Message&& m, milliseconds timeout,
                                                   const std::string& what, int attempts,
                                                   milliseconds first_backoff) override {
    auto r = std::make_shared<ControlRetry>();
    try {
      r->to = worker(to);
      if (attempts < 1) {
        throw std::invalid_argument("host_control_call_retrying(" + what + " to " + r->to.str() +
                                    "): attempts must be >= 1, got " + std::to_string(attempts));
      }
      if (first_backoff.count() < 0) {
        throw std::invalid_argument("host_control_call_retrying(" + what + " to " + r->to.str() +
                                    "): first_backoff must be >= 0 ms, got " +
                                    std::to_string(first_backoff.count()) + " ms");
      }
    } catch (...) {
      return make_exceptional_future<wire::Message>(std::current_exception());
    }
    r->kind = kind;
    r->message = std::move(m);
    r->timeout = timeout;
    r->what = what;
    r->attempts = attempts;
    r->backoff = first_backoff;
    // One protocol step from here to the end, backoffs included: between two attempts no call is
    // in the table, and the join must not take that gap for idleness.
    host_protocol_begin(1);
    control_attempt(r);
    return r->result;
  }
  bool host_post(std::function<void()> fn) override { return callback_pool_.post(std::move(fn)); }
  void host_encode_back(int peer, bool in_reply, FunctionRef<void()> encode) override {
    const auto route = in_reply ? device_routes_.request(peer, nullptr, members_)
                                : device_routes_.response(peer, members_);
    wire::DeviceRouteScope in_route(&route);
    encode();
  }
  void host_protocol_begin(std::uint64_t steps) override { calls_.protocol_begin(steps); }
  void host_protocol_end(std::uint64_t steps) override { calls_.protocol_end(steps); }
  bool host_after(milliseconds delay, std::function<void()> fn) override {
    if (stopped_.load()) return false;
    return calls_.after(delay, std::move(fn));
  }
  std::weak_ptr<detail::WaitDriver> host_wait_driver() override { return weak_from_this(); }
  void host_drive(const std::function<bool()>& done,
                  std::chrono::steady_clock::time_point until) override {
    if (options_.sync_wait_spin.count() <= 0 || done()) return;
    if (transport::on_transport_thread()) return;
    transport_drive(done, until);
  }
  CallAttachments host_attach(int dst) override { return attach(dst); }
  std::shared_ptr<void> host_enter_request(int peer, const CallAttachments& got) override {
    return std::make_shared<LayerScopes>(*this, peer, got);
  }
  void host_encode_reply(int peer, const CallAttachments& got,
                         FunctionRef<void()> encode) override {
    encode_reply(peer, got, encode);
  }
  void host_decode_reply(int from, const CallAttachments& sent,
                         FunctionRef<void()> decode) override {
    decode_from(from, sent, decode);
  }
  detail::ExecutorFn host_user_executor() override { return callback_executor(); }

  // Before a thread sleeps waiting for `done` (a future this agent handed out, through
  // detail::set_wait_driver): polls it for up to sync_wait_spin, bounded
  // by the wait's own deadline, reading the transport itself meanwhile where the policy can
  // (transport.hpp, drive()), so a small call's reply is picked up by the thread that waits for
  // it instead of waking two more.
  void drive_wait(const std::function<bool()>& done,
                  std::chrono::steady_clock::time_point until) override {
    const auto budget = options_.sync_wait_spin;
    if (budget.count() <= 0 || done()) return;
    // A reading thread (inside a read, or a policy's own thread outside a task) never reads on
    // a waiter's behalf: it may hold the very lead that reading needs.
    if (transport::on_transport_thread()) return;
    transport_drive(done, std::min(until, std::chrono::steady_clock::now() + budget));
  }

  // Queues a request on the request pool (a control message, or one of the agent's own calls, on
  // the callback pool). A user request that comes after shutdown began is dropped: the caller
  // learns through peer loss or its timeout.
  void dispatch_request(int peer, wire::Message&& m) {
    if (wire::is_control_message_type(m.type)) {
      // Library code that never blocks on the network: like a request, it may run on the reading
      // thread (a to_here() then costs one round trip, not two hand-offs more).
      std::function<void()> control = [this, peer, msg = std::move(m)]() mutable {
        handle_control(peer, std::move(msg));
      };
      if (!transport::offer_inline_library(control, [this](std::function<void()> t) {
            return callback_pool_.post(std::move(t));
          })) {
        callback_pool_.post(std::move(control));
      }
      return;
    }
    // The agent's own calls (membership: admit, liveness ping, leave; the group protocol) never
    // wait for a request thread: user handlers that hold every one of them (a long training step)
    // must not make this worker look dead to a joiner, nor stall a join or a shutdown.
    const bool internal = RequestHeader::peek_internal(m);
    std::function<void()> task = [this, peer, msg = std::move(m)]() mutable {
      handle_request(peer, std::move(msg));
    };
    if (internal) {
      // Also while stop() runs: its exit barrier is made of such calls.
      callback_pool_.post(std::move(task));
      return;
    }
    // Leader/follower: the reading thread may run it itself once another thread took over the
    // I/O (transport.hpp, InlineScope; docs/threading.md); otherwise it goes to the request pool.
    if (transport::offer_inline(
            task, [this](std::function<void()> t) { return request_pool_.post(std::move(t)); })) {
      return;
    }
    request_pool_.post(std::move(task));
  }

  // A peer that finished init before us may call us while we still read the worker table: hold
  // its message until we know where to send the reply.
  void hold_or_dispatch(int peer, wire::Message&& m) {
    if (!group_ready_.load(std::memory_order_acquire)) {
      std::lock_guard<std::mutex> lk(early_mu_);
      if (!group_ready_.load(std::memory_order_relaxed)) {
        early_requests_.emplace_back(peer, std::move(m));
        return;
      }
    }
    dispatch_request(peer, std::move(m));
  }

  // An abandoned thread returns from its handler whenever it does, and then still uses this
  // agent: it encodes and sends the reply (through the transport context the agent owns, whose
  // send fails quietly after stop), updates the counters, finishes its pool loop. Tasks capture
  // the agent by raw pointer (`this`), so the agent must never be freed: agents that abandoned a
  // thread are kept here for the life of the process. The list itself is never destroyed (a heap
  // object), so no exit-time destructor races with such a thread either. One agent per
  // non-graceful shutdown that met a stuck handler: a bounded, deliberate leak.
  static void keep_alive_forever(std::shared_ptr<RpcAgent> agent) {
    if (!agent) return;
    static auto* mu = new std::mutex;
    static auto* kept = new std::vector<std::shared_ptr<RpcAgent>>;
    std::lock_guard<std::mutex> lk(*mu);
    kept->push_back(std::move(agent));
  }

  void encode_in_layers(std::size_t i, int dst, const CallAttachments& sent,
                        FunctionRef<void()> encode, std::vector<std::function<void()>>& undo) {
    if (i == extensions_.size()) {
      encode();
      return;
    }
    extensions_[i]->encode_for(
        dst, sent, [&] { encode_in_layers(i + 1, dst, sent, encode, undo); }, undo);
  }
  void decode_in_layers(std::size_t i, int from, const CallAttachments& sent,
                        FunctionRef<void()> decode) {
    if (i == extensions_.size()) {
      decode();
      return;
    }
    extensions_[i]->decode_from(from, sent, [&] { decode_in_layers(i + 1, from, sent, decode); });
  }
  void encode_reply_in_layers(std::size_t i, int peer, const CallAttachments& got,
                              FunctionRef<void()> encode) {
    if (i == extensions_.size()) {
      encode();
      return;
    }
    extensions_[i]->encode_reply(peer, got,
                                 [&] { encode_reply_in_layers(i + 1, peer, got, encode); });
  }

  // One host_control_call_retrying, shared by its attempts and the timers between them.
  struct ControlRetry {
    WorkerInfo to;
    wire::MessageType kind = wire::MessageType::Request;
    wire::Message message;  // kept for the next attempt; each sends a copy (tensors shared)
    milliseconds timeout{0};
    std::string what;
    int attempts = 1;
    int sent = 0;
    milliseconds backoff{0};  // before the next attempt
    Future<wire::Message> result;
  };

  // Sends one attempt of `r`; on a send failure that may pass, schedules the next one.
  void control_attempt(const std::shared_ptr<ControlRetry>& r) {
    ++r->sent;
    auto unsent = std::make_shared<bool>(false);
    wire::Message copy = r->message;  // the payload is copied, the tensors' storage is shared
    auto fut = call(r->to, std::move(copy), r->timeout, /*internal=*/false, r->what, r->kind,
                    [unsent] { *unsent = true; });
    fut.add_done_callback([this, r, unsent](const Future<wire::Message>& f) {
      if (!f.has_error()) {
        r->result.try_set_value(f.value());
        host_protocol_end(1);
        return;
      }
      control_failed(r, f.exception_ptr(), *unsent);
    });
  }

  void control_failed(const std::shared_ptr<ControlRetry>& r, std::exception_ptr e, bool unsent) {
    const auto finish = [&](std::exception_ptr error) {
      r->result.try_set_exception(std::move(error));
      host_protocol_end(1);
    };
    // Only a message that surely never left is sent again: after it left, the receiver may have
    // acted on it (the RRef protocol's handlers are not idempotent: a second delete of one fork
    // would be taken for an early one). A refusal that is not a network failure (too large, an
    // agent shut down) would be refused again.
    bool network = false;
    std::string text;
    try {
      std::rethrow_exception(e);
    } catch (const DistNetworkError& ex) {
      network = true;
      text = ex.what();
    } catch (...) {
    }
    if (!unsent || !network) {
      finish(std::move(e));
      return;
    }
    const auto give_up = [&](const std::string& why) {
      finish(std::make_exception_ptr(DistNetworkError(
          r->what + " to " + r->to.str() + " failed after " + std::to_string(r->sent) +
          " attempt(s), " + why + "; last error: " + text)));
    };
    if (stopped_.load()) {
      return give_up("not retried: the RPC agent of " + self().str() + " is shutting down");
    }
    if (is_lost(r->to.id)) return give_up("not retried: the worker is lost");
    if (r->sent >= r->attempts) return give_up("the most allowed");
    const milliseconds wait = r->backoff;
    r->backoff = r->backoff.count() > 0 ? r->backoff * 2 : r->backoff;
    // The task fails the call if it is dropped unrun (the agent stopped meanwhile).
    struct Next {
      Next(RpcAgent* a, std::shared_ptr<ControlRetry> retry) : agent(a), r(std::move(retry)) {}
      Next(const Next&) = delete;
      Next& operator=(const Next&) = delete;
      RpcAgent* agent;
      std::shared_ptr<ControlRetry> r;
      bool ran = false;
      ~Next() {
        if (ran || r->result.done()) return;
        r->result.try_set_exception(std::make_exception_ptr(DistNetworkError(
            r->what + " to " + r->to.str() + " failed after " + std::to_string(r->sent) +
            " attempt(s), not retried: the RPC agent of " + agent->self().str() +
            " is shutting down")));
        agent->host_protocol_end(1);
      }
    };
    auto next = std::make_shared<Next>(this, r);
    const bool queued = host_after(wait, [next] {
      next->ran = true;
      if (next->agent->stopped_.load()) {
        next->ran = false;  // the destructor fails it
        return;
      }
      next->agent->control_attempt(next->r);
    });
    if (!queued) {
      next->ran = true;
      give_up("not retried: the RPC agent of " + self().str() + " is shutting down");
    }
  }

  // Fails every call still waiting for a reply (local stop, and the destructor).
  void fail_pending_calls() {
    for (const auto& [id, what] : calls_.calls_to(-1)) {
      fail_call(id, std::make_exception_ptr(
                        RpcError("RPC agent of " + self().str() + " shut down before the reply")));
    }
  }

  // A message to this worker itself keeps value semantics: the receiver gets copies. Device
  // buffers (a policy that moves device memory leaves CUDA tensors on their device) are copied
  // on this thread's current streams, which the receiver's streams do not wait for: this thread
  // waits until those copies are done.
  // The originals are kept until then: their memory may belong to another stream.
  static void detail_clone_buffers(wire::Message& m) {
    std::vector<c10::Device> devices;
    std::vector<at::Tensor> originals;
    for (auto& b : m.buffers) {
      at::Tensor copy = b.clone();
      if (!b.device().is_cpu()) {
        if (std::find(devices.begin(), devices.end(), b.device()) == devices.end()) {
          devices.push_back(b.device());
        }
        originals.push_back(std::move(b));
      }
      b = std::move(copy);
    }
    for (const c10::Device& d : devices) {
      const c10::impl::VirtualGuardImpl impl(d.type());
      impl.synchronizeStream(impl.getStream(d));
    }
  }

  // Hands `m` to worker `to` (a call or a control message without an answer). A message to this
  // worker itself skips the transport but keeps value semantics: the receiver gets copies of its
  // buffers. Throws what stopped it: the copy's error, an RpcError when this agent is shutting
  // down, or the transport's refusal in wrap_send_error's words.
  void deliver(const WorkerInfo& to, wire::Message&& m, const std::string& what) {
    if (to.id == self().id) {
      detail_clone_buffers(m);
      if (!dispatch_local(std::move(m))) {
        throw RpcError("RPC agent of " + self().str() + " is shutting down: cannot run " + what);
      }
      return;
    }
    try {
      transport_send(to.id, std::move(m));
    } catch (...) {
      std::rethrow_exception(wrap_send_error(std::current_exception(), to, what));
    }
  }

  std::exception_ptr wrap_send_error(std::exception_ptr e, const WorkerInfo& to,
                                     const std::string& what) const {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      // A call that raced past the `stopped_` check meets the transport this agent's stop shut
      // down: that refusal is the agent's stop, and says so in the agent's words.
      if (stopped_.load()) {
        return std::make_exception_ptr(RpcError("RPC agent of " + self().str() +
                                                " is shut down: " + what + " to " + to.str() +
                                                " not sent (" + ex.what() + ")"));
      }
      if (dynamic_cast<const DistError*>(&ex) != nullptr) return e;
      return std::make_exception_ptr(
          RpcError("RPC " + what + " to " + to.str() + " could not be sent: " + ex.what()));
    } catch (...) {
      return e;
    }
  }

  // Removes call `id` and fails its future; false if it already completed.
  bool fail_call(std::uint64_t id, std::exception_ptr e) { return calls_.fail(id, std::move(e)); }

  void complete_call(int peer, wire::Message&& m) {
    auto taken = calls_.take(m.id, peer);
    if (taken.other_peer) {
      detail::log_warning(self().name, "dropping a reply for call " + std::to_string(m.id) +
                                           " from worker " + std::to_string(peer) +
                                           ": the call went to " + taken.other_peer->str());
      return;
    }
    if (!taken.call) return;  // timed out or failed already: the late reply is dropped
    auto& f = taken.call->future;
    const WorkerInfo& to = taken.call->to;
    if (m.type == wire::MessageType::Exception) {
      WireException w;
      try {
        wire::decode(m, w);
      } catch (const std::exception& e) {
        w = {"distrpc::RpcError", std::string("undecodable error reply: ") + e.what()};
      }
      f.try_set_exception(ExceptionRegistry::instance().rebuild(w, to.str()));
    } else {
      f.try_set_value(std::move(m));
    }
    calls_.settled(taken.call->internal);
  }

  static std::shared_ptr<const Registry> global_registry() {
    // Not owned: the process's registry lives as long as the process.
    return std::shared_ptr<const Registry>(&Registry::instance(), [](const Registry*) {});
  }

  // The function a peer asks for: from this agent's registry, or one of the library's own from
  // the process's.
  std::optional<detail::RegistryEntry> find_function(const std::string& name) const {
    auto entry = registry_->find(name);
    if (!entry && registry_.get() != &Registry::instance()) {
      entry = Registry::instance().find(name);
      if (entry && !entry->library) entry.reset();
    }
    return entry;
  }

  // The layers' enter_request() scopes, released in reverse order.
  class LayerScopes {
   public:
    LayerScopes(const RpcAgent& agent, int peer, const CallAttachments& got) {
      for (const auto& x : agent.extensions_) {
        if (auto scope = x->enter_request(peer, got)) scopes_.push_back(std::move(scope));
      }
    }
    ~LayerScopes() {
      while (!scopes_.empty()) scopes_.pop_back();
    }
    LayerScopes(const LayerScopes&) = delete;
    LayerScopes& operator=(const LayerScopes&) = delete;

   private:
    std::vector<std::shared_ptr<void>> scopes_;
  };

  // What the registry's handler of the request running on this thread reaches
  // (detail::tls_request_hooks), while it runs: the layers' scopes of a request from `peer` that
  // carried `got`. Made on the request's thread (`decoding`: the arguments are still to be
  // decoded), and again where a result that comes later is encoded (the reopener).
  class RunningRequest final : public detail::RequestHooks {
   public:
    RunningRequest(std::shared_ptr<RpcAgent> agent, int peer, CallAttachments got, bool decoding)
        : agent_(std::move(agent)),
          peer_(peer),
          got_(std::move(got)),
          decoding_(decoding),
          scopes_(*agent_, peer_, got_),
          saved_(detail::tls_request_hooks) {
      detail::tls_request_hooks = this;
    }
    ~RunningRequest() { detail::tls_request_hooks = saved_; }
    RunningRequest(const RunningRequest&) = delete;
    RunningRequest& operator=(const RunningRequest&) = delete;

    void arguments_decoded() override {
      if (!decoding_) return;
      for (const auto& x : agent_->extensions_) x->arguments_decoded(peer_);
    }
    std::function<std::shared_ptr<void>()> reopener() const override {
      return [weak = std::weak_ptr<RpcAgent>(agent_), peer = peer_,
              got = got_]() -> std::shared_ptr<void> {
        auto agent = weak.lock();
        if (!agent) return nullptr;
        return std::make_shared<RunningRequest>(std::move(agent), peer, got, false);
      };
    }
    void encode_result(FunctionRef<void()> encode) override {
      agent_->encode_reply(peer_, got_, encode);
    }

   private:
    const std::shared_ptr<RpcAgent> agent_;
    const int peer_;
    const CallAttachments got_;
    const bool decoding_;
    LayerScopes scopes_;
    detail::RequestHooks* const saved_;
  };

  void handle_request(int peer, wire::Message&& req) {
    detail::CurrentAgentScope current(this);
    const std::uint64_t id = req.id;
    RequestHeader h;
    Future<wire::Message> result;
    bool counted = false;
    try {
      {
        // Only the header: the handler decodes the whole payload with the argument types.
        wire::InputArchive peek(req);
        peek(h);
      }
      if (!h.internal) {
        calls_.server_begin();
        counted = true;
      }
      auto entry = find_function(h.name);
      if (!entry) {
        throw RpcError("function '" + h.name + "' is not registered on " + self().str() +
                       ": expose it there (DISTRPC_EXPOSE(stub, &impl) for a DISTRPC_REMOTE "
                       "declaration, DISTRPC_REGISTER(f) for a function called as rpc_sync<&f>) "
                       "or build both sides from the same source");
      }
      // Only the library's own functions run as its internal calls (off the request pool,
      // outside the shutdown join's count): a peer cannot move user work there.
      if (h.internal && !entry->library) {
        throw RpcError("function '" + h.name + "' on " + self().str() +
                       " was called as one of the library's own calls, which it is not");
      }
      if (options_.serve_exposed_only && !entry->exposed && !entry->library) {
        throw RpcError("function '" + h.name + "' is not exposed on " + self().str() +
                       ": this worker serves only the functions it exposes "
                       "(RpcBackendOptions::serve_exposed_only); expose it there with "
                       "DISTRPC_REGISTER(" +
                       h.name + ")");
      }
      if (entry->signature != h.signature) {
        // Both sides' signatures in the library's spelling; a raw request may carry no text.
        throw RpcError(
            "signature mismatch: function '" + h.name + "' has signature " + entry->signature_text +
            " on " + self().str() + ", but the caller's declaration is " +
            (h.signature_text.empty() ? std::string("another one (not sent)") : h.signature_text));
      }
      // The layers' scopes around the run (e.g. RRefs among the arguments come from `peer`,
      // RRefs in the result go back to it), and their hooks for the handler.
      RunningRequest hooks(shared_from_this(), peer, h.attachments, true);
      if (h.mode == RequestHeader::kPlainCall) {
        result = entry->handler(req);
      } else {
        std::optional<Future<wire::Message>> ran;
        for (const auto& x : extensions_) {
          if ((ran = x->run_request(peer, h, *entry, req))) break;
        }
        if (!ran) {
          throw RpcError("no layer on " + self().str() + " runs requests of mode " +
                         std::to_string(static_cast<int>(h.mode)) + " (function '" + h.name + "')");
        }
        result = std::move(*ran);
      }
    } catch (...) {
      result = make_exceptional_future<wire::Message>(std::current_exception());
    }
    // A request of a layer's own mode that never ran: the layer learns of it after the reply (a
    // remote() whose creator sent a fetch along: the creator learns of the failed creation
    // first).
    std::exception_ptr unrun = h.mode != RequestHeader::kPlainCall && result.has_error()
                                   ? result.exception_ptr()
                                   : nullptr;
    reply_when_done(peer, id, h.name, counted, std::move(result));
    if (unrun) {
      for (const auto& x : extensions_) x->request_not_run(peer, h, unrun);
    }
  }

  // The id of a control message that gets no answer (host_control_notify): calls are numbered
  // from 1 (agent/call_table.hpp).
  static constexpr std::uint64_t kNoAnswer = 0;

  // A control message of a layer plugged in (on the callback pool): its block of kinds names the
  // layer (AgentExtension::kKindsPerExtension).
  void handle_control(int peer, wire::Message&& req) {
    detail::CurrentAgentScope current(this);
    const std::uint64_t id = req.id;
    const int kind =
        static_cast<int>(req.type) - static_cast<int>(wire::MessageType::kFirstControl);
    Future<wire::Message> result;
    std::string name = "control message " + std::to_string(kind);
    try {
      const int layer = kind / AgentExtension::kKindsPerExtension;
      AgentExtension* owner = nullptr;
      for (const auto& x : extensions_) {
        if (x->id() == layer) owner = x.get();
      }
      if (kind < 0 || owner == nullptr) {
        throw RpcError("unknown control message kind " + std::to_string(kind) + " from worker " +
                       std::to_string(peer) + " (on " + self().str() + ")");
      }
      const int own = kind % AgentExtension::kKindsPerExtension;
      name = owner->control_name(own);
      result = owner->handle_control(peer, own, req);
    } catch (...) {
      result = make_exceptional_future<wire::Message>(std::current_exception());
    }
    if (id == kNoAnswer) {
      // Sent with host_control_notify: nobody waits for an answer; a failure is only logged.
      result.add_done_callback([this, peer, name](const Future<wire::Message>& done) {
        if (!done.has_error() || stopped_.load()) return;  // stopping: failures are expected
        const WireException w = ExceptionRegistry::instance().encode(done.exception_ptr());
        detail::log_warning(self().name, "'" + name + "' from worker " + std::to_string(peer) +
                                             " raised " + w.type_name + ": " + w.message);
      });
      return;
    }
    reply_when_done(peer, id, name, /*counted=*/false, std::move(result));
  }

  // Queues a message sent to this worker itself (value semantics kept by the caller).
  bool dispatch_local(wire::Message&& request) {
    if (wire::is_control_message_type(request.type)) {
      return callback_pool_.post([this, req = std::move(request)]() mutable {
        handle_control(self().id, std::move(req));
      });
    }
    const bool internal = RequestHeader::peek_internal(request);
    std::function<void()> task = [this, req = std::move(request)]() mutable {
      handle_request(self().id, std::move(req));
    };
    return internal ? callback_pool_.post(std::move(task)) : request_pool_.post(std::move(task));
  }

  void reply_when_done(int peer, std::uint64_t id, const std::string& name, bool counted,
                       Future<wire::Message> result) {
    auto respond = [this, peer, id, name, counted](const Future<wire::Message>& done) {
      wire::Message out;
      if (done.has_error()) {
        WireException w = ExceptionRegistry::instance().encode(done.exception_ptr());
        detail::log_warning(self().name, "'" + name + "' called by worker " + std::to_string(peer) +
                                             " raised " + w.type_name + ": " + w.message);
        out.type = wire::MessageType::Exception;
        wire::encode(out, w);
      } else {
        out = done.value();
      }
      out.id = id;
      send_reply(peer, std::move(out));
      if (counted) calls_.server_end();
    };
    if (result.done()) {
      respond(result);
    } else {
      // An async function (or an RRef fetch waiting for its value): this thread is free now;
      // the reply goes when its future completes, sent by the thread that completes it unless
      // that is a reading thread, which must not block on a send (then from the callback pool).
      result.add_done_callback(
          [this](std::function<void()> fn) {
            if (!transport::on_transport_thread()) {
              fn();
            } else if (!callback_pool_.post(std::move(fn))) {
              throw RpcError("RPC agent of " + self().str() + " is shut down: reply dropped");
            }
          },
          respond);
    }
  }

  void send_reply(int peer, wire::Message&& out) {
    if (peer == self().id) {
      try {
        detail_clone_buffers(out);
      } catch (...) {
        fail_call(out.id, std::current_exception());  // the caller is here: it learns why
        return;
      }
      complete_call(peer, std::move(out));
      return;
    }
    try {
      transport_send(peer, std::move(out));
    } catch (const std::exception& e) {
      // The caller learns of it through peer loss or its timeout; nothing else to do here. After
      // stop (a handler abandoned by shutdown returned at last) that is expected: no message.
      if (stopped_.load()) return;
      detail::log_warning(self().name, "could not send a reply to worker " + std::to_string(peer) +
                                           ": " + e.what());
    }
  }

  detail::Membership members_;
  const RpcBackendOptions options_;
  // Set once the static group has met, before any request is served; read-only afterwards.
  detail::DeviceRoutes device_routes_;
  std::atomic<milliseconds> default_timeout_;
  const std::shared_ptr<const Registry> registry_;

  // Loss notices queued for the layers and not yet handled, per peer (on_peer_lost).
  std::mutex loss_notices_mu_;
  std::condition_variable loss_notices_cv_;
  std::map<int, int> loss_notices_;

  // Requests that arrived before the worker table was read (hold_or_dispatch).
  std::mutex early_mu_;
  std::atomic<bool> group_ready_{false};
  std::vector<std::pair<int, wire::Message>> early_requests_;

  detail::GatherTable gathers_;

  std::atomic<bool> stopped_{false};

  ThreadPool request_pool_;
  ThreadPool callback_pool_;
  // How the layers reach this agent (extension.hpp, detail::HostGate): closed by the destructor.
  const std::shared_ptr<detail::HostGate> gate_;
  // The layers plugged in (extension.hpp), one instance each, in id order.
  const std::vector<std::shared_ptr<AgentExtension>> extensions_;
  // Last: its timer posts timed tasks to the callback pool, so it stops before the pools go.
  detail::CallTable<wire::Message> calls_;
};

// Binds the agent to a transport policy chosen at compile time.
template <class T>
class Agent final : public RpcAgent {
  static_assert(transport::check_transport<T>(), "see the messages above");

 public:
  Agent(WorkerInfo self, int world_size, const RpcBackendOptions& opts,
        std::shared_ptr<const Registry> registry = nullptr)
      : RpcAgent(std::move(self), world_size, opts, std::move(registry)),
        ctx_(make_options(), make_callbacks()) {}

  ~Agent() override {
    try {
      stop(/*sync_exit=*/false, milliseconds(0));
    } catch (...) {
      // A destructor must not throw; stop(false) does no store work.
    }
    // Before any member goes (the transport first): a layer's call still inside the stopped
    // agent (a user thread's RRef delete, a late callback) finishes, later ones are refused.
    close_gate();
  }

  std::string transport_name() const override { return std::string(T::name); }
  bool transport_carries_device_buffers() const override {
    return transport::carries_device_buffers<T>();
  }
  void transport_drive(const std::function<bool()>& done,
                       std::chrono::steady_clock::time_point until) override {
    if constexpr (transport::has_drive<typename T::Context>) {
      ctx_.drive(done, until);
    } else {
      RpcAgent::transport_drive(done, until);
    }
  }
  typename T::Context& context() { return ctx_; }

 protected:
  void transport_send(int peer, wire::Message&& m) override { ctx_.send(peer, std::move(m)); }
  std::string transport_address() const override { return ctx_.address(); }
  void transport_add_peer(int id, const std::string& name, const std::string& address) override {
    ctx_.add_peer(id, name, address);
  }
  std::size_t transport_shutdown(Clock::time_point deadline) override {
    return transport::shutdown_until(ctx_, deadline);
  }

 private:
  transport::TransportOptions make_options() const {
    transport::TransportOptions o;
    o.self_id = self().id;
    o.self_name = self().name;
    o.listen_host = options().listen_host.empty() ? o.listen_host : options().listen_host;
    o.advertise_host = options().advertise_host;
    o.auth_token = options().auth_token;
    o.tls = options().tls;
    o.limits.max_message_bytes = options().max_message_bytes;
    o.connect_timeout = options().init_timeout;
    // Peers are added once they published their address, which they do after listening: a
    // refusal then means the peer is gone (a call to it fails at once, not after init_timeout).
    o.refused_retry = std::chrono::milliseconds(100);
    return o;
  }
  transport::TransportCallbacks make_callbacks() {
    transport::TransportCallbacks cb;
    cb.on_message = [this](int peer, wire::Message&& m) { on_message(peer, std::move(m)); };
    cb.on_peer_lost = [this](int peer, const std::string& why) { on_peer_lost(peer, why); };
    return cb;
  }

  typename T::Context ctx_;
};

}  // namespace distrpc
