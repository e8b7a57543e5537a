// TCPStore's wire protocol, PyTorch c10d's (described in store/tcp_store.hpp): query types of both
// numberings, reply codes, limits, the request writer and the incremental request reader.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "distrpc/store/detail/common.hpp"
#include "distrpc/store/store.hpp"
#include "distrpc/wire/auth.hpp"

namespace distrpc::store::detail {

// What a PyTorch >= 2.2 client sends first (after the VALIDATE query type); it switches the
// connection to the current numbering of query types.
inline constexpr std::uint32_t kValidateMagic = 0x3C85F7CE;
// c10d's TCPStore puts this before every user key; its constructor registers itself with an add on
// kInitKey (unprefixed), which a master with wait_for_workers counts.
inline constexpr std::string_view kKeyPrefix = "/";
inline constexpr std::string_view kInitKey = "init/";
// Keys in one CHECK / WAIT / MULTI_GET / MULTI_SET. c10d's own server allows 128 Ki; every key
// costs at least its 8-byte length on the wire, so this bounds only the bookkeeping of one request.
inline constexpr std::uint64_t kMaxKeysPerRequest = 128 * 1024;
// The largest request the server buffers: a COMPARE_SET with a maximal key and two maximal values
// (MULTI_SET requests are held to the same total).
inline constexpr std::size_t kMaxRequestBytes =
    2 * Store::kMaxValueBytes + Store::kMaxKeyBytes + 64;
// A client waits this much longer than its own timeout for a reply that a server must send at
// once (the answer to a cancelled wait, say) before it calls the server unresponsive.
inline constexpr std::chrono::milliseconds kClientGrace{2000};

// The operations, independent of how a connection numbers them.
enum class Query : std::uint8_t {
  kSet,
  kCompareSet,
  kGet,
  kAdd,
  kCheck,
  kWait,
  kNumKeys,
  kWatchKey,
  kDelete,
  kAppend,
  kMultiGet,
  kMultiSet,
  kCancelWait,
  kPing,
  kUnknown,
};

// PyTorch 1.13 to 2.1 number the query types from SET = 0 (WATCH_KEY at 7); this is what a
// connection that did not start with VALIDATE speaks, and what distrpc's client sends.
inline Query legacy_query(std::uint8_t b) {
  static constexpr Query kTable[] = {
      Query::kSet,      Query::kCompareSet, Query::kGet,       Query::kAdd,    Query::kCheck,
      Query::kWait,     Query::kNumKeys,    Query::kWatchKey,  Query::kDelete, Query::kAppend,
      Query::kMultiGet, Query::kMultiSet,   Query::kCancelWait};
  return b < std::size(kTable) ? kTable[b] : Query::kUnknown;
}
// PyTorch >= 2.2 puts VALIDATE at 0, drops WATCH_KEY and adds PING after CANCEL_WAIT.
inline Query validated_query(std::uint8_t b) {
  static constexpr Query kTable[] = {
      Query::kUnknown,  Query::kSet,      Query::kCompareSet, Query::kGet,    Query::kAdd,
      Query::kCheck,    Query::kWait,     Query::kNumKeys,    Query::kDelete, Query::kAppend,
      Query::kMultiGet, Query::kMultiSet, Query::kCancelWait, Query::kPing};
  return b < std::size(kTable) ? kTable[b] : Query::kUnknown;
}
// The legacy byte of each query distrpc's client sends.
enum LegacyByte : std::uint8_t {
  kSetByte = 0,
  kCompareSetByte = 1,
  kGetByte = 2,
  kAddByte = 3,
  kCheckByte = 4,
  kWaitByte = 5,
  kNumKeysByte = 6,
  kDeleteByte = 8,
};
inline constexpr std::uint8_t kValidateByte = 0;

// Replies of CHECK and WAIT / CANCEL_WAIT.
inline constexpr std::uint8_t kReady = 0;
inline constexpr std::uint8_t kNotReady = 1;
inline constexpr std::uint8_t kStopWaiting = 0;
inline constexpr std::uint8_t kWaitCanceled = 1;

// distrpc's authentication (not c10d's: a server with a secret serves only distrpc clients that
// have it). A client with a secret opens with kAuthByte, kAuthMagic and its nonce; a server with a
// secret answers kAuthChallenge, its nonce and its proof (one without answers kAuthNoSecret); the
// client checks the proof and sends its own (kProofBytes); the server answers kAuthAccepted or
// closes the connection. 0xa7 is a query type of neither numbering, nor the magic's first byte.
inline constexpr std::uint8_t kAuthByte = 0xa7;
inline constexpr std::uint32_t kAuthMagic = 0x48545541;  // "AUTH"
inline constexpr std::uint8_t kAuthNoSecret = 0;
inline constexpr std::uint8_t kAuthChallenge = 1;
inline constexpr std::uint8_t kAuthAccepted = 1;
// The identities a store's proofs are bound to: the roles (a store connection has no worker).
inline constexpr wire::auth::Party kStoreClientParty{"TCPStore client", -1};
inline constexpr wire::auth::Party kStoreServerParty{"TCPStore server", -1};

// Bytes that do not follow the protocol; the text says how.
class WireError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

using Buffer = std::vector<std::uint8_t>;

// Integers go in host order, as c10d sends them (its peers are little-endian machines).
template <class T>
inline void put_le(Buffer& b, T v) {
  using U = std::make_unsigned_t<T>;
  const auto u = static_cast<U>(v);
  for (std::size_t i = 0; i < sizeof(T); ++i) b.push_back(static_cast<std::uint8_t>(u >> (8 * i)));
}
// Raw bytes at the end. resize + memcpy rather than insert(end, first, last): GCC 13 warns,
// wrongly, that the latter writes past the buffer (-Wstringop-overflow) once inlined here.
inline void put_bytes(Buffer& b, const void* p, std::size_t n) {
  if (n == 0) return;
  const std::size_t at = b.size();
  b.resize(at + n);
  std::memcpy(b.data() + at, p, n);
}
// A string or byte vector: u64 length, bytes.
inline void put_str(Buffer& b, const void* p, std::size_t n) {
  put_le<std::uint64_t>(b, n);
  put_bytes(b, p, n);
}
inline void put_str(Buffer& b, std::string_view s) {
  put_str(b, s.data(), s.size());
}
inline void put_str(Buffer& b, const Bytes& s) {
  put_str(b, s.data(), s.size());
}
// A user key as c10d's TCPStore writes it: prefixed.
inline void put_key(Buffer& b, std::string_view key) {
  put_le<std::uint64_t>(b, kKeyPrefix.size() + key.size());
  put_bytes(b, kKeyPrefix.data(), kKeyPrefix.size());
  put_bytes(b, key.data(), key.size());
}

// Thrown by Reader when the bytes buffered so far end inside the request: wait for more.
struct NeedMore {};

// Bounds-checked reading of one request from the bytes buffered so far. c10d's requests carry no
// overall length, so every length and count is checked against its limit as soon as it is read
// (WireError), and a field cut short by the buffer end throws NeedMore, leaving the reader at that
// field's start (the caller goes on from there once more bytes came; nothing is consumed before
// a request is complete).
class Reader {
 public:
  // Reads `p[at..n)`.
  Reader(const std::uint8_t* p, std::size_t n, std::size_t at = 0) : p_(p), n_(n), at_(at) {}
  std::uint8_t u8() {
    need(1);
    return p_[at_++];
  }
  template <class T>
  T le() {
    need(sizeof(T));
    std::make_unsigned_t<T> v = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i) {
      v |= static_cast<std::make_unsigned_t<T>>(p_[at_ + i]) << (8 * i);
    }
    at_ += sizeof(T);
    return static_cast<T>(v);
  }
  std::string key(const char* what) {
    const auto n = length(what, Store::kMaxKeyBytes + kKeyPrefix.size());
    std::string s(reinterpret_cast<const char*>(p_ + at_), n);
    at_ += n;
    return s;
  }
  Bytes bytes(const char* what) {
    const auto n = length(what, Store::kMaxValueBytes);
    Bytes b(p_ + at_, p_ + at_ + n);
    at_ += n;
    return b;
  }
  std::uint64_t count(const char* what) {
    const auto n = le<std::uint64_t>();
    if (n > kMaxKeysPerRequest) {
      throw WireError(std::string("the ") + what + " count " + std::to_string(n) +
                      " is over the limit of " + std::to_string(kMaxKeysPerRequest));
    }
    return n;
  }
  std::size_t consumed() const { return at_; }
  // `n` raw bytes (a nonce, a proof).
  void fixed(void* dst, std::size_t n) {
    need(n);
    std::memcpy(dst, p_ + at_, n);
    at_ += n;
  }

 private:
  // A length field and the bytes it announces, all there, or NeedMore with nothing read.
  std::size_t length(const char* what, std::size_t limit) {
    const std::size_t start = at_;
    const auto n = le<std::uint64_t>();
    if (n > limit) {
      throw WireError(std::string("the ") + what + " length " + std::to_string(n) +
                      " is over the limit of " + std::to_string(limit) + " bytes");
    }
    if (n_ - at_ < n) {
      at_ = start;
      throw NeedMore{};
    }
    return static_cast<std::size_t>(n);
  }
  void need(std::size_t k) const {
    if (n_ - at_ < k) throw NeedMore{};
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
