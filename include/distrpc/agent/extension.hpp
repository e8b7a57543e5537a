// Extension points of the agent: how a layer above it (RRefs today, distributed autograd next)
// plugs in without the agent knowing it. A layer registers a factory once
// (register_agent_extension); every agent then makes one instance of it, hands it the services
// below, and calls its hooks: its own control messages, a scope around each request it runs,
// request modes it owns, peer loss, the steps of a graceful shutdown, debug info.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "distrpc/entry_gate.hpp"
#include "distrpc/function_ref.hpp"
#include "distrpc/future.hpp"
#include "distrpc/registry.hpp"
#include "distrpc/rpc_error.hpp"
#include "distrpc/wire.hpp"
#include "distrpc/worker_info.hpp"

namespace distrpc {

namespace detail {
class HostGate;
}

// What the agent offers the layers plugged into it. A layer reaches these through the agent's
// gate (host_gate(), detail::HostGate), never through a reference kept from its construction:
// the layer's objects may outlive the agent.
class AgentServices {
 public:
  // The gate every later use of these services goes through (see detail::HostGate).
  virtual std::shared_ptr<detail::HostGate> host_gate() const = 0;
  virtual const WorkerInfo& host_self() const = 0;
  virtual WorkerInfo host_worker(int id) const = 0;
  virtual std::chrono::milliseconds host_timeout(std::chrono::milliseconds requested) const = 0;
  // 0 when this process is the first to hold its rank in its group (every member of a static
  // group); otherwise a number no earlier holder of the rank had (its join number in a dynamic
  // group). Ids a layer makes, and which other workers may still hold from an earlier process
  // under this rank, stay unique when they are made from it.
  virtual std::int64_t host_incarnation() const = 0;
  // A control message of the layer's own kind to worker `to`, counted in the graceful-shutdown
  // join like a user call; the reply (or the failure) arrives through the future.
  virtual Future<wire::Message> host_control_call(int to, wire::MessageType kind, wire::Message&& m,
                                                  std::chrono::milliseconds timeout,
                                                  const std::string& what) = 0;
  // A control message of the layer's own kind to worker `to` that gets no answer: for a protocol
  // whose receiver reports what became of it another way, so that no reply costs either side a
  // send. Not counted in the graceful-shutdown join. Throws (RpcError or DistNetworkError, naming
  // the worker and `what`) when it could not be sent; the receiver's handler runs as for any
  // control message, and a failure there is logged on the receiver only.
  virtual void host_control_notify(int to, wire::MessageType kind, wire::Message&& m,
                                   const std::string& what) = 0;
  // host_control_call for a fire-and-forget protocol message that must not be lost to a passing
  // send failure: when the transport refused to send (a DistNetworkError, nothing left), a copy of
  // `m` (tensors shared) is sent again after `first_backoff`, then after twice that, and so on, up
  // to `attempts` sends in all. Never retried: a worker known lost, an agent stopping (the call
  // fails at once, naming the worker and `what`), and any error after the message left (a
  // timeout, a remote exception, peer loss): the receiver may have acted on it already. Counted in
  // the graceful-shutdown join, backoffs included, like host_control_call. Bad arguments
  // (attempts < 1, a negative backoff) fail the future with std::invalid_argument.
  virtual Future<wire::Message> host_control_call_retrying(
      int to, wire::MessageType kind, wire::Message&& m, std::chrono::milliseconds timeout,
      const std::string& what, int attempts, std::chrono::milliseconds first_backoff) = 0;
  // Queues library work on the callback pool; false once the agent stopped.
  virtual bool host_post(std::function<void()> fn) = 0;
  // `steps` protocol steps are under way locally (between two counted messages): the join waits.
  virtual void host_protocol_begin(std::uint64_t steps) = 0;
  virtual void host_protocol_end(std::uint64_t steps) = 0;
  // Queues `fn` on the callback pool `delay` from now; false once the agent stopped (fn dropped).
  virtual bool host_after(std::chrono::milliseconds delay, std::function<void()> fn) = 0;
  // Where user callbacks of futures handed to the user run.
  virtual detail::ExecutorFn host_user_executor() = 0;
  // Drives the futures handed to the user while they are waited on (detail::set_wait_driver).
  virtual std::weak_ptr<detail::WaitDriver> host_wait_driver() = 0;
  // Reads the transport on this thread until `done()` or `until`, where the policy can, for a
  // layer waiting for a known short exchange of several messages (a backward pass): unlike the
  // wait driver, not bounded by sync_wait_spin. Returns at once when the user turned reading
  // while waiting off (sync_wait_spin 0) or on a transport thread.
  virtual void host_drive(const std::function<bool()>& done,
                          std::chrono::steady_clock::time_point until) = 0;

