// The shm transport's listener thread: binds the abstract socket, accepts connections and runs
// their handshakes (Hello both ways, then the ring and the writer's eventfd), each within
// connect_timeout, then hands adopted connections to the reader (pending_in_).
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "distrpc/transport/shm/detail/impl.hpp"

namespace distrpc::transport::shm::detail {

inline void Impl::listen() {
  std::random_device rd;
  std::mt19937_64 rng((static_cast<std::uint64_t>(rd()) << 32) ^ rd() ^
                      static_cast<std::uint64_t>(::getpid()));
  for (int attempt = 0;; ++attempt) {
    char name[64];
    std::snprintf(name, sizeof name, "%s%d-%016llx", std::string(kAddressPrefix).c_str(),
                  static_cast<int>(::getpid()), static_cast<unsigned long long>(rng()));
    Fd s(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!s) {
      throw DistNetworkError("distrpc shm: " + self_text() +
                             " cannot create a Unix socket: " + errno_text(errno));
    }
    sockaddr_un sa;
    const socklen_t len = abstract_sockaddr(name, sa);
    if (::bind(s.get(), reinterpret_cast<sockaddr*>(&sa), len) != 0) {
      // A random 64-bit name is taken only by a squatter: try another, a few times.
      if (errno == EADDRINUSE && attempt < 8) continue;
      throw DistNetworkError("distrpc shm: " + self_text() + " cannot bind abstract socket '" +
                             name + "': " + errno_text(errno));
    }
    if (::listen(s.get(), SOMAXCONN) != 0) {
      throw DistNetworkError("distrpc shm: " + self_text() + " cannot listen on '" + name +
                             "': " + errno_text(errno));
    }
    listen_sock_ = std::move(s);
    address_ = name;
    return;
  }
}

inline void Impl::listener_loop() {
  std::vector<std::unique_ptr<PendingHandshake>> pending;
  std::vector<pollfd> fds;
  while (!stopping_.load()) {
    fds.clear();
    fds.push_back({listener_stop_.get(), POLLIN, 0});
    fds.push_back({listen_sock_.get(), POLLIN, 0});
    auto next_deadline = Clock::time_point::max();
    for (auto& h : pending) {
      fds.push_back({h->sock.get(), POLLIN, 0});
      next_deadline = std::min(next_deadline, h->deadline);
    }
    int timeout = -1;
    if (!pending.empty()) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(next_deadline - Clock::now());
      timeout = static_cast<int>(std::clamp<long long>(left.count() + 1, 0, 60000));
    }
    const int r = ::poll(fds.data(), fds.size(), timeout);
    if (r < 0 && errno != EINTR) {
      throw DistNetworkError("distrpc shm: poll on the listener failed: " + errno_text(errno));
    }
    if (stopping_.load()) return;
    const auto now = Clock::now();
    // Handshake steps first (fds[2..] match `pending` as it was when polled).
    std::vector<std::unique_ptr<PendingHandshake>> still;
    for (std::size_t i = 0; i < pending.size(); ++i) {
      auto& h = pending[i];
      bool keep = true;
      if (r > 0 && fds[i + 2].revents != 0) {
        keep = handshake_step(*h);
      } else if (now >= h->deadline) {
        log_drop(h->remote,
                 "no handshake within " + std::to_string(options_.connect_timeout.count()) + " ms");
        keep = false;
      }
      if (keep) still.push_back(std::move(h));
    }
    pending.swap(still);
    if (r > 0 && (fds[1].revents & POLLIN)) {
      for (;;) {
        Fd s(::accept4(listen_sock_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
        if (!s) {
          if (errno == EINTR) continue;
          if (errno != EAGAIN && errno != EWOULDBLOCK) {
            // EMFILE and friends: keep serving, without spinning on the error.
            distrpc::detail::log_warning(log_who(), "shm: accept on " + address_ + " failed: " +
                                                        errno_text(errno) + " (retrying)");
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
          }
          break;
        }
        auto h = std::make_unique<PendingHandshake>();
        h->remote = peer_credentials(s.get());
        h->sock = std::move(s);
        h->deadline = Clock::now() + options_.connect_timeout;
        pending.push_back(std::move(h));
      }
    }
  }
}

// One packet of an incoming handshake; false when the connection is finished with (adopted or
// dropped).
inline bool Impl::handshake_step(PendingHandshake& h) {
  Packet pkt;
  try {
    const int r = try_recv_packet(h.sock.get(), pkt);
    if (r == EAGAIN) return true;
    if (r == kPeerClosed) {
      log_drop(h.remote, "the peer closed the connection during the handshake");
      return false;
    }
    if (r != 0) {
      log_drop(h.remote, "reading the handshake failed: " + errno_text(r));
      return false;
    }
    if (!h.hello_done) {
      if (!pkt.fds.empty()) throw wire::ProtocolError("the Hello packet carries descriptors");
      h.hello = parse_hello_packet(pkt.data);
      wire::check_auth_offer(h.hello, token_.has_value());
      check_claimed_identity(h.hello);
      h.mine = wire::make_acceptor_hello(my_hello(), h.hello, token_);
      const std::string reply = hello_packet(h.mine);
      const int fd = wake_efd_.get();
      if (const int err = send_packet(h.sock.get(), reply.data(), reply.size(), &fd, 1, h.deadline,
                                      stopping_)) {
        log_drop(h.remote, "sending the handshake reply failed: " + errno_text(err));
        return false;
      }
      h.hello_done = true;
      h.answer_needed = token_.has_value();
      return true;
    }
    if (h.answer_needed) {
      // With a secret, the dialler proves it before it may hand over its ring.
      if (!pkt.fds.empty()) throw wire::ProtocolError("the answer packet carries descriptors");
      const wire::auth::Proof answer = parse_auth_answer_packet(pkt.data, wire::hello_who(h.hello));
      wire::verify_dialler_answer(h.mine, h.hello, answer, *token_);
      h.answer_needed = false;
      return true;
    }
    adopt_incoming(h, pkt);
  } catch (const std::exception& e) {
    log_drop(h.remote, std::string("bad handshake: ") + e.what());
  }
  return false;
}

// The claimed id must be a valid worker id, and agree with what add_peer() said about it.
inline void Impl::check_claimed_identity(const wire::Hello& hello) {
  if (hello.worker_id < 0 || hello.worker_id > INT_MAX) {
    throw wire::ProtocolError("worker '" + hello.worker_name + "' claims worker id " +
                              std::to_string(hello.worker_id) + ", outside 0.." +
                              std::to_string(INT_MAX));
  }
  auto p = find_peer(static_cast<int>(hello.worker_id));
  if (!p) return;
  std::lock_guard<std::mutex> lk(p->mu);
  if (!p->name.empty() && p->name != hello.worker_name) {
    throw wire::ProtocolError("the peer claims to be worker " + std::to_string(p->id) + " as '" +
                              hello.worker_name + "', but worker " + std::to_string(p->id) +
                              " is '" + p->name + "'");
  }
}

// The setup packet: the ring memfd and the writer's space eventfd. Throws ProtocolError.
inline void Impl::adopt_incoming(PendingHandshake& h, Packet& pkt) {
  SetupPacket setup{};
  if (pkt.data.size() != sizeof setup) {
    throw wire::ProtocolError("the setup packet has " + std::to_string(pkt.data.size()) +
                              " bytes (expected " + std::to_string(sizeof setup) + ")");
  }
  std::memcpy(&setup, pkt.data.data(), sizeof setup);
  if (setup.magic != kSetupMagic || setup.version != kSetupVersion) {
    throw wire::ProtocolError("the setup packet has a bad magic number or version");
  }
  if (pkt.fds.size() != 2) {
    throw wire::ProtocolError("the setup packet carries " + std::to_string(pkt.fds.size()) +
                              " descriptors (expected the ring and an eventfd)");
  }
  const std::uint64_t cap = setup.capacity;
  if (cap < kMinRingCapacity || cap > kMaxRingCapacity || (cap & (cap - 1)) != 0) {
    throw wire::ProtocolError("ring capacity " + std::to_string(cap) +
                              " is not a power of two in " + std::to_string(kMinRingCapacity) +
                              ".." + std::to_string(kMaxRingCapacity));
  }
  const std::uint64_t size = checked_memfd_size(pkt.fds[0].get(), "the ring",
                                                kRingHeaderBytes + cap, kRingHeaderBytes + cap);
  check_eventfd(pkt.fds[1].get(), "the writer's space eventfd");
  auto map = map_peer_memory(pkt.fds[0].get(), static_cast<std::size_t>(size));
  check_new_ring(map->base(), cap);
  auto c = std::make_shared<InConn>(std::move(map), cap, options_.limits);
  c->peer = static_cast<int>(h.hello.worker_id);
  c->peer_name = h.hello.worker_name;
  c->remote = h.remote;
  c->space_efd = std::move(pkt.fds[1]);
  const AckPacket ack{kAckMagic, kSetupVersion};
  if (const int err =
          send_packet(h.sock.get(), &ack, sizeof ack, nullptr, 0, h.deadline, stopping_)) {
    throw wire::ProtocolError("sending the setup acknowledgement failed: " + errno_text(err));
  }
  c->sock = std::move(h.sock);
  auto p = peer_entry(c->peer);
  {
    std::lock_guard<std::mutex> lk(p->mu);
    if (p->name.empty()) p->name = c->peer_name;
    p->liveness.stamp_adopted(*c, p->address, h.hello.listen_address);
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_.load()) return;
    pending_in_.push_back(std::move(c));
    changes_.store(true, std::memory_order_release);
  }
  signal_eventfd(wake_efd_.get());
}

}  // namespace distrpc::transport::shm::detail
