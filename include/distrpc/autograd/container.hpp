// The contexts of one worker, and the current context of each thread. Ids name the worker that
// made the context: (worker_id << 48) | counter, the counter from 0 per worker, so a worker that
// receives a context id knows where it came from and ids never collide across workers. A worker
// that receives autograd metadata for an id it does not have creates that context then (lazily).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

#include "distrpc/autograd/context.hpp"

namespace distrpc::dist_autograd {

// Ids are signed 64-bit (-1: none, and PyTorch's type): a worker id of 16 bits would make ids
// negative from worker 32768 on, so worker ids have 15 bits.
inline constexpr int kWorkerIdBits = 15;
inline constexpr int kCounterBits = 48;
inline constexpr std::int64_t kCounterMask = (std::int64_t{1} << kCounterBits) - 1;

namespace detail {
// The thread's current context id, -1 when none (one per thread; handlers run inside the
// caller's).
inline thread_local std::int64_t tls_context_id = -1;

// Sets the thread's current context for its lifetime, restoring the previous one.
class CurrentContextScope {
 public:
  explicit CurrentContextScope(std::int64_t id) : saved_(tls_context_id) { tls_context_id = id; }
  ~CurrentContextScope() { tls_context_id = saved_; }
  CurrentContextScope(const CurrentContextScope&) = delete;
  CurrentContextScope& operator=(const CurrentContextScope&) = delete;

 private:
  const std::int64_t saved_;
};

inline std::string not_found_text(std::int64_t id) {
  return "Could not find autograd context with id: " + std::to_string(id);
}
}  // namespace detail

class ContextContainer {
 public:
  explicit ContextContainer(int worker_id) : worker_id_(worker_id) {
    if (worker_id < 0 || worker_id >= (1 << kWorkerIdBits)) {
      throw std::invalid_argument("distributed autograd: worker id " + std::to_string(worker_id) +
                                  " is outside 0.." + std::to_string((1 << kWorkerIdBits) - 1) +
                                  " (context ids are (worker_id << 48) | counter, and positive)");
    }
  }

  int worker_id() const { return worker_id_; }
  // The largest context id this worker can make.
  std::int64_t max_id() const {
    return (static_cast<std::int64_t>(worker_id_) << kCounterBits) + kCounterMask;
  }

  // A new context of this worker (not made current).
  ContextPtr make() {
    std::lock_guard<std::mutex> lk(mu_);
    if (next_counter_ > kCounterMask) {
      throw std::runtime_error("distributed autograd: worker " + std::to_string(worker_id_) +
                               " made all " + std::to_string(kCounterMask + 1) +
                               " context ids it can make");
    }
    const std::int64_t id =
        (static_cast<std::int64_t>(worker_id_) << kCounterBits) | next_counter_++;
    auto ctx = std::make_shared<DistAutogradContext>(id);
    contexts_.emplace(id, ctx);
    return ctx;
  }
  // Context `id`, made if missing (a message carrying it arrived); null when it was released
  // here (a message still in flight when the release came must not make it again: nothing would
  // release it a second time).
  ContextPtr get_or_create(std::int64_t id) {
    std::lock_guard<std::mutex> lk(mu_);
    if (const auto it = contexts_.find(id); it != contexts_.end()) return it->second;
    if (released_locked(id)) return nullptr;
    auto ctx = std::make_shared<DistAutogradContext>(id);
    contexts_.emplace(id, ctx);
    return ctx;
  }
  ContextPtr find(std::int64_t id) const {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = contexts_.find(id);
    return it == contexts_.end() ? nullptr : it->second;
  }
  ContextPtr retrieve(std::int64_t id) const {
    auto ctx = find(id);
    if (!ctx) throw std::runtime_error(detail::not_found_text(id));
    return ctx;
  }
  // Removes context `id` (remembered as released, see get_or_create); null if it was not here.
  ContextPtr erase(std::int64_t id) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = contexts_.find(id);
    if (it == contexts_.end()) return nullptr;
    auto ctx = std::move(it->second);
    contexts_.erase(it);
    remember_locked(id);
    return ctx;
  }
  // Removes every context worker `creator` made (it was lost, so nothing will release them) and
  // makes none of its ids again until it joins again (joined()): a request of its that still runs
  // here, or is still queued, must not make its context again for good.
  std::vector<ContextPtr> erase_made_by(int creator) {
    std::lock_guard<std::mutex> lk(mu_);
    lost_creators_.insert(creator);
    std::vector<ContextPtr> gone;
    std::erase_if(contexts_, [&](const auto& entry) {
      if (creator_of(entry.first) != creator) return false;
      gone.push_back(entry.second);
      return true;
    });
    std::erase_if(released_, [&](std::int64_t id) {
      return creator_of(id) == creator && released_set_.erase(id) != 0;
    });
    return gone;
  }
  // Worker `creator` joined again (a new incarnation, counting its ids from 0): its contexts are
  // made again when its messages bring them.
  void joined(int creator) {
    std::lock_guard<std::mutex> lk(mu_);
    lost_creators_.erase(creator);
  }
  std::size_t size() const {
    std::lock_guard<std::mutex> lk(mu_);
    return contexts_.size();
  }
  std::vector<ContextPtr> all() const {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<ContextPtr> out;
    for (const auto& [id, c] : contexts_) out.push_back(c);
    return out;
  }

 private:
  // How many released ids of other workers are remembered: far more than the contexts a
  // training loop releases while a message of one of them can still be in flight.
  static constexpr std::size_t kRemembered = 65536;

  static int creator_of(std::int64_t id) { return static_cast<int>(id >> kCounterBits); }
  // Under mu_. This worker's own ids below its counter are released when absent; another
  // worker's when remembered.
  bool released_locked(std::int64_t id) const {
    if (creator_of(id) == worker_id_) return (id & kCounterMask) < next_counter_;
    return released_set_.count(id) != 0 || lost_creators_.count(creator_of(id)) != 0;
  }
  void remember_locked(std::int64_t id) {
    if (creator_of(id) == worker_id_ || !released_set_.insert(id).second) return;
    released_.push_back(id);
    if (released_.size() > kRemembered) {
      released_set_.erase(released_.front());
      released_.pop_front();
    }
  }

  const int worker_id_;
  mutable std::mutex mu_;
  std::int64_t next_counter_ = 0;
  std::map<std::int64_t, ContextPtr> contexts_;
  std::deque<std::int64_t> released_;  // other workers' released ids, oldest first
  std::unordered_set<std::int64_t> released_set_;
  std::set<int> lost_creators_;  // lost workers, until they join again
};

}  // namespace distrpc::dist_autograd
