// TCPStore's wire protocol (described in store/tcp_store.hpp): opcodes, statuses, limits, and the
// frame writer and reader both ends use.
#pragma once

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <fcntl.h>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "distrpc/log.hpp"
#include "distrpc/net/dial.hpp"
#include "distrpc/net/errno_text.hpp"
#include "distrpc/net/fd.hpp"
#include "distrpc/store/detail/common.hpp"
#include "distrpc/store/store.hpp"


namespace distrpc::store::detail {

inline constexpr std::uint32_t kMagic = 0x53545244;  // "DRTS"
inline constexpr std::uint16_t kVersion = 1;
inline constexpr std::uint8_t kPrimaryFlag = 1;
// The largest legal request: COMPARE_SET with a maximal key and two maximal values.
inline constexpr std::size_t kMaxFrameBytes = 2 * Store::kMaxValueBytes + Store::kMaxKeyBytes + 64;
// A client waits this much longer than the timeout it gave the server before it calls the server
// unresponsive: the server's own timeout reply should always arrive first.
inline constexpr std::chrono::milliseconds kClientGrace{2000};

enum Op : std::uint8_t {
  kHello = 1,
  kSet = 2,
  kGet = 3,
  kAdd = 4,
  kCompareSet = 5,
  kCheck = 6,
  kWait = 7,
  kDelete = 8,
  kNumKeys = 9,
};
enum Status : std::uint8_t { kOk = 0, kTimeout = 1, kError = 2 };

// A frame that does not follow the protocol; the text says how.
class WireError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

using Buffer = std::vector<std::uint8_t>;

inline void put_u8(Buffer& b, std::uint8_t v) {
  b.push_back(v);
}
template <class T>
inline void put_le(Buffer& b, T v) {
  using U = std::make_unsigned_t<T>;
  const auto u = static_cast<U>(v);
  for (std::size_t i = 0; i < sizeof(T); ++i) b.push_back(static_cast<std::uint8_t>(u >> (8 * i)));
}
inline void put_str(Buffer& b, const void* p, std::size_t n) {
  put_le<std::uint32_t>(b, static_cast<std::uint32_t>(n));
  const auto* c = static_cast<const std::uint8_t*>(p);
  b.insert(b.end(), c, c + n);
}
inline void put_str(Buffer& b, std::string_view s) {
  put_str(b, s.data(), s.size());
}
inline void put_str(Buffer& b, const Bytes& s) {
  put_str(b, s.data(), s.size());
}

// Starts a frame: room for the length, then the first byte. end_frame() fills the length in.
inline void begin_frame(Buffer& b, std::uint8_t first) {
  b.clear();
  b.resize(4);
  b.push_back(first);
}
inline void end_frame(Buffer& b) {
  const auto n = static_cast<std::uint32_t>(b.size() - 4);
  for (int i = 0; i < 4; ++i) b[i] = static_cast<std::uint8_t>(n >> (8 * i));
}
inline std::uint32_t read_le32(const std::uint8_t* p) {
  return std::uint32_t(p[0]) | std::uint32_t(p[1]) << 8 | std::uint32_t(p[2]) << 16 |
         std::uint32_t(p[3]) << 24;
}

// Bounds-checked reading of one frame body; every overrun is a WireError naming the field.
class Reader {
 public:
  Reader(const std::uint8_t* p, std::size_t n) : p_(p), n_(n) {}
  std::uint8_t u8(const char* what) {
    need(1, what);
    return p_[at_++];
  }
  template <class T>
  T le(const char* what) {
    need(sizeof(T), what);
    std::make_unsigned_t<T> v = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i) {
      v |= static_cast<std::make_unsigned_t<T>>(p_[at_ + i]) << (8 * i);
    }
    at_ += sizeof(T);
    return static_cast<T>(v);
  }
  std::string str(const char* what) {
    const auto n = le<std::uint32_t>(what);
    need(n, what);
    std::string s(reinterpret_cast<const char*>(p_ + at_), n);
    at_ += n;
    return s;
  }
  Bytes bytes(const char* what) {
    const auto n = le<std::uint32_t>(what);
    need(n, what);
    Bytes b(p_ + at_, p_ + at_ + n);
    at_ += n;
    return b;
  }
  std::vector<std::string> strs(const char* what) {
    const auto n = le<std::uint32_t>(what);
    // Each string takes at least 4 bytes: refuse a count the frame cannot hold before reserving.
    if (n > (n_ - at_) / 4) {
      throw WireError(std::string("the ") + what + " count " + std::to_string(n) +
                      " exceeds what the frame can hold");
    }
    std::vector<std::string> out;
    out.reserve(n);
    for (std::uint32_t i = 0; i < n; ++i) out.push_back(str(what));
    return out;
  }
  void finish() const {
    if (at_ != n_) {
      throw WireError(std::to_string(n_ - at_) + " unexpected bytes after the last field");
    }
  }

 private:
  void need(std::size_t k, const char* what) const {
    if (n_ - at_ < k) throw WireError(std::string("the frame ends inside the ") + what);
  }
  const std::uint8_t* p_;
  std::size_t n_;
  std::size_t at_ = 0;
};

inline std::string host_port(const std::string& host, int port) {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

}  // namespace distrpc::store::detail
