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
// A lost worker fails the backward when the count still needs it: a message to it not processed,
// or one it sent not processed yet (gradients for the root get no answer, so nothing else would
// time out; between two other workers the answer's timeout ran on the lost one), except gradients
// for the root that already arrived. Such a message may only be named by a report read after the
// loss, so lost workers are remembered for the rest of the backward. (As in PyTorch, where a
// worker answers a pass only once everything it sent was answered: losing it fails the backward.)
//
// Compared with answering each gradient message only when everything it started is done (a
// chain of nested replies), the root learns of every pass directly: a backward across two
// workers costs one round trip, not one per hop.
#pragma once

#include <cstdint>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "distrpc/future.hpp"

namespace distrpc::dist_autograd::detail {

class BackwardTracker {
 public:
  explicit BackwardTracker(int root) : root_(root) {}

  // A message this worker is about to send (or its own first pass: dst = itself).
  void created(std::int64_t id, int dst) { apply(root_, id, {id}, {dst}, /*processed=*/false); }

  // A report from worker `from`: `processed` (or -1) is done, and its pass sent `ids` to `dsts`.
  void report(int from, std::int64_t processed, const std::vector<std::int64_t>& ids,
              const std::vector<int>& dsts) {
    apply(from, processed, ids, dsts, /*processed=*/true);
  }

  // Gradients message `id` reached the root, which runs its pass now: from here on, its sender's
  // loss no longer matters to it.
  void arrived(std::int64_t id) {
    std::lock_guard<std::mutex> lk(mu_);
    counts_[id].arrived = true;
  }

  // Worker `worker` was lost: the backward fails with `error` when a pass there is still to run,
  // or a message it sent is not processed yet (see the top). Remembered, since the report that
  // names such a message may be read after the loss was.
  void lost(int worker, std::exception_ptr error) {
    std::exception_ptr failure;
    {
      std::lock_guard<std::mutex> lk(mu_);
      lost_.emplace(worker, std::move(error));
      failure = lost_failure_locked();
    }
    if (failure) fail(std::move(failure));
  }

  // True when the backward cannot be done without worker `worker` (see lost()).
  bool waits_for(int worker) const {
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& [id, e] : counts_) {
      if (waits_on(e, worker)) return true;
    }
    return false;
  }

  // The first failure wins; later reports change nothing.
  void fail(std::exception_ptr e) { done_.try_set_exception(std::move(e)); }

  const Future<void>& done() const { return done_; }

 private:
  struct Entry {
    int count = 0;
    int dst = -1;          // -1: its creation not reported yet
    int src = -1;          // who reported its creation
    bool arrived = false;  // a message to the root: it came (arrived())
  };

  // Whether `e` cannot be done without worker `w`: a pass to run there, or a message from there
  // not processed yet (unless it reached the root already).
  bool waits_on(const Entry& e, int w) const {
    return e.count > 0 && (e.dst == w || (e.src == w && !(e.dst == root_ && e.arrived)));
  }

  // Under mu_: the error of a lost worker that an entry still waits on, else null. (An earlier
  // lost worker's error, when it is returned for a later loss, had failed the backward already.)
  std::exception_ptr lost_failure_locked() const {
    for (const auto& [worker, error] : lost_) {
      for (const auto& [id, e] : counts_) {
        if (waits_on(e, worker)) return error;
      }
    }
    return nullptr;
  }

  void apply(int from, std::int64_t processed, const std::vector<std::int64_t>& ids,
             const std::vector<int>& dsts, bool has_processed) {
    bool finished = false;
    std::exception_ptr failure;
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (std::size_t i = 0; i < ids.size(); ++i) {
        Entry& e = counts_[ids[i]];
        e.dst = i < dsts.size() ? dsts[i] : -1;
        e.src = from;
        if (++e.count == 0) counts_.erase(ids[i]);
      }
      if (has_processed && processed >= 0) {
        if (--counts_[processed].count == 0) counts_.erase(processed);
      }
      finished = counts_.empty();
      // An entry of count 0 kept for its arrival stays until its pass reports; one that waits on
      // a worker already lost fails the backward now.
      failure = lost_failure_locked();
    }
    // Outside the lock: completing runs the waiter's callbacks.
    if (failure) {
      fail(std::move(failure));
    } else if (finished) {
      done_.try_set_value();
    }
  }

  const int root_;
  mutable std::mutex mu_;
  std::unordered_map<std::int64_t, Entry> counts_;
  std::map<int, std::exception_ptr> lost_;
  Future<void> done_;
};

}  // namespace distrpc::dist_autograd::detail
