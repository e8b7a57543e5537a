// The callable registry: what a worker is willing to run on behalf of a peer.
//
// Nothing received is ever executed unless it was registered here: explicitly with
// DISTRPC_REGISTER(fn) or DISTRPC_EXPOSE(stub, &impl) (declare.hpp), or implicitly by a binary
// that instantiates rpc_sync/rpc_async/remote of `fn` (SPMD programs register what they call). An
// entry is keyed by the function's name and carries its signature (text and hash); the handler
// decodes the arguments with the exact parameter types, runs the function and encodes the result
// (or returns the function's Future, which makes the call asynchronous by its type).
//
// A name identifies one implementation: registering another one under a name already taken is
// refused with both origins (see Registry::add). Registrations made while the program starts
// (the macros, call sites) cannot throw there, so they are recorded and init_rpc / RpcGroup::join
// fail with the text instead.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <source_location>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "distrpc/function_id.hpp"
#include "distrpc/function_ref.hpp"
#include "distrpc/future.hpp"
#include "distrpc/wire.hpp"
#include "distrpc/wire/boxed_value.hpp"
#include "distrpc/wire/type_spelling.hpp"

namespace distrpc {

// What the layers plugged into the agent attach to a call (AgentExtension::attach): (layer id,
// bytes) pairs, opaque to the agent. They travel in the request header (or inside a layer's own
// control message) and are handed back to the layers where the call runs and where its reply is
// decoded (e.g. distributed autograd's context id).
using CallAttachments = std::vector<std::pair<std::uint8_t, std::string>>;

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
  // The caller's signature as people read it ("Tensor(Tensor, i64)"), for the callee's error
  // when `signature` differs from its own.
  std::string signature_text{};
  // Set by the layers as the call is sent; nothing on the wire when empty (a bit of the mode
  // byte says whether they follow).
  CallAttachments attachments{};

  static constexpr std::uint8_t kAttachmentsBit = 0x80;

  template <class Archive>
  void save(Archive& ar) const {
    const auto wire_mode =
        static_cast<std::uint8_t>(mode | (attachments.empty() ? 0 : kAttachmentsBit));
    ar(name, signature, signature_text, internal, wire_mode);  // peek_internal() reads 4 of them
    if (mode != kPlainCall) ar(mode_data);
    if (!attachments.empty()) ar(attachments);
  }
  // Whether the request in `m` is one of the agent's own (`internal`), read without decoding the
  // rest (for routing it on a reading thread); false when the header is malformed, which the
  // full decode then reports.
  static bool peek_internal(const wire::Message& m) noexcept {
    try {
      wire::InputArchive ar(m);
      ar.skip(ar.read<cereal::size_type>());  // name
      ar.skip(sizeof(std::uint64_t));         // signature
      ar.skip(ar.read<cereal::size_type>());  // signature_text
      bool internal = false;
      ar(internal);
      return internal;
    } catch (...) {
      return false;
    }
  }

  template <class Archive>
  void load(Archive& ar) {
    std::uint8_t wire_mode = 0;
    ar(name, signature, signature_text, internal, wire_mode);
    mode = static_cast<std::uint8_t>(wire_mode & ~kAttachmentsBit);
    if (mode != kPlainCall) ar(mode_data);
    if ((wire_mode & kAttachmentsBit) != 0) ar(attachments);
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
  // Exposed explicitly (DISTRPC_REGISTER, DISTRPC_EXPOSE, Registry::add), not only registered
  // because this binary calls it: what a worker with RpcBackendOptions::serve_exposed_only serves.
  bool exposed = false;
  // Where the implementation comes from, for the duplicate-name error: "'ns::f' (DISTRPC_EXPOSE
  // at server.cpp:12)", or the function's name and address where no source location exists.
  std::string origin{};
  // Which implementation this is (impl_tag<F>): registering the same one again is fine, another
  // one under the same name is refused. Null: unknown, never the same as another.
  const void* impl = nullptr;
};

// One object per implementation F, so that its address identifies F: a function with internal
// linkage (an anonymous namespace) gets one per translation unit, as the function itself.
template <auto F>
inline constexpr char impl_tag = 0;

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
  // The result is being encoded on this thread (encode()): inside the layers' reply scopes
  // (e.g. distributed autograd records what the reply carries).
  virtual void encode_result(FunctionRef<void()> encode) = 0;

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
  // register it again. Throws std::invalid_argument, naming both origins, if `name` is taken by
  // another implementation (an entry added this way has no identity of its own: adding the name
  // twice is refused).
  void add(std::string name, std::uint64_t signature, std::string signature_text,
           detail::Handler handler, detail::BoxedHandler boxed_handler = {}, bool library = false,
           bool exposed = true) {
    detail::RegistryEntry e;
    e.signature = signature;
    e.signature_text = std::move(signature_text);
    e.handler = std::move(handler);
    e.boxed_handler = std::move(boxed_handler);
    e.library = library;
    e.exposed = exposed;
    e.origin = "Registry::add(\"" + name + "\", ...)";
    add_entry(std::move(name), std::move(e));
  }

