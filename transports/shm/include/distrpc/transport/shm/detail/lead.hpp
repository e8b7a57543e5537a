// Who reads: the I/O threads, and callers waiting for a reply.
//
// One reader at a time holds lead_mu_: the rings are single-consumer, and ins_, watched_, ...
// belong to the reader. The lead is taken with try_lock and given up without waking anybody,
// under one invariant: whenever nobody holds it, either every ring is declared sleeping
// (ring.hpp), so the next record makes its writer signal wake_efd_, which wakes an idle I/O
// thread; or the rings were left unattended (leave_unattended()) and one idle I/O thread
// watches: it wakes every kWatchPeriod and takes the lead once a stretch lasted a whole
// period. A reader takes at most one request per turn (service()). So:
// - a reader with nothing to read for spin_us_ declares the rings sleeping, looks once more,
//   lets go of the lead and sleeps in epoll_wait (idle_wait) without handling anything there;
// - a reader handed a task by on_message (a lone request) does the same and runs the task:
//   reading resumes through the signal only if a record comes meanwhile, and otherwise no
//   thread is woken at all (an eager hand-over to a parked thread cost one per call);
// - in a stream (records behind the task, or a watcher already up) it leaves the rings
//   unattended instead, runs the task and comes back for the next record: one thread serves
//   the stream with no wake-up per request, and a task that blocks delays the rest by about
//   one watch period, after which they are read and queued to the receiver's pool;
// - a caller waiting for a reply (drive()) takes the lead while it is free and reads its reply
//   itself; a leader that sees a caller wanting it and has nothing to read lets go at once. A
//   caller leaving with replies still coming leaves the rings unattended too.
// A thread woken from idle_wait that finds the lead taken consumes the signal, raises missed_
// and tries once more; the holder, which may have looked at the rings just before the signal,
// looks again after it lets go (settle()) and signals again only if a record is waiting. So a
// woken thread never parks on the mutex, and letting go of the lead never wakes anybody.
#pragma once

#include <sched.h>
#include <sys/epoll.h>
#include <array>
#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>

#include "distrpc/transport/shm/detail/impl.hpp"

