// The typed call path beneath rpc_sync / rpc_async / remote: where a call goes (Destination), its
// options, the compile-time checks of a call, and the encoding of a request and decoding of its
// reply inside the layers' scopes (AgentExtension::encode_for / decode_from).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>

#include "distrpc/agent.hpp"
#include "distrpc/declare.hpp"
#include "distrpc/device_future.hpp"
#include "distrpc/function_id.hpp"
#include "distrpc/future.hpp"
#include "distrpc/registry.hpp"
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
  // Non-empty: this request's tensors follow this map instead of RpcBackendOptions::device_maps
  // (checked like those). The response comes back through the inverse of the configured map.
  DeviceMap device_map = {};
};

inline CallOptions with_timeout(std::chrono::milliseconds t) {
  return CallOptions{t};
}
// A call whose request tensors follow `map`: rpc_sync<f>("worker1", with_device_map({{0, 1}}), x).
inline CallOptions with_device_map(std::initializer_list<std::pair<DeviceSpec, DeviceSpec>> map) {
  CallOptions o;
  o.device_map = make_device_map(map, "`with_device_map`");
  return o;
}

namespace detail {

// A request on its way: the reply to come, and what the layers attached to the request (handed
// back to them when the reply is decoded).
struct SentCall {
  Future<wire::Message> reply;
  CallAttachments attachments;
};

// `reply` decoded by `decode` into a future with `devices` (a worker with devices): the decoding
// runs on streams of the pool, and the future records its events on those streams when it
// completes (device_future.hpp), so a waiter on any stream sees finished values. As then() does,
// anything that fails on the way fails the future.
template <class T, class Decode>
Future<T> decode_on_pool_streams(const Future<wire::Message>& reply, Decode decode,
                                 const std::vector<c10::Device>& devices) {
  Future<T> typed = make_future<T>(devices);
  reply.add_done_callback(
      [typed, decode = std::move(decode), devices](const Future<wire::Message>& done) {
        try {
          detail::PoolStreamsScope streams(devices);
          if constexpr (std::is_void_v<T>) {
            decode(done);
            typed.try_set_value();
          } else {
            typed.try_set_value(decode(done));
          }
        } catch (...) {
          typed.try_set_exception(std::current_exception());
        }
      });
  return typed;
}

// The typed result of a call to worker `from` (decoded inside the layers' scopes: RRefs in it
// were forked by `from`).
template <class T>
Future<T> decode_reply(SentCall sent, const std::shared_ptr<RpcAgent>& agent, int from) {
  auto decode = [agent, from,
                 atts = std::move(sent.attachments)](const Future<wire::Message>& done) {
    if constexpr (std::is_void_v<T>) {
      done.value();
    } else {
      T out{};
      const wire::Message& m = done.value();
      agent->decode_from(from, atts, [&] { wire::decode(m, out); });
      return out;
    }
  };
  Future<T> typed =
      agent->stream_devices().empty()
          ? sent.reply.then(std::move(decode))
          : decode_on_pool_streams<T>(sent.reply, std::move(decode), agent->stream_devices());
  // The reply completes on a transport I/O thread: user callbacks on `typed` go to the pool. A
  // thread that waits for it reads the transport meanwhile (sync_wait_spin).
  set_callback_executor(typed, agent->callback_executor());
  set_wait_driver(typed, agent);
  return typed;
}

template <auto F, class... A>
constexpr void check_call() {
  static_assert(free_function<F> || remote_stub<F>,
                "distrpc: the template argument must be a pointer to a function or static member "
                "function, e.g. distrpc::rpc_sync<&add>(\"worker1\", x, y), or a DISTRPC_REMOTE "
                "declaration, e.g. distrpc::rpc_sync<add>(\"worker1\", x, y)");
  if constexpr (remote_stub<F>) {
    using Stub = std::remove_cvref_t<decltype(F)>;
    static_assert(sizeof...(A) == Stub::arity,
                  "distrpc::rpc_sync/rpc_async/remote<stub>(to, args...): wrong number of "
                  "arguments for the DISTRPC_REMOTE declaration (see its signature in the "
                  "'required from' line)");
    static_assert(std::is_invocable_v<typename Stub::pointer, A...>,
                  "distrpc::rpc_sync/rpc_async/remote<stub>(to, args...): an argument does not "
                  "convert to the type of the declaration's parameter at the same position");
    static_assert((!is_future_v<std::decay_t<A>> && ...),
                  "distrpc: a Future cannot be sent as an argument (it is not serializable): pass "
                  "future.value() instead");
  } else if constexpr (free_function<F>) {
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
template <auto F, int = free_function<F> ? 1 : (remote_stub<F> ? 2 : 0)>
struct call_result {
  using type = void;
};
template <auto F>
struct call_result<F, 1> {
  using type = unwrap_future_t<typename fn_traits<decltype(F)>::result>;
};
template <auto F>
struct call_result<F, 2> {
  using type = unwrap_future_t<typename std::remove_cvref_t<decltype(F)>::result>;
};
template <auto F>
using call_result_t = typename call_result<F>::type;

// How a call of F names it: a DISTRPC_REMOTE declaration by its name and library-spelled
// signature; a function (the SPMD form) by its compiler-spelled name, registered here too (the
// binary that calls F also serves F).
template <auto F, bool = free_function<F>>
struct call_identity {
  using Stub = std::remove_cvref_t<decltype(F)>;
  using args = typename Stub::args;
  static RequestHeader header() {
    RequestHeader h;
    h.name = std::string(Stub::name());
    h.signature = Stub::signature();
    h.signature_text = Stub::signature_text();
    return h;
  }
  static void register_caller() {}
};
template <auto F>
struct call_identity<F, true> {
  using args = typename fn_traits<decltype(F)>::args;
  static RequestHeader header() {
    RequestHeader h;
    h.name = std::string(function_name<F>());
    h.signature = signature_hash<F>();
    h.signature_text = signature_text<F>();
    return h;
  }
  static void register_caller() { ensure_registered<F>(); }
};

// Encodes (header, packed arguments) for `dst` inside the layers' scopes and sends it. What the
// layers did while encoding (RRefs among the arguments forked to `dst`) is undone if encoding
// fails or the message is never sent.
// The agent's own calls (header.internal) carry no attachments.
template <class Packed>
SentCall send_packed(const std::shared_ptr<RpcAgent>& agent, const WorkerInfo& dst,
                     std::chrono::milliseconds timeout, RequestHeader header, const Packed& packed,
                     const std::string& what, const DeviceMap* device_map = nullptr) {
  if (!header.internal) header.attachments = agent->attach(dst.id);
  wire::Message m;
  std::function<void()> undo = agent->encode_for(
      dst.id, header.attachments, [&] { wire::encode(m, header, packed); }, device_map);
  auto reply = agent->call(dst, std::move(m), timeout, header.internal, what,
                           wire::MessageType::Request, undo);
  return SentCall{std::move(reply), std::move(header.attachments)};
}

// As send_call, with the call named `what` in its errors ("RPC <what> to WorkerInfo(...) failed:
// ..."): a runner serving many user-visible calls (builtin operators) names the one it runs.
template <auto F, class... A>
SentCall send_named_call(const std::shared_ptr<RpcAgent>& agent, const WorkerInfo& dst,
                         CallOptions opts, bool internal, const std::string& what, A&&... args) {
  using Id = call_identity<F>;
  Id::register_caller();
  const auto timeout = agent->effective_timeout(opts.timeout);
  typename Id::args packed(std::forward<A>(args)...);
  RequestHeader h = Id::header();
  h.internal = internal;
  return send_packed(agent, dst, timeout, h, packed,
                     what.empty() ? "call to '" + h.name + "'" : what, &opts.device_map);
}

template <auto F, class... A>
SentCall send_call(const std::shared_ptr<RpcAgent>& agent, const WorkerInfo& dst, CallOptions opts,
                   bool internal, A&&... args) {
  return send_named_call<F>(agent, dst, opts, internal, std::string(), std::forward<A>(args)...);
}

}  // namespace detail
}  // namespace distrpc
