// Pieces every store shares: the timeout error type, size checks, error texts that name the key,
// decimal counters and deadlines. Kept in one place so the stores word their errors alike.
#pragma once

#include <chrono>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "distrpc/error.hpp"
#include "distrpc/store/store.hpp"

namespace distrpc::store {

// A store operation ran past its timeout. Still a DistStoreError (the family c10d code catches);
// its own type so a caller (the store-based barrier) can tell "not yet" from "broken".
class StoreTimeoutError : public DistStoreError {
 public:
  using DistStoreError::DistStoreError;
};

namespace detail {

using Clock = std::chrono::steady_clock;

// A key as it appears in an error text: quoted, non-printable bytes escaped, long keys cut so a
// 64 KiB key does not flood a log.
inline std::string quote_key(std::string_view key, bool with_size = true) {
  constexpr std::size_t kShown = 120;
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "'";
  for (std::size_t i = 0; i < key.size() && i < kShown; ++i) {
    const auto c = static_cast<unsigned char>(key[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '\'') {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  if (key.size() > kShown) out += "...";
  out += "'";
  if (with_size && key.size() > kShown) out += " (" + std::to_string(key.size()) + " bytes)";
  return out;
}

inline std::string quote_keys(const std::vector<std::string>& keys) {
  constexpr std::size_t kShown = 16;
  std::string out = "[";
  for (std::size_t i = 0; i < keys.size() && i < kShown; ++i) {
    if (i) out += ", ";
    out += quote_key(keys[i]);
  }
  if (keys.size() > kShown) out += ", ... (" + std::to_string(keys.size()) + " keys)";
  return out + "]";
}

// Both the client side and the server side of every store check these, so an oversized request
// fails with a text naming the size and the limit instead of an allocation failure somewhere.
inline void check_key(std::string_view store, std::string_view op, std::string_view key) {
  if (key.size() > Store::kMaxKeyBytes) {
    throw DistStoreError(std::string(store) + ": " + std::string(op) + ": key " +
                         quote_key(key, false) + " is " + std::to_string(key.size()) +
                         " bytes, over the limit of " + std::to_string(Store::kMaxKeyBytes) +
                         " bytes (Store::kMaxKeyBytes)");
  }
}

inline void check_value(std::string_view store, std::string_view op, std::string_view key,
                        std::size_t size) {
  if (size > Store::kMaxValueBytes) {
    throw DistStoreError(std::string(store) + ": " + std::string(op) + ": value for key " +
                         quote_key(key) + " is " + std::to_string(size) +
                         " bytes, over the limit of " + std::to_string(Store::kMaxValueBytes) +
                         " bytes (Store::kMaxValueBytes)");
  }
}

// The text of every store timeout: "Timeout", the operation, the duration in ms, the keys.
inline std::string timeout_text(std::string_view store, std::string_view op,
                                const std::vector<std::string>& keys,
                                const std::vector<std::string>& missing,
                                std::chrono::milliseconds timeout) {
  std::string text = std::string(store) + ": Timeout after " + std::to_string(timeout.count()) +
                     " ms in " + std::string(op) + " waiting for key" +
                     (keys.size() == 1 ? " " : "s ") +
                     (keys.size() == 1 ? quote_key(keys[0]) : quote_keys(keys));
  if (keys.size() > 1) text += " (missing " + quote_keys(missing) + ")";
  return text;
}

// Counters are stored as decimal text, as c10d does, so get() on a counter reads "42".
inline std::int64_t parse_counter(std::string_view store, std::string_view key, const Bytes& v) {
  const std::string_view s(reinterpret_cast<const char*>(v.data()), v.size());
  bool ok = !s.empty() && s.size() <= 20;
  std::size_t i = 0;
  bool negative = false;
  if (ok && (s[0] == '-' || s[0] == '+')) {
    negative = s[0] == '-';
    i = 1;
    ok = s.size() > 1;
  }
  // Accumulate negatively so INT64_MIN parses too.
  std::int64_t acc = 0;
  for (; ok && i < s.size(); ++i) {
    if (s[i] < '0' || s[i] > '9') {
      ok = false;
      break;
    }
    const int digit = s[i] - '0';
    if (acc < (std::numeric_limits<std::int64_t>::min() + digit) / 10) {
      ok = false;
      break;
    }
    acc = acc * 10 - digit;
  }
  if (ok && !negative && acc == std::numeric_limits<std::int64_t>::min()) ok = false;
  if (!ok) {
    std::string shown(s.substr(0, 40));
    throw DistStoreError(std::string(store) + ": add: the value of key " + quote_key(key) +
                         " is not a 64-bit decimal integer (" + quote_key(shown) +
                         (s.size() > 40 ? "..." : "") + ")");
  }
  return negative ? acc : -acc;
}

inline std::int64_t checked_add(std::string_view store, std::string_view key, std::int64_t a,
                                std::int64_t b) {
  std::int64_t out = 0;
  if (__builtin_add_overflow(a, b, &out)) {
    throw DistStoreError(std::string(store) + ": add: " + std::to_string(a) + " + " +
                         std::to_string(b) + " overflows the 64-bit counter at key " +
                         quote_key(key));
  }
  return out;
}

inline Bytes format_counter(std::int64_t v) {
  return to_bytes(std::to_string(v));
}

// A point in time to give up at; kNoTimeout (0 ms) means never.
class Deadline {
 public:
  explicit Deadline(std::chrono::milliseconds timeout)
      : infinite_(timeout <= Store::kNoTimeout), at_(Clock::now() + timeout) {}
  bool infinite() const { return infinite_; }
  bool expired() const { return !infinite_ && Clock::now() >= at_; }
  Clock::time_point at() const { return at_; }
  // Time left, at least 0; meaningless when infinite().
  std::chrono::milliseconds remaining() const {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(at_ - Clock::now());
    return left.count() > 0 ? left : std::chrono::milliseconds(0);
  }

 private:
  bool infinite_;
  Clock::time_point at_;
};

}  // namespace detail
}  // namespace distrpc::store
