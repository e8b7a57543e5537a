// Reading, by whichever thread holds the lead (lead.hpp): the rings' records become messages
// (the parsing itself is record.hpp's RecordParser), the sockets report hang-ups and carry
// segment descriptors, and lost connections are reported to the owner once per peer.
#pragma once

#include <sys/epoll.h>
#include <algorithm>
#include <array>
#include <memory>
#include <optional>
#include <string>
#include "distrpc/transport/shm/detail/record.hpp"

#include "distrpc/transport/shm/detail/impl.hpp"

namespace distrpc::transport::shm::detail {

inline void Impl::apply_changes() {
  std::vector<std::shared_ptr<InConn>> ins;
  std::vector<std::shared_ptr<OutConn>> outs;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ins.swap(pending_in_);
    outs.swap(pending_out_);
    changes_.store(false, std::memory_order_relaxed);
  }
  for (auto& c : ins) {
    const std::uint64_t token = next_token_++;
    // Hang-ups only: segment announcements stay queued in the socket until a record needs one,
    // so the kernel's socket buffer, not our memory, holds a writer that runs ahead.
    watch(c->sock.get(), token, EPOLLRDHUP);
    watched_[token] = Watched{c, nullptr};
    ins_.push_back(c);
  }
  for (auto& c : outs) {
    if (c->closed.load()) continue;
    const std::uint64_t token = next_token_++;
    watch(c->sock.get(), token, EPOLLIN | EPOLLRDHUP);  // the peer never sends on it: EPOLLIN is
    watched_[token] = Watched{nullptr, c};              // a protocol error
  }
}

// Waits up to `timeout_ms` (-1: until something happens) for socket events: hang-ups, segment
// descriptors, wake-ups.
inline void Impl::poll_sockets(int timeout_ms) {
  std::array<epoll_event, 32> evs;
  int n;
  do {
    n = ::epoll_wait(epoll_.get(), evs.data(), static_cast<int>(evs.size()), timeout_ms);
  } while (n < 0 && errno == EINTR);
  if (n < 0) throw DistNetworkError("distrpc shm: epoll_wait failed: " + errno_text(errno));
  for (int i = 0; i < n; ++i) {
    const std::uint64_t token = evs[static_cast<std::size_t>(i)].data.u64;
    const std::uint32_t events = evs[static_cast<std::size_t>(i)].events;
    if (token == kWakeToken) {
      // At shutdown it stays signalled: a thread about to sleep in idle_wait must still see it.
      if (!stopping_.load()) drain_eventfd(wake_efd_.get());
      continue;
    }
    if (token == kWatchToken) {
      drain_eventfd(watch_efd_.get());  // the lead is held: nothing to watch
      continue;
    }
    auto it = watched_.find(token);
    if (it == watched_.end()) continue;
    Watched w = it->second;
    if (w.in) {
      on_in_socket(w.in, token, events);
    } else {
      on_out_socket(w.out, token, events);
    }
    if (stopping_.load(std::memory_order_relaxed)) return;
  }
}

inline void Impl::on_in_socket(std::shared_ptr<InConn> c, std::uint64_t token,
                               std::uint32_t events) {
  if (events & (EPOLLHUP | EPOLLRDHUP | EPOLLERR)) c->hung_up = true;
  if (!c->hung_up) return;
  // Deliver what the peer completed before it went away, then report it.
  InlineScope scope;  // what the last records hand back is queued: the peer is gone
  for (;;) {
    scope.release_to_fallback();  // service() reads on only without a request in hand
    if (!service(c, scope) || stopping_.load()) break;
  }
  if (stopping_.load()) return;
  if (!is_in_watched(token)) return;  // service() dropped it already
  lose(c, token,
       c->mid_record() ? "connection closed by peer in the middle of a message (its process "
                         "exited or was killed)"
                       : "connection closed by peer");
}

inline void Impl::on_out_socket(const std::shared_ptr<OutConn>& c, std::uint64_t token,
                                std::uint32_t events) {
  std::string reason;
  if (events & (EPOLLHUP | EPOLLRDHUP | EPOLLERR)) {
    reason = c->recorded_failure();
    if (reason.empty()) reason = "connection closed by peer";
  } else if (events & EPOLLIN) {
    reason = "protocol error: the peer sent an unexpected packet on a connection we write";
    log_drop(c->describe(), reason);
  } else {
    return;
  }
  unwatch(token, c->sock.get());
  if (!c->close()) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    outs_.erase(c);
  }
  report_lost(c->peer, c.get(), c->generation, reason);
}

