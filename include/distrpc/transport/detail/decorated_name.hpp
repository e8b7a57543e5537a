// "outer(inner)" as a compile-time constant: the name of a decorator policy wrapping another, so
// that e.g. Auto<Faulty<Shm>, Faulty<Tcp>> keeps distinct names.
#pragma once

#include <array>
#include <cstddef>
#include <string_view>

namespace distrpc::transport::detail {

template <const std::string_view& Outer, const std::string_view& Inner>
struct DecoratedName {
  static constexpr std::size_t kSize = Outer.size() + 1 + Inner.size() + 1;
  static constexpr std::array<char, kSize> kChars = [] {
    std::array<char, kSize> a{};
    std::size_t i = 0;
    for (char c : Outer) a[i++] = c;
    a[i++] = '(';
    for (char c : Inner) a[i++] = c;
    a[i] = ')';
    return a;
  }();
  static constexpr std::string_view value{kChars.data(), kSize};
};

}  // namespace distrpc::transport::detail
