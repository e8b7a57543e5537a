// GatherTable: the leader's side of the group protocol's all-gather (barrier, all_gather,
// wait_all_workers and the shutdown join run on it), as plain state that knows nothing of the
// network, so its rules are testable in one process.
//
// Members contribute a blob to the gather `key`#`seq` (key: the sorted member names; seq: the
// n-th gather over that set). The gather resolves once every member either contributed or is
// known lost. Its outcome is decided here once and handed to every member alike, so every
// survivor sees the same values, the same lost set and the same error text whatever the timing:
//  - strict gathers (barrier, all_gather) fail as soon as a member that has not contributed is
//    known lost, naming every member known lost at that moment;
//  - tolerant gathers (the steps of a graceful shutdown) complete among the survivors and list
//    the lost members in the outcome.
// Outcomes are kept for a few gathers per key: a member that asks after the fact (a late
// contributor, or a new leader that took over after the old one died between replies) gets the
// very outcome the others got.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "distrpc/future.hpp"

namespace distrpc::detail {

// What a gather ended with; sent from the leader to every member.
struct GatherOutcome {
  enum class Status : std::uint8_t { ok = 0, lost_members = 1, timed_out = 2 };
  Status status = Status::ok;
  std::map<std::string, std::string> values;  // name -> blob of every member that contributed
  std::vector<std::string> lost;              // members lost before they contributed (sorted)
  std::string text;                           // the failure, when status != ok
  bool led = false;  // on the member that led it and answered the others (not sent)

  template <class Archive>
  void serialize(Archive& ar) {
    ar(status, values, lost, text);
  }
};

// "worker2, worker3"
inline std::string join_names(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// The text of a strict gather that lost members; `op` names the operation ("barrier", ...).
inline std::string lost_members_text(const std::string& op, const std::vector<std::string>& lost) {
  return op + " failed: worker(s) lost from the group: " + join_names(lost) +
         " (their connections broke or they no longer answer)";
}

class GatherTable {
 public:
  using Key = std::pair<std::string, std::uint64_t>;

  // The sequence number of this member's next gather over `key`: every member gathers over a
  // set in the same order, so the n-th gather of each meets the n-th of the others.
  std::uint64_t next_seq(const std::string& key) {
    std::lock_guard<std::mutex> lk(mu_);
    return seq_[key]++;
  }

  // `name` contributes `blob`; `lost` are members the contributor knows lost. The future
  // completes with the outcome (at once when the gather was already decided).
  Future<GatherOutcome> contribute(const std::string& key, std::uint64_t seq,
                                   const std::vector<std::string>& names, bool tolerant,
                                   const std::string& op, const std::string& name, std::string blob,
                                   const std::vector<std::string>& lost) {
    Future<GatherOutcome> done;
    Resolution r;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (auto o = completed_locked({key, seq})) {
        done.set_value(*o);
        return done;
      }
      Open& g = open_locked({key, seq}, names, tolerant, op);
      g.values[name] = std::move(blob);
      g.lost.insert(lost.begin(), lost.end());
      g.waiters.push_back(done);
      r = resolve_locked({key, seq});
    }
    r.deliver();
    return done;
  }

  // Members known lost now (the leader's own view, refreshed while it waits).
  void note_lost(const std::string& key, std::uint64_t seq, const std::vector<std::string>& lost) {
    Resolution r;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = open_.find({key, seq});
      if (it == open_.end() || lost.empty()) return;
      it->second.lost.insert(lost.begin(), lost.end());
      r = resolve_locked({key, seq});
    }
    r.deliver();
  }

