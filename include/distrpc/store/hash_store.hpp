// HashStore: an in-process Store (a map under a mutex). For tests, single-process groups, and as
// the model the other stores are checked against.
#pragma once

#include <condition_variable>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "distrpc/store/detail/common.hpp"
#include "distrpc/store/store.hpp"

namespace distrpc::store {

class HashStore : public Store {
 public:
  explicit HashStore(milliseconds timeout = kDefaultTimeout) : Store(timeout) {}

  // The base class's convenience overloads (string values, default-timeout wait).
  using Store::set;
  using Store::wait;

  void set(const std::string& key, const Bytes& value) override {
    detail::check_key(kName, "set", key);
    detail::check_value(kName, "set", key, value.size());
    {
      std::lock_guard lock(mu_);
      map_[key] = value;
    }
    cv_.notify_all();
  }

  Bytes get(const std::string& key) override {
    detail::check_key(kName, "get", key);
    const auto timeout = this->timeout();
    std::unique_lock lock(mu_);
    wait_locked(lock, {key}, timeout, "get");
    return map_.at(key);
  }

  std::int64_t add(const std::string& key, std::int64_t delta) override {
    detail::check_key(kName, "add", key);
    std::int64_t result = 0;
    {
      std::lock_guard lock(mu_);
      auto it = map_.find(key);
      const std::int64_t old = it == map_.end() ? 0 : detail::parse_counter(kName, key, it->second);
      result = detail::checked_add(kName, key, old, delta);
      map_[key] = detail::format_counter(result);
    }
    cv_.notify_all();
    return result;
  }

  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override {
    detail::check_key(kName, "compare_set", key);
    detail::check_value(kName, "compare_set", key, expected.size());
    detail::check_value(kName, "compare_set", key, desired.size());
    Bytes result;
    bool changed = false;
    {
      std::lock_guard lock(mu_);
      auto it = map_.find(key);
      if (it == map_.end()) {
        if (expected.empty()) {
          map_.emplace(key, desired);
          result = desired;
          changed = true;
        } else {
          result = expected;
        }
      } else if (it->second == expected) {
        it->second = desired;
        result = desired;
        changed = true;
      } else {
        result = it->second;
      }
    }
    if (changed) cv_.notify_all();
    return result;
  }

  bool check(const std::vector<std::string>& keys) override {
    for (const auto& k : keys) detail::check_key(kName, "check", k);
    std::lock_guard lock(mu_);
    return all_present(keys);
  }

  void wait(const std::vector<std::string>& keys, milliseconds timeout) override {
    for (const auto& k : keys) detail::check_key(kName, "wait", k);
    std::unique_lock lock(mu_);
    wait_locked(lock, keys, timeout, "wait");
  }

  bool delete_key(const std::string& key) override {
    detail::check_key(kName, "delete_key", key);
    std::lock_guard lock(mu_);
    return map_.erase(key) > 0;
  }

  std::int64_t num_keys() override {
    std::lock_guard lock(mu_);
    return static_cast<std::int64_t>(map_.size());
  }

 private:
  static constexpr const char* kName = "HashStore";

  bool all_present(const std::vector<std::string>& keys) const {
    for (const auto& k : keys) {
      if (!map_.contains(k)) return false;
    }
    return true;
  }

  void wait_locked(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys,
                   milliseconds timeout, const char* op) {
    const detail::Deadline deadline(timeout);
    auto ready = [&] { return all_present(keys); };
    if (deadline.infinite()) {
      cv_.wait(lock, ready);
      return;
    }
    if (cv_.wait_until(lock, deadline.at(), ready)) return;
    std::vector<std::string> missing;
    for (const auto& k : keys) {
      if (!map_.contains(k)) missing.push_back(k);
    }
    throw StoreTimeoutError(detail::timeout_text(kName, op, keys, missing, timeout));
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<std::string, Bytes> map_;
};

}  // namespace distrpc::store
