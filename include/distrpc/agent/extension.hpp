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

#include "distrpc/function_ref.hpp"
#include "distrpc/future.hpp"
#include "distrpc/registry.hpp"
#include "distrpc/wire.hpp"
#include "distrpc/worker_info.hpp"

namespace distrpc {

// What the agent offers the layers plugged into it.
class AgentServices {
 public:
  virtual const WorkerInfo& host_self() const = 0;
  virtual WorkerInfo host_worker(int id) const = 0;
  virtual std::chrono::milliseconds host_timeout(std::chrono::milliseconds requested) const = 0;
  // A control message of the layer's own kind to worker `to`, counted in the graceful-shutdown
  // join like a user call; the reply (or the failure) arrives through the future.
  virtual Future<wire::Message> host_control_call(int to, wire::MessageType kind, wire::Message&& m,
                                                  std::chrono::milliseconds timeout,
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

 protected:
  virtual ~AgentServices() = default;
};

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
