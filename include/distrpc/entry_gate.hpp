// EntryGate: lets an object's teardown wait for the threads that are inside its methods.
//
// Two places need it. A transport's shutdown() must wait for the callers reading in its drive()
// (they run callbacks there, and read the sockets it is about to close), and an agent's
// destructor must wait for the layers above it that are inside one of its calls (a user thread
// dropping an RRef while another thread destroys the agent). Both have the same shape: any number
// of threads enter and leave, entries nest, the owner closes the gate (later entries are refused)
// and waits until no one else is inside. A thread that closes the gate from inside its own entry
// (the owner torn down from one of its own callbacks) is not waited for, or it would wait for
// itself: each thread records the gates it is inside.
//
// Entering and leaving an open gate are one atomic operation each and a thread-local push and pop:
// no lock on the hot path. Only leaving a closed gate takes the mutex, to wake the closer.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

namespace distrpc::detail {

class EntryGate {
 public:
  EntryGate() = default;
  EntryGate(const EntryGate&) = delete;
  EntryGate& operator=(const EntryGate&) = delete;

  // Held for one entry; false (and nothing to undo) when the gate was closed.
  class Scope {
   public:
    explicit Scope(EntryGate& gate) : gate_(gate), entered_(gate.enter()) {}
    ~Scope() {
      if (entered_) gate_.leave();
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    explicit operator bool() const noexcept { return entered_; }

   private:
    EntryGate& gate_;
    const bool entered_;
  };

  // True when entered; each true is matched by one leave() on the same thread.
  bool enter() {
    // Refused without touching the count once closed: a thread that keeps calling (a caller
    // looping on drive()) must not keep the count above the closer's target.
    if (closed()) return false;
    auto& mine = inside_here();
    mine.push_back(this);  // first: it may throw, and nothing is counted yet
    // Counted and checked in one step: a closer either sees this entry, or this thread sees the
    // gate closed (it closed just now) and backs out.
    if ((state_.fetch_add(kOne) & kClosed) != 0) {
      mine.pop_back();
      leave_counted();
      return false;
    }
    return true;
  }

  void leave() {
    auto& mine = inside_here();
    const auto it = std::find(mine.rbegin(), mine.rend(), this);
    if (it != mine.rend()) mine.erase(std::next(it).base());
    leave_counted();
  }

  // Refuses every later entry and waits until no thread other than this one is inside.
  void close_and_wait() {
    const std::int64_t own = close();
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return inside() <= own; });
  }

  // The same, waiting until `deadline` at most: true when no other thread is left inside.
  bool close_and_wait_until(std::chrono::steady_clock::time_point deadline) {
    const std::int64_t own = close();
    std::unique_lock<std::mutex> lk(mu_);
    return cv_.wait_until(lk, deadline, [&] { return inside() <= own; });
  }

  bool closed() const { return (state_.load() & kClosed) != 0; }

 private:
  // The gates the calling thread is inside (nested entries, or entries of several owners).
  static std::vector<const EntryGate*>& inside_here() {
    thread_local std::vector<const EntryGate*> gates;
    return gates;
  }

  // Closes the gate; returns how many entries the calling thread holds itself.
  std::int64_t close() {
    state_.fetch_or(kClosed);
    const auto& mine = inside_here();
    return static_cast<std::int64_t>(std::count(mine.begin(), mine.end(), this));
  }

  std::int64_t inside() const { return static_cast<std::int64_t>(state_.load() / kOne); }

  void leave_counted() {
    // While the gate is open, a plain decrement. Once it is closed, the decrement is made under
    // the mutex and wakes the closer: every leave, not only the last (a closer holding entries
    // itself waits for the count to fall to those, not to zero). The closer checks the count
    // under that mutex too, so it cannot see the count fall, return and free the gate while this
    // thread is still about to touch it.
    std::uint64_t s = state_.load();
    while ((s & kClosed) == 0) {
      if (state_.compare_exchange_weak(s, s - kOne)) return;
    }
    std::lock_guard<std::mutex> lk(mu_);
    state_.fetch_sub(kOne);
    cv_.notify_all();
  }

  // Bit 0: closed; the rest: how many entries are inside (in units of kOne).
  static constexpr std::uint64_t kClosed = 1;
  static constexpr std::uint64_t kOne = 2;
  std::atomic<std::uint64_t> state_{0};
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace distrpc::detail