namespace distrpc::transport::shm::detail {

// One I/O thread.
inline void Impl::io_main() {
  std::unique_lock<std::mutex> lead(lead_mu_, std::defer_lock);
  bool woken = false;  // back from idle_wait: if the lead is taken, wait for it
  for (;;) {
    if (stopping_.load()) return;
    if (!lead.try_lock() && !(woken && retry_lead(lead))) {
      idle_wait();
      woken = true;
      continue;
    }
    InlineTask task = io_loop(woken);  // returns with every ring declared sleeping
    woken = false;
    close_readers_if_stopping();
    lead.unlock();
    settle(lead);
    if (stopping_.load()) {
      task.queue();
      return;
    }
    if (task.empty()) {
      idle_wait();
      woken = true;
      continue;
    }
    {
      // Bounds shutdown's join of this thread while the task runs (bounded_thread.hpp); not
      // entered when shutdown already decided to join this thread.
      BoundedThread::UserCodeScope user;
      if (stopping_.load() || !user.entered()) {
        task.queue();
        return;
      }
      task.run_here();
    }
    running_task_.store(false);
  }
}

// Woken, and the lead is taken: consume the signal (first: one sent after it must stay), tell
// the holder, and try once more. True when this thread got the lead after all.
inline bool Impl::retry_lead(std::unique_lock<std::mutex>& lead) {
  if (!stopping_.load()) drain_eventfd(wake_efd_.get());
  missed_.store(true);
  return lead.try_lock();
}

// Just let go of the lead: if a woken thread found it taken meanwhile, look at the rings again
// and signal only if a record is waiting (the holder of the moment settles it otherwise).
inline void Impl::settle(std::unique_lock<std::mutex>& lead) {
  if (!missed_.load() || !lead.try_lock()) return;
  const bool ready = missed_.exchange(false) && sleep_rings_or_ready();
  lead.unlock();
  if (ready) signal_eventfd(wake_efd_.get());
}

// Sleeps until a writer's signal, a socket event or shutdown. Handles nothing: the thread that
// takes the lead next sees the same (level-triggered) events in poll_sockets(). While the
// rings are left unattended (leave_unattended()), one sleeping thread is the watcher: it wakes
// every kWatchPeriod and returns (to take the lead) once one unattended stretch lasted a whole
// period, so records never wait behind a task that blocks.
inline void Impl::idle_wait() {
  std::array<epoll_event, 8> evs;
  bool watcher = false;
  std::uint64_t seq = 0;
  const auto become_watcher = [&] {
    bool none = false;
    watcher = watching_.compare_exchange_strong(none, true);
    seq = unattended_seq_.load();
  };
  const auto stop_watching = [&] {
    if (watcher) watching_.store(false);
    watcher = false;
  };
  for (;;) {
    // Dekker with leave_unattended(): a thread stores watching_ (or holds it false) and then
    // loads unattended_; that one stores unattended_ and then loads watching_. So either a
    // thread watches, or that one signals watch_efd_.
    if (!watcher && unattended_.load()) become_watcher();
    const int n = wait_events(evs, watcher);
    if (stopping_.load()) {
      stop_watching();
      return;
    }
    if (n == 0) {
      // A watcher's period ended. One stretch left unattended all along: take the lead. No
      // stretch at all: the stream is over, sleep until signalled.
      const std::uint64_t now_seq = unattended_seq_.load();
      if (now_seq == seq) {
        const bool stuck = unattended_.load();
        stop_watching();
        if (stuck) return;
      }
      seq = now_seq;
      continue;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      stop_watching();
      return;
    }
    bool other = false;
    for (int i = 0; i < n; ++i) {
      if (evs[static_cast<std::size_t>(i)].data.u64 == kWatchToken) {
        drain_eventfd(watch_efd_.get());
        if (!watcher) become_watcher();  // asked to: a stream has begun
      } else {
        other = true;
      }
    }
    if (other) {
      stop_watching();
      return;
    }
  }
}

inline int Impl::wait_events(std::array<epoll_event, 8>& evs, bool timed) {
  if (!timed) return ::epoll_wait(epoll_.get(), evs.data(), static_cast<int>(evs.size()), -1);
  timespec ts{0, std::chrono::duration_cast<std::chrono::nanoseconds>(kWatchPeriod).count()};
  const int n =
      ::epoll_pwait2(epoll_.get(), evs.data(), static_cast<int>(evs.size()), &ts, nullptr);
  if (n < 0 && errno == ENOSYS) {  // before Linux 5.11: millisecond resolution
    return ::epoll_wait(epoll_.get(), evs.data(), static_cast<int>(evs.size()), 1);
  }
  return n;
}

// Declares every ring sleeping, then looks once more (ring.hpp): true when something came in
// meanwhile, and then the rings are awake again. With the lead held.
inline bool Impl::sleep_rings_or_ready() {
  unattended_.store(false, std::memory_order_relaxed);  // the lead is held: attended
  for (auto& c : ins_) c->reader.declare_sleeping();
  std::atomic_thread_fence(std::memory_order_seq_cst);
  bool ready = changes_.load(std::memory_order_acquire);
  for (std::size_t i = 0; i < ins_.size() && !ready; ++i) {
    try {
      ready = ins_[i]->reader.available() > 0;
    } catch (const RingCorrupt&) {
      ready = true;  // service() reports it
    }
  }
  if (ready) wake_rings();
  return ready;
}

// With a task in hand: true once the other I/O thread is not running one (any more). A short
// task (an RRef protocol step, a small handler) is waited for, briefly: the task in hand then
// runs here too instead of waking a pool thread.
inline bool Impl::other_task_done() {
  if (!running_task_.load()) return true;
  // Measured from the start of that task: one that runs long already (a blocked handler)
  // costs each request read meanwhile no wait at all.
  const auto until = Clock::time_point(Clock::duration(task_started_.load())) + kTaskWait;
  while (running_task_.load()) {
    if (Clock::now() >= until || stopping_.load(std::memory_order_relaxed)) return false;
    ::sched_yield();
  }
  return true;
}

// Whether a ring holds a record now (with the lead held; the rings stay as declared).
inline bool Impl::rings_ready() {
  for (auto& c : ins_) {
    try {
      if (c->reader.available() > 0) return true;
    } catch (const RingCorrupt&) {
      return true;  // service() reports it
    }
  }
  return false;
}

inline void Impl::wake_rings() {
  unattended_.store(false, std::memory_order_relaxed);  // the lead is held: attended
  for (auto& c : ins_) c->reader.clear_sleeping();
}

// With the lead held and records waiting, about to let go of it without declaring the rings
// sleeping (a stream; the holder runs a task or returns to its caller): the other I/O thread
// watches from now on, and takes over if this lasts a whole kWatchPeriod (idle_wait()).
inline void Impl::leave_unattended() {
  unattended_seq_.fetch_add(1);
  unattended_.store(true);
  if (!watching_.load()) signal_eventfd(watch_efd_.get());  // wakes a thread to watch
}

// Reads every ring once (with the lead held); true if anything came.
inline bool Impl::service_all(InlineScope& scope) {
  if (changes_.load(std::memory_order_acquire)) apply_changes();
  bool progress = false;
  for (std::size_t i = 0; i < ins_.size() && !stopping_.load(std::memory_order_relaxed); ++i) {
    std::shared_ptr<InConn> c = ins_[i];  // a copy: service() may remove it from ins_
    progress |= service(c, scope);
  }
  return progress;
}

// The leader's loop (lead held): returns a task on_message handed back, to run once the lead
// is let go, or an empty one when idle or stopping; either way with the rings declared
// sleeping.
// `woken`: back from idle_wait(), so a socket event may be what woke it: look at once. A
// thread back for the next record of a stream after running a task does not (an epoll_wait
// per request halved the pipelined small-call rate): the period below covers it.
inline InlineTask Impl::io_loop(bool woken) {
  wake_rings();
  auto last_activity = Clock::now();
  if (woken || last_activity - last_socket_poll_ >= kSocketPollPeriod) {
    poll_sockets(0);
    last_socket_poll_ = last_activity;
  }
  const auto spin = std::chrono::microseconds(spin_us_);
  while (!stopping_.load(std::memory_order_relaxed)) {
    InlineScope scope;
    const bool progress = service_all(scope);
    auto now = Clock::now();
    if (now - last_socket_poll_ >= kSocketPollPeriod) {
      poll_sockets(0);
      last_socket_poll_ = now;
    }
    if (scope.holds_task()) {
      // Run it on this thread unless the other one is running a task already (then it goes
      // to the receiver's pool when the scope closes, and this thread reads on). A record
      // that came meanwhile means a stream: the rings stay awake, unattended, while the other
      // I/O thread watches (see idle_wait()).
      if (!other_task_done()) continue;
      if (rings_ready() || watching_.load() || sleep_rings_or_ready()) leave_unattended();
      task_started_.store(Clock::now().time_since_epoch().count());
      running_task_.store(true);
      return scope.take();
    }
    if (progress) {
      last_activity = now;
      // A caller polling for its reply (drive()) wants the lead: hand it the stream rather
      // than read its reply here and wake it (the rings stay awake for it; the watcher
      // covers a caller that is gone by then).
      if (!lead_wanted_.exchange(false)) continue;
      leave_unattended();
      return {};
    }
    // Idle: past the spin, or at once when a waiting caller wants to read its reply itself.
    if (now - last_activity < spin && !lead_wanted_.exchange(false)) {
      ::sched_yield();
      continue;
    }
    if (!sleep_rings_or_ready()) return {};
    last_activity = now;
  }
  sleep_rings_or_ready();
  return {};
}

// A caller waiting for a reply reads it itself while the lead is free (see above): then no I/O
// thread wakes for it, and with two cores shared by two processes the spinning threads are
// the two that matter. Requests read here go to the receiver's pool; control messages run here.
inline void Impl::drive(const std::function<bool()>& done,
                        std::chrono::steady_clock::time_point until) {
  const distrpc::detail::EntryGate::Scope in(drivers_);
  if (!in) return;  // shut down
  std::unique_lock<std::mutex> lead(lead_mu_, std::defer_lock);
  const Impl* const outer = lead_in_drive();  // restored whenever this call lets the lead go
  while (!done() && !stopping_.load(std::memory_order_relaxed) && Clock::now() < until) {
    if (!lead.owns_lock()) {
      if (!lead.try_lock()) {
        lead_wanted_.store(true, std::memory_order_relaxed);
        ::sched_yield();
        continue;
      }
      lead_in_drive() = this;
      wake_rings();  // while this thread reads, writers need not signal
    }
    InlineScope scope;
    const bool progress = service_all(scope);
    if (scope.holds_task()) {
      // A control message runs here, the request goes to the pool
      // (InlineTask::run_library_here()); the lead is let go first, as at the end below: the
      // task may send, or wait and read through a nested drive().
      InlineTask task = scope.take();
      if (sleep_rings_or_ready()) leave_unattended();
      lead_in_drive() = outer;
      lead.unlock();
      settle(lead);
      task.run_library_here();
      continue;
    }
    if (!progress) ::sched_yield();
  }
  // Hand the lead back as found. Records that came meanwhile (a stream of replies) are left
  // unattended: this caller is likely back soon, and the watcher takes over if it is not.
  if (!lead.owns_lock()) return;
  close_readers_if_stopping();
  if (sleep_rings_or_ready()) leave_unattended();
  lead_in_drive() = outer;
  lead.unlock();
  settle(lead);
}

}  // namespace distrpc::transport::shm::detail