  // For a layer whose own control messages carry a call (RRefs' fetch): the layers' attachments
  // for a call to `dst` made on this thread (AgentExtension::attach); the scopes of the layers
  // where such a call is served (enter_request) and its reply encoded (encode_reply); and the
  // decoding of that reply at the caller (decode_from).
  virtual CallAttachments host_attach(int dst) = 0;
  virtual std::shared_ptr<void> host_enter_request(int peer, const CallAttachments& got) = 0;
  virtual void host_encode_reply(int peer, const CallAttachments& got,
                                 FunctionRef<void()> encode) = 0;
  virtual void host_decode_reply(int from, const CallAttachments& sent,
                                 FunctionRef<void()> decode) = 0;
  // Encodes (encode()) tensors that go back to where `peer`'s tensors came from (their
  // gradients). Those that came in `peer`'s request travelled through `peer`'s device map, so
  // theirs take a reply's route (its inverse); those that came in a reply to this worker
  // (`in_reply`) travelled through the inverse of this worker's map, so theirs take a request's
  // route (this worker's map to `peer`).
  virtual void host_encode_back(int peer, bool in_reply, FunctionRef<void()> encode) = 0;

 protected:
  virtual ~AgentServices() = default;
};

namespace detail {

// How the layers plugged into an agent reach it. Their objects can outlive the agent: a user thread
// may drop its last RRef, call to_here(), or add a callback to a future it kept, while another
// thread destroys the agent, and the layer then holds the bookkeeping (a shared_ptr) but not the
// agent. So no layer keeps the agent by reference: each use takes a pass (enter()), the agent's
// destructor closes the gate after its stop() (close()) and waits for the passes still out before
// its memory goes. Those are short library calls into a stopped agent (which fails them at once),
// never user code waiting on the network, so the wait is short. After close(), enter() gives an
// empty pass and the layer fails its call with shut_down_text() or drops what it meant to send.
// A pass is an entry of an EntryGate (entry_gate.hpp), not a lock: passes nest, and any number of
// threads hold one at once.
class HostGate : public std::enable_shared_from_this<HostGate> {
 public:
  // `self`: the agent's own worker, for error texts once the agent is gone.
  HostGate(AgentServices& host, WorkerInfo self) : host_(&host), self_(std::move(self)) {}
  HostGate(const HostGate&) = delete;
  HostGate& operator=(const HostGate&) = delete;

  class Pass {
   public:
    Pass() = default;
    Pass(Pass&& o) noexcept : gate_(o.gate_) { o.gate_ = nullptr; }
    Pass& operator=(Pass&& o) noexcept {
      if (this != &o) {
        if (gate_ != nullptr) gate_->entries_.leave();
        gate_ = o.gate_;
        o.gate_ = nullptr;
      }
      return *this;
    }
    Pass(const Pass&) = delete;
    Pass& operator=(const Pass&) = delete;
    ~Pass() {
      if (gate_ != nullptr) gate_->entries_.leave();
    }
    explicit operator bool() const { return gate_ != nullptr; }
    AgentServices* operator->() const { return gate_->host_; }
    AgentServices& operator*() const { return *gate_->host_; }