  // Decides the gather with `outcome` (a timeout, or the outcome a member already received from
  // an earlier leader). No effect when it was decided already.
  void decide(const std::string& key, std::uint64_t seq, GatherOutcome outcome) {
    Resolution r;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (completed_locked({key, seq})) return;
      r = finish_locked({key, seq}, std::move(outcome));
    }
    r.deliver();
  }

  // Members of an open gather that neither contributed nor are known lost.
  std::vector<std::string> missing(const std::string& key, std::uint64_t seq) const {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<std::string> out;
    auto it = open_.find({key, seq});
    if (it == open_.end()) return out;
    for (const auto& n : it->second.expected) {
      if (!it->second.values.count(n) && !it->second.lost.count(n)) out.push_back(n);
    }
    return out;
  }

  // The outcome of `key`#`seq` if this member knows it (it led it, or received it as a member).
  std::optional<GatherOutcome> completed(const std::string& key, std::uint64_t seq) const {
    std::lock_guard<std::mutex> lk(mu_);
    return completed_locked({key, seq});
  }

  // A member records the outcome it received, so a later leader can learn it from it.
  void remember(const std::string& key, std::uint64_t seq, const GatherOutcome& outcome) {
    std::lock_guard<std::mutex> lk(mu_);
    remember_locked({key, seq}, outcome);
  }

 private:
  // Outcomes kept per key: a gather can only be asked about while the gathers after it wait for
  // the asking leader, so a few are plenty.
  static constexpr std::size_t kKeptPerKey = 4;

  struct Open {
    std::set<std::string> expected;
    bool tolerant = false;
    std::string op;
    std::map<std::string, std::string> values;
    std::set<std::string> lost;
    std::vector<Future<GatherOutcome>> waiters;
  };

  // Futures to complete once the lock is released (their callbacks send replies).
  struct Resolution {
    std::vector<Future<GatherOutcome>> waiters;
    GatherOutcome outcome;
    void deliver() {
      for (auto& w : waiters) w.try_set_value(outcome);
    }
  };

  Open& open_locked(const Key& k, const std::vector<std::string>& names, bool tolerant,
                    const std::string& op) {
    Open& g = open_[k];
    if (g.expected.empty()) {
      g.expected.insert(names.begin(), names.end());
      g.tolerant = tolerant;
      g.op = op;
    }
    return g;
  }

  Resolution resolve_locked(const Key& k) {
    Open& g = open_.at(k);
    std::vector<std::string> lost;  // lost before contributing: those are what the outcome names
    std::size_t accounted = 0;
    for (const auto& n : g.expected) {
      if (g.values.count(n)) {
        ++accounted;
      } else if (g.lost.count(n)) {
        ++accounted;
        lost.push_back(n);
      }
    }
    GatherOutcome o;
    if (!lost.empty() && !g.tolerant) {
      o.status = GatherOutcome::Status::lost_members;
      o.lost = lost;
      o.text = lost_members_text(g.op, lost);
      return finish_locked(k, std::move(o));
    }
    if (accounted < g.expected.size()) return {};
    o.lost = std::move(lost);
    o.values = std::move(g.values);
    return finish_locked(k, std::move(o));
  }

  Resolution finish_locked(const Key& k, GatherOutcome o) {
    Resolution r;
    if (auto it = open_.find(k); it != open_.end()) {
      r.waiters = std::move(it->second.waiters);
      open_.erase(it);
    }
    remember_locked(k, o);
    r.outcome = std::move(o);
    return r;
  }

  void remember_locked(const Key& k, const GatherOutcome& o) {
    auto& kept = done_[k.first];
    kept[k.second] = o;
    while (kept.size() > kKeptPerKey) kept.erase(kept.begin());
  }

  std::optional<GatherOutcome> completed_locked(const Key& k) const {
    auto it = done_.find(k.first);
    if (it == done_.end()) return std::nullopt;
    auto jt = it->second.find(k.second);
    if (jt == it->second.end()) return std::nullopt;
    return jt->second;
  }

  mutable std::mutex mu_;
  std::map<Key, Open> open_;
  std::map<std::string, std::map<std::uint64_t, GatherOutcome>> done_;
  std::map<std::string, std::uint64_t> seq_;
};

}  // namespace distrpc::detail
