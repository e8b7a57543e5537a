// The callable registry: what a worker is willing to run on behalf of a peer.
//
// Nothing received is ever executed unless it was registered here, either explicitly with
// DISTRPC_REGISTER(fn) or implicitly by a binary that instantiates rpc_sync/rpc_async/remote of
// `fn` (SPMD programs register what they call). An entry is keyed by the function's stable name
// and carries its signature hash; the handler decodes the arguments with the exact parameter
// types, runs the function and encodes the result (or returns the function's Future, which makes
// the call asynchronous by its type).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "distrpc/function_id.hpp"
#include "distrpc/future.hpp"
#include "distrpc/rref/id.hpp"
#include "distrpc/rref/scope.hpp"
#include "distrpc/rref/value.hpp"
#include "distrpc/wire.hpp"

namespace distrpc {

// How a request wants its function run.
enum class CallMode : std::uint8_t {
  call = 0,    // rpc_sync / rpc_async: the result travels back
  remote = 1,  // remote(): the result stays with the callee, who owns RRef `rref_id`
};

// The first value of every request payload: which function, and how it is typed.
struct RequestHeader {
  std::string name;
  std::uint64_t signature = 0;
  // Calls the agent makes for itself (all-gather, join) are not counted as user work.
  bool internal = false;
  CallMode mode = CallMode::call;
  // Only for CallMode::remote: the RRef the callee creates, and the caller's fork of it (equal to
  // rref_id when the caller is the owner itself).
  RRefId rref_id{};
  ForkId fork_id{};

  template <class Archive>
  void save(Archive& ar) const {
    ar(name, signature, internal, static_cast<std::uint8_t>(mode));
    if (mode == CallMode::remote) ar(rref_id, fork_id);
  }
  template <class Archive>
  void load(Archive& ar) {
    std::uint8_t m = 0;
    ar(name, signature, internal, m);
    if (m > 1) throw wire::DecodeError("unknown call mode " + std::to_string(m) + " in a request");
    mode = static_cast<CallMode>(m);
    if (mode == CallMode::remote) ar(rref_id, fork_id);
  }
};

namespace detail {

// Runs a decoded request; returns the response message (ready, or later for async functions).
using Handler = std::function<Future<wire::Message>(const wire::Message& request)>;
// Runs a decoded remote() request; returns the value the owner's RRef will hold.
using RemoteHandler = std::function<Future<BoxedValue>(const wire::Message& request)>;

struct RegistryEntry {
  std::uint64_t signature = 0;
  std::string signature_text;
  Handler handler;
  RemoteHandler remote_handler;
};

}  // namespace detail

class Registry {
 public:
  static Registry& instance() {
    static Registry r;
    return r;
  }

  void add(std::string name, std::uint64_t signature, std::string signature_text,
           detail::Handler handler, detail::RemoteHandler remote_handler = {}) {
    std::lock_guard<std::mutex> lk(mu_);
    entries_[std::move(name)] = detail::RegistryEntry{
        signature, std::move(signature_text), std::move(handler), std::move(remote_handler)};
  }

  std::optional<detail::RegistryEntry> find(const std::string& name) const {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = entries_.find(name);
    if (it == entries_.end()) return std::nullopt;
    return it->second;
  }

  bool contains(const std::string& name) const { return find(name).has_value(); }

