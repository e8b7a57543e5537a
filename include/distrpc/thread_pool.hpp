// ThreadPool: the executors of the agent.
//
// Two instances per agent (docs/threading.md): a fixed pool of `num_worker_threads` running
// incoming requests (their handlers may block), and an elastic pool running completion callbacks
// of futures, which grows when all its threads are blocked (a callback may itself wait on a nested
// RPC), so blocked user code never starves the processing of responses and callbacks.
#pragma once

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

namespace distrpc {

class ThreadPool {
 public:
  // `base` threads start now and live until shutdown; up to `max - base` more are started when a
  // task is posted while none is idle, and retire after `linger` without work.
  ThreadPool(std::string name, std::size_t base, std::size_t max,
             std::chrono::milliseconds linger = std::chrono::seconds(10))
      : name_(std::move(name)), base_(base), max_(max < base ? base : max), linger_(linger) {
    std::lock_guard<std::mutex> lk(mu_);
    for (std::size_t i = 0; i < base_; ++i) start_thread_locked(/*core=*/true);
  }
  ~ThreadPool() { shutdown(); }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Queues `task`. Returns false (and drops it) after shutdown began.
  bool post(std::function<void()> task) {
    std::unique_lock<std::mutex> lk(mu_);
    if (stopping_) return false;
    queue_.push_back(std::move(task));
    if (idle_ < queue_.size() && threads_ < max_) start_thread_locked(/*core=*/false);
    lk.unlock();
    cv_.notify_one();
    return true;
  }

  // Runs what is queued, then joins every thread. Idempotent; must not be called from a pool
  // thread.
  void shutdown() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (joined_) return;
      stopping_ = true;
    }
    cv_.notify_all();
    std::map<std::thread::id, std::thread> all;
    {
      std::lock_guard<std::mutex> lk(mu_);
      all.swap(workers_);
      finished_.clear();
    }
    for (auto& [id, t] : all) {
      if (t.joinable()) t.join();
    }
    std::lock_guard<std::mutex> lk(mu_);
    joined_ = true;
  }

  // True when called from one of this pool's threads.
  bool in_pool() const { return current_pool() == this; }

  std::size_t size() const {
    std::lock_guard<std::mutex> lk(mu_);
    return threads_;
  }
  std::size_t idle() const {
    std::lock_guard<std::mutex> lk(mu_);
    return idle_;
  }
  std::size_t queued() const {
    std::lock_guard<std::mutex> lk(mu_);
    return queue_.size();
  }
  std::size_t base_size() const { return base_; }

 private:
  static const ThreadPool*& current_pool() {
    thread_local const ThreadPool* pool = nullptr;
    return pool;
  }

  void start_thread_locked(bool core) {
    // Reap extra threads that retired, so a long-lived elastic pool does not accumulate them.
    for (auto id : finished_) {
      auto it = workers_.find(id);
      if (it != workers_.end()) {
        it->second.join();
        workers_.erase(it);
      }
    }
    finished_.clear();
    ++threads_;
    std::thread t([this, core] { run(core); });
    auto id = t.get_id();
    workers_.emplace(id, std::move(t));
  }

  void run(bool core) {
    current_pool() = this;
    std::unique_lock<std::mutex> lk(mu_);
    while (true) {
      ++idle_;
      bool got = core ? (cv_.wait(lk, [&] { return stopping_ || !queue_.empty(); }), true)
                      : cv_.wait_for(lk, linger_, [&] { return stopping_ || !queue_.empty(); });
      --idle_;
      if (queue_.empty()) {
        if (stopping_ || !got) break;  // drained at shutdown, or an extra thread without work
        continue;
      }
      auto task = std::move(queue_.front());
      queue_.pop_front();
      lk.unlock();
      try {
        task();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "distrpc: uncaught exception in %s thread: %s\n", name_.c_str(),
                     e.what());
      } catch (...) {
        std::fprintf(stderr, "distrpc: uncaught non-standard exception in %s thread\n",
                     name_.c_str());
      }
      lk.lock();
    }
    --threads_;
    if (!stopping_) finished_.push_back(std::this_thread::get_id());
  }

  const std::string name_;
  const std::size_t base_;
  const std::size_t max_;
  const std::chrono::milliseconds linger_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::map<std::thread::id, std::thread> workers_;
  std::vector<std::thread::id> finished_;
  std::size_t threads_ = 0;
  std::size_t idle_ = 0;
  bool stopping_ = false;
  bool joined_ = false;
};

}  // namespace distrpc
