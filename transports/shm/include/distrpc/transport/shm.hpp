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
#include "distrpc/transport/detail/impl_context.hpp"
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
// The concept's calls (transport/detail/impl_context.hpp) forward to shm::detail::Impl. Here: the
// constructor listens on a fresh abstract Unix socket and starts the listener and I/O threads
// (DistNetworkError when shared memory or the socket is unusable); address() is the socket's name
// ("distrpc-shm-<pid>-<random>"); send() writes into the ring to the peer (large buffers into a
// shared segment); drive() reads only while no other thread does.
class Shm::Context : public detail::ImplContext<shm::detail::Impl> {
 public:
  using ImplContext::ImplContext;
};

static_assert(check_transport<Shm>());

}  // namespace distrpc::transport
