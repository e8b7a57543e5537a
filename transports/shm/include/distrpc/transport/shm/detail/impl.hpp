// The shm transport's implementation object: its state and the list of what it does. The member
// functions that are more than a few lines live with their peers, one idea per header:
//   listener.hpp     accepting and handshaking incoming connections (listener thread)
//   connect.hpp      dialing and handshaking outgoing connections (calling thread)
//   ring_writer.hpp  writing a message's record into the ring (calling thread)
//   lead.hpp         who reads: the two I/O threads and callers waiting for a reply
//   reader.hpp       reading the rings and sockets, reporting lost peers (whoever leads)
// shm.hpp includes them all; this header alone declares them.
#pragma once

#include <pthread.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "distrpc/bounded_thread.hpp"
#include "distrpc/error.hpp"
#include "distrpc/log.hpp"
#include "distrpc/transport/detail/dial_registered.hpp"
#include "distrpc/transport/detail/self.hpp"
#include "distrpc/transport/shm/detail/connection.hpp"
#include "distrpc/transport/shm/detail/protocol.hpp"
#include "distrpc/transport/shm/system.hpp"
#include "distrpc/transport/transport.hpp"
#include "distrpc/wire/errors.hpp"
#include "distrpc/wire/handshake.hpp"
#include "distrpc/wire/message.hpp"

namespace distrpc::transport::shm::detail {

class Impl : public std::enable_shared_from_this<Impl> {
 public:
  Impl(const TransportOptions& options, TransportCallbacks callbacks)
      : options_(options), callbacks_(std::move(callbacks)), spin_us_(spin_us_from_env()) {
    // A bad DISTRPC_RECV_CACHE_MB fails the start, not a reading thread's first large message.
    (void)wire::RecvStorage::limit_from_env();
    token_ = transport::detail::transport_secret(options_);
    if (!memfd_usable()) {
      throw DistNetworkError("distrpc shm: " + self_text() +
                             ": shared memory is not usable here (memfd_create with sealing "
                             "failed); use the tcp transport");
    }
    wake_efd_ = make_eventfd();
    watch_efd_ = make_eventfd();
    listener_stop_ = make_eventfd();
    epoll_ = Fd(::epoll_create1(EPOLL_CLOEXEC));
    if (!epoll_) throw DistNetworkError("distrpc shm: epoll_create1 failed: " + errno_text(errno));
    watch(wake_efd_.get(), kWakeToken, EPOLLIN);
    watch(watch_efd_.get(), kWatchToken, EPOLLIN);
    listen();
  }

  // Separate from the constructor: the threads hold a shared_ptr to this.
  void start() {
    auto self = shared_from_this();
    listen_thread_ =
        std::thread([self] { self->run_thread(&Impl::listener_loop, "distrpc-shm-lsn"); });
    for (auto& t : io_threads_) {
      t = BoundedThread([self] { self->run_thread(&Impl::io_main, "distrpc-shm-io"); });
    }
  }

  const std::string& address() const { return address_; }

  void add_peer(int id, const std::string& name, const std::string& address) {
    if (id < 0) {
      throw DistNetworkError("distrpc shm: add_peer: worker id " + std::to_string(id) + " ('" +
                             name + "') is negative");
    }
    if (const std::string why = address_problem(address); !why.empty()) {
      throw DistNetworkError("distrpc shm: add_peer: worker " + std::to_string(id) + " ('" + name +
                             "'): bad address '" + address + "': " + why);
    }
    auto p = peer_entry(id);
    std::lock_guard<std::mutex> lk(p->mu);
    const bool moved = !p->address.empty() && p->address != address;
    p->name = name;
    p->address = address;
    // A fresh registration (after a loss, or at a new address) is a fresh incarnation: it may be
    // connected (and lost) again, and the old one's late hang-up is ignored. The ring opened to
    // the old one is not written for it: shut down (its end is ignored), the next send dials.
    if (p->liveness.renew(moved) && p->out) {
      const auto old = std::move(p->out);
      old->record_failure("worker " + std::to_string(id) + " was registered again");
      old->shutdown_sock();
    }
  }

  void send(int peer, const wire::Message& m) {
    if (stopping_.load()) {
      throw DistNetworkError("distrpc shm: cannot send to worker " + std::to_string(peer) +
                             ": the transport of " + self_text() + " is shut down");
    }
    try {
      wire::check_limits(m, options_.limits);
    } catch (const wire::EncodeError& e) {
      throw wire::EncodeError("distrpc shm: refusing to send to worker " + std::to_string(peer) +
                              ": " + e.what());
    }
    write_message(*connection_to(peer), m);
  }

