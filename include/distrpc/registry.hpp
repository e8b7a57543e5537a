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
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

#include "distrpc/function_id.hpp"
#include "distrpc/future.hpp"
#include "distrpc/wire.hpp"
#include "distrpc/wire/boxed_value.hpp"

// At global scope on purpose: GCC spells a template's function argument relative to the
// template's own namespace, so only from here are the library's functions named in full
// ("distrpc::detail::run_builtin"; function_name() says "run_builtin").
template <auto F>
constexpr std::string_view distrpc_function_full_name_pretty() {
  return __PRETTY_FUNCTION__;
}

namespace distrpc {

// The first value of every request payload: which function, and how it is typed.
struct RequestHeader {
  // How the function is run. kPlainCall: the result travels back (rpc_sync / rpc_async). Other
  // modes belong to a layer plugged into the agent (AgentExtension::run_request; RRefs' remote()
  // is one), whose own fields travel in `mode_data`, opaque here.
  static constexpr std::uint8_t kPlainCall = 0;

  std::string name;
  std::uint64_t signature = 0;
  // Calls the agent makes for itself (all-gather, join) are not counted as user work.
  bool internal = false;
  std::uint8_t mode = kPlainCall;
  std::string mode_data{};

  template <class Archive>
  void save(Archive& ar) const {
    ar(name, signature, internal, mode);
    if (mode != kPlainCall) ar(mode_data);
  }
  template <class Archive>
  void load(Archive& ar) {
    ar(name, signature, internal, mode);
    if (mode != kPlainCall) ar(mode_data);
  }
};

namespace detail {

// Runs a decoded request; returns the response message (ready, or later for async functions).
using Handler = std::function<Future<wire::Message>(const wire::Message& request)>;
// Runs a decoded request whose result a layer keeps where it is (remote()): returns it boxed.
using BoxedHandler = std::function<Future<BoxedValue>(const wire::Message& request)>;

struct RegistryEntry {
  std::uint64_t signature = 0;
  std::string signature_text;
  Handler handler;
  BoxedHandler boxed_handler;
  // One of the library's own (namespace distrpc): served by every agent, whatever its registry.
  bool library = false;
  // Exposed explicitly (DISTRPC_REGISTER, Registry::add), not only registered because this binary
  // calls it: what a worker with RpcBackendOptions::serve_exposed_only serves.
  bool exposed = false;
};

// True for the library's own functions (the group protocol, builtin operators, RRef proxies and
// module helpers).
template <auto F>
constexpr bool is_library_function() {
  return extract(distrpc_function_full_name_pretty<F>(), "F = ").substr(0, 9) == "distrpc::";
}

// The layers' hooks around the request this thread runs, set by the agent while a handler runs
// (RpcAgent::handle_request, AgentExtension), so that the registry's handlers reach them without
// knowing the layers.
class RequestHooks {
 public:
  // The handler decoded the arguments and is about to run the function (e.g. wait until the
  // owner of every RRef among them confirmed it).
  virtual void arguments_decoded() = 0;
  // For a result encoded later on another thread (a function returning a Future): something
  // that reopens the layers' scopes of this request there, for as long as what it returns lives.
  virtual std::function<std::shared_ptr<void>()> reopener() const = 0;

 protected:
  ~RequestHooks() = default;
};

inline thread_local RequestHooks* tls_request_hooks = nullptr;

}  // namespace detail

class Registry {
 public:
  static Registry& instance() {
    static Registry r;
    return r;
  }

  // `exposed`: see RegistryEntry; once exposed, a function stays exposed when its call sites
  // register it again.
  void add(std::string name, std::uint64_t signature, std::string signature_text,
           detail::Handler handler, detail::BoxedHandler boxed_handler = {}, bool library = false,
           bool exposed = true) {
    std::lock_guard<std::mutex> lk(mu_);
    auto& e = entries_[std::move(name)];
    const bool was_exposed = e.exposed;
    e = detail::RegistryEntry{signature,        std::move(signature_text),
                              std::move(handler), std::move(boxed_handler),
                              library,          exposed || was_exposed};
  }

  std::optional<detail::RegistryEntry> find(const std::string& name) const {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = entries_.find(name);
    if (it == entries_.end()) return std::nullopt;
    return it->second;
  }

  bool contains(const std::string& name) const { return find(name).has_value(); }

  // Adds function F (a function or static member function), as DISTRPC_REGISTER(F) does for the
  // process's registry: for an agent given this registry (RpcGroup::join).
  template <auto F>
  void add();

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

// Decodes (header, args...); then the layers finish what the arguments need before the function
// runs (RequestHooks::arguments_decoded).
template <auto F>
typename fn_traits<decltype(F)>::args decode_arguments(const wire::Message& request) {
  RequestHeader header;
  typename fn_traits<decltype(F)>::args args;
  wire::decode(request, header, args);
  if (tls_request_hooks != nullptr) tls_request_hooks->arguments_decoded();
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
      // The result is encoded later, on another thread: the layers' scopes of this request (e.g.
      // where RRefs in the result are forked to) are reopened there.
      std::function<std::shared_ptr<void>()> reopen;
      if (tls_request_hooks != nullptr) reopen = tls_request_hooks->reopener();
      R fut = std::apply(F, std::move(args));
      return fut.then([reopen = std::move(reopen)](const R& done) {
        const auto scopes = reopen ? reopen() : nullptr;
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

// The boxed handler of F: decode, call, and box the result for the layer that keeps it (remote():
// the owner's RRef). A function returning void leaves a NoValue: it only tells that it ran.
template <auto F>
Future<BoxedValue> invoke_boxed(const wire::Message& request) {
  using R = fn_result_t<F>;
  using V = unwrap_future_t<R>;
  using S = boxed_storage_t<V>;
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
                             std::string(type_name<decltype(F)>()), &invoke<F>, &invoke_boxed<F>,
                             is_library_function<F>(), /*exposed=*/false);
    return true;
  }
  // Odr-using this from a call site instantiates it: the binary that calls F also serves F.
  static inline const bool registered = add();
};

template <auto F>
void ensure_registered() {
  (void)Registrar<F>::registered;
}

// DISTRPC_REGISTER(F): registered and exposed.
template <auto F>
bool expose() {
  ensure_registered<F>();
  Registry::instance().add<F>();
  return true;
}

}  // namespace detail

template <auto F>
void Registry::add() {
  static_assert(detail::free_function<F>,
                "distrpc::Registry::add<&f>(): f must be a function or static member function");
  add(std::string(detail::function_name<F>()), detail::signature_hash<F>(),
      std::string(detail::type_name<decltype(F)>()), &detail::invoke<F>, &detail::invoke_boxed<F>,
      detail::is_library_function<F>());
}
}  // namespace distrpc

#define DISTRPC_REGISTER_CAT2(a, b) a##b
#define DISTRPC_REGISTER_CAT(a, b) DISTRPC_REGISTER_CAT2(a, b)

// Registers `fn` (a function or static member function) so peers may call it on this worker.
#define DISTRPC_REGISTER(fn)                                                        \
  [[maybe_unused]] static const bool DISTRPC_REGISTER_CAT(distrpc_reg_, __LINE__) = \
      ::distrpc::detail::expose<&fn>()