  // Adds `e` under `name`; the same implementation again (e.impl) only adds its flags (library,
  // exposed). Throws std::invalid_argument naming both origins if another implementation holds
  // `name`.
  void add_entry(std::string name, detail::RegistryEntry e) {
    std::string conflict = merge(std::move(name), std::move(e));
    if (!conflict.empty()) throw std::invalid_argument(conflict);
  }

  // As add_entry, for registrations made while the program starts (static initializers), where an
  // exception would terminate the program: a conflict is recorded instead, and starting an agent
  // with this registry fails with its text (check_conflicts()).
  void add_at_startup(std::string name, detail::RegistryEntry e) {
    std::string conflict = merge(std::move(name), std::move(e));
    if (conflict.empty()) return;
    std::lock_guard<std::mutex> lk(mu_);
    conflicts_.push_back(std::move(conflict));
  }

  // The conflicts add_at_startup recorded, one text each.
  std::vector<std::string> conflicts() const {
    std::lock_guard<std::mutex> lk(mu_);
    return conflicts_;
  }

  // Throws std::invalid_argument with every recorded conflict (init_rpc and RpcGroup::join call
  // it before they start anything).
  void check_conflicts() const {
    const auto all = conflicts();
    if (all.empty()) return;
    std::string text = all.front();
    for (std::size_t i = 1; i < all.size(); ++i) text += "; " + all[i];
    throw std::invalid_argument(text);
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

  // Exposes `impl` under the name and signature of the DISTRPC_REMOTE declaration `Stub`, as
  // DISTRPC_EXPOSE does for the process's registry (declare.hpp). Throws std::invalid_argument if
  // another implementation holds the name.
  template <auto Stub, auto Impl>
  void expose(std::source_location where = std::source_location::current());

 private:
  // Adds or merges; returns the conflict's text (empty if none).
  std::string merge(std::string name, detail::RegistryEntry e) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = entries_.find(name);
    if (it == entries_.end()) {
      entries_.emplace(std::move(name), std::move(e));
      return {};
    }
    detail::RegistryEntry& old = it->second;
    if (old.impl == nullptr || old.impl != e.impl) {
      return "two implementations are registered under the function name '" + name +
             "': " + old.origin + " and " + e.origin +
             " (a name identifies one function: rename one of them)";
    }
    old.library = old.library || e.library;
    old.exposed = old.exposed || e.exposed;
    return {};
  }

