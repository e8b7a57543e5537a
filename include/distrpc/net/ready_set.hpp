// The epoll set a transport's reading threads share, read two ways: by threads that sleep until
// a connection is ready, and by threads that poll it without sleeping (a reading thread right
// after a message, a caller waiting for its reply). While anyone polls, no sleeping thread is
// woken for readiness: on a virtual machine such a wake-up costs the sender an interrupt to
// another core and the woken thread tens of microseconds, only to find that the poller took the
// connection first.
//
// How: connections are registered one-shot in the inner set (fd()); pollers read the inner set
// directly; sleepers wait on an outer set that holds the inner one (one-shot too) and a stop
// eventfd. The first poller switches the inner set's registration in the outer one off and
// the last one switches it on again, so sleepers hear nothing while polling goes on; a sleeper
// that woke takes one connection from the inner set and switches the registration on again (when
// it should be on), so a second ready connection wakes the other sleeper.
//
// A poller that took a connection may then be busy for long (a caller running a task for what it
// read), or be preempted. Sleepers do not sleep forever: every 50 ms (Watch) they look whether
// anyone polled within 1 ms; if not, they listen again until a poller polls again. So a stalled
// poller delays the other connections by 50 ms at most, and a short task costs no sleeper a
// wake-up (a timer per task would: programming one costs a virtual machine tens of microseconds).
// A poller that waits again inside what it handles (a nested poll on the same thread) hands the
// set to the sleepers at once when that inner wait ends, since the outer one is busy.
#pragma once

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "distrpc/error.hpp"
#include "distrpc/log.hpp"
#include "distrpc/net/errno_text.hpp"

namespace distrpc::net {

class ReadySet {
 public:
  // What wait() and poll() return besides 1 (an event, in `ev`).
  static constexpr int kNothing = 0;   // nothing taken: look again
  static constexpr int kStopped = -2;  // stop() was called
  // How often sleepers look whether the pollers still poll, and how long without a poll means
  // they do not (busy with what they took, or preempted). Tests choose others.
  struct Watch {
    int every_ms = 50;
    std::chrono::milliseconds stale{1};
  };

  // `who` names the owner in the text of errors and log lines (e.g. "distrpc tcp").
  explicit ReadySet(std::string who) : ReadySet(std::move(who), Watch{}) {}
  ReadySet(std::string who, Watch watch) : who_(std::move(who)), watch_(watch) {
    inner_ = ::epoll_create1(EPOLL_CLOEXEC);
    if (inner_ < 0) fail(errno);
    outer_ = ::epoll_create1(EPOLL_CLOEXEC);
    if (outer_ < 0) fail(errno);
    stopfd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (stopfd_ < 0) fail(errno);
    // Level-triggered and never drained: once written, it wakes every sleeper, for good.
    epoll_event stop{EPOLLIN, {.u64 = kStopKey}};
    if (::epoll_ctl(outer_, EPOLL_CTL_ADD, stopfd_, &stop) < 0) fail(errno);
    epoll_event in{EPOLLIN | EPOLLONESHOT, {.u64 = kInnerKey}};
    if (::epoll_ctl(outer_, EPOLL_CTL_ADD, inner_, &in) < 0) fail(errno);
  }
  ~ReadySet() { close_all(); }
  ReadySet(const ReadySet&) = delete;
  ReadySet& operator=(const ReadySet&) = delete;

  // The inner set: connections are added and re-armed here (one-shot), with a nonzero data.u64.
  int fd() const { return inner_; }

  // Sleeps until a connection is ready and nobody polls (or the pollers stopped polling: see
  // above), then takes it: 1 (in `ev`), kNothing (someone else took it, a look at the pollers,
  // or EINTR: call again), kStopped, or -1 with errno set.
  int wait(epoll_event& ev) {
    epoll_event outer{};
    // Once the outer registration could not be switched (see arm()), sleepers look at the inner
    // set every millisecond instead of relying on it.
    const bool deaf = deaf_.load(std::memory_order_relaxed);
    const int n = ::epoll_wait(outer_, &outer, 1, deaf ? 1 : watch_.every_ms);
    if (n < 0 && errno != EINTR) return -1;
    if (n <= 0) {
      // A timeout, or a signal (which must not postpone the look for good): look at the
      // pollers, and take what is ready if sleepers should listen (also a safety net).
      watch_pollers();
      bool listen = deaf;
      {
        std::lock_guard<std::mutex> lk(mu_);
        listen = listen || sleepers_listen();
      }
      return listen && ::epoll_wait(inner_, &ev, 1, 0) == 1 ? 1 : kNothing;
    }
    if (outer.data.u64 == kStopKey) return kStopped;
    // The outer registration fired and is off now (one-shot): take one connection, then turn
    // it back on (when it should be on) so that another ready connection wakes another sleeper.
    const int got = ::epoll_wait(inner_, &ev, 1, 0);
    const int err = errno;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (sleepers_listen()) arm(true);
    }
    if (got < 0) {
      errno = err;
      return err == EINTR ? kNothing : -1;
    }
    return got == 1 ? 1 : kNothing;
  }

  // Takes a ready connection without sleeping: 1 (in `ev`), else kNothing (or -1 with errno).
  // Only between begin_polling() (or a true try_begin_polling()) and end_polling().
  int poll(epoll_event& ev) {
    last_poll_.store(now_ns(), std::memory_order_relaxed);
    if (overdue_.load(std::memory_order_relaxed)) resume();
    const int n = ::epoll_wait(inner_, &ev, 1, 0);
    if (n < 0) return errno == EINTR ? kNothing : -1;
    return n;
  }

