// Membership: who is in an agent's group, who of them is lost, and how the group meets and parts
// through the store (the worker table at init; the exit barrier and the store host's wait at
// shutdown). The all-gathers of the group protocol build on it (agent/group_protocol.hpp); the
// agent adds the transport (peers are added once the table is read).
#pragma once

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "distrpc/rpc_error.hpp"
#include "distrpc/store/store.hpp"
#include "distrpc/worker_info.hpp"

namespace distrpc::detail {

class Membership {
 public:
  using Clock = std::chrono::steady_clock;
  using milliseconds = std::chrono::milliseconds;

  Membership(WorkerInfo self, int world_size) : self_(std::move(self)), world_size_(world_size) {}

  const WorkerInfo& self() const { return self_; }
  int world_size() const { return world_size_; }

  // ---- the worker table ------------------------------------------------------------------
  WorkerInfo worker(const std::string& name) const {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = by_name_.find(name);
    if (it == by_name_.end()) {
      throw RpcError("could not find destination named '" + name + "' among the " +
                     std::to_string(workers_.size()) + " workers of this group (on " + self_.str() +
                     ")");
    }
    return workers_[static_cast<std::size_t>(it->second)];
  }
  WorkerInfo worker(int id) const {
    std::lock_guard<std::mutex> lk(mu_);
    if (id < 0 || id >= static_cast<int>(workers_.size())) {
      throw RpcError("could not find destination with id " + std::to_string(id) +
                     ": worker ids are 0.." +
                     std::to_string(static_cast<int>(workers_.size()) - 1));
    }
    return workers_[static_cast<std::size_t>(id)];
  }
  WorkerInfo worker(const WorkerInfo& w) const {
    WorkerInfo known = worker(w.id);
    if (known.name != w.name) {
      throw RpcError("could not find destination " + w.str() + ": worker " + std::to_string(w.id) +
                     " is " + known.str());
    }
    return known;
  }
  std::vector<WorkerInfo> workers() const {
    std::lock_guard<std::mutex> lk(mu_);
    return workers_;
  }
  // Worker `id` as error texts name it, also before the table is read or for a bad id.
  WorkerInfo describe(int id) const {
    std::lock_guard<std::mutex> lk(mu_);
    if (id >= 0 && id < static_cast<int>(workers_.size())) {
      return workers_[static_cast<std::size_t>(id)];
    }
    return WorkerInfo{id, "worker id " + std::to_string(id)};
  }

  // ---- lost members ----------------------------------------------------------------------
  // Worker `id` is gone: its connection broke or it no longer accepts one. The first reason is
  // kept. Group operations stop waiting for a lost member.
  void mark_lost(int id, const std::string& reason) {
    std::lock_guard<std::mutex> lk(mu_);
    lost_.emplace(id, reason);
  }
  bool is_lost(int id) const {
    std::lock_guard<std::mutex> lk(mu_);
    return lost_.count(id) > 0;
  }
  bool any_lost() const {
    std::lock_guard<std::mutex> lk(mu_);
    return !lost_.empty();
  }
  int live_members() const {
    std::lock_guard<std::mutex> lk(mu_);
    return world_size_ - static_cast<int>(lost_.size());
  }
  // The names of the members known lost, sorted.
  std::vector<std::string> lost_names() const {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<std::string> out;
    for (const auto& [id, why] : lost_) {
      out.push_back(id < static_cast<int>(workers_.size())
                        ? workers_[static_cast<std::size_t>(id)].name
                        : "worker id " + std::to_string(id));
    }
    std::sort(out.begin(), out.end());
    return out;
  }

  // ---- meeting and parting through the store ---------------------------------------------
  // The store the group met through; kept for the exit barrier of a graceful shutdown.
  void set_store(std::shared_ptr<store::Store> s) { store_ = std::move(s); }
  const std::shared_ptr<store::Store>& store() const { return store_; }
  void drop_store() { store_.reset(); }

