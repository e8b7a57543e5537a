// Remote functions declared by name, for a client and a server built from different sources:
//
//   // math_api.hpp, shared by both sides: a declaration, no implementation
//   DISTRPC_REMOTE(add, "math.add", at::Tensor(at::Tensor, at::Tensor));
//
//   // the server: its implementation, exposed under that name
//   DISTRPC_EXPOSE(add, &math::add_impl);
//
//   // the client: calls it through the declaration
//   at::Tensor y = distrpc::rpc_sync<add>("server", a, b);
//
// A declaration's identity is its name plus a fingerprint of its signature in the library's own
// spelling of types (wire/type_spelling.hpp), so the two binaries agree whatever compiler built
// them; the callee refuses a call whose signature differs, naming both.
#pragma once

#include <cstddef>
#include <cstdint>
#include <source_location>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>

#include "distrpc/function_id.hpp"
#include "distrpc/future.hpp"
#include "distrpc/registry.hpp"
#include "distrpc/wire/type_spelling.hpp"

namespace distrpc {

// A remote function's name as a template argument ("math.add").
template <std::size_t N>
struct FunctionName {
  char text[N]{};
  constexpr FunctionName(const char (&s)[N]) {  // NOLINT: implicit, from the literal
    for (std::size_t i = 0; i < N; ++i) text[i] = s[i];
  }
  constexpr std::string_view view() const { return {text, N - 1}; }
};

// The type of a DISTRPC_REMOTE stub: the name and signature R(A...) of a function that runs on
// another worker. An empty value, usable as a template argument: rpc_sync<stub>(to, args...).
template <FunctionName Name, class Sig>
struct Remote;

template <FunctionName Name, class R, class... A>
struct Remote<Name, R(A...)> {
  using result = R;
  using args = std::tuple<std::decay_t<A>...>;
  // The function type arguments are checked against, as for a call of R(*)(A...).
  using pointer = R (*)(A...);
  static constexpr std::size_t arity = sizeof...(A);

