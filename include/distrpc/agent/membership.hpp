// Membership: who is in an agent's group, who of them is lost, and how the group meets and parts
// through the store (the worker table at init; the exit barrier and the store host's wait at
// shutdown). The all-gathers of the group protocol build on it (agent/group_protocol.hpp); the
// agent adds the transport (peers are added once the table is read).
//
// A group is static (a world size: every rank 0..N-1 meets once, meet()) or dynamic (no world
// size: members join and leave over time, join_dynamic(), admit(), remove(); the messages are
// agent/elastic.hpp's). Its table is keyed by worker id (the rank), which in a dynamic group need
// not be contiguous.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
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

  // One member's entry in a dynamic group's store: its join number (the order of joins), who it
  // is and where its transport listens.
  struct DynamicEntry {
    std::int64_t seq = 0;
    WorkerInfo info;
    std::string address;
  };
  // What join_dynamic() read: the other members (in join order) and the entries this worker
  // takes over (a dead member's name or rank, see admit()).
  struct DynamicView {
    std::vector<DynamicEntry> members;
    std::vector<DynamicEntry> replaced;
  };
  static constexpr const char* kMixedText =
      "RPC group mixes statically and dynamically initialized members which is not supported.";

  // world_size < 0: a dynamic group.
  Membership(WorkerInfo self, int world_size)
      : self_(std::move(self)), world_size_(world_size), dynamic_(world_size < 0) {}

  const WorkerInfo& self() const { return self_; }
  bool dynamic() const { return dynamic_; }
  // A dynamic group's size is its current membership as this worker sees it.
  int world_size() const {
    if (!dynamic_) return world_size_;
    std::lock_guard<std::mutex> lk(mu_);
    return static_cast<int>(workers_.size());
  }

  // ---- the worker table ------------------------------------------------------------------
  WorkerInfo worker(const std::string& name) const {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = by_name_.find(name);
    if (it == by_name_.end()) {
      std::string why;
      if (departed_names_.count(name)) why = ": '" + name + "' left the group";
      throw RpcError("could not find destination named '" + name + "' among the " +
                     std::to_string(workers_.size()) + " workers of this group (on " + self_.str() +
                     ")" + why);
    }
    return workers_.at(it->second);
  }
  WorkerInfo worker(int id) const {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = workers_.find(id);
    if (it == workers_.end()) {
      if (!dynamic_) {
        throw RpcError("could not find destination with id " + std::to_string(id) +
                       ": worker ids are 0.." + std::to_string(world_size_ - 1));
      }
      auto gone = departed_.find(id);
      throw RpcError("could not find destination with id " + std::to_string(id) +
                     (gone != departed_.end() ? ": worker '" + gone->second + "' left the group"
                                              : ": no member of this dynamic group has it"));
    }
    return it->second;
  }
  WorkerInfo worker(const WorkerInfo& w) const {
    WorkerInfo known;
    try {
      known = worker(w.id);
    } catch (const RpcError&) {
      if (!dynamic_) throw;
      throw RpcError("could not find destination " + w.str() + ": '" + w.name +
                     "' is no longer a member of this group (it left, or was replaced)");
    }
    if (known.name != w.name) {
      throw RpcError("could not find destination " + w.str() + ": worker " + std::to_string(w.id) +
                     " is " + known.str());
    }
    return known;
  }
  // In id order.
  std::vector<WorkerInfo> workers() const {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<WorkerInfo> out;
    for (const auto& [id, w] : workers_) out.push_back(w);
    return out;
  }
  // Worker `id` as error texts name it, also before the table is read or for a bad id.
  WorkerInfo describe(int id) const {
    std::lock_guard<std::mutex> lk(mu_);
    if (auto it = workers_.find(id); it != workers_.end()) return it->second;
    if (auto it = departed_.find(id); it != departed_.end()) return WorkerInfo{id, it->second};
    return WorkerInfo{id, "worker id " + std::to_string(id)};
  }

  // ---- lost members ----------------------------------------------------------------------
  // Worker `id` is gone: its connection broke or it no longer accepts one. The first reason is
  // kept. Group operations stop waiting for a lost member.
  void mark_lost(int id, const std::string& reason) {
    std::lock_guard<std::mutex> lk(mu_);
    // A dynamic group's departed members are no members: their connections close when they go.
    if (dynamic_ && !workers_.count(id)) return;
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
    const int size = dynamic_ ? static_cast<int>(workers_.size()) : world_size_;
    return size - static_cast<int>(lost_.size());
  }
  // The names of the members known lost, sorted.
  std::vector<std::string> lost_names() const {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<std::string> out;
    for (const auto& [id, why] : lost_) {
      auto it = workers_.find(id);
      out.push_back(it != workers_.end() ? it->second.name : "worker id " + std::to_string(id));
    }
    std::sort(out.begin(), out.end());
    return out;
  }

  // ---- meeting and parting through the store ---------------------------------------------
  // The store the group met through; kept for the exit barrier of a graceful shutdown.
  void set_store(std::shared_ptr<store::Store> s) { store_ = std::move(s); }
  const std::shared_ptr<store::Store>& store() const { return store_; }
  void drop_store() { store_.reset(); }

  // What meet() read: every rank's transport address and the `extra` text it published.
  struct MeetResult {
    std::vector<std::string> addresses;
    std::vector<std::string> extras;
  };

  // Publishes this worker (its name, transport `address` and an `extra` text for the layers: its
  // device maps), reads everyone's entry, validates the table (unique names, then `check` on the
  // extras) and keeps it. Every rank reads the same table, so a check that fails fails alike on
  // every rank: init is all or nothing.
  MeetResult meet(const std::string& address, milliseconds timeout, const std::string& extra = {},
                  const std::function<void(const std::vector<WorkerInfo>&,
                                           const std::vector<std::string>&)>& check = {}) {
    auto& st = *store_;
    claim_mode("static");
    st.set(key("worker/" + std::to_string(self_.id)), self_.name + "\n" + address + "\n" + extra);
    std::vector<std::string> keys;
    for (int r = 0; r < world_size_; ++r) keys.push_back(key("worker/" + std::to_string(r)));
    st.wait(keys, timeout);
    std::vector<WorkerInfo> all;
    MeetResult out;
    for (int r = 0; r < world_size_; ++r) {
      const std::string v = st.get_string(keys[static_cast<std::size_t>(r)]);
      const auto nl = v.find('\n');
      if (nl == std::string::npos) {
        throw RpcError("malformed worker entry for rank " + std::to_string(r) + " in the store");
      }
      // "name\naddress" (no extra part: a worker that publishes none) or "name\naddress\nextra".
      const auto nl2 = v.find('\n', nl + 1);
      all.push_back(WorkerInfo{r, v.substr(0, nl)});
      out.addresses.push_back(v.substr(nl + 1, nl2 == std::string::npos ? nl2 : nl2 - nl - 1));
      out.extras.push_back(nl2 == std::string::npos ? std::string() : v.substr(nl2 + 1));
    }
    try {
      std::map<std::string, int> seen;
      for (const auto& w : all) {
        auto [it, fresh] = seen.emplace(w.name, w.id);
        if (!fresh) {
          throw RpcError("Worker name '" + w.name + "' is not unique: ranks " +
                         std::to_string(it->second) + " and " + std::to_string(w.id) +
                         " both use it (seen on rank " + std::to_string(self_.id) + ")");
        }
      }
      if (check) check(all, out.extras);
    } catch (...) {
      // Every rank fails alike; rank 0 hosts the store server, so it waits until everyone has
      // read the table before it fails (and the server goes away).
      st.add(key("table_read"), 1);
      if (self_.id == 0) {
        const auto deadline = Clock::now() + timeout;
        while (st.add(key("table_read"), 0) < world_size_ && Clock::now() < deadline) {
          std::this_thread::sleep_for(milliseconds(1));
        }
      }
      throw;
    }
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& w : all) {
      workers_[w.id] = w;
      by_name_[w.name] = w.id;
    }
    return out;
  }

  // ---- a dynamic group ---------------------------------------------------------------------
  // Joining, through the store. Every joiner takes the next join number (an atomic add: joins
  // are totally ordered without a lock) and publishes its entry under it; it then reads every
  // earlier entry, skipping those marked left. A later entry with the same name or rank as an
  // earlier one supersedes it (a replacement). The joiner tells each member it read (admit(),
  // sent by agent/elastic.hpp) and each member adds it; a member that joins later reads this
  // entry itself. So every pair of members learns of each other exactly once, in one direction
  // each: the later one reads the earlier from the store, the earlier hears from the later. No one
  // watches the store. Returns the other members and the entries this worker replaces; the table
  // holds this worker and the members read.
  DynamicView join_dynamic(const std::string& address, milliseconds timeout) {
    auto& st = *store_;
    claim_mode("dynamic");
    const std::int64_t seq = st.add(key("dyn/seq"), 1);
    own_seq_ = seq;
    // Published only if no later joiner took this number for abandoned meanwhile (below).
    const store::Bytes entry =
        store::to_bytes(std::to_string(self_.id) + "\n" + self_.name + "\n" + address);
    if (st.compare_set(key("dyn/join/" + std::to_string(seq)), {}, entry) != entry) {
      throw RpcError("init_rpc: " + self_.str() +
                     " could not join the dynamic group: its entry "
                     "(join number " +
                     std::to_string(seq) +
                     ") came after a later joiner had "
                     "waited init_timeout for it and taken it for abandoned; try again");
    }
    std::vector<std::string> keys;
    for (std::int64_t i = 1; i < seq; ++i) keys.push_back(key("dyn/join/" + std::to_string(i)));
    // An earlier joiner took its number just before us: its entry follows at once. One that
    // never comes (that joiner died between taking its number and publishing) is marked
    // abandoned after `timeout`, so that it holds up this join once, and no later one.
    if (!keys.empty()) {
      try {
        st.wait(keys, timeout);
      } catch (const DistStoreError&) {
        for (const auto& k : keys) {
          if (!st.check({k})) (void)st.compare_set(k, {}, store::to_bytes(kAbandoned));
        }
      }
    }
    std::vector<DynamicEntry> view;
    bool rank_held_before = false;
    for (std::int64_t i = 1; i < seq; ++i) {
      const std::string v = st.get_string(keys[static_cast<std::size_t>(i - 1)]);
      if (v == kAbandoned) continue;
      DynamicEntry e = parse_entry(i, v);
      // Left or not: ids that process made may still be held by the members.
      if (e.info.id == self_.id) rank_held_before = true;
      if (st.check({key("dyn/left/" + std::to_string(i))})) continue;
      std::erase_if(view, [&](const DynamicEntry& o) {
        return o.info.id == e.info.id || o.info.name == e.info.name;
      });
      view.push_back(std::move(e));
    }
    // RRef ids add the incarnation times 2^40 to a 63-bit counter (rref/id.hpp).
    if (rank_held_before && seq >= kMaxIncarnation) {
      mark_left_in_store();  // later joiners skip this entry
      throw RpcError("init_rpc: " + self_.str() +
                     " could not join the dynamic group: its join number " + std::to_string(seq) +
                     " reaches " + std::to_string(kMaxIncarnation) +
                     ", the most for a rank held before (ids it makes would overflow); start the "
                     "group on a new store");
    }
    incarnation_.store(rank_held_before ? seq : 0, std::memory_order_release);
    DynamicView out;
    for (auto& e : view) {
      const bool mine = e.info.id == self_.id || e.info.name == self_.name;
      (mine ? out.replaced : out.members).push_back(std::move(e));
    }
    std::lock_guard<std::mutex> lk(mu_);
    workers_[self_.id] = self_;
    by_name_[self_.name] = self_.id;
    seqs_[self_.id] = seq;
    for (const auto& e : out.members) {
      workers_[e.info.id] = e.info;
      by_name_[e.info.name] = e.info.id;
      seqs_[e.info.id] = e.seq;
    }
    return out;
  }
  std::int64_t own_seq() const { return own_seq_; }
  static constexpr std::int64_t kMaxIncarnation = std::int64_t{1} << 22;
  // 0 when no earlier process held this worker's rank in its group (every member of a static
  // group); otherwise this member's join number, which no earlier holder of the rank had. Set by
  // the join, before any request or call of this worker.
  std::int64_t incarnation() const { return incarnation_.load(std::memory_order_acquire); }
  // The join number of member `id` (0: unknown).
  std::int64_t seq_of(int id) const {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = seqs_.find(id);
    return it == seqs_.end() ? 0 : it->second;
  }
  // Whether the member that joined under `seq` marked itself left in the store.
  bool left_in_store(std::int64_t seq) const {
    try {
      return store_ && store_->check({key("dyn/left/" + std::to_string(seq))});
    } catch (const std::exception&) {
      return false;  // the store went (its host left): nothing known
    }
  }
  // Marks this worker's entry left: joiners from now on skip it.
  void mark_left_in_store() {
    if (store_ && own_seq_ > 0) store_->set(key("dyn/left/" + std::to_string(own_seq_)), "1");
  }

  // The members other than this worker that have `w`'s name or rank: those `w` would replace.
  std::vector<WorkerInfo> conflicts(const WorkerInfo& w) const {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<WorkerInfo> out;
    for (const auto& [id, m] : workers_) {
      if (id != self_.id && (id == w.id || m.name == w.name)) out.push_back(m);
    }
    return out;
  }

  // Member `w` (join number `seq`) joins: it replaces any entry with its name or rank (the caller
  // checked they are gone). False when this worker is leaving: the joiner then leaves it out.
  bool admit(const WorkerInfo& w, std::int64_t seq) {
    std::lock_guard<std::mutex> lk(mu_);
    if (leaving_) return false;
    erase_locked(w.id);
    if (auto it = by_name_.find(w.name); it != by_name_.end()) erase_locked(it->second);
    workers_[w.id] = w;
    by_name_[w.name] = w.id;
    seqs_[w.id] = seq;
    departed_.erase(w.id);
    departed_names_.erase(w.name);
    return true;
  }
  // Member `w` left (or never completed its join): it is no member from now on. Only the entry of
  // that very worker goes: a replacement that took its rank since stays.
  void remove(const WorkerInfo& w) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = workers_.find(w.id);
    if (it == workers_.end() || it->second.name != w.name || w.id == self_.id) return;
    erase_locked(w.id);
    departed_[w.id] = w.name;
    departed_names_.insert(w.name);
  }
  // This worker leaves: from now on admit() refuses joiners (they leave it out). Returns the
  // members to tell, those not known lost. Atomic with admit(): a joiner admitted before is in
  // the list, one after learns that this worker is leaving.
  std::vector<WorkerInfo> begin_leave() {
    std::lock_guard<std::mutex> lk(mu_);
    leaving_ = true;
    std::vector<WorkerInfo> out;
    for (const auto& [id, m] : workers_) {
      if (id != self_.id && !lost_.count(id)) out.push_back(m);
    }
    return out;
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

  // The first member decides whether the group on this store is static or dynamic; a member of
  // the other kind fails here, before it publishes anything.
  void claim_mode(const std::string& mine) {
    const std::string k = key("mode");
    const std::string got =
        store::to_string(store_->compare_set(k, store::Bytes{}, store::to_bytes(mine)));
    if (got != mine) throw RpcError(kMixedText);
  }

  // What a joiner writes under a join number whose entry never came (see join_dynamic).
  static constexpr const char* kAbandoned = "abandoned";

  static DynamicEntry parse_entry(std::int64_t seq, const std::string& v) {
    const auto a = v.find('\n');
    const auto b = a == std::string::npos ? a : v.find('\n', a + 1);
    if (b == std::string::npos) {
      throw RpcError("malformed member entry " + std::to_string(seq) + " in the store: '" + v +
                     "'");
    }
    DynamicEntry e;
    e.seq = seq;
    e.info.id = std::stoi(v.substr(0, a));
    e.info.name = v.substr(a + 1, b - a - 1);
    e.address = v.substr(b + 1);
    return e;
  }

  void erase_locked(int id) {
    auto it = workers_.find(id);
    if (it == workers_.end()) return;
    by_name_.erase(it->second.name);
    workers_.erase(it);
    lost_.erase(id);
    seqs_.erase(id);
  }

  const WorkerInfo self_;
  const int world_size_;
  const bool dynamic_;
  mutable std::mutex mu_;
  std::map<int, WorkerInfo> workers_;  // id -> worker
  std::map<std::string, int> by_name_;
  std::map<int, std::string> lost_;  // id -> why (mark_lost)
  // A dynamic group: the members' join numbers, this worker's, who left (for error texts), and
  // whether this worker is leaving.
  std::map<int, std::int64_t> seqs_;
  std::int64_t own_seq_ = 0;
  std::atomic<std::int64_t> incarnation_{0};
  std::map<int, std::string> departed_;
  std::set<std::string> departed_names_;
  bool leaving_ = false;
  std::shared_ptr<store::Store> store_;
};

}  // namespace distrpc::detail