  // Returns how many I/O threads it abandoned: still running a handed-back task (a request handler
  // that did not return) at `deadline`, they are detached instead of joined. Such a thread owns
  // this Impl (its shared_ptr) and, when its task returns, takes the lead, meets `stopping_` and
  // exits without touching a ring or a socket.
  std::size_t shutdown(Clock::time_point deadline) {
    const auto guard = transport::detail::lock_for_shutdown(shutdown_mu_);
    if (!guard.owns_lock() || shut_down_) return 0;
    std::vector<std::shared_ptr<OutConn>> outs;
    {
      std::lock_guard<std::mutex> lk(mu_);
      stopping_.store(true);
      outs.assign(outs_.begin(), outs_.end());
    }
    for (auto& c : outs) c->shutdown_sock();  // wakes writers waiting for ring space
    signal_eventfd(wake_efd_.get());
    signal_eventfd(listener_stop_.get());
    // Called from a callback, the thread it runs on is detached: it returns to a stopped loop
    // and exits, holding the last reference to this object if the Context is gone by then.
    const auto [abandoned, on_io_thread] =
        transport::detail::stop_threads(listen_thread_, io_threads_, deadline);
    // Nor a caller in drive() (it saw stopping_), except one past `deadline` in a library task;
    // it also lets go of the lead, so the incoming connections are closed below.
    transport::detail::close_drive_gate(drivers_, deadline, log_who(), "shm");
    for (auto& c : outs) c->close();
    {
      std::lock_guard<std::mutex> lk(mu_);
      outs_.clear();
      pending_in_.clear();
      pending_out_.clear();
      for (auto& [id, p] : peers_) {
        std::lock_guard<std::mutex> plk(p->mu);
        p->out.reset();
      }
    }
    // Only the thread holding lead_mu_ touches these. When we run on an I/O thread (detached
    // above), it returns into the reader's loop: it owns them until it exits. An abandoned thread
    // runs a task without the lead and, once it takes the lead again, meets `stopping_` and exits
    // without reading; so when nobody holds the lead now, nobody reads any more. Clearing closes
    // the sockets of incoming connections, so peers see the loss even with a thread abandoned.
    // A callback in this thread's drive() holds the lead (a try_lock of a mutex this thread owns
    // is undefined): its drive() clears them when it returns, as an I/O thread does.
    if (!on_io_thread && lead_in_drive() != this) {
      std::unique_lock<std::mutex> lead(lead_mu_, std::try_to_lock);
      if (lead.owns_lock()) {
        ins_.clear();
        watched_.clear();
      }
    }
    listen_sock_.reset();
    shut_down_ = true;
    return abandoned;
  }

 private:
  static constexpr std::uint64_t kWakeToken = 0;
  static constexpr std::uint64_t kWatchToken = ~std::uint64_t{0};

  std::string self_text() const { return transport::detail::worker_text(options_); }
  std::string log_who() const { return transport::detail::log_who(options_); }

  // A connection refused or closed for what the peer did (one line; the listener goes on).
  void log_drop(const std::string& remote, const std::string& reason) const {
    distrpc::detail::log_warning(log_who(),
                                 "shm: dropping connection from " + remote + ": " + reason);
  }

  wire::Hello my_hello() const { return transport::detail::make_hello(options_, token_, address_); }

  std::shared_ptr<Peer> peer_entry(int id) {
    std::lock_guard<std::mutex> lk(mu_);
    auto& slot = peers_[id];
    if (!slot) slot = std::make_shared<Peer>(id);
    return slot;
  }

  std::shared_ptr<Peer> find_peer(int id) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = peers_.find(id);
    return it == peers_.end() ? nullptr : it->second;
  }

