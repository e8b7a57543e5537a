// Connecting, on the calling thread: the first send to a peer dials its abstract socket (retrying
// while it is not listening yet), exchanges Hellos, creates the ring and hands it over. One
// attempt per peer at a time; a failed attempt's error stands for the callers that waited on it.
#pragma once

#include <sys/socket.h>
#include <sys/un.h>
#include <array>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include "distrpc/net/dial.hpp"
#include "distrpc/transport/detail/dial_registered.hpp"
#include "distrpc/transport/detail/identity.hpp"

#include "distrpc/transport/shm/detail/impl.hpp"

namespace distrpc::transport::shm::detail {

inline std::shared_ptr<OutConn> Impl::connection_to(int id) {
  auto p = find_peer(id);
  if (!p) {
    throw DistNetworkError("distrpc shm: cannot send to worker " + std::to_string(id) +
                           ": its address is unknown (add_peer() was not called for it)");
  }
  const auto usable = [&]() -> std::shared_ptr<OutConn> {
    std::lock_guard<std::mutex> lk(p->mu);
    if (p->out) {
      if (!p->out->broken.load()) return p->out;
      if (p->liveness.current(p->out->generation)) {
        const std::string why = p->out->recorded_failure();
        throw DistNetworkError("distrpc shm: cannot send to " + p->describe_locked() +
                               ": the connection was lost (" +
                               (why.empty() ? std::string("closed") : why) + ")");
      }
      p->out.reset();  // broke before add_peer() registered the peer again: dial afresh
    }
    if (p->liveness.lost()) {
      throw DistNetworkError("distrpc shm: cannot send to " + p->describe_locked() +
                             ": the connection was lost (" + p->liveness.lost_reason() + ")");
    }
    if (p->address.empty()) {
      throw DistNetworkError("distrpc shm: cannot send to " + p->describe_locked() +
                             ": its address is unknown (add_peer() was not called for it)");
    }
    return nullptr;
  };
  if (auto c = usable()) return c;
  const std::uint64_t seen = p->attempts.load();
  std::lock_guard<std::mutex> ck(p->connect_mu);
  if (auto c = usable()) return c;
  // Another thread's attempt failed while this one waited: its error stands for both.
  if (p->attempts.load() != seen && !p->last_failure.empty()) {
    throw DistNetworkError(p->last_failure);
  }
  for (;;) {
    // Read before the dial's address: a move after it makes this generation an old one.
    std::uint64_t generation = 0;
    {
      std::lock_guard<std::mutex> lk(p->mu);
      generation = p->liveness.generation();
    }
    std::shared_ptr<OutConn> c;
    std::string address;
    std::tie(c, address) = transport::detail::dial_registered(
        *p, [&](const std::string& name, const std::string& at) { return dial(id, name, at); });
    if (!c) continue;  // moved while it was dialled: the new address next
    // Until it is installed below, it belongs to the generation it was dialled in: should the
    // worker move meanwhile, its end is no loss.
    c->generation.store(generation);
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stopping_.load()) {
        c->close();
        throw DistNetworkError("distrpc shm: cannot send to worker " + std::to_string(id) +
                               ": the transport of " + self_text() + " is shut down");
      }
      outs_.insert(c);
      pending_out_.push_back(c);
      changes_.store(true, std::memory_order_release);
    }
    bool moved = false;
    {
      std::lock_guard<std::mutex> lk(p->mu);
      // Moved after the dial's last look (before it handed over its ring): what answered at the
      // old address is the incarnation being replaced, so the message goes to the new one.
      moved = p->address != address;
      if (!moved) {
        c->generation.store(p->liveness.generation());
        p->out = c;
      }
    }
    signal_eventfd(wake_efd_.get());
    if (!moved) return c;
    c->record_failure("worker " + std::to_string(id) +
                      " was registered at a new address while it was dialled");
    c->shutdown_sock();
  }
}

