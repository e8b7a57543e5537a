// CallTable: the calls a worker waits on (their futures, deadlines, destinations), the counters
// the graceful-shutdown join compares, and the timer thread that fails calls at their deadlines
// and hands timed library tasks to an executor. It knows nothing of the network or of the layers
// above the agent, so its rules are testable in one process.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "distrpc/future.hpp"
#include "distrpc/rpc_error.hpp"
#include "distrpc/worker_info.hpp"

namespace distrpc {

inline std::string timeout_text(std::chrono::milliseconds t) {
  return "RPC ran for more than set timeout (" + std::to_string(t.count()) +
         " ms) and will now be marked with an error";
}

// Counters the graceful-shutdown join compares across the group: user calls and RRef protocol
// messages (not the agent's own all-gathers).
struct WorkCounters {
  std::uint64_t client_sent = 0;    // requests this worker sent
  std::uint64_t client_done = 0;    // of those, answered, failed or timed out
  std::uint64_t server_active = 0;  // requests being run here (including pending async ones)
  // RRef protocol steps under way here between two counted messages (a fork request queued but
  // not sent yet, a child accept due after a confirmation): a gauge, 0 when idle.
  std::uint64_t protocol_pending = 0;

  friend bool operator==(const WorkCounters&, const WorkCounters&) = default;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(client_sent, client_done, server_active, protocol_pending);
  }
};

namespace detail {

template <class Reply>
class CallTable {
 public:
  using Clock = std::chrono::steady_clock;
  using Post = std::function<bool(std::function<void()>)>;

  // A call waiting for its reply.
  struct Call {
    WorkerInfo to;
    Future<Reply> future;
    std::chrono::milliseconds timeout;
    bool internal;     // the agent's own (group protocol): not counted for the join
    std::string what;  // names the call in error texts
  };

  // What take() found.
  struct Taken {
    std::optional<Call> call;  // removed from the table; the caller completes its future
    std::optional<WorkerInfo> other_peer;  // the call exists but went to this other worker
  };

  // `post` queues timed tasks (after()) on the owner's executor; the timer never runs them.
  explicit CallTable(Post post) : post_(std::move(post)), timer_([this] { run_timer(); }) {}
  ~CallTable() { stop(); }
  CallTable(const CallTable&) = delete;
  CallTable& operator=(const CallTable&) = delete;

  // Records a call and returns its id. A positive timeout fails it at its deadline with an
  // RpcTimeoutError naming the call and the worker.
  std::uint64_t add(WorkerInfo to, Future<Reply> future, std::chrono::milliseconds timeout,
                    bool internal, std::string what) {
    const std::uint64_t id = next_id_.fetch_add(1) + 1;
    bool wake_timer = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      Entry e{Call{std::move(to), std::move(future), timeout, internal, std::move(what)},
              deadlines_.end()};
      if (timeout.count() > 0) {
        const auto at = Clock::now() + timeout;
        e.deadline = deadlines_.emplace(at, id);
        // Wake the timer only if it would sleep past this deadline: with one timeout for every
        // call that is rare, not once per call (a futex wake-up and a context switch each).
        if (at < timer_wakes_at_) {
          timer_wakes_at_ = at;
          wake_timer = true;
        }
      }
      calls_.emplace(id, std::move(e));
      if (!internal) ++counters_.client_sent;
    }
    if (wake_timer) timer_cv_.notify_one();
    return id;
  }

  // Removes call `id` to complete it; `from` >= 0: only if it went to that worker. A call taken
  // here counts as done; its caller completes the future, then calls settled().
  Taken take(std::uint64_t id, int from = -1) {
    std::lock_guard<std::mutex> lk(mu_);
    Taken out;
    auto it = calls_.find(id);
    if (it == calls_.end()) return out;
    if (from >= 0 && it->second.call.to.id != from) {
      out.other_peer = it->second.call.to;
      return out;
    }
    out.call = take_locked(it);
    return out;
  }

  // The call's future was completed after take(): its inline callbacks have run, so the join may
  // count it idle now.
  void settled(bool internal) {
    if (internal) return;
    std::lock_guard<std::mutex> lk(mu_);
    --counters_.protocol_pending;
  }

  // Removes call `id` and fails its future; false if it ended already.
  bool fail(std::uint64_t id, std::exception_ptr e) {
    Taken t = take(id);
    if (!t.call) return false;
    t.call->future.try_set_exception(std::move(e));
    settled(t.call->internal);
    return true;
  }

  // The ids (and what they are) of the calls waiting on worker `peer`; every call for peer < 0.
  std::vector<std::pair<std::uint64_t, std::string>> calls_to(int peer) const {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<std::pair<std::uint64_t, std::string>> out;
    for (const auto& [id, e] : calls_) {
      if (peer < 0 || e.call.to.id == peer) out.emplace_back(id, e.call.what);
    }
    return out;
  }

  std::size_t size() const {
    std::lock_guard<std::mutex> lk(mu_);
    return calls_.size();
  }

