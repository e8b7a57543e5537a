// PrefixStore: a view of another store in which every key is "<prefix>/<key>", so groups and
// subsystems can share one store without their keys meeting.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "distrpc/store/detail/common.hpp"
#include "distrpc/store/store.hpp"

namespace distrpc::store {

class PrefixStore : public Store {
 public:
  // The view starts with the underlying store's timeout; set_timeout() on the view changes only the
  // view's get()/wait(keys).
  PrefixStore(std::string prefix, std::shared_ptr<Store> store)
      : Store(checked(store)->timeout()), prefix_(std::move(prefix)), store_(std::move(store)) {}

  const std::string& prefix() const { return prefix_; }
  const std::shared_ptr<Store>& underlying() const { return store_; }

  using Store::set;
  using Store::wait;

  void set(const std::string& key, const Bytes& value) override { store_->set(join(key), value); }

  Bytes get(const std::string& key) override {
    const std::string k = join(key);
    const auto timeout = this->timeout();
    // The underlying get() uses the underlying timeout; when the view's differs, wait first.
    if (timeout != store_->timeout()) store_->wait({k}, timeout);
    return store_->get(k);
  }

  std::int64_t add(const std::string& key, std::int64_t delta) override {
    return store_->add(join(key), delta);
  }

  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override {
    return store_->compare_set(join(key), expected, desired);
  }

  bool check(const std::vector<std::string>& keys) override { return store_->check(join(keys)); }

  void wait(const std::vector<std::string>& keys, milliseconds timeout) override {
    store_->wait(join(keys), timeout);
  }

  bool delete_key(const std::string& key) override { return store_->delete_key(join(key)); }

  // Counts every key of the underlying store, as c10d's PrefixStore does.
  std::int64_t num_keys() override { return store_->num_keys(); }

 private:
  static const std::shared_ptr<Store>& checked(const std::shared_ptr<Store>& s) {
    if (!s) throw DistError("PrefixStore: the underlying store is null");
    return s;
  }

  std::string join(const std::string& key) const { return prefix_ + "/" + key; }
  std::vector<std::string> join(const std::vector<std::string>& keys) const {
    std::vector<std::string> out;
    out.reserve(keys.size());
    for (const auto& k : keys) out.push_back(join(k));
    return out;
  }

  std::string prefix_;
  std::shared_ptr<Store> store_;
};

}  // namespace distrpc::store
