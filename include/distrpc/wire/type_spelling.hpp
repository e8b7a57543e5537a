// The library's own spelling of the types a remote function takes and returns, for the identity
// of DISTRPC_REMOTE declarations: two binaries agree on "Tensor(Tensor, i64)" whatever compiler,
// standard library or namespace layout built them, and an error can show it to a person.
//
//   at::Tensor -> "Tensor"        bool -> "bool"          std::int64_t -> "i64" (i8 .. i64, u8 .. u64)
//   double -> "f64", float -> "f32"                        std::string -> "str"
//   std::vector<T> -> "list<T>"   std::optional<T> -> "optional<T>"
//   std::tuple<A, B> -> "tuple<A, B>"   std::pair<A, B> -> "pair<A, B>"
//   std::map<K, V> -> "map<K, V>" std::unordered_map<K, V> -> "unordered_map<K, V>"
//   c10::IValue -> "IValue"       Future<T> -> "Future<T>"   void -> "void"
//
// The layers above add their own types (RRef<T> -> "RRef<T>"). A user type names itself, either
// at global scope with DISTRPC_TYPE_NAME(geo::Point, "geo.Point") or with a member
// `static constexpr std::string_view distrpc_type_name = "geo.Point";`. A type with no spelling
// is refused at compile time where a declaration uses it.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "distrpc/function_id.hpp"
#include "distrpc/future.hpp"

namespace distrpc {

// The spelling of T: specialize it (DISTRPC_TYPE_NAME does) with `known = true` and a static
// name(). Unspecialized, it takes T's own `distrpc_type_name` member when T has one.
template <class T>
struct TypeName {
  static constexpr bool known = requires { std::string_view(T::distrpc_type_name); };
  static std::string name() {
    if constexpr (known) {
      return std::string(std::string_view(T::distrpc_type_name));
    } else {
      return {};
    }
  }
};

namespace detail {

// Whether T (without cv-qualifiers or reference) has a spelling, its parts included.
template <class T>
constexpr bool spellable();

// T's spelling. Call only where spellable<T>() holds (check_spellable<T>() says why not).
template <class T>
std::string spelling();

template <class... T>
std::string spelling_list() {
  std::string out;
  ((out += (out.empty() ? "" : ", ") + spelling<T>()), ...);
  return out;
}

}  // namespace detail

template <>
struct TypeName<void> {
  static constexpr bool known = true;
  static std::string name() { return "void"; }
};
template <>
struct TypeName<std::string> {
  static constexpr bool known = true;
  static std::string name() { return "str"; }
};
template <>
struct TypeName<at::Tensor> {
  static constexpr bool known = true;
  static std::string name() { return "Tensor"; }
};
template <>
struct TypeName<c10::IValue> {
  static constexpr bool known = true;
  static std::string name() { return "IValue"; }
};
template <class T, class A>
struct TypeName<std::vector<T, A>> {
  static constexpr bool known = detail::spellable<T>();
  static std::string name() { return "list<" + detail::spelling<T>() + ">"; }
};
template <class T>
struct TypeName<std::optional<T>> {
  static constexpr bool known = detail::spellable<T>();
  static std::string name() { return "optional<" + detail::spelling<T>() + ">"; }
};
template <class... T>
struct TypeName<std::tuple<T...>> {
  static constexpr bool known = (detail::spellable<T>() && ...);
  static std::string name() { return "tuple<" + detail::spelling_list<T...>() + ">"; }
};
template <class A, class B>
struct TypeName<std::pair<A, B>> {
  static constexpr bool known = detail::spellable<A>() && detail::spellable<B>();
  static std::string name() { return "pair<" + detail::spelling_list<A, B>() + ">"; }
};
template <class K, class V, class C, class A>
struct TypeName<std::map<K, V, C, A>> {
  static constexpr bool known = detail::spellable<K>() && detail::spellable<V>();
  static std::string name() { return "map<" + detail::spelling_list<K, V>() + ">"; }
};
template <class K, class V, class H, class E, class A>
struct TypeName<std::unordered_map<K, V, H, E, A>> {
  static constexpr bool known = detail::spellable<K>() && detail::spellable<V>();
  static std::string name() { return "unordered_map<" + detail::spelling_list<K, V>() + ">"; }
};
template <class T>
struct TypeName<Future<T>> {
  static constexpr bool known = detail::spellable<T>();
  static std::string name() { return "Future<" + detail::spelling<T>() + ">"; }
};

namespace detail {

// Numbers by kind and width, so that `long` and `long long` (both 64-bit) read the same.
template <class T>
constexpr bool is_number_v = std::is_arithmetic_v<T> && !std::is_same_v<T, bool>;

template <class T>
std::string number_spelling() {
  const std::string bits = std::to_string(sizeof(T) * 8);
  if constexpr (std::is_floating_point_v<T>) return "f" + bits;
  if constexpr (std::is_signed_v<T>) return "i" + bits;
  return "u" + bits;
}

template <class T>
constexpr bool spellable() {
  using U = std::remove_cvref_t<T>;
  if constexpr (std::is_same_v<U, bool> || is_number_v<U>) {
    return true;
  } else {
    return TypeName<U>::known;
  }
}

template <class T>
std::string spelling() {
  using U = std::remove_cvref_t<T>;
  if constexpr (std::is_same_v<U, bool>) {
    return "bool";
  } else if constexpr (is_number_v<U>) {
    return number_spelling<U>();
  } else {
    return TypeName<U>::name();
  }
}

// Fails to compile, naming T in the 'required from' lines, when T has no spelling.
template <class T>
constexpr bool check_spellable() {
  static_assert(spellable<T>(),
                "distrpc: a type in a DISTRPC_REMOTE declaration has no library name (the type is "
                "named in the 'required from' lines below): name it at global scope with "
                "DISTRPC_TYPE_NAME(T, \"pkg.T\"), or give it a member "
                "`static constexpr std::string_view distrpc_type_name = \"pkg.T\";`");
  return spellable<T>();
}

// The signature R(A...) as the library spells it: parameters decayed (how they travel), and a
// Future<T> result as T (whether the callee runs asynchronously is its own business).
template <class R, class... A>
std::string signature_spelling() {
  return spelling<unwrap_future_t<R>>() + "(" + spelling_list<std::decay_t<A>...>() + ")";
}

}  // namespace detail
}  // namespace distrpc

// Names a user type for DISTRPC_REMOTE declarations, at global scope:
//   DISTRPC_TYPE_NAME(geo::Point, "geo.Point");
// Every binary that sends or receives the type must name it the same.
#define DISTRPC_TYPE_NAME(T, text)                             \
  template <>                                                  \
  struct distrpc::TypeName<T> {                                \
    static constexpr bool known = true;                        \
    static std::string name() { return std::string(text); }    \
  }