  // ---- the join's counters ----------------------------------------------------------------
  WorkCounters counters() const {
    std::lock_guard<std::mutex> lk(mu_);
    return counters_;
  }
  void server_begin() {
    std::lock_guard<std::mutex> lk(mu_);
    ++counters_.server_active;
  }
  void server_end() {
    std::lock_guard<std::mutex> lk(mu_);
    --counters_.server_active;
  }
  void protocol_begin(std::uint64_t steps) {
    std::lock_guard<std::mutex> lk(mu_);
    counters_.protocol_pending += steps;
  }
  void protocol_end(std::uint64_t steps) {
    std::lock_guard<std::mutex> lk(mu_);
    counters_.protocol_pending -= steps;
  }

  // ---- timed tasks -------------------------------------------------------------------------
  // Posts `fn` `delay` from now; false once stopped (fn dropped).
  bool after(std::chrono::milliseconds delay, std::function<void()> fn) {
    const auto at = Clock::now() + delay;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (timer_stop_) return false;
      timed_tasks_.emplace(at, std::move(fn));
      if (at >= timer_wakes_at_) return true;
      timer_wakes_at_ = at;
    }
    timer_cv_.notify_one();
    return true;
  }

  // Joins the timer; timed tasks that never ran are dropped (they may hold their owners).
  // Calls still in the table stay there: the owner fails them.
  void stop() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      timer_stop_ = true;
    }
    timer_cv_.notify_all();
    if (timer_.joinable()) timer_.join();
    std::multimap<Clock::time_point, std::function<void()>> never_run;
    {
      std::lock_guard<std::mutex> lk(mu_);
      never_run.swap(timed_tasks_);
    }
  }

 private:
  struct Entry {
    Call call;
    typename std::multimap<Clock::time_point, std::uint64_t>::iterator deadline;
  };

  Call take_locked(typename std::unordered_map<std::uint64_t, Entry>::iterator it) {
    if (it->second.deadline != deadlines_.end()) deadlines_.erase(it->second.deadline);
    Call c = std::move(it->second.call);
    calls_.erase(it);
    count_done_locked(c.internal);
    return c;
  }

  // A call is done, but its future's inline callbacks have not run yet; those may queue RRef
  // protocol work. The gauge covers that gap (until settled()), so the join never sees "idle" in
  // between.
  void count_done_locked(bool internal) {
    if (internal) return;
    ++counters_.client_done;
    ++counters_.protocol_pending;
  }

  // Fails calls at their deadlines and hands timed tasks to post_: it never runs them itself, so
  // a task that blocks cannot delay a timeout.
  void run_timer() {
    std::unique_lock<std::mutex> lk(mu_);
    while (!timer_stop_) {
      if (deadlines_.empty() && timed_tasks_.empty()) {
        timer_wakes_at_ = Clock::time_point::max();
        timer_cv_.wait(lk,
                       [&] { return timer_stop_ || !deadlines_.empty() || !timed_tasks_.empty(); });
        continue;
      }
      // Sleeps until the earliest deadline known now; a call that ends earlier leaves it as is
      // (the wake-up then finds nothing due and sleeps on to the next one).
      auto next = Clock::time_point::max();
      if (!deadlines_.empty()) next = deadlines_.begin()->first;
      if (!timed_tasks_.empty()) next = std::min(next, timed_tasks_.begin()->first);
      if (Clock::now() < next) {
        timer_wakes_at_ = next;
        timer_cv_.wait_until(lk, next);
        continue;
      }
      if (!timed_tasks_.empty() && timed_tasks_.begin()->first == next) {
        std::function<void()> fn = std::move(timed_tasks_.begin()->second);
        timed_tasks_.erase(timed_tasks_.begin());
        lk.unlock();
        post_(std::move(fn));  // refused once stopping: the task's owner cleans up
        lk.lock();
        continue;
      }
      const std::uint64_t id = deadlines_.begin()->second;
      deadlines_.erase(deadlines_.begin());
      auto it = calls_.find(id);
      if (it == calls_.end()) continue;
      it->second.deadline = deadlines_.end();
      Call c = take_locked(it);
      lk.unlock();
      c.future.try_set_exception(std::make_exception_ptr(
          RpcTimeoutError(timeout_text(c.timeout) + " (" + c.what + " on " + c.to.str() + ")")));
      lk.lock();
      if (!c.internal) --counters_.protocol_pending;
    }
  }

  const Post post_;
  mutable std::mutex mu_;
  std::unordered_map<std::uint64_t, Entry> calls_;
  std::multimap<Clock::time_point, std::uint64_t> deadlines_;
  std::multimap<Clock::time_point, std::function<void()>> timed_tasks_;  // after()
  WorkCounters counters_;
  std::atomic<std::uint64_t> next_id_{0};
  std::condition_variable timer_cv_;
  // When the timer thread wakes next (max: not before a notify); guarded by mu_.
  Clock::time_point timer_wakes_at_ = Clock::time_point::max();
  bool timer_stop_ = false;
  std::thread timer_;  // last: started once everything above exists
};

}  // namespace detail
}  // namespace distrpc
