// Work: the handle a collective or point-to-point call returns (PyTorch's dist.Work). A backend
// completes it once, with the output tensors or an error; callers wait with a timeout, poll, or
// chain on its distrpc::Future. All state lives in that future (completion is published there
// atomically) and in atomics, so no lock exists to be held while callbacks run.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <distrpc/error.hpp>
#include <distrpc/future.hpp>

namespace distrpc::dist {

// wait()'s default: no limit (PyTorch's kNoTimeout).
inline constexpr std::chrono::milliseconds kNoTimeout{0};

class Work {
 public:
  // op_name names the operation in errors ("allreduce", "recv"); sequence_number is the
  // backend's per-collective counter (-1 where the backend keeps none).
  explicit Work(std::string op_name = "", std::int64_t sequence_number = -1)
      : op_name_(std::move(op_name)), sequence_number_(sequence_number) {}

  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;
  virtual ~Work() = default;

  // Blocks until the work completes; true on success, rethrows the backend's error on failure.
  // With a timeout (> 0) that passes first, throws DistBackendError "Operation timed out!"
  // (PyTorch's text) and leaves the work running.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) {
    if (timeout < std::chrono::milliseconds::zero()) {
      throw std::invalid_argument("Work::wait: the timeout must not be negative, got " +
                                  std::to_string(timeout.count()) + " ms");
    }
    check_not_on_completing_thread();
    if (timeout == kNoTimeout) {
      future_.FutureBase::wait();
    } else if (!future_.wait_for(timeout)) {
      throw DistBackendError("Operation timed out!");
    }
    if (future_.has_error()) std::rethrow_exception(future_.exception_ptr());
    return true;
  }

  bool is_completed() const noexcept { return future_.done(); }
  // False while running and after a failure.
  bool is_success() const noexcept { return future_.has_value(); }
  // The failure, or null while running and after success.
  std::exception_ptr exception() const noexcept {
    return future_.has_error() ? future_.exception_ptr() : nullptr;
  }
  // The output tensors; waits without limit, rethrows on failure.
  const std::vector<at::Tensor>& result() const {
    check_not_on_completing_thread();
    return future_.value();
  }
  // Completes with the output tensors (or the error): PyTorch's Work.get_future().
  Future<std::vector<at::Tensor>> get_future() const { return future_; }

  std::int64_t sequence_number() const noexcept { return sequence_number_; }
  const std::string& op_name() const noexcept { return op_name_; }

  // The rank a receive got its message from (recv from any source); PyTorch's text otherwise.
  int source_rank() const {
    const int r = source_rank_.load(std::memory_order_acquire);
    if (r < 0) {
      throw std::logic_error(
          "sourceRank() may only be called on recv or recvAnysource work objects.");
    }
    return r;
  }

  // ---- For backends. The thread that runs this work and completes it (a backend with one thread
  // for its queue), set before the work is handed out: waiting for it on that thread, from a
  // callback of an earlier work, could never end, and throws instead.
  void set_completing_thread(std::thread::id id) noexcept {
    completing_thread_.store(id, std::memory_order_release);
  }
  // Each returns false (and changes nothing) if the work is already complete,
  // so a timeout path and a completion path may race safely. Callbacks on the future run on the
  // completing thread, after completion is published, with nothing locked.
  bool finish(std::vector<at::Tensor> outputs) { return future_.try_set_value(std::move(outputs)); }
  bool finish_error(std::exception_ptr e) {
    if (!e) throw std::invalid_argument("Work::finish_error: the exception is null");
    return future_.try_set_exception(std::move(e));
  }
  // A backend that can bring the work closer to completion from a waiting thread (a GPU event
  // it can poll there) lets every wait on this work, wait(), result() and waits on
  // get_future(), ask it first (distrpc::detail::WaitDriver). Completed there, the work's
  // callbacks run on that thread. Set before the work is handed out; held weakly.
  void set_wait_driver(std::weak_ptr<distrpc::detail::WaitDriver> driver) {
    distrpc::detail::set_wait_driver(future_, std::move(driver));
  }
  // A receive from any source: the sender's rank, set before completing so waiters see it.
  bool finish_recv(std::vector<at::Tensor> outputs, int source_rank) {
    if (source_rank < 0) {
      throw std::invalid_argument("Work::finish_recv: the source rank must not be negative, got " +
                                  std::to_string(source_rank));
    }
    // The first completer claims the rank slot, so a racing second one cannot overwrite the
    // rank a waiter already read.
    int unset = -1;
    if (is_completed() ||
        !source_rank_.compare_exchange_strong(unset, source_rank, std::memory_order_acq_rel)) {
      return false;
    }
    return finish(std::move(outputs));
  }

 private:
  void check_not_on_completing_thread() const {
    if (is_completed() ||
        completing_thread_.load(std::memory_order_acquire) != std::this_thread::get_id()) {
      return;
    }
    throw std::logic_error(
        "Work::wait: " + (op_name_.empty() ? std::string("a work") : op_name_) +
        (sequence_number_ >= 0 ? " (sequence number " + std::to_string(sequence_number_) + ")"
                               : std::string()) +
        " was waited for on the thread that runs it (in a callback of another work of its "
        "group): it could never complete. Wait on another thread, or chain it with "
        "get_future().then()");
  }

  const std::string op_name_;
  const std::int64_t sequence_number_;
  std::atomic<std::thread::id> completing_thread_{};
  std::atomic<int> source_rank_{-1};
  Future<std::vector<at::Tensor>> future_;
};

}  // namespace distrpc::dist
