// ThreadPool: the executors of the agent.
//
// Two instances per agent (docs/threading.md): a fixed pool of `num_worker_threads` running
// incoming requests (their handlers may block), and an elastic pool running completion callbacks
// of futures, which grows when all its threads are blocked (a callback may itself wait on a nested
// RPC), so blocked user code never starves the processing of responses and callbacks.
//
// Shutdown is bounded: a task that never returns (a user handler waiting on something that never
// happens) must not make a non-graceful shutdown hang. Such a thread is detached ("abandoned")
// at the deadline; its state (queue, mutex, counters) is shared-owned by every worker thread, so
// it stays valid when the task returns long after the ThreadPool object is gone.
#pragma once

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "distrpc/bounded_thread.hpp"
#include "distrpc/log.hpp"

namespace distrpc {

class ThreadPool {
 public:
  using Clock = std::chrono::steady_clock;

  // `base` threads start now and live until shutdown; up to `max - base` more are started when a
  // task is posted while none is idle, and retire after `linger` without work.
  // `on_thread_start` runs first on every thread the pool starts (e.g. to name the agent the
  // thread works for).
  ThreadPool(std::string name, std::size_t base, std::size_t max,
             std::chrono::milliseconds linger = std::chrono::seconds(10),
             std::function<void()> on_thread_start = {})
      : s_(std::make_shared<State>(std::move(name), base, max < base ? base : max, linger,
                                   std::move(on_thread_start))) {
    std::lock_guard<std::mutex> lk(s_->mu);
    for (std::size_t i = 0; i < s_->base; ++i) start_thread_locked(s_, /*core=*/true);
  }
  // Bounded like any shutdown: a task still running after kDefaultShutdownGrace is abandoned.
  ~ThreadPool() { shutdown(Clock::now() + kDefaultShutdownGrace); }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Queues `task`. Returns false (and drops it) after shutdown began.
  bool post(std::function<void()> task) {
    std::unique_lock<std::mutex> lk(s_->mu);
    if (s_->stopping) return false;
    s_->queue.push_back(std::move(task));
    if (s_->idle < s_->queue.size() && s_->threads < s_->max) start_thread_locked(s_, false);
    lk.unlock();
    s_->cv.notify_one();
    return true;
  }

  // Stops accepting tasks (post() returns false from now on); with `drop_queued`, the tasks queued
  // but not started are discarded. The threads finish what they run (and, without
  // `drop_queued`, what is queued), then exit. Idempotent; shutdown() does it too.
  void close(bool drop_queued) {
    std::deque<std::function<void()>> dropped;
    {
      std::lock_guard<std::mutex> lk(s_->mu);
      s_->stopping = true;
      if (drop_queued) dropped.swap(s_->queue);
    }
    s_->cv.notify_all();
    dropped.clear();  // outside the lock: destroying a task may run user destructors
  }

  // close(drop_queued), then joins every thread, waiting for tasks no later than `deadline`: a
  // thread still inside a task then is detached (abandoned; it exits when its task returns), and
  // the tasks still queued are discarded, so no new task starts after this returns. Returns how
  // many threads were abandoned. Idempotent (a later call returns 0); must not be called from a
  // pool thread.
  std::size_t shutdown(Clock::time_point deadline, bool drop_queued = false) {
    close(drop_queued);
    std::deque<std::function<void()>> dropped;
    std::map<std::thread::id, BoundedThread> all;
    {
      std::lock_guard<std::mutex> lk(s_->mu);
      if (s_->shut_down) return 0;
      s_->shut_down = true;
      all.swap(s_->workers);
      s_->finished.clear();
    }
    std::size_t abandoned = 0;
    for (auto& [id, t] : all) abandoned += t.join_until(deadline) ? 0 : 1;
    {
      // Left when threads were abandoned or kept from starting a task past the deadline.
      std::lock_guard<std::mutex> lk(s_->mu);
      dropped.swap(s_->queue);
    }
    dropped.clear();
    return abandoned;
  }

  // True when called from one of this pool's threads.
  bool in_pool() const { return current_pool() == s_.get(); }

  std::size_t size() const {
    std::lock_guard<std::mutex> lk(s_->mu);
    return s_->threads;
  }
  std::size_t idle() const {
    std::lock_guard<std::mutex> lk(s_->mu);
    return s_->idle;
  }
  std::size_t queued() const {
    std::lock_guard<std::mutex> lk(s_->mu);
    return s_->queue.size();
  }
  std::size_t base_size() const { return s_->base; }

 private:
  // Everything a worker thread touches; each worker holds a shared_ptr to it.
  struct State {
    State(std::string n, std::size_t b, std::size_t m, std::chrono::milliseconds l,
          std::function<void()> start)
        : name(std::move(n)), base(b), max(m), linger(l), on_thread_start(std::move(start)) {}
    const std::string name;
    const std::size_t base;
    const std::size_t max;
    const std::chrono::milliseconds linger;
    const std::function<void()> on_thread_start;
    mutable std::mutex mu;
    std::condition_variable cv;
    std::deque<std::function<void()>> queue;
    std::map<std::thread::id, BoundedThread> workers;
    std::vector<std::thread::id> finished;
    std::size_t threads = 0;
    std::size_t idle = 0;
    bool stopping = false;
    bool shut_down = false;
  };

  static const State*& current_pool() {
    thread_local const State* pool = nullptr;
    return pool;
  }

  static void start_thread_locked(const std::shared_ptr<State>& s, bool core) {
    // Reap extra threads that retired, so a long-lived elastic pool does not accumulate them.
    for (auto id : s->finished) {
      auto it = s->workers.find(id);
      if (it != s->workers.end()) {
        it->second.join();
        s->workers.erase(it);
      }
    }
    s->finished.clear();
    ++s->threads;
    BoundedThread t([s, core] { run(*s, core); });
    auto id = t.get_id();
    s->workers.emplace(id, std::move(t));
  }

  static void run(State& s, bool core) {
    current_pool() = &s;
    // Named after the pool (Linux keeps 15 characters), or it would inherit its creator's name.
    ::pthread_setname_np(::pthread_self(), s.name.substr(0, 15).c_str());
    if (s.on_thread_start) s.on_thread_start();
    std::unique_lock<std::mutex> lk(s.mu);
    while (true) {
      ++s.idle;
      bool got = core ? (s.cv.wait(lk, [&] { return s.stopping || !s.queue.empty(); }), true)
                      : s.cv.wait_for(lk, s.linger, [&] { return s.stopping || !s.queue.empty(); });
      --s.idle;
      if (s.queue.empty()) {
        if (s.stopping || !got) break;  // drained at shutdown, or an extra thread without work
        continue;
      }
      auto task = std::move(s.queue.front());
      s.queue.pop_front();
      lk.unlock();
      {
        // A shutdown past its deadline joins this thread only if it is outside this scope, and
        // then keeps it from entering: the task is dropped like the rest of the queue.
        BoundedThread::UserCodeScope user;
        if (user.entered()) {
          try {
            task();
          } catch (const std::exception& e) {
            detail::log_error(s.name + " thread", std::string("uncaught exception: ") + e.what());
          } catch (...) {
            detail::log_error(s.name + " thread", "uncaught non-standard exception");
          }
        }
        task = nullptr;  // its captures may hold user objects: destroyed in the scope, unlocked
      }
      lk.lock();
    }
    --s.threads;
    if (!s.stopping) s.finished.push_back(std::this_thread::get_id());
  }

  std::shared_ptr<State> s_;
};

}  // namespace distrpc