   private:
    friend class HostGate;
    explicit Pass(HostGate* g) : gate_(g) {}
    HostGate* gate_ = nullptr;
  };

  // A pass while the agent exists; an empty one once its destructor closed the gate.
  Pass enter() { return entries_.enter() ? Pass(this) : Pass(); }

  // The agent is going (its destructor, after stop()): no pass is given from now on, and the
  // passes still out are waited for. Those this very thread holds are not waited for (the agent
  // destroyed from inside one of its own calls would otherwise wait for itself). Idempotent.
  void close() { entries_.close_and_wait(); }

  bool closed() const { return entries_.closed(); }
  const WorkerInfo& self() const { return self_; }
  // The agent's own text for a refusal after its stop: "RPC agent of W is shut down: <what>".
  std::string shut_down_text(const std::string& what) const {
    return "RPC agent of " + self_.str() + " is shut down: " + what;
  }

  // Where callbacks of futures handed to users run (the agent's callback pool). The executor is
  // kept in those futures, which outlive the agent: it reaches the pool through the gate, and
  // once the agent is gone it refuses as a stopped pool does (the callback fails with the text).
  ExecutorFn user_executor() {
    return [gate = shared_from_this()](std::function<void()> fn) {
      auto pass = gate->enter();
      if (!pass || !pass->host_post(std::move(fn))) {
        throw RpcError(gate->shut_down_text("callback dropped"));
      }
    };
  }
  // The wait driver of futures handed to users (none once the agent is gone).
  std::weak_ptr<WaitDriver> wait_driver() {
    auto pass = enter();
    if (!pass) return {};
    return pass->host_wait_driver();
  }

 private:
  AgentServices* const host_;
  const WorkerInfo self_;
  EntryGate entries_;
};

}  // namespace detail

// A layer plugged into the agent. Hooks run on library threads (a pool thread, or a transport
// thread where said); none runs user code or blocks on the network.
class AgentExtension {
 public:
  // Control kinds per extension: extension `id()` owns the control message kinds
  // [id * kKindsPerExtension, (id + 1) * kKindsPerExtension) (wire::control_message_type()).
  // The id is fixed per layer, not given by registration order, so binaries built from different
  // sources agree on the wire.
  static constexpr int kKindsPerExtension = 16;
  static constexpr int kMaxExtensions = 7;  // 112 control kinds (wire/message.hpp)

  virtual ~AgentExtension() = default;

  // Stable identity: 0 RRefs, 1 distributed autograd, ...
  virtual int id() const = 0;
  // The wire type of this extension's control kind `kind` (< kKindsPerExtension).
  wire::MessageType control_type(int kind) const {
    return wire::control_message_type(static_cast<std::uint8_t>(id() * kKindsPerExtension + kind));
  }

  // One of its control messages arrived from `peer` (on the callback pool, or inline on a
  // reading thread through offer_inline_library: it must not block). The reply goes back as the
  // future's value or error. `name` below names the kind in error texts.
  virtual Future<wire::Message> handle_control(int peer, int kind, const wire::Message& m) = 0;
  virtual std::string control_name(int kind) const = 0;

  // A call to worker `dst` is being made on this thread (a user call, not the agent's own): what
  // this layer attaches to it (e.g. the distributed-autograd context the caller is in). Added to
  // `out` as (id(), bytes); called before encode_for().
  virtual void attach(int /*dst*/, CallAttachments& /*out*/) {}

