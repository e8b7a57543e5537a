// BoundedThread: a std::thread whose join is bounded for the user code it runs.
//
// A non-graceful shutdown must never hang (docs/threading.md, "Bounded shutdown"), yet some of
// the threads it stops may be running user code that never returns: request handlers and
// callbacks on the agent's pools, and handed-back requests on the transports' reading threads
// (leader/follower). std::thread offers no timed join, so a BoundedThread sets a flag when its
// function returns, and marks the stretches where it runs user code (UserCodeScope).
// join_until(deadline) waits for the flag up to the deadline; then a thread inside user code is
// detached ("abandoned"), and any other one is joined: it is in library code on its way out, and
// it is kept from entering user code from then on. So the count of abandoned threads is exact,
// and no join waits on user code past the deadline. One helper for the pools and every transport.
//
// Memory safety is the owner's part: a detached thread keeps running, so whatever it touches after
// its user code returns must stay alive. The thread function therefore owns, by shared_ptr, the
// state it goes back to (the pool's State, the transport's Impl), and the agent keeps itself alive
// when it abandons threads (agent.hpp, RpcAgent::stop()).
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>

namespace distrpc {

// How long a local stop waits for running handlers when no timeout is given: then their threads
// are abandoned (detached). RpcBackendOptions::shutdown_grace defaults to it.
inline constexpr std::chrono::milliseconds kDefaultShutdownGrace{2000};

// Joins `t`, unless this is `t` itself (a stop called from inside one of the owner's callbacks,
// which ran on that thread): a thread cannot join itself, so it is detached, and it must touch
// nothing of its owner once it returns there. Returns whether it was detached.
inline bool join_or_detach(std::thread& t) {
  if (!t.joinable()) return false;
  if (t.get_id() == std::this_thread::get_id()) {
    t.detach();
    return true;
  }
  t.join();
  return false;
}

class BoundedThread {
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool finished = false;  // the thread function returned
    int in_user_code = 0;   // UserCodeScopes open (nested ones count too)
    bool sealed = false;    // the owner stopped waiting: no UserCodeScope may open any more
  };
  static State*& current() {
    thread_local State* state = nullptr;
    return state;
  }

 public:
  using Clock = std::chrono::steady_clock;

  BoundedThread() = default;

  template <class F>
  requires(!std::is_same_v<std::remove_cvref_t<F>, BoundedThread>) explicit BoundedThread(F&& fn)
      : state_(std::make_shared<State>()) {
    thread_ = std::thread([state = state_, fn = std::forward<F>(fn)]() mutable {
      current() = state.get();
      // Set when fn returns, however it returns; what fn captured is released after this, and a
      // join waits for that.
      struct Mark {
        State& s;
        ~Mark() {
          std::lock_guard<std::mutex> lk(s.mu);
          s.finished = true;
          s.cv.notify_all();
        }
      } mark{*state};
      fn();
    });
  }

  BoundedThread(BoundedThread&&) noexcept = default;
  BoundedThread& operator=(BoundedThread&&) noexcept = default;
  // Like std::thread: destroying a joinable one terminates (join or detach it first).
  ~BoundedThread() = default;

  // Open around user code on a BoundedThread. `entered()` is false when the owner already gave up
  // waiting for this thread (its shutdown passed the deadline): the code must then not run, the
  // thread is about to be joined. On any other thread it marks nothing and is always entered.
  class UserCodeScope {
   public:
    UserCodeScope() : state_(current()) {
      if (!state_) return;
      std::lock_guard<std::mutex> lk(state_->mu);
      if (state_->sealed) {
        entered_ = false;
        return;
      }
      ++state_->in_user_code;
    }
    ~UserCodeScope() {
      if (!state_ || !entered_) return;
      std::lock_guard<std::mutex> lk(state_->mu);
      --state_->in_user_code;
    }
    UserCodeScope(const UserCodeScope&) = delete;
    UserCodeScope& operator=(const UserCodeScope&) = delete;
    bool entered() const { return entered_; }

   private:
    State* state_;
    bool entered_ = true;
  };

  bool joinable() const { return thread_.joinable(); }
  std::thread::id get_id() const { return thread_.get_id(); }
  void join() { thread_.join(); }
  void detach() { thread_.detach(); }

  // True once the thread function returned.
  bool finished() const {
    if (!state_) return true;
    std::lock_guard<std::mutex> lk(state_->mu);
    return state_->finished;
  }

  // Joins the thread, waiting past `deadline` only while it is not in user code; returns false
  // when it was inside user code then and was detached instead (it keeps running, owning what its
  // function captured). True as well when not joinable. Clock::time_point::max(): no limit.
  bool join_until(Clock::time_point deadline) {
    if (!thread_.joinable()) return true;
    if (state_) {
      std::unique_lock<std::mutex> lk(state_->mu);
      const auto done = [&] { return state_->finished; };
      if (deadline == Clock::time_point::max()) {
        state_->cv.wait(lk, done);
      } else if (!state_->cv.wait_until(lk, deadline, done)) {
        if (state_->in_user_code > 0) {
          lk.unlock();
          thread_.detach();
          return false;
        }
        // In library code, on its way out (its owner stopped it before calling this): it may
        // not start user code any more, so the join below is short.
        state_->sealed = true;
      }
    }
    thread_.join();
    return true;
  }

 private:
  std::shared_ptr<State> state_;
  std::thread thread_;
};

}  // namespace distrpc