inline void Impl::unwatch(std::uint64_t token, int fd) {
  if (fd >= 0) ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd, nullptr);
  watched_.erase(token);
}

inline std::uint64_t Impl::token_of(const std::shared_ptr<InConn>& c) const {
  for (const auto& [token, w] : watched_) {
    if (w.in == c) return token;
  }
  return ~std::uint64_t{0};
}

// Reads what the ring holds, up to the first request on_message hands back (kept in `scope`);
// true if it made progress or left bytes for later. Drops the connection on any violation.
inline bool Impl::service(std::shared_ptr<InConn> cp, InlineScope& scope) {
  // A callback shut the Context down: nothing more is delivered, from any ring.
  if (stopping_.load(std::memory_order_relaxed)) return false;
  InConn& c = *cp;
  bool progress = false;
  try {
    std::uint64_t avail = c.reader.available();
    if (avail == 0) return false;
    progress = true;
    while (avail > 0) {
      // One request per turn: the records after it are read by whoever leads next (see
      // io_main), while this thread may run it.
      if (scope.holds_request()) break;
      std::optional<wire::Message> m = c.parser.parse(c.reader, avail);
      if (!m) break;
      if (c.reader.release()) signal_eventfd(c.space_efd.get());
      deliver(c, std::move(*m));
      if (stopping_.load(std::memory_order_relaxed)) return true;
    }
    if (c.reader.release()) signal_eventfd(c.space_efd.get());
  } catch (const std::exception& e) {
    // Gone: nothing more to read on it (its parser stopped inside the refused record, and a
    // second look would find the same record again, for ever).
    drop(cp, token_of(cp), e.what());
    return false;
  }
  return progress;
}

inline void Impl::deliver(InConn& c, wire::Message&& m) {
  if (!callbacks_.on_message) return;
  try {
    callbacks_.on_message(c.peer, std::move(m));
  } catch (const std::exception& e) {
    // The owner's bug, not the peer's: the connection stays.
    distrpc::detail::log_error(
        log_who(), "shm: on_message for a message from " + c.describe() + " threw: " + e.what());
  }
}

// A protocol violation or corrupted shared memory: logged, then handled like any other loss.
inline void Impl::drop(std::shared_ptr<InConn> c, std::uint64_t token, const std::string& reason) {
  if (stopping_.load()) return;
  log_drop(c->remote, c->describe() + ": " + reason);
  lose(c, token, reason);
}

inline void Impl::lose(std::shared_ptr<InConn> c, std::uint64_t token, const std::string& reason) {
  if (!is_in_watched(token)) return;
  unwatch(token, c->sock.get());
  ins_.erase(std::remove(ins_.begin(), ins_.end(), c), ins_.end());
  c->sock.reset();  // the peer sees the hang-up
  report_lost(c->peer, nullptr, c->generation, reason, c->ahead);
}

inline void Impl::report_lost(int peer, const OutConn* out, std::uint64_t generation,
                              const std::string& reason, const std::string& ahead) {
  bool report = false;
  if (auto p = find_peer(peer)) {
    std::lock_guard<std::mutex> lk(p->mu);
    if (out && p->out.get() == out) p->out.reset();
    // A connection of a registration since replaced is ignored.
    if (!p->liveness.current(generation, ahead, p->address)) return;
    // Our connection to it and its connection to us break together: it is reported once.
    report = p->liveness.mark_lost(reason);
    // A peer that loses either connection loses both: a half-open pair would let requests go
    // out while replies could never come back.
    if (!out && p->out) {
      auto o = p->out;
      o->record_failure("its connection to us was lost (" + reason + ")");
      o->shutdown_sock();
    }
  }
  if (!report || stopping_.load() || !callbacks_.on_peer_lost) return;
  try {
    callbacks_.on_peer_lost(peer, reason);
  } catch (const std::exception& e) {
    distrpc::detail::log_error(
        log_who(), "shm: on_peer_lost for worker " + std::to_string(peer) + " threw: " + e.what());
  }
}

}  // namespace distrpc::transport::shm::detail
