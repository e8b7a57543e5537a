// ModuleDirectory<I>: the owner's table from module RRef id to module, for the short form of a
// forward call.
//
// PyTorch sends the module RRef with every forward. When the caller is a user of that RRef, the
// owner reading it must answer the caller with a ChildAccept (docs/rref.md, "user A shares with
// O"): two extra messages per call, which more than doubled a small forward's latency. So a
// RemoteModule sends the RRef only until one call has succeeded; the owner, seeing the RRef,
// records the module here under the RRef's id, and later calls name the id alone.
//
// An entry holds the module weakly: it dies with the owner's value (when the last fork of the
// RRef is released), so the table never keeps a module alive. A caller using the short form holds
// its fork until the reply arrives, so the entry it names cannot die under its call. Entries are
// keyed per interface, so an id cannot reach a module through another interface's signature.
// Ids are as forgeable by a peer of the group as RRefs are on the wire: the group is the trust
// boundary (docs/remote_module.md, "Security").
#pragma once

#include <algorithm>
#include <cstddef>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>

#include "distrpc/nn/interface_module.hpp"
#include "distrpc/rref/id.hpp"

namespace distrpc::nn::detail {

template <class I>
class ModuleDirectory {
 public:
  static ModuleDirectory& instance() {
    static ModuleDirectory d;
    return d;
  }

  void put(const RRefId& id, const InterfaceModule<I>& module) {
    std::lock_guard<std::mutex> lk(mu_);
    entries_[id] = module.core_;
    // Drop dead entries now and then, so the table stays as large as the live modules.
    if (entries_.size() >= next_sweep_) {
      for (auto it = entries_.begin(); it != entries_.end();) {
        it = it->second.expired() ? entries_.erase(it) : std::next(it);
      }
      next_sweep_ = std::max<std::size_t>(64, 2 * entries_.size());
    }
  }

  std::optional<InterfaceModule<I>> find(const RRefId& id) const {
    std::shared_ptr<const typename InterfaceModule<I>::Core> core;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = entries_.find(id);
      if (it == entries_.end()) return std::nullopt;
      core = it->second.lock();
    }
    if (!core) return std::nullopt;
    return InterfaceModule<I>(std::move(core));
  }

  std::size_t size() const {
    std::lock_guard<std::mutex> lk(mu_);
    return entries_.size();
  }

 private:
  ModuleDirectory() = default;

  mutable std::mutex mu_;
  std::unordered_map<RRefId, std::weak_ptr<const typename InterfaceModule<I>::Core>> entries_;
  std::size_t next_sweep_ = 64;
};

}  // namespace distrpc::nn::detail