  void watch(int fd, std::uint64_t token, std::uint32_t events) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = token;
    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
      throw DistNetworkError("distrpc shm: epoll_ctl failed: " + errno_text(errno));
    }
  }

  template <class Fn>
  void run_thread(Fn fn, const char* thread_name) {
    ::pthread_setname_np(::pthread_self(), thread_name);
    mark_transport_thread();
    for (;;) {
      try {
        (this->*fn)();
        return;
      } catch (const std::exception& e) {
        // Handlers catch what they expect; anything else must not take the thread down silently.
        distrpc::detail::log_error(log_who(), std::string("shm: unexpected error on thread ") +
                                                  thread_name + ": " + e.what());
        if (stopping_.load()) return;
      }
    }
  }

  // ---- listener (listener.hpp) ----------------------------------------------------------------

  void listen();
  void listener_loop();
  // One packet of an incoming handshake; false when the connection is finished with (adopted or
  // dropped).
  bool handshake_step(PendingHandshake& h);
  void check_claimed_identity(const wire::Hello& hello);
  void adopt_incoming(PendingHandshake& h, Packet& pkt);

  // ---- connecting (connect.hpp) ---------------------------------------------------------------

  std::shared_ptr<OutConn> connection_to(int id);
  // True when add_peer() has registered worker `id` at another address than `address`.
  bool moved_away(int id, const std::string& address) {
    auto p = find_peer(id);
    return p && transport::detail::moved_away(*p, address);
  }
  std::shared_ptr<OutConn> dial(int id, const std::string& name, const std::string& address);
  std::shared_ptr<OutConn> handshake(Fd sock, int id, const std::string& name,
                                     const std::string& address, const std::string& who,
                                     Clock::time_point deadline);

  // ---- sending (ring_writer.hpp) --------------------------------------------------------------

  void write_message(OutConn& c, const wire::Message& m);
  void ring_write(OutConn& c, const char* p, std::size_t n);
  void wait_for_space(OutConn& c);

  // ---- who reads (lead.hpp) -------------------------------------------------------------------

  void io_main();
  bool retry_lead(std::unique_lock<std::mutex>& lead);
  void settle(std::unique_lock<std::mutex>& lead);
  void idle_wait();
  int wait_events(std::array<epoll_event, 8>& evs, bool timed);
  bool sleep_rings_or_ready();
  bool other_task_done();
  bool rings_ready();
  void wake_rings();
  void leave_unattended();
  bool service_all(InlineScope& scope);
  InlineTask io_loop(bool woken);

 public:
  void drive(const std::function<bool()>& done, std::chrono::steady_clock::time_point until);

 private:
  // ---- reading (reader.hpp) -------------------------------------------------------------------

  struct Watched {
    std::shared_ptr<InConn> in;
    std::shared_ptr<OutConn> out;
  };

  // The Impl whose lead this thread holds in drive() (so inside a callback there), else null.
  static const Impl*& lead_in_drive() {
    thread_local const Impl* impl = nullptr;
    return impl;
  }
  void apply_changes();
  // With the lead held: once stopping, closes the incoming connections (their peers see the
  // loss), as shutdown() does when nobody holds the lead.
  void close_readers_if_stopping() {
    if (!stopping_.load()) return;
    ins_.clear();
    watched_.clear();
  }
  void poll_sockets(int timeout_ms);
  void on_in_socket(std::shared_ptr<InConn> c, std::uint64_t token, std::uint32_t events);
  void on_out_socket(const std::shared_ptr<OutConn>& c, std::uint64_t token, std::uint32_t events);
  bool is_in_watched(std::uint64_t token) const { return watched_.count(token) != 0; }
  void unwatch(std::uint64_t token, int fd);
  std::uint64_t token_of(const std::shared_ptr<InConn>& c) const;
  bool service(std::shared_ptr<InConn> cp, InlineScope& scope);
  void deliver(InConn& c, wire::Message&& m);
  void drop(std::shared_ptr<InConn> c, std::uint64_t token, const std::string& reason);
  void lose(std::shared_ptr<InConn> c, std::uint64_t token, const std::string& reason);
  // `ahead`: an incoming connection's (PeerLiveness::stamp_adopted), empty for ours.
  void report_lost(int peer, const OutConn* out, std::uint64_t generation,
                   const std::string& reason, const std::string& ahead = {});

  const TransportOptions options_;
  const TransportCallbacks callbacks_;
  const int spin_us_;
  std::optional<std::string> token_;
  std::string address_;

  Fd listen_sock_;
  Fd listener_stop_;
  Fd wake_efd_;  // the I/O thread sleeps on it; peers (and we) signal it
  Fd epoll_;

  std::atomic<bool> stopping_{false};
  distrpc::detail::EntryGate drivers_;  // callers in drive(), waited for by shutdown()
  std::mutex mu_;  // guards peers_, outs_, pending_in_, pending_out_
  std::map<int, std::shared_ptr<Peer>> peers_;
  std::set<std::shared_ptr<OutConn>> outs_;
  std::vector<std::shared_ptr<InConn>> pending_in_;
  std::vector<std::shared_ptr<OutConn>> pending_out_;
  std::atomic<bool> changes_{false};

  // I/O thread only.
  std::vector<std::shared_ptr<InConn>> ins_;
  std::unordered_map<std::uint64_t, Watched> watched_;
  std::uint64_t next_token_ = 1;

  std::mutex shutdown_mu_;
  bool shut_down_ = false;
  std::thread listen_thread_;
  std::array<BoundedThread, 2> io_threads_;  // the two I/O threads (see io_main)
  std::mutex lead_mu_;                       // held by the one thread that reads (see io_main)
  Clock::time_point last_socket_poll_{};     // with the lead held: io_loop()'s last look
  std::atomic<bool> running_task_{false};    // an I/O thread runs a handed-back task
  std::atomic<bool> lead_wanted_{false};     // a caller in drive() waits for the lead
  std::atomic<bool> missed_{false};          // a woken I/O thread found the lead taken
  // Records may wait while nobody holds the lead (leave_unattended()); counted per stretch.
  std::atomic<bool> unattended_{false};
  std::atomic<std::uint64_t> unattended_seq_{0};
  std::atomic<bool> watching_{false};  // a sleeping I/O thread wakes every kWatchPeriod
  Fd watch_efd_;                       // wakes a sleeping I/O thread to become the watcher
  // How long records may wait unattended before the watcher reads them: the time a task that
  // blocks (or a caller that went away) delays the records behind it.
  static constexpr auto kWatchPeriod = std::chrono::microseconds(100);
  static constexpr auto kTaskWait = std::chrono::microseconds(20);  // see other_task_done()
  std::atomic<Clock::rep> task_started_{0};                         // when running_task_ began
};

}  // namespace distrpc::transport::shm::detail
