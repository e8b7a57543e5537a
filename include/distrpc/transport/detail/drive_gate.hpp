// DriveGate: lets a policy's shutdown() wait for the callers reading in its drive().
//
// drive() reads on a caller's thread, and can be inside a callback (on_message) when another
// thread shuts the Context down. shutdown() promises that no callback runs after it returns and
// closes the sockets that thread reads: it must wait for that thread to leave drive() first (it
// leaves at once once it sees the policy stopping). A thread that shuts the Context down from
// inside its own drive() (a callback there) is not waited for, or it would wait for itself.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <vector>

namespace distrpc::transport::detail {

class DriveGate {
 public:
  // Held for one drive() call; false (and nothing to do) once the gate closed.
  class Scope {
   public:
    explicit Scope(DriveGate& gate) : gate_(gate), entered_(gate.enter()) {}
    ~Scope() {
      if (entered_) gate_.leave();
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    explicit operator bool() const noexcept { return entered_; }

   private:
    DriveGate& gate_;
    const bool entered_;
  };

  // Closes the gate (later drive() calls return at once) and waits, until `deadline` at most,
  // until no other thread is inside. The caller has made the policy stop first, so those threads
  // leave their loop. True when none is left inside.
  bool close_and_wait(std::chrono::steady_clock::time_point deadline) {
    const auto own = static_cast<int>(std::count(driving().begin(), driving().end(), this));
    std::unique_lock<std::mutex> lk(mu_);
    closed_ = true;
    return cv_.wait_until(lk, deadline, [&] { return inside_ <= own; });
  }

 private:
  // The gates the calling thread is inside (a nested drive(), or drives of two Contexts).
  static std::vector<const DriveGate*>& driving() {
    thread_local std::vector<const DriveGate*> gates;
    return gates;
  }

  bool enter() {
    auto& gates = driving();
    gates.push_back(this);  // first: it may throw, and nothing is counted yet
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) {
      gates.pop_back();
      return false;
    }
    ++inside_;
    return true;
  }

  void leave() {
    auto& gates = driving();
    gates.erase(std::find(gates.rbegin(), gates.rend(), this).base() - 1);
    // Notified under the lock: the waiter may free this gate as soon as it sees the count.
    std::lock_guard<std::mutex> lk(mu_);
    --inside_;
    cv_.notify_all();
  }

  std::mutex mu_;
  std::condition_variable cv_;
  int inside_ = 0;
  bool closed_ = false;
};

}  // namespace distrpc::transport::detail
