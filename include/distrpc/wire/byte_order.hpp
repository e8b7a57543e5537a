// Explicit little-endian integer encoding for the fixed-layout parts of the protocol (frame
// headers, the handshake). They are written byte by byte so their layout does not depend on the
// host.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace distrpc::wire::detail {

template <class T>
inline void put_le(char* out, T value) noexcept {
  static_assert(std::is_integral_v<T>, "put_le writes integers");
  using U = std::make_unsigned_t<T>;
  auto bits = static_cast<U>(value);
  for (std::size_t i = 0; i < sizeof(T); ++i) {
    out[i] = static_cast<char>(static_cast<unsigned char>(bits >> (8 * i)));
  }
}

template <class T>
inline T get_le(const char* in) noexcept {
  static_assert(std::is_integral_v<T>, "get_le reads integers");
  using U = std::make_unsigned_t<T>;
  U bits = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) {
    bits |= static_cast<U>(static_cast<U>(static_cast<unsigned char>(in[i])) << (8 * i));
  }
  return static_cast<T>(bits);
}

}  // namespace distrpc::wire::detail
