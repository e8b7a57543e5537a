// Compile-time identity of a callable: a stable name plus a hash of its signature.
//
// Both come from the compiler's spelling of the template argument (`&ns::fn` → "ns::fn") and of
// the function type, so every binary built from the same source by the same compiler agrees on
// them without a code generator. The callee rejects a name it does not know or a signature hash
// that differs from its own, instead of misreading the argument bytes.
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

template <auto F>
constexpr std::uint64_t signature_hash() {
  return fnv1a(type_name<decltype(F)>());
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