  static constexpr std::string_view name() { return Name.view(); }
  // "Tensor(Tensor, i64)": what travels with every call and what errors show.
  static const std::string& signature_text() {
    static const std::string text = detail::signature_spelling<R, A...>();
    return text;
  }
  static std::uint64_t signature() {
    static const std::uint64_t hash = detail::fnv1a(signature_text());
    return hash;
  }
};

namespace detail {

template <class T>
struct is_remote : std::false_type {};
template <FunctionName Name, class Sig>
struct is_remote<Remote<Name, Sig>> : std::true_type {};

// F is a DISTRPC_REMOTE stub (as a template argument: rpc_sync<add>).
template <auto F>
inline constexpr bool remote_stub = is_remote<std::remove_cvref_t<decltype(F)>>::value;

template <class Sig>
struct declaration_traits {
  static constexpr bool valid = false;
};
template <class R, class... A>
struct declaration_traits<R(A...)> {
  static constexpr bool valid = true;
  static constexpr bool spelled =
      (check_spellable<unwrap_future_t<R>>() && ... && check_spellable<std::decay_t<A>>());
};

// DISTRPC_REMOTE's compile-time checks: a function type whose every type has a spelling.
template <class Sig>
constexpr bool check_declaration() {
  static_assert(declaration_traits<Sig>::valid,
                "DISTRPC_REMOTE(stub, \"name\", signature): the signature must be a function "
                "type, e.g. at::Tensor(at::Tensor, std::int64_t)");
  if constexpr (declaration_traits<Sig>::valid) {
    return declaration_traits<Sig>::spelled;
  } else {
    return false;
  }
}

// DISTRPC_EXPOSE's compile-time checks: Impl is a function whose parameters (as they travel,
// decayed) and result (a Future<T> counts as T) are the declaration's.
template <class Stub, auto Impl>
constexpr bool check_expose() {
  static_assert(is_remote<Stub>::value,
                "DISTRPC_EXPOSE(stub, &impl): stub must be declared with DISTRPC_REMOTE");
  static_assert(free_function<Impl>,
                "DISTRPC_EXPOSE(stub, &impl): impl must be a pointer to a function or static "
                "member function");
  if constexpr (is_remote<Stub>::value && free_function<Impl>) {
    using Declared = fn_traits<typename Stub::pointer>;
    using Given = fn_traits<decltype(Impl)>;
    constexpr bool same_args = std::is_same_v<typename Declared::args, typename Given::args>;
    static_assert(same_args,
                  "DISTRPC_EXPOSE(stub, &impl): impl's parameter types differ from the "
                  "declaration's (compare them in the 'required from' lines)");
    constexpr bool same_result = std::is_same_v<unwrap_future_t<typename Declared::result>,
                                                unwrap_future_t<typename Given::result>>;
    static_assert(same_result,
                  "DISTRPC_EXPOSE(stub, &impl): impl's result type differs from the "
                  "declaration's (a Future<T> result counts as T)");
    return same_args && same_result;
  } else {
    return false;
  }
}

template <class Stub, auto Impl>
RegistryEntry exposed_entry(std::string_view how, std::source_location where) {
  RegistryEntry e;
  e.signature = Stub::signature();
  e.signature_text = Stub::signature_text();
  e.handler = &invoke<Impl>;
  e.boxed_handler = &invoke_boxed<Impl>;
  e.exposed = true;
  e.origin = "'" + std::string(function_name<Impl>()) + "' (" + std::string(how) + " at " +
             where.file_name() + ":" + std::to_string(where.line()) + ")";
  e.impl = &impl_tag<Impl>;
  return e;
}

// DISTRPC_EXPOSE: at start-up, so a conflict is recorded (Registry::add_at_startup).
template <class Stub, auto Impl>
bool expose_at_startup(std::source_location where) {
  if constexpr (check_expose<Stub, Impl>()) {
    Registry::instance().add_at_startup(std::string(Stub::name()),
                                        exposed_entry<Stub, Impl>("DISTRPC_EXPOSE", where));
  }
  return true;
}

}  // namespace detail

template <auto Stub, auto Impl>
void Registry::expose(std::source_location where) {
  using S = std::remove_cvref_t<decltype(Stub)>;
  if constexpr (detail::check_expose<S, Impl>()) {
    add_entry(std::string(S::name()), detail::exposed_entry<S, Impl>("Registry::expose", where));
  }
}

// Exposes `Impl` in the process's registry under the declaration `Stub`'s name, at run time (for
// example before init_rpc, with a choice made by the program): as DISTRPC_EXPOSE, but a name
// already held by another implementation throws std::invalid_argument here.
template <auto Stub, auto Impl>
void expose(std::source_location where = std::source_location::current()) {
  Registry::instance().expose<Stub, Impl>(where);
}

}  // namespace distrpc

// Declares `stub`, a function named `name` ("math.add") that runs on another worker, with the
// given signature (a function type). At namespace scope, in a header shared by the client and the
// server; there is no definition. Every type in the signature needs a library name
// (DISTRPC_TYPE_NAME for the program's own).
#define DISTRPC_REMOTE(stub, name, ...)                                                      \
  static_assert(::distrpc::detail::check_declaration<__VA_ARGS__>(), "see the error above"); \
  inline constexpr ::distrpc::Remote<name, __VA_ARGS__> stub {}

// Exposes function `impl` (e.g. &math::add_impl) under the name of the declaration `stub`: peers'
// calls of the declaration run it, also on a worker with RpcBackendOptions::serve_exposed_only.
// Checks at compile time that impl's signature is the declaration's. At namespace scope; another
// implementation already exposed under the same name makes init_rpc fail, naming both.
#define DISTRPC_EXPOSE(stub, impl)                                                     \
  [[maybe_unused]] static const bool DISTRPC_REGISTER_CAT(distrpc_expose_, __LINE__) = \
      ::distrpc::detail::expose_at_startup<std::remove_cvref_t<decltype(stub)>, impl>( \
          std::source_location::current())
