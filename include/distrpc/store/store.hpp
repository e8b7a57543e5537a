// The Store interface: a small key/value service every rank of a group can reach, used for
// rendezvous (addresses, names), barriers and counters. Semantics follow c10d's Store.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "distrpc/error.hpp"

namespace distrpc::store {

using Bytes = std::vector<std::uint8_t>;

inline Bytes to_bytes(std::string_view s) { return Bytes(s.begin(), s.end()); }
inline std::string to_string(const Bytes& b) { return std::string(b.begin(), b.end()); }

class Store {
 public:
  // The unit of every timeout; a member, so the stores and their users spell it briefly without
  // a using-declaration leaking into distrpc::store.
  using milliseconds = std::chrono::milliseconds;
  // c10d's default store timeout.
  static constexpr milliseconds kDefaultTimeout{300'000};
  // Passed as a timeout: wait without limit.
  static constexpr milliseconds kNoTimeout{0};
  // Bounds every store enforces (DistStoreError naming the size and the limit beyond them), so a
  // confused or hostile peer cannot make a server allocate without limit.
  static constexpr std::size_t kMaxKeyBytes = 64 * 1024;
  static constexpr std::size_t kMaxValueBytes = 64 * 1024 * 1024;

  explicit Store(milliseconds timeout = kDefaultTimeout) : timeout_(timeout) {}
  virtual ~Store() = default;
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Sets `key` to `value`, overwriting; wakes waiters on `key`.
  virtual void set(const std::string& key, const Bytes& value) = 0;
  void set(const std::string& key, std::string_view value) { set(key, to_bytes(value)); }

  // Returns the value of `key`, waiting up to timeout() for it to appear; DistStoreError on timeout.
  virtual Bytes get(const std::string& key) = 0;
  std::string get_string(const std::string& key) { return to_string(get(key)); }

  // Atomically adds `delta` to the integer stored at `key` (missing = 0) and returns the new value.
  // add(key, 0) is an atomic read. The value is stored as decimal text, as c10d does.
  virtual std::int64_t add(const std::string& key, std::int64_t delta) = 0;

  // If `key` holds `expected` (or is missing and `expected` is empty), sets it to `desired` and
  // returns `desired`; if `key` is missing otherwise, returns `expected`; else returns the current value.
  virtual Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) = 0;

  // True when every key exists, without waiting.
  virtual bool check(const std::vector<std::string>& keys) = 0;

  // Waits until every key exists; DistStoreError naming the missing keys and the duration on timeout.
  virtual void wait(const std::vector<std::string>& keys, milliseconds timeout) = 0;
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout()); }

  // Removes `key`; true if it existed.
  virtual bool delete_key(const std::string& key) = 0;

  // Number of keys currently stored.
  virtual std::int64_t num_keys() = 0;

  // The default timeout of get() and wait(keys); safe to change while other threads use the store.
  void set_timeout(milliseconds timeout) { timeout_.store(timeout); }
  milliseconds timeout() const { return timeout_.load(); }

 private:
  std::atomic<milliseconds> timeout_;
};

}  // namespace distrpc::store
