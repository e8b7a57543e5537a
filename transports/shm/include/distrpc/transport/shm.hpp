// The shared-memory transport policy: moves wire::Message values between processes of one host
// through shared memory, without a socket on the data path.
//
// Connection model (docs/transports.md, "Shm"): like Tcp, each process opens at most one connection
// to each peer, lazily on the first send, and WRITES only on the connections it opened; it READS
// those its peers opened to it. A connection is a SOCK_SEQPACKET Unix socket in the abstract
// namespace (no socket file) carrying the handshake and, afterwards, only descriptors of tensor
// segments, plus one single-producer single-consumer ring in a sealed memfd (no /dev/shm name)
// carrying the records. The socket stays open for the connection's life: a peer's death is its
// hang-up, seen at once by the kernel.
//
// Threads: the calling thread connects, handshakes and writes (into the ring, under a
// per-connection mutex: no hand-off). One listener thread accepts and handshakes incoming
// connections. Two I/O threads take turns as the reader (leader/follower): the leader reads every
// incoming ring, watches every socket and runs the callbacks; it spins (yielding the CPU) for a
// short while after activity and then sleeps on an eventfd, so an idle agent uses no CPU. A writer
// signals the eventfd only when the reader said it was going to sleep (ring.hpp). When on_message
// hands a task back (transport.hpp, InlineScope) and the rings are empty, the leader lets go of
// the lead and runs the task itself: a small request then runs without waking a pool thread, and
// a record that comes meanwhile wakes the other thread to read it. A caller waiting for a reply
// may read it itself (drive()). Details in shm/detail/lead.hpp.
//
// This header is the policy's interface; the implementation (namespace shm::detail) is in
// shm/detail/: impl.hpp lists it and the headers beside it hold one part each.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "distrpc/transport/shm/detail/connect.hpp"
#include "distrpc/transport/shm/detail/impl.hpp"
#include "distrpc/transport/shm/detail/lead.hpp"
#include "distrpc/transport/shm/detail/listener.hpp"
#include "distrpc/transport/shm/detail/reader.hpp"
#include "distrpc/transport/shm/detail/ring_writer.hpp"
#include "distrpc/transport/shm/system.hpp"
#include "distrpc/transport/transport.hpp"
#include "distrpc/wire/message.hpp"

namespace distrpc::transport {

struct Shm {
  static constexpr std::string_view name = "shm";
  // Linux with working sealed memfds (the only thing that can be missing: old kernels, seccomp).
  static bool viable() { return shm::detail::memfd_usable(); }
  // Boot id and the IPC and network namespaces: peers with equal keys share a kernel and can reach
  // each other's abstract sockets.
  static std::string domain_key() { return shm::detail::host_domain_key(); }
  class Context;
};

// Per-agent state of the shared-memory policy. Not copyable or movable: its threads refer to it.
// (The member functions only forward to shm::detail::Impl; they follow the declaration.)
class Shm::Context {
 public:
  // Listens on a fresh abstract Unix socket and starts the listener and I/O threads. Throws
  // DistNetworkError when shared memory or the socket is unusable.
  Context(const TransportOptions& options, TransportCallbacks callbacks);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  // The abstract socket's name ("distrpc-shm-<pid>-<random>"), to publish for peers.
  std::string address() const;

  // Records where worker `id` listens. Calling it again (a restarted peer) also clears a lost
  // state, so the next send connects afresh.
  void add_peer(int id, const std::string& name, const std::string& address);

  // Writes `message` into the ring to worker `peer` from the calling thread (large buffers into a
  // shared segment), connecting first if needed. Thread-safe; in order per peer. Throws
  // wire::EncodeError (over the limits, nothing written) or DistNetworkError.
  void send(int peer, wire::Message&& message);

  // Idempotent: closes every connection, joins the threads; no callback runs after it returns
  // (except the one it is called from, if any). An I/O thread still running a handed-back task at
  // `deadline` is abandoned instead (detached; it runs no callback afterwards and exits when the
  // task returns); returns how many were. Without a deadline: kDefaultShutdownGrace from now.
  std::size_t shutdown(std::chrono::steady_clock::time_point deadline);
  void shutdown();

  // Reads on the calling thread while no other thread does, until done() or `until`
  // (transport.hpp).
  void drive(const std::function<bool()>& done, std::chrono::steady_clock::time_point until);

 private:
  std::shared_ptr<shm::detail::Impl> impl_;
};

// ---- Shm::Context: forwards to the implementation ---------------------------------------------

inline Shm::Context::Context(const TransportOptions& options, TransportCallbacks callbacks)
    : impl_(std::make_shared<shm::detail::Impl>(options, std::move(callbacks))) {
  impl_->start();
}
inline Shm::Context::~Context() {
  shutdown();
}
inline std::string Shm::Context::address() const {
  return impl_->address();
}
inline void Shm::Context::add_peer(int id, const std::string& name, const std::string& address) {
  impl_->add_peer(id, name, address);
}
inline void Shm::Context::send(int peer, wire::Message&& message) {
  impl_->send(peer, message);
}
inline std::size_t Shm::Context::shutdown(std::chrono::steady_clock::time_point deadline) {
  return impl_->shutdown(deadline);
}
inline void Shm::Context::shutdown() {
  shutdown(std::chrono::steady_clock::now() + kDefaultShutdownGrace);
}
inline void Shm::Context::drive(const std::function<bool()>& done,
                                std::chrono::steady_clock::time_point until) {
  impl_->drive(done, until);
}

static_assert(check_transport<Shm>());

}  // namespace distrpc::transport