inline std::shared_ptr<OutConn> Impl::dial(int id, const std::string& name,
                                           const std::string& address) {
  const std::string who = "worker " + std::to_string(id) + " ('" + name + "') at " + address;
  const auto error = [&](const std::string& what) {
    return DistNetworkError("distrpc shm: cannot connect to " + who + ": " + what);
  };
  const net::DialTiming timing{Clock::now(), options_.connect_timeout, options_.refused_retry};
  sockaddr_un sa;
  const socklen_t len = abstract_sockaddr(address, sa);
  // Not listening yet (it is starting up), or its backlog is full: retried until the deadline.
  Fd s = net::dial_with_backoff(
      timing, stopping_,
      [&](net::DialFailure& failure) -> std::optional<Fd> {
        if (moved_away(id, address)) throw error("it was registered at a new address");
        Fd sock(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
        if (!sock) throw error("socket: " + errno_text(errno));
        if (::connect(sock.get(), reinterpret_cast<sockaddr*>(&sa), len) == 0) return sock;
        failure.err = errno;
        failure.text = "connect: " + errno_text(failure.err);
        return std::nullopt;
      },
      error);
  return handshake(std::move(s), id, name, address, who, timing.deadline());
}

inline std::shared_ptr<OutConn> Impl::handshake(Fd sock, int id, const std::string& name,
                                                const std::string& address, const std::string& who,
                                                Clock::time_point deadline) {
  const auto error = [&](const std::string& what) {
    return DistNetworkError("distrpc shm: handshake with " + who + " failed: " + what);
  };
  const auto io_text = [&](int err, const char* refused) {
    if (err == kPeerClosed) return std::string(refused);
    if (err == ETIMEDOUT) {
      return "no reply within " + std::to_string(options_.connect_timeout.count()) +
             " ms (connect_timeout)";
    }
    if (err == ECANCELED) return std::string("the transport is shut down");
    return errno_text(err);
  };
  const wire::Hello mine = my_hello();
  const std::string hello = hello_packet(mine);
  if (const int err =
          send_packet(sock.get(), hello.data(), hello.size(), nullptr, 0, deadline, stopping_)) {
    throw error("sending our Hello: " + io_text(err, "the peer closed the connection"));
  }
  Packet reply;
  wire::Hello theirs;
  std::optional<wire::auth::Proof> answer;
  try {
    if (const int err = recv_packet(sock.get(), reply, deadline, stopping_)) {
      throw error("reading its Hello: " +
                  io_text(err,
                          "the peer closed the connection (it refused our handshake: see its "
                          "log; a shared secret on one side only, a protocol version or a worker "
                          "identity are the usual reasons)"));
    }
    theirs = parse_hello_packet(reply.data);
    answer = wire::answer_acceptor(mine, theirs, token_);
    if (reply.fds.size() != 1) {
      throw wire::ProtocolError("its Hello carries " + std::to_string(reply.fds.size()) +
                                " descriptors (expected its wake-up eventfd)");
    }
    check_eventfd(reply.fds[0].get(), "its wake-up eventfd");
  } catch (const wire::ProtocolError& e) {
    throw error(e.what());
  }
  if (const std::string wrong =
          transport::detail::identity_mismatch(id, name, theirs.worker_id, theirs.worker_name);
      !wrong.empty()) {
    throw error(wrong);
  }
  if (answer) {
    const std::string packet = auth_answer_packet(*answer);
    if (const int err = send_packet(sock.get(), packet.data(), packet.size(), nullptr, 0, deadline,
                                    stopping_)) {
      throw error("sending our answer to its challenge: " +
                  io_text(err, "the peer closed the connection"));
    }
  }
  // Moved meanwhile: hung up before the ring is handed over, so the old incarnation takes nothing
  // into use (and reports nobody lost); the caller dials the new address.
  if (moved_away(id, address)) throw error("it was registered at a new address");
  const std::string label = "w" + std::to_string(options_.self_id) + "->w" + std::to_string(id);
  // Out of memory or descriptors here fails this dial, named like every other step of it.
  Fd ring_fd;
  std::shared_ptr<OutConn> c;
  try {
    ring_fd = make_memfd("distrpc-shm ring " + label, kRingHeaderBytes + kDefaultRingCapacity);
    auto map = map_shared(ring_fd.get(), kRingHeaderBytes + kDefaultRingCapacity,
                          /*prefault=*/true);
    init_ring(map->base(), kDefaultRingCapacity);
    c = std::make_shared<OutConn>(std::move(map), kDefaultRingCapacity, label);
    c->space_efd = make_eventfd();
  } catch (const DistNetworkError& e) {
    throw error("making the shared ring: " + reason_without_prefix(e));
  }
  c->wake_efd = std::move(reply.fds[0]);
  const SetupPacket setup{kSetupMagic, kSetupVersion, kDefaultRingCapacity};
  const std::array<int, 2> fds{ring_fd.get(), c->space_efd.get()};
  if (const int err = send_packet(sock.get(), &setup, sizeof setup, fds.data(), fds.size(),
                                  deadline, stopping_)) {
    throw error("sending the shared ring: " + io_text(err, "the peer closed the connection"));
  }
  Packet ack;
  if (const int err = recv_packet(sock.get(), ack, deadline, stopping_)) {
    throw error("waiting for it to adopt the shared ring: " +
                io_text(err,
                        "the peer closed the connection (it refused our answer to its "
                        "challenge or our shared memory: see its log)"));
  }
  AckPacket a{};
  if (ack.data.size() != sizeof a || !ack.fds.empty()) {
    throw error("its acknowledgement is malformed");
  }
  std::memcpy(&a, ack.data.data(), sizeof a);
  if (a.magic != kAckMagic || a.version != kSetupVersion) {
    throw error("its acknowledgement has a bad magic number or version");
  }
  c->sock = std::move(sock);
  c->peer = id;
  c->peer_name = theirs.worker_name;
  c->remote = address;
  return c;
}

}  // namespace distrpc::transport::shm::detail
