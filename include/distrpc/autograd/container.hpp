// The contexts of one worker, and the current context of each thread. Ids name the worker that
// made the context: (worker_id << 48) | counter, the counter from 0 per worker, so a worker that
// receives a context id knows where it came from and ids never collide across workers. A worker
// that receives autograd metadata for an id it does not have creates that context then (lazily).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "distrpc/autograd/context.hpp"

namespace distrpc::dist_autograd {

inline constexpr int kWorkerIdBits = 16;
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
                                  " does not fit in " + std::to_string(kWorkerIdBits) + " bits");
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
  // Context `id`, made if missing (a message carrying it arrived).
  ContextPtr get_or_create(std::int64_t id) {
    std::lock_guard<std::mutex> lk(mu_);
    auto& slot = contexts_[id];
    if (!slot) slot = std::make_shared<DistAutogradContext>(id);
    return slot;
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
  // Removes context `id`; null if it was not here.
  ContextPtr erase(std::int64_t id) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = contexts_.find(id);
    if (it == contexts_.end()) return nullptr;
    auto ctx = std::move(it->second);
    contexts_.erase(it);
    return ctx;
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
  const int worker_id_;
  mutable std::mutex mu_;
  std::int64_t next_counter_ = 0;
  std::map<std::int64_t, ContextPtr> contexts_;
};

}  // namespace distrpc::dist_autograd