  // A caller that will poll whatever others do (a thread waiting for its reply), until
  // end_polling(); it may handle what it took in between (see above).
  void begin_polling() {
    last_poll_.store(now_ns(), std::memory_order_relaxed);
    polling_here().push_back(this);
    std::lock_guard<std::mutex> lk(mu_);
    if (pollers_.fetch_add(1, std::memory_order_relaxed) == 0) arm(false);
  }
  // A reading thread polls only when nobody else does: false (and nothing changed) otherwise.
  bool try_begin_polling() {
    std::lock_guard<std::mutex> lk(mu_);
    if (pollers_.load(std::memory_order_relaxed) != 0) return false;
    last_poll_.store(now_ns(), std::memory_order_relaxed);
    pollers_.store(1, std::memory_order_relaxed);
    polling_here().push_back(this);
    arm(false);
    return true;
  }
  void end_polling() {
    auto& here = polling_here();
    if (!here.empty()) here.pop_back();
    // Still polling this set further up this thread's stack: that poller is busy handling what
    // it took (a nested wait inside a task it runs), so sleepers listen until it polls again.
    const bool outer_busy = std::find(here.begin(), here.end(), this) != here.end();
    std::lock_guard<std::mutex> lk(mu_);
    if (pollers_.fetch_sub(1, std::memory_order_relaxed) == 1) {
      overdue_.store(false, std::memory_order_relaxed);
      arm(true);
    } else if (outer_busy && !overdue_.exchange(true, std::memory_order_relaxed)) {
      arm(true);
    }
  }
  // How many threads poll now (a reading thread stops when it is no longer the only one).
  int pollers() const { return pollers_.load(std::memory_order_relaxed); }

  // begin_polling() ... end_polling() for a scope.
  class Polling {
   public:
    explicit Polling(ReadySet& set) : set_(set) { set_.begin_polling(); }
    ~Polling() { set_.end_polling(); }
    Polling(const Polling&) = delete;
    Polling& operator=(const Polling&) = delete;

   private:
    ReadySet& set_;
  };

  // Wakes every sleeper now and from now on (wait() returns kStopped). Idempotent.
  void stop() {
    const std::uint64_t one = 1;
    [[maybe_unused]] const auto w = ::write(stopfd_, &one, sizeof one);
  }

 private:
  static constexpr std::uint64_t kStopKey = 0;
  static constexpr std::uint64_t kInnerKey = 1;

  // The sets this thread polls, innermost last (a wait nested in a task a poller runs).
  static std::vector<const ReadySet*>& polling_here() {
    thread_local std::vector<const ReadySet*> sets;
    return sets;
  }
  static std::int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  // Under mu_: whether sleepers should hear the inner set's readiness.
  bool sleepers_listen() const {
    return pollers_.load(std::memory_order_relaxed) == 0 ||
           overdue_.load(std::memory_order_relaxed);
  }
  // On a sleeper, every Watch::every_ms: pollers that have not polled for Watch::stale leave the
  // set to the sleepers until one polls again.
  void watch_pollers() {
    const std::int64_t stale =
        std::chrono::duration_cast<std::chrono::nanoseconds>(watch_.stale).count();
    const auto is_stale = [&] {
      return pollers_.load(std::memory_order_relaxed) > 0 &&
             now_ns() - last_poll_.load(std::memory_order_relaxed) >= stale;
    };
    if (!is_stale()) return;
    std::lock_guard<std::mutex> lk(mu_);
    // Again under the lock: a poll() and its resume() may have come in between.
    if (is_stale() && !overdue_.exchange(true, std::memory_order_relaxed)) arm(true);
  }
  // A poller polls again after the sleepers took over: they stop listening.
  void resume() {
    std::lock_guard<std::mutex> lk(mu_);
    if (pollers_.load(std::memory_order_relaxed) > 0 &&
        overdue_.exchange(false, std::memory_order_relaxed)) {
      arm(false);
    }
  }

  // Turns the sleepers' view of the inner set on (they wake when it holds a ready connection;
  // at once if it holds one now) or off. Under mu_. It cannot fail short of the kernel running
  // out of memory (the registration exists for the life of the set); if it does, sleepers could
  // miss readiness, so from then on they poll every millisecond (wait()), and it is logged once.
  void arm(bool on) {
    epoll_event ev{on ? static_cast<std::uint32_t>(EPOLLIN | EPOLLONESHOT) : 0u,
                   {.u64 = kInnerKey}};
    if (::epoll_ctl(outer_, EPOLL_CTL_MOD, inner_, &ev) < 0) {
      const int err = errno;
      if (deaf_.exchange(true, std::memory_order_relaxed)) return;
      distrpc::detail::log_error(who_, "cannot " + std::string(on ? "re-arm" : "quiet") +
                                           " the reading threads' epoll set (" + errno_text(err) +
                                           "): they poll every millisecond from now");
    }
  }

  [[noreturn]] void fail(int err) {
    close_all();
    throw DistNetworkError(who_ +
                           ": cannot make the reading threads' epoll set: " + errno_text(err));
  }

  void close_all() {
    for (int* fd : {&stopfd_, &outer_, &inner_}) {
      if (*fd >= 0) ::close(*fd);
      *fd = -1;
    }
  }

  std::string who_;
  Watch watch_;
  int inner_ = -1;   // connections, one-shot
  int outer_ = -1;   // the inner set (one-shot, off while anyone polls) and stopfd_
  int stopfd_ = -1;  // written by stop()
  std::mutex mu_;    // orders arm() with the state below
  std::atomic<int> pollers_{0};
  std::atomic<std::int64_t> last_poll_{0};  // steady_clock ns of the latest poll()
  std::atomic<bool> overdue_{false};        // pollers stopped polling: sleepers listen
  std::atomic<bool> deaf_{false};           // a switch failed: sleepers poll (wait())
};

}  // namespace distrpc::net