 private:
  mutable std::mutex mu_;
  std::map<std::string, detail::RegistryEntry> entries_;
};

namespace detail {

template <class R>
wire::Message response_with(R&& value) {
  wire::Message m;
  m.type = wire::MessageType::Response;
  wire::encode(m, value);
  return m;
}

inline wire::Message empty_response() {
  wire::Message m;
  m.type = wire::MessageType::Response;
  return m;
}

template <auto F>
using fn_result_t = typename fn_traits<decltype(F)>::result;

// Decodes (header, args...) and waits until the owner confirmed every RRef among the arguments.
template <auto F>
typename fn_traits<decltype(F)>::args decode_arguments(const wire::Message& request) {
  RequestHeader header;
  typename fn_traits<decltype(F)>::args args;
  wire::decode(request, header, args);
  await_rref_confirmations();
  return args;
}

// The handler of F: decode (header, args...), call, encode the result.
template <auto F>
Future<wire::Message> invoke(const wire::Message& request) {
  using R = fn_result_t<F>;
  using V = unwrap_future_t<R>;
  if constexpr (!std::is_void_v<V> && !wire_serializable_v<V>) {
    (void)request;
    throw std::invalid_argument(
        "the result of '" + std::string(function_name<F>()) + "' (type '" +
        std::string(type_name<V>()) +
        "') cannot be serialized: call it with distrpc::remote() to keep it on the callee");
  } else {
    auto args = decode_arguments<F>(request);
    if constexpr (is_future_v<R>) {
      // The result is encoded later, on another thread: carry the encoding scope (where RRefs in
      // the result are forked to) over to it.
      std::shared_ptr<RRefEncodeScope> scope;
      if (tls_rref_encode != nullptr) {
        scope = std::make_shared<RRefEncodeScope>();
        scope->ctx = tls_rref_encode->ctx;
        scope->dst = tls_rref_encode->dst;
      }
      R fut = std::apply(F, std::move(args));
      return fut.then([scope](const R& done) {
        EncodeScopeGuard guard(tls_rref_encode, scope.get());
        if constexpr (std::is_void_v<V>) {
          done.value();
          return empty_response();
        } else {
          return response_with(done.value());
        }
      });
    } else if constexpr (std::is_void_v<R>) {
      std::apply(F, std::move(args));
      return make_ready_future(empty_response());
    } else {
      return make_ready_future(response_with(std::apply(F, std::move(args))));
    }
  }
}

// The remote() handler of F: decode, call, and box the result for the owner's RRef (a function
// returning void leaves a NoValue: the RRef<void> only tells that it ran, or how it failed).
template <auto F>
Future<BoxedValue> invoke_boxed(const wire::Message& request) {
  using R = fn_result_t<F>;
  using V = unwrap_future_t<R>;
  using S = rref_storage_t<V>;
  auto args = decode_arguments<F>(request);
  if constexpr (is_future_v<R>) {
    R fut = std::apply(F, std::move(args));
    return fut.then([](const R& done) {
      if constexpr (std::is_void_v<V>) {
        done.value();
        return BoxedValue{std::make_shared<S>(), value_ops<S>()};
      } else {
        return BoxedValue{std::make_shared<S>(done.value()), value_ops<S>()};
      }
    });
  } else if constexpr (std::is_void_v<V>) {
    std::apply(F, std::move(args));
    return make_ready_future(BoxedValue{std::make_shared<S>(), value_ops<S>()});
  } else {
    return make_ready_future(
        BoxedValue{std::make_shared<S>(std::apply(F, std::move(args))), value_ops<S>()});
  }
}

template <auto F>
struct Registrar {
  static bool add() {
    Registry::instance().add(std::string(function_name<F>()), signature_hash<F>(),
                             std::string(type_name<decltype(F)>()), &invoke<F>, &invoke_boxed<F>);
    return true;
  }
  // Odr-using this from a call site instantiates it: the binary that calls F also serves F.
  static inline const bool registered = add();
};

template <auto F>
void ensure_registered() {
  (void)Registrar<F>::registered;
}

}  // namespace detail
}  // namespace distrpc

#define DISTRPC_REGISTER_CAT2(a, b) a##b
#define DISTRPC_REGISTER_CAT(a, b) DISTRPC_REGISTER_CAT2(a, b)

// Registers `fn` (a function or static member function) so peers may call it on this worker.
#define DISTRPC_REGISTER(fn)                                                        \
  [[maybe_unused]] static const bool DISTRPC_REGISTER_CAT(distrpc_reg_, __LINE__) = \
      (::distrpc::detail::ensure_registered<&fn>(), true)
