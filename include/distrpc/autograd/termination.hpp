// When is a distributed backward pass done? The worker that called backward() (the root) keeps
// the count below; every other worker only reports to it.
//
// Each message carrying gradients has an id. A worker that processed one (ran the pass it
// starts) tells the root, in one report, "processed X; created Y1..Yk" (the messages its pass
// sent); the root counts +1 per creation and -1 per processing. Reports travel on different
// links and may arrive in any order, so a count can go negative for a while; the backward is
// done when every count is zero. That cannot happen early: a message not yet processed either
// has its creation counted (+1, nothing can cancel it yet) or not, in which case the report of
// the message whose pass created it has not arrived, so that one is still +1 — and so on up to a
// message the root created itself, counted when sent. The root's own first pass counts as a
// message too, so nothing finishes while it still sends.
//
// Compared with answering each gradient message only when everything it started is done (a
// chain of nested replies), the root learns of every pass directly: a backward across two
// workers costs one round trip, not one per hop.
#pragma once

#include <cstdint>
#include <exception>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "distrpc/future.hpp"

namespace distrpc::dist_autograd::detail {

class BackwardTracker {
 public:
  // A message this worker is about to send (or its own first pass: dst = itself).
  void created(std::int64_t id, int dst) { apply(id, {id}, {dst}, /*processed=*/false); }

  // A report: `processed` (or -1) is done, and its pass sent `ids` to `dsts`.
  void report(std::int64_t processed, const std::vector<std::int64_t>& ids,
              const std::vector<int>& dsts) {
    apply(processed, ids, dsts, /*processed=*/true);
  }

  // The first failure wins; later reports change nothing.
  void fail(std::exception_ptr e) { done_.try_set_exception(std::move(e)); }

  // True when a message sent to `worker` is known and not processed yet.
  bool waits_for(int worker) const {
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& [id, e] : counts_) {
      if (e.count > 0 && e.dst == worker) return true;
    }
    return false;
  }

  const Future<void>& done() const { return done_; }

 private:
  struct Entry {
    int count = 0;
    int dst = -1;  // -1: its creation not reported yet
  };

  void apply(std::int64_t processed, const std::vector<std::int64_t>& ids,
             const std::vector<int>& dsts, bool has_processed) {
    bool finished = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (std::size_t i = 0; i < ids.size(); ++i) {
        Entry& e = counts_[ids[i]];
        e.dst = i < dsts.size() ? dsts[i] : -1;
        if (++e.count == 0) counts_.erase(ids[i]);
      }
      if (has_processed && processed >= 0) {
        if (--counts_[processed].count == 0) counts_.erase(processed);
      }
      finished = counts_.empty();
    }
    // Outside the lock: completing runs the waiter's callbacks.
    if (finished) done_.try_set_value();
  }

  mutable std::mutex mu_;
  std::unordered_map<std::int64_t, Entry> counts_;
  Future<void> done_;
};

}  // namespace distrpc::dist_autograd::detail