  // A request from `peer` is about to run on this thread, with the attachments it carried: what
  // is returned stays alive while its handler decodes the arguments, runs, and encodes a result
  // that is ready at once (e.g. the thread-local scopes under which RRefs among arguments and
  // results are forked).
  virtual std::shared_ptr<void> enter_request(int /*peer*/, const CallAttachments& /*got*/) {
    return nullptr;
  }
  // The request's handler decoded its arguments, inside this layer's enter_request() scope, and
  // is about to run the function (e.g. wait until RRef arguments are confirmed by their owner).
  virtual void arguments_decoded(int /*peer*/) {}
  // A request of a mode this layer owns (RequestHeader::mode other than kPlainCall): runs it
  // and returns its reply, or nullopt when the mode is not this layer's.
  virtual std::optional<Future<wire::Message>> run_request(int /*peer*/,
                                                           const RequestHeader& /*header*/,
                                                           const detail::RegistryEntry& /*entry*/,
                                                           wire::Message& /*request*/) {
    return std::nullopt;
  }
  // A request of this layer's mode failed before it ran (unknown function, signature mismatch,
  // undecodable arguments): called after the error reply was sent.
  virtual void request_not_run(int /*peer*/, const RequestHeader& /*header*/,
                               std::exception_ptr /*error*/) {}
  // The reply of a request from `peer` (which carried `got`) is being encoded on this thread:
  // runs encode() inside the layer's scope (e.g. record what the reply carries).
  virtual void encode_reply(int /*peer*/, const CallAttachments& /*got*/,
                            FunctionRef<void()> encode) {
    encode();
  }

  // A call to worker `dst`, with the attachments `sent`, is being encoded on this thread: runs
  // encode() inside the layer's scope (e.g. where RRefs among the arguments are forked to). What
  // must be undone if the message is never sent goes into `undo`; if encode() throws, the layer
  // undoes its part itself.
  virtual void encode_for(int /*dst*/, const CallAttachments& /*sent*/, FunctionRef<void()> encode,
                          std::vector<std::function<void()>>& /*undo*/) {
    encode();
  }
  // The reply from worker `from` to a call that carried `sent` is being decoded on this thread:
  // runs decode() inside the layer's scope (e.g. RRefs in it were forked by `from`).
  virtual void decode_from(int /*from*/, const CallAttachments& /*sent*/,
                           FunctionRef<void()> decode) {
    decode();
  }

  // Worker `peer` is lost (on the callback pool).
  virtual void on_peer_lost(int /*peer*/) {}
  // A worker joined a dynamic group as `peer`, possibly replacing a lost one of that id (on a
  // request thread, before the joiner can send anything to this worker).
  virtual void on_peer_joined(int /*peer*/) {}
  // Graceful shutdown, after the group's calls joined: release what this worker holds of others
  // (bounded by `limit`); the group then meets once more before report_leaks().
  virtual void before_exit(std::chrono::milliseconds /*limit*/) {}
  // Graceful shutdown, once every worker released its holdings: what is still held here by
  // others, as an error text ("" when nothing is).
  virtual std::string report_leaks() const { return {}; }
  // The local stop began: no protocol message is sent from now on.
  virtual void on_stop() {}
  virtual void add_debug_info(std::map<std::string, std::string>& /*out*/) const {}
};

using AgentExtensionFactory = std::function<std::shared_ptr<AgentExtension>(AgentServices&)>;

namespace detail {
struct ExtensionFactories {
  std::mutex mu;
  std::map<int, AgentExtensionFactory> by_id;
};
inline ExtensionFactories& extension_factories() {
  static ExtensionFactories f;
  return f;
}
}  // namespace detail

// Registers a layer: every agent made from now on has one instance of it. Registering an id twice
// keeps the first factory (a header included by many translation units registers once per unit).
inline bool register_agent_extension(int id, AgentExtensionFactory factory) {
  auto& f = detail::extension_factories();
  std::lock_guard<std::mutex> lk(f.mu);
  f.by_id.emplace(id, std::move(factory));
  return true;
}

// One instance of every registered layer, in id order.
inline std::vector<std::shared_ptr<AgentExtension>> make_agent_extensions(AgentServices& services) {
  std::vector<AgentExtensionFactory> factories;
  {
    auto& f = detail::extension_factories();
    std::lock_guard<std::mutex> lk(f.mu);
    for (auto& [id, make] : f.by_id) factories.push_back(make);
  }
  std::vector<std::shared_ptr<AgentExtension>> out;
  for (auto& make : factories) out.push_back(make(services));
  return out;
}

}  // namespace distrpc
