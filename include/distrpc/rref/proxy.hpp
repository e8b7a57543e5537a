// Method proxies: how rref.rpc_sync<&T::method>(args...) runs a member function on the owner.
//
// MethodProxy<&T::m>::call(RRef<T> self, args...) is an ordinary free function (a static member),
// so it travels through the same registry, type checks and call modes as any other: the RRef
// argument arrives on the owner as its owner RRef, and call() runs the method on the owned object.
// A method returning Future<U> is asynchronous like any function returning a Future.
//
// The by-name path (DISTRPC_REGISTER_METHOD(T, m), rref.rpc_sync_by_name<R>("m", args...)) looks
// the name up in a per-class table; a name not there is an AttributeError "has no attribute".
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeindex>
#include <utility>

#include "distrpc/function_id.hpp"
#include "distrpc/registry.hpp"
#include "distrpc/rpc_error.hpp"

namespace distrpc {

template <class T>
class RRef;

// A proxy named a method the object's class does not have (PyTorch raises AttributeError).
class AttributeError : public RpcError {
 public:
  using RpcError::RpcError;
};

namespace detail {

inline const bool attribute_error_registered =
    (ExceptionRegistry::instance().add<AttributeError>("distrpc::AttributeError"), true);

template <class R>
using proxy_result_t = std::conditional_t<std::is_reference_v<R>, std::decay_t<R>, R>;

template <auto M, class Sig = decltype(M)>
struct MethodProxy {
  static constexpr bool valid = false;
  using Class = void;
};

#define DISTRPC_METHOD_PROXY(QUALS)                                                \
  template <auto M, class C, class R, class... A>                                  \
  struct MethodProxy<M, R (C::*)(A...) QUALS> {                                    \
    static constexpr bool valid = true;                                            \
    using Class = C;                                                               \
    using Result = proxy_result_t<R>;                                              \
    static Result call(RRef<C> self, std::decay_t<A>... args) {                    \
      if constexpr (std::is_void_v<Result>) {                                      \
        (self.local_value().*M)(std::move(args)...);                               \
      } else {                                                                     \
        return (self.local_value().*M)(std::move(args)...);                        \
      }                                                                            \
    }                                                                              \
    static constexpr std::string_view signature() { return type_name<R(A...)>(); } \
  };
DISTRPC_METHOD_PROXY()
DISTRPC_METHOD_PROXY(const)
DISTRPC_METHOD_PROXY(noexcept)
DISTRPC_METHOD_PROXY(const noexcept)
#undef DISTRPC_METHOD_PROXY

template <auto M, class T>
constexpr bool check_method() {
  static_assert(MethodProxy<M>::valid,
                "distrpc::RRef<T> proxies take a pointer to a non-static member function of T, "
                "e.g. rref.rpc_sync<&Counter::increment>(1)");
  if constexpr (MethodProxy<M>::valid) {
    static_assert(std::is_same_v<typename MethodProxy<M>::Class, T>,
                  "distrpc::RRef<T> proxy: the method belongs to another class than T (for a "
                  "method inherited from a base class B, use an RRef<B> or a wrapper in T)");
    return std::is_same_v<typename MethodProxy<M>::Class, T>;
  }
  return false;
}

// The per-class table of methods callable by name.
struct MethodEntry {
  std::string proxy_name;             // the registry name of MethodProxy<M>::call
  std::uint64_t proxy_signature = 0;  // its signature hash
  std::string signature;              // "R (A...)" of the method, as the compiler spells it
};

class MethodRegistry {
 public:
  static MethodRegistry& instance() {
    static MethodRegistry r;
    return r;
  }
  void add(std::type_index cls, const std::string& method, MethodEntry e) {
    std::lock_guard<std::mutex> lk(mu_);
    table_[cls][method] = std::move(e);
  }
  std::optional<MethodEntry> find(std::type_index cls, const std::string& method) const {
    std::lock_guard<std::mutex> lk(mu_);
    auto c = table_.find(cls);
    if (c == table_.end()) return std::nullopt;
    auto m = c->second.find(method);
    if (m == c->second.end()) return std::nullopt;
    return m->second;
  }

 private:
  mutable std::mutex mu_;
  std::map<std::type_index, std::map<std::string, MethodEntry>> table_;
};

template <auto M>
bool register_method(const char* name) {
  using P = MethodProxy<M>;
  static_assert(P::valid, "DISTRPC_REGISTER_METHOD(T, m): m must be a non-static member function");
  ensure_library_registered<&P::call>();
  MethodRegistry::instance().add(
      typeid(typename P::Class), name,
      MethodEntry{std::string(function_name<&P::call>()), signature_hash<&P::call>(),
                  std::string(P::signature())});
  return true;
}

}  // namespace detail
}  // namespace distrpc

// Makes T::method callable by name through RRef<T>'s *_by_name proxies (and registers its proxy
// for typed calls from callee-only binaries).
#define DISTRPC_REGISTER_METHOD(T, method)                                                 \
  [[maybe_unused]] static const bool DISTRPC_REGISTER_CAT(distrpc_method_reg_, __LINE__) = \
      ::distrpc::detail::register_method<&T::method>(#method)