  // Publishes this worker (its name and transport `address`), reads everyone's entry, validates
  // the table and keeps it. Returns every rank's address.
  std::vector<std::string> meet(const std::string& address, milliseconds timeout) {
    auto& st = *store_;
    st.set(key("worker/" + std::to_string(self_.id)), self_.name + "\n" + address);
    std::vector<std::string> keys;
    for (int r = 0; r < world_size_; ++r) keys.push_back(key("worker/" + std::to_string(r)));
    st.wait(keys, timeout);
    std::vector<WorkerInfo> all;
    std::vector<std::string> addrs;
    for (int r = 0; r < world_size_; ++r) {
      const std::string v = st.get_string(keys[static_cast<std::size_t>(r)]);
      const auto nl = v.find('\n');
      if (nl == std::string::npos) {
        throw RpcError("malformed worker entry for rank " + std::to_string(r) + " in the store");
      }
      all.push_back(WorkerInfo{r, v.substr(0, nl)});
      addrs.push_back(v.substr(nl + 1));
    }
    // Every rank reads the same table, so every rank reports the same duplicate.
    std::map<std::string, int> seen;
    for (const auto& w : all) {
      auto [it, fresh] = seen.emplace(w.name, w.id);
      if (!fresh) {
        // Every rank fails alike; rank 0 hosts the store server, so it waits until everyone has
        // read the table before it fails (and the server goes away).
        st.add(key("table_read"), 1);
        if (self_.id == 0) {
          const auto deadline = Clock::now() + timeout;
          while (st.add(key("table_read"), 0) < world_size_ && Clock::now() < deadline) {
            std::this_thread::sleep_for(milliseconds(1));
          }
        }
        throw RpcError("Worker name '" + w.name + "' is not unique: ranks " +
                       std::to_string(it->second) + " and " + std::to_string(w.id) +
                       " both use it (seen on rank " + std::to_string(self_.id) + ")");
      }
    }
    std::lock_guard<std::mutex> lk(mu_);
    workers_ = all;
    for (const auto& w : all) by_name_[w.name] = w.id;
    return addrs;
  }

  // Every member not lost reaches this point before anyone goes on (at most `timeout`, else 5
  // minutes). Lost members never arrive: the count wanted shrinks as losses become known.
  void exit_barrier(milliseconds timeout) {
    auto& st = *store_;
    const std::string k = key("exit");
    st.add(k, 1);
    const auto deadline =
        Clock::now() + (timeout.count() > 0 ? timeout : milliseconds(std::chrono::minutes(5)));
    while (st.add(k, 0) < live_members()) {
      if (Clock::now() > deadline) {
        throw RpcError(
            "graceful shutdown timed out waiting for the other workers at the exit barrier");
      }
      std::this_thread::sleep_for(milliseconds(1));
    }
  }

  // The process hosting the store server (rank 0) must outlive the other ranks' last use of it:
  // past the exit barrier each rank marks that it left, and rank 0 waits until every other rank
  // either did or is lost (a rank killed after the exit barrier never marks it). Runs while the
  // transport still reports losses; bounded, since every rank is past the exit barrier already.
  void leave_store() {
    auto& st = *store_;
    if (self_.id != 0) {
      st.add(key("left/" + std::to_string(self_.id)), 1);
      return;
    }
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    for (int r = 1; r < world_size_; ++r) {
      while (st.add(key("left/" + std::to_string(r)), 0) == 0 && !is_lost(r) &&
             Clock::now() < deadline) {
        std::this_thread::sleep_for(milliseconds(1));
      }
    }
  }

  // Waits until every member not known lost, other than this one, closed its connections (they
  // are then reported lost), or `limit` passes.
  void wait_others_gone(milliseconds limit) const {
    const auto deadline = Clock::now() + limit;
    while (live_members() > 1 && Clock::now() < deadline) {
      std::this_thread::sleep_for(milliseconds(1));
    }
  }

 private:
  std::string key(const std::string& k) const { return "distrpc/rpc/" + k; }

  const WorkerInfo self_;
  const int world_size_;
  mutable std::mutex mu_;
  std::vector<WorkerInfo> workers_;
  std::map<std::string, int> by_name_;
  std::map<int, std::string> lost_;  // id -> why (mark_lost)
  std::shared_ptr<store::Store> store_;
};

}  // namespace distrpc::detail
