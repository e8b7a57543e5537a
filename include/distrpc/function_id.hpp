// Compile-time identity of a callable called in the SPMD form (rpc_sync<&ns::fn>): its name as the
// compiler spells the template argument (`&ns::fn` → "ns::fn"), so every binary built from the
// same source by the same compiler agrees on it without a code generator. Its signature's text
// and hash live with the registry (registry.hpp: the library's spelling of the types where it has
// one). Programs built from different sources use named declarations instead (declare.hpp). The
// callee rejects a name it does not know or a signature hash that differs from its own, instead of
// misreading the argument bytes.
#pragma once

#include <cstdint>
#include <string_view>
#include <tuple>
#include <type_traits>

namespace distrpc::detail {

template <auto F>
constexpr std::string_view pretty_value() {
  return __PRETTY_FUNCTION__;
}
template <class T>
constexpr std::string_view pretty_type() {
  return __PRETTY_FUNCTION__;
}

// Extracts what follows `marker` up to the first ';' or the closing ']' (GCC and Clang spellings).
constexpr std::string_view extract(std::string_view pretty, std::string_view marker) {
  auto start = pretty.find(marker);
  if (start == std::string_view::npos) return pretty;
  start += marker.size();
  auto end = pretty.find_first_of(";]", start);
  auto out = pretty.substr(start, end - start);
  while (!out.empty() && (out.front() == '&' || out.front() == ' ')) out.remove_prefix(1);
  return out;
}

template <auto F>
constexpr std::string_view function_name() {
  return extract(pretty_value<F>(), "F = ");
}

template <class T>
constexpr std::string_view type_name() {
  return extract(pretty_type<T>(), "T = ");
}

constexpr std::uint64_t fnv1a(std::string_view s) {
  std::uint64_t h = 14695981039346656037ull;
  for (char c : s) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h;
}

// Function traits for plain functions and static member functions (both are function pointers).
template <class Sig>
struct fn_traits;
template <class R, class... A>
struct fn_traits<R (*)(A...)> {
  using result = R;
  using args = std::tuple<std::decay_t<A>...>;
  static constexpr std::size_t arity = sizeof...(A);
};
template <class R, class... A>
struct fn_traits<R (*)(A...) noexcept> : fn_traits<R (*)(A...)> {};

template <auto F>
concept free_function = requires {
  typename fn_traits<decltype(F)>::result;
};

}  // namespace distrpc::detail
