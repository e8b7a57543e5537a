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
#include "distrpc/wire.hpp"

namespace distrpc {

// The first value of every request payload: which function, and how it is typed.
struct RequestHeader {
  std::string name;
  std::uint64_t signature = 0;
  // Calls the agent makes for itself (all-gather, join) are not counted as user work.
  bool internal = false;

  template <class Archive>
  void serialize(Archive& ar) {
    ar(name, signature, internal);
  }
};

namespace detail {

// Runs a decoded request; returns the response message (ready, or later for async functions).
using Handler = std::function<Future<wire::Message>(const wire::Message& request)>;

struct RegistryEntry {
  std::uint64_t signature = 0;
  std::string signature_text;
  Handler handler;
};

}  // namespace detail

class Registry {
 public:
  static Registry& instance() {
    static Registry r;
    return r;
  }

  void add(std::string name, std::uint64_t signature, std::string signature_text,
           detail::Handler handler) {
    std::lock_guard<std::mutex> lk(mu_);
    entries_[std::move(name)] =
        detail::RegistryEntry{signature, std::move(signature_text), std::move(handler)};
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

// The handler of F: decode (header, args...), call, encode the result.
template <auto F>
Future<wire::Message> invoke(const wire::Message& request) {
  using Traits = fn_traits<decltype(F)>;
  using R = typename Traits::result;
  RequestHeader header;
  typename Traits::args args;
  wire::decode(request, header, args);
  if constexpr (is_future_v<R>) {
    using U = future_value_t<R>;
    R fut = std::apply(F, std::move(args));
    return fut.then([](const R& done) {
      if constexpr (std::is_void_v<U>) {
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

template <auto F>
struct Registrar {
  static bool add() {
    Registry::instance().add(std::string(function_name<F>()), signature_hash<F>(),
                             std::string(type_name<decltype(F)>()), &invoke<F>);
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