  mutable std::mutex mu_;
  std::map<std::string, detail::RegistryEntry> entries_;
  std::vector<std::string> conflicts_;
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

// The reply of the request running on this thread, encoded inside the layers' reply scopes.
template <class R>
wire::Message request_response_with(R&& value) {
  if (tls_request_hooks == nullptr) return response_with(std::forward<R>(value));
  wire::Message m;
  tls_request_hooks->encode_result([&] { m = response_with(std::forward<R>(value)); });
  return m;
}

template <auto F>
using fn_result_t = typename fn_traits<decltype(F)>::result;

// The signature text of a function F called in the SPMD form: the library's spelling when every
// type has one ("Tensor(Tensor, i64)"), else the compiler's. Both sides are the same binary's
// source there, so either identifies it; the hash is taken from this text.
template <class Sig>
struct spmd_signature;
template <class R, class... A>
struct spmd_signature<R (*)(A...)> {
  static std::string text() {
    if constexpr (spellable<unwrap_future_t<R>>() && (spellable<std::decay_t<A>>() && ...)) {
      return signature_spelling<R, A...>();
    } else {
      return std::string(type_name<R (*)(A...)>());
    }
  }
};
template <class R, class... A>
struct spmd_signature<R (*)(A...) noexcept> : spmd_signature<R (*)(A...)> {};

template <auto F>
const std::string& signature_text() {
  static const std::string text = spmd_signature<decltype(F)>::text();
  return text;
}

template <auto F>
std::uint64_t signature_hash() {
  static const std::uint64_t hash = fnv1a(signature_text<F>());
  return hash;
}

// Where F comes from when nothing but F is known (a call site registers it): its name and address
// (two functions of one name from different translation units differ in address).
template <auto F>
std::string function_origin() {
  char address[32];
  std::snprintf(address, sizeof address, "%p", reinterpret_cast<const void*>(F));
  return "'" + std::string(function_name<F>()) + "' at " + address;
}

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
          return request_response_with(done.value());
        }
      });
    } else if constexpr (std::is_void_v<R>) {
      std::apply(F, std::move(args));
      return make_ready_future(empty_response());
    } else {
      return make_ready_future(request_response_with(std::apply(F, std::move(args))));
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

// The entry of F under its own (compiler-spelled) name.
template <auto F>
RegistryEntry entry_of(bool library, bool exposed, std::string origin) {
  RegistryEntry e;
  e.signature = signature_hash<F>();
  e.signature_text = signature_text<F>();
  e.handler = &invoke<F>;
  e.boxed_handler = &invoke_boxed<F>;
  e.library = library;
  e.exposed = exposed;
  e.origin = std::move(origin);
  e.impl = &impl_tag<F>;
  return e;
}

// `Library`: one of the library's own functions (the group protocol, builtin operators, RRef
// proxies, RemoteModule's owner calls), served by every agent whatever its registry and options.
// The library registers its functions through ensure_library_registered; a user's never are.
template <auto F, bool Library>
struct Registrar {
  static bool add() {
    Registry::instance().add_at_startup(
        std::string(function_name<F>()),
        entry_of<F>(Library, /*exposed=*/false, function_origin<F>()));
    return true;
  }
  // Odr-using this from a call site instantiates it: the binary that calls F also serves F.
  static inline const bool registered = add();
};

template <auto F>
void ensure_registered() {
  (void)Registrar<F, false>::registered;
}

template <auto F>
void ensure_library_registered() {
  (void)Registrar<F, true>::registered;
}

// DISTRPC_REGISTER(F): registered and exposed (at start-up: a conflict is recorded, see
// Registry::add_at_startup).
template <auto F>
bool expose(std::source_location where) {
  ensure_registered<F>();
  Registry::instance().add_at_startup(
      std::string(function_name<F>()),
      entry_of<F>(false, /*exposed=*/true,
                  function_origin<F>() + " (DISTRPC_REGISTER at " + where.file_name() + ":" +
                      std::to_string(where.line()) + ")"));
  return true;
}

}  // namespace detail

template <auto F>
void Registry::add() {
  static_assert(detail::free_function<F>,
                "distrpc::Registry::add<&f>(): f must be a function or static member function");
  add_entry(std::string(detail::function_name<F>()),
            detail::entry_of<F>(false, /*exposed=*/true,
                                detail::function_origin<F>() + " (Registry::add)"));
}
}  // namespace distrpc

#define DISTRPC_REGISTER_CAT2(a, b) a##b
#define DISTRPC_REGISTER_CAT(a, b) DISTRPC_REGISTER_CAT2(a, b)

// Registers `fn` (a function or static member function) so peers may call it on this worker.
#define DISTRPC_REGISTER(fn)                                                        \
  [[maybe_unused]] static const bool DISTRPC_REGISTER_CAT(distrpc_reg_, __LINE__) = \
      ::distrpc::detail::expose<&fn>(std::source_location::current())
