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
// may read it itself (drive()). Details at io_main.
#pragma once

#include <pthread.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "distrpc/bounded_thread.hpp"
#include "distrpc/error.hpp"
#include "distrpc/transport/detail/dial.hpp"
#include "distrpc/transport/detail/identity.hpp"
#include "distrpc/transport/detail/peer_liveness.hpp"
#include "distrpc/transport/shm/ring.hpp"
#include "distrpc/transport/shm/segment.hpp"
#include "distrpc/transport/shm/system.hpp"
#include "distrpc/transport/transport.hpp"
#include "distrpc/wire/byte_order.hpp"
#include "distrpc/wire/errors.hpp"
#include "distrpc/wire/frame.hpp"
#include "distrpc/wire/handshake.hpp"
#include "distrpc/wire/message.hpp"

namespace distrpc::transport {

struct Shm {
  static constexpr std::string_view name = "shm";
  // Linux with working sealed memfds (the only thing that can be missing: old kernels, seccomp).
  static bool viable() {
    static const bool ok = shm_detail::memfd_works();
    return ok;
  }
  // Boot id and the IPC and network namespaces: peers with equal keys share a kernel and can reach
  // each other's abstract sockets.
  static std::string domain_key() { return shm_detail::host_domain_key(); }
  class Context;
};

namespace shm_detail {
class Impl;  // the implementation, below
}  // namespace shm_detail

// Per-agent state of the shared-memory policy. Not copyable or movable: its threads refer to it.
// (Declared first, as the policy's interface; the implementation follows in shm_detail, and the
// member functions, which only forward to it, at the end of this file.)
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
  std::shared_ptr<shm_detail::Impl> impl_;
};

namespace shm_detail {

// Data bytes of each connection's ring. Small messages need little; larger ones stream through.
inline constexpr std::uint64_t kDefaultRingCapacity = std::uint64_t{2} << 20;
// How long the I/O thread keeps polling after the last activity before it sleeps, unless
// DISTRPC_SHM_SPIN_US says otherwise (0: never spin). Spinning yields the CPU on every round, so on
// a busy 2-core machine it costs latency to no one; idle, it stops after this.
inline constexpr int kDefaultSpinUs = 200;
// While spinning or busy, sockets (hang-ups, segment descriptors) are polled this often.
inline constexpr auto kSocketPollPeriod = std::chrono::microseconds(500);
// A writer waiting for ring space spins this long before it sleeps.
inline constexpr auto kWriterSpin = std::chrono::microseconds(50);
// A handshake frame is a Hello: name and token are bounded by the wire layer, so this is ample.
inline constexpr std::uint64_t kMaxHelloFrameBytes = 8 * 1024;

// Every ring record starts with this (then, for a message: the wire frame header, the placement
// table, the payload and the inline buffers).
inline constexpr std::uint32_t kRecordMagic = 0x52485344u;  // "DSHR"
inline constexpr std::uint32_t kRecordOneShot = 1;          // drop `segment` after this message
inline constexpr std::size_t kRecordHeaderBytes = 16;       // magic, segment, flags, forget
// Placement of a buffer: its offset in the record's segment, or inline in the ring.
inline constexpr std::uint64_t kInline = ~std::uint64_t{0};

// Packets on the Unix socket after the Hello exchange.
inline constexpr std::uint32_t kSetupMagic = 0x43485344u;  // "DSHC": ring memfd + space eventfd
inline constexpr std::uint32_t kAckMagic = 0x41485344u;    // "DSHA": the acceptor adopted it
inline constexpr std::uint32_t kSetupVersion = 1;
struct SetupPacket {
  std::uint32_t magic;
  std::uint32_t version;
  std::uint64_t capacity;
};
struct AckPacket {
  std::uint32_t magic;
  std::uint32_t version;
};

inline int spin_us_from_env() {
  const char* v = std::getenv("DISTRPC_SHM_SPIN_US");
  if (!v || !*v) return kDefaultSpinUs;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (*end != '\0' || n < 0 || n > 1000000) {
    throw std::invalid_argument(std::string("DISTRPC_SHM_SPIN_US='") + v +
                                "' is not a number of microseconds in 0..1000000");
  }
  return static_cast<int>(n);
}

inline wire::Limits hello_limits() {
  wire::Limits l;
  l.max_payload_bytes = kMaxHelloFrameBytes;
  l.max_buffers = 0;
  l.max_message_bytes = kMaxHelloFrameBytes;
  return l;
}

inline std::string hello_packet(const wire::Hello& h) {
  const wire::Message m = wire::encode_hello(h);
  return wire::encode_frame_header(m) + m.payload;
}

// A Hello packet: exactly one frame header and its payload. Throws ProtocolError.
inline wire::Hello parse_hello_packet(const std::string& data) {
  wire::FrameDecoder d(hello_limits());
  const std::size_t used = d.feed(data.data(), data.size());
  if (!d.done()) throw wire::ProtocolError("the handshake packet is shorter than a frame header");
  wire::Message m = wire::allocate_message(d.header());
  if (data.size() - used != m.payload.size()) {
    throw wire::ProtocolError("the handshake packet holds " + std::to_string(data.size() - used) +
                              " payload bytes, its header says " +
                              std::to_string(m.payload.size()));
  }
  std::memcpy(m.payload.data(), data.data() + used, m.payload.size());
  return wire::decode_hello(m);
}

inline void log_drop(const std::string& remote, const std::string& reason) {
  std::fprintf(stderr, "distrpc shm: dropping connection from %s: %s\n", remote.c_str(),
               reason.c_str());
}

inline std::string peer_credentials(int fd) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return "(unknown process)";
  return "pid " + std::to_string(cred.pid);
}

// A connection this process opened: it writes the ring. Shared by the calling threads (writes,
// under write_mu) and the I/O thread (watches the socket for a hang-up). The socket is closed only
// holding write_mu, so a writer never touches a closed (possibly reused) descriptor; ::shutdown()
// first, so a writer blocked waiting for space wakes at once.
struct OutConn {
  OutConn(std::shared_ptr<Mapping> m, std::uint64_t capacity, std::string label)
      : ring_map(std::move(m)), writer(ring_map->base(), capacity), segments(std::move(label)) {}

  int peer = -1;
  std::uint64_t generation = 0;  // of the Peer when this connection was made
  std::string peer_name;
  std::string remote;
  Fd sock;
  std::shared_ptr<Mapping> ring_map;
  RingWriter writer;
  Fd space_efd;  // ours: the peer's reader signals it when it frees space we wait for
  Fd wake_efd;   // the peer's: signalled when its reader sleeps and we published
  SegmentCache segments;

  std::mutex write_mu;
  std::string scratch;               // under write_mu: record header, frame header, placements
  std::vector<std::uint64_t> place;  // under write_mu
  std::atomic<bool> closed{false};
  // Set when the socket is shut down: a write into the ring would still "succeed", into a ring
  // nobody reads any more, so writers check this instead of learning it from the socket.
  std::atomic<bool> broken{false};
  std::mutex close_mu;
  std::mutex failure_mu;
  std::string failure;

  std::string describe() const {
    return "worker " + std::to_string(peer) + " ('" + peer_name + "') at " + remote;
  }
  void record_failure(const std::string& why) {
    std::lock_guard<std::mutex> lk(failure_mu);
    if (failure.empty()) failure = why;
  }
  std::string recorded_failure() {
    std::lock_guard<std::mutex> lk(failure_mu);
    return failure;
  }
  void shutdown_sock() {
    std::lock_guard<std::mutex> lk(close_mu);
    broken.store(true);
    if (!closed.load()) ::shutdown(sock.get(), SHUT_RDWR);
  }
  // True if this call closed it.
  bool close() {
    {
      std::lock_guard<std::mutex> lk(close_mu);
      if (closed.load()) return false;
      broken.store(true);
      ::shutdown(sock.get(), SHUT_RDWR);
    }
    std::scoped_lock lk(write_mu, close_mu);
    closed.store(true);
    sock.reset();
    return true;
  }
};

// A connection a peer opened to us: we read its ring. Touched only by the I/O thread (and by
// shutdown() after that thread stopped).
struct InConn {
  InConn(std::shared_ptr<Mapping> m, std::uint64_t capacity, const wire::Limits& limits)
      : ring_map(std::move(m)), reader(ring_map->base(), capacity), decoder(limits) {}

  int peer = -1;
  std::uint64_t generation = 0;  // of the Peer when this connection was adopted
  std::string peer_name;
  std::string remote;
  Fd sock;
  std::shared_ptr<Mapping> ring_map;
  RingReader reader;
  Fd space_efd;  // the peer's: signalled when we free space it waits for
  bool hung_up = false;

  // The segments in use (cached by the writer, or one-shot until their record is read).
  std::uint32_t last_announced = 0;
  std::map<std::uint32_t, std::shared_ptr<RecvSegment>> segments;

  // Parse state of the record being read.
  enum class Stage { Record, Frame, Placement, Body } stage = Stage::Record;
  std::array<char, kRecordHeaderBytes> record{};
  std::size_t record_filled = 0;
  std::uint32_t segment = 0;
  std::uint32_t flags = 0;
  wire::FrameDecoder decoder;
  std::string placement;
  std::size_t placement_filled = 0;
  wire::Message msg;
  std::vector<std::size_t> inline_buffers;  // indices of msg.buffers read from the ring
  std::size_t part = 0, part_off = 0;       // part 0 is the payload, part i > 0 inline buffer i-1
  std::uint64_t body_total = 0, body_received = 0;

  bool mid_record() const { return stage != Stage::Record || record_filled > 0; }
  std::string describe() const {
    return "worker " + std::to_string(peer) + " ('" + peer_name + "') at " + remote;
  }
};

// What this process knows about one worker: where it listens, the connection it opened to it.
struct Peer {
  explicit Peer(int id_) : id(id_) {}
  const int id;

  std::mutex connect_mu;                   // one connect attempt at a time, held across it
  std::atomic<std::uint64_t> attempts{0};  // finished failed attempts
  std::string last_failure;                // under connect_mu

  std::mutex mu;  // guards the fields below
  std::string name;
  std::string address;
  std::shared_ptr<OutConn> out;
  // A connection broke: sends fail fast until add_peer(); with the generation guard (a late
  // hang-up of the old pair must not mark a fresh registration lost).
  detail::PeerLiveness liveness;

  std::string describe_locked() const {
    return "worker " + std::to_string(id) + " ('" + name + "')" +
           (address.empty() ? std::string() : " at " + address);
  }
};

// An incoming connection between accept and the end of its handshake (listener thread only).
struct PendingHandshake {
  Fd sock;
  std::string remote;
  Clock::time_point deadline;
  bool hello_done = false;
  wire::Hello hello;
};

class Impl : public std::enable_shared_from_this<Impl> {
 public:
  Impl(const TransportOptions& options, TransportCallbacks callbacks)
      : options_(options), callbacks_(std::move(callbacks)), spin_us_(spin_us_from_env()) {
    if (!options_.auth_token.empty()) token_ = options_.auth_token;
    if (!Shm::viable()) {
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
    p->name = name;
    p->address = address;
    // A fresh registration is a fresh incarnation: it may be connected (and lost) again.
    p->liveness.renew();
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
    std::lock_guard<std::mutex> guard(shutdown_mu_);
    if (shut_down_) return 0;
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
    if (!on_io_thread) {
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

  std::string self_text() const {
    return "worker " + std::to_string(options_.self_id) + " ('" + options_.self_name + "')";
  }

  wire::Hello my_hello() const {
    wire::Hello h;
    h.protocol_version = wire::kProtocolVersion;
    h.worker_name = options_.self_name;
    h.worker_id = options_.self_id;
    h.auth_token = token_;
    return h;
  }

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
        std::fprintf(stderr, "distrpc shm: %s: unexpected error on thread %s: %s\n",
                     self_text().c_str(), thread_name, e.what());
        if (stopping_.load()) return;
      }
    }
  }

  // ---- listener ------------------------------------------------------------------------------

  void listen() {
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

  void listener_loop() {
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
          log_drop(h->remote, "no handshake within " +
                                  std::to_string(options_.connect_timeout.count()) + " ms");
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
              std::fprintf(stderr, "distrpc shm: %s: accept on %s failed: %s (retrying)\n",
                           self_text().c_str(), address_.c_str(), errno_text(errno).c_str());
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
  bool handshake_step(PendingHandshake& h) {
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
        wire::verify_auth_token(h.hello, token_);
        check_claimed_identity(h.hello);
        const std::string reply = hello_packet(my_hello());
        const int fd = wake_efd_.get();
        if (const int err = send_packet(h.sock.get(), reply.data(), reply.size(), &fd, 1,
                                        h.deadline, stopping_)) {
          log_drop(h.remote, "sending the handshake reply failed: " + errno_text(err));
          return false;
        }
        h.hello_done = true;
        return true;
      }
      adopt_incoming(h, pkt);
    } catch (const std::exception& e) {
      log_drop(h.remote, std::string("bad handshake: ") + e.what());
    }
    return false;
  }

  // The claimed id must be a valid worker id, and agree with what add_peer() said about it.
  void check_claimed_identity(const wire::Hello& hello) {
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
  void adopt_incoming(PendingHandshake& h, Packet& pkt) {
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
    auto map = map_shared(pkt.fds[0].get(), static_cast<std::size_t>(size), /*prefault=*/true);
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
      c->generation = p->liveness.generation();
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stopping_.load()) return;
      pending_in_.push_back(std::move(c));
      changes_.store(true, std::memory_order_release);
    }
    signal_eventfd(wake_efd_.get());
  }

  // ---- connecting (calling thread) -----------------------------------------------------------

  std::shared_ptr<OutConn> connection_to(int id) {
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
    std::string name, address;
    {
      std::lock_guard<std::mutex> lk(p->mu);
      name = p->name;
      address = p->address;
    }
    std::shared_ptr<OutConn> c;
    try {
      c = dial(id, name, address);
    } catch (const DistNetworkError& e) {
      p->last_failure = e.what();
      p->attempts.fetch_add(1);
      throw;
    }
    p->last_failure.clear();
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
    {
      std::lock_guard<std::mutex> lk(p->mu);
      c->generation = p->liveness.generation();
      p->out = c;
    }
    signal_eventfd(wake_efd_.get());
    return c;
  }

  std::shared_ptr<OutConn> dial(int id, const std::string& name, const std::string& address) {
    const std::string who = "worker " + std::to_string(id) + " ('" + name + "') at " + address;
    const auto error = [&](const std::string& what) {
      return DistNetworkError("distrpc shm: cannot connect to " + who + ": " + what);
    };
    const detail::DialTiming timing{Clock::now(), options_.connect_timeout, options_.refused_retry};
    sockaddr_un sa;
    const socklen_t len = abstract_sockaddr(address, sa);
    // Not listening yet (it is starting up), or its backlog is full: retried until the deadline.
    Fd s = detail::dial_with_backoff(
        timing, stopping_,
        [&](detail::DialFailure& failure) -> std::optional<Fd> {
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

  std::shared_ptr<OutConn> handshake(Fd sock, int id, const std::string& name,
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
    const std::string hello = hello_packet(my_hello());
    if (const int err =
            send_packet(sock.get(), hello.data(), hello.size(), nullptr, 0, deadline, stopping_)) {
      throw error("sending our Hello: " + io_text(err, "the peer closed the connection"));
    }
    Packet reply;
    wire::Hello theirs;
    try {
      if (const int err = recv_packet(sock.get(), reply, deadline, stopping_)) {
        throw error("reading its Hello: " +
                    io_text(err,
                            "the peer closed the connection (it refused our handshake: see its "
                            "log; a wrong auth token, protocol version or worker identity are the "
                            "usual reasons)"));
      }
      theirs = parse_hello_packet(reply.data);
      wire::verify_auth_token(theirs, token_);
      if (reply.fds.size() != 1) {
        throw wire::ProtocolError("its Hello carries " + std::to_string(reply.fds.size()) +
                                  " descriptors (expected its wake-up eventfd)");
      }
      check_eventfd(reply.fds[0].get(), "its wake-up eventfd");
    } catch (const wire::ProtocolError& e) {
      throw error(e.what());
    }
    if (const std::string wrong =
            detail::identity_mismatch(id, name, theirs.worker_id, theirs.worker_name);
        !wrong.empty()) {
      throw error(wrong);
    }
    const std::string label = "w" + std::to_string(options_.self_id) + "->w" + std::to_string(id);
    Fd ring_fd = make_memfd("distrpc-shm ring " + label, kRingHeaderBytes + kDefaultRingCapacity);
    auto map = map_shared(ring_fd.get(), kRingHeaderBytes + kDefaultRingCapacity,
                          /*prefault=*/true);
    init_ring(map->base(), kDefaultRingCapacity);
    auto c = std::make_shared<OutConn>(std::move(map), kDefaultRingCapacity, label);
    c->space_efd = make_eventfd();
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
                          "the peer closed the connection (it refused our shared memory: "
                          "see its log)"));
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

  // ---- sending (calling thread) --------------------------------------------------------------

  void write_message(OutConn& c, const wire::Message& m) {
    std::lock_guard<std::mutex> lk(c.write_mu);
    if (c.closed.load() || c.broken.load()) {
      if (stopping_.load()) {
        throw DistNetworkError("distrpc shm: cannot send to " + c.describe() +
                               ": the transport of " + self_text() + " is shut down");
      }
      const std::string why = c.recorded_failure();
      throw DistNetworkError("distrpc shm: cannot send to " + c.describe() +
                             ": the connection was lost" + (why.empty() ? "" : " (" + why + ")"));
    }
    // Placement: large buffers go to one segment (64-byte aligned), the rest through the ring.
    c.place.assign(m.buffers.size(), kInline);
    std::uint64_t seg_bytes = 0;
    for (std::size_t i = 0; i < m.buffers.size(); ++i) {
      const auto n = static_cast<std::uint64_t>(m.buffers[i].numel());
      if (n < kSegmentThreshold) continue;
      seg_bytes = (seg_bytes + kSegmentAlign - 1) / kSegmentAlign * kSegmentAlign;
      c.place[i] = seg_bytes;
      seg_bytes += n;
    }
    SegmentChoice seg;
    if (seg_bytes > 0) seg = c.segments.acquire(seg_bytes);  // may throw: nothing written yet
    try {
      if (seg.fresh) {
        const SegmentPacket sp{kSegmentPacketMagic, seg.segment.id, seg.segment.capacity};
        const int fd = seg.fd.get();
        if (const int err =
                send_packet(c.sock.get(), &sp, sizeof sp, &fd, 1, std::nullopt, stopping_)) {
          throw DistNetworkError(err == ECANCELED
                                     ? std::string("the transport was shut down")
                                     : "announcing a tensor segment: " + errno_text(err));
        }
        seg.fd.reset();
      }
      // The one copy of every large buffer.
      for (std::size_t i = 0; i < m.buffers.size(); ++i) {
        if (c.place[i] == kInline) continue;
        std::memcpy(seg.segment.data() + c.place[i], m.buffers[i].data_ptr(),
                    static_cast<std::size_t>(m.buffers[i].numel()));
      }
      c.scratch.resize(kRecordHeaderBytes);
      char* r = c.scratch.data();
      wire::detail::put_le<std::uint32_t>(r + 0, kRecordMagic);
      wire::detail::put_le<std::uint32_t>(r + 4, seg.segment.id);
      wire::detail::put_le<std::uint32_t>(r + 8, seg.one_shot ? kRecordOneShot : 0);
      wire::detail::put_le<std::uint32_t>(r + 12, seg.forget);
      wire::append_frame_header(c.scratch, m);
      const std::size_t at = c.scratch.size();
      c.scratch.resize(at + 8 * m.buffers.size());
      for (std::size_t i = 0; i < m.buffers.size(); ++i) {
        wire::detail::put_le<std::uint64_t>(c.scratch.data() + at + 8 * i, c.place[i]);
      }
      ring_write(c, c.scratch.data(), c.scratch.size());
      ring_write(c, m.payload.data(), m.payload.size());
      for (std::size_t i = 0; i < m.buffers.size(); ++i) {
        if (c.place[i] != kInline) continue;
        ring_write(c, static_cast<const char*>(m.buffers[i].data_ptr()),
                   static_cast<std::size_t>(m.buffers[i].numel()));
      }
      if (c.writer.publish()) signal_eventfd(c.wake_efd.get());
    } catch (const std::exception& e) {
      std::string text = e.what();
      if (dynamic_cast<const RingCorrupt*>(&e)) log_drop(c.describe(), text);
      // Part of a record may be in the ring: the connection is unusable. The I/O thread sees the
      // shutdown as a hang-up, closes the connection and reports this reason.
      c.record_failure("write failed: " + text);
      c.shutdown_sock();
      throw DistNetworkError("distrpc shm: send of " + wire::to_string(m.type) + " message " +
                             std::to_string(m.id) + " to " + c.describe() + " failed: " + text);
    }
  }

  // Copies `n` bytes into the ring, waiting for space as needed (a message larger than the ring
  // streams through it while the reader consumes).
  void ring_write(OutConn& c, const char* p, std::size_t n) {
    while (n > 0) {
      const std::uint64_t free = c.writer.free_space();
      if (free == 0) {
        if (c.writer.publish()) signal_eventfd(c.wake_efd.get());
        wait_for_space(c);
        continue;
      }
      const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(n, free));
      c.writer.copy_in(p, k);
      p += k;
      n -= k;
    }
  }

  void wait_for_space(OutConn& c) {
    const auto spin_until = Clock::now() + kWriterSpin;
    while (Clock::now() < spin_until) {
      if (c.writer.free_space() > 0) return;
      ::sched_yield();
    }
    c.writer.declare_sleeping();
    for (;;) {
      if (c.writer.free_space() > 0) break;
      if (stopping_.load()) {
        c.writer.clear_sleeping();
        throw DistNetworkError("the transport was shut down");
      }
      std::array<pollfd, 2> fds{pollfd{c.space_efd.get(), POLLIN, 0},
                                pollfd{c.sock.get(), POLLRDHUP, 0}};
      const int r = ::poll(fds.data(), fds.size(), kPollSliceMs);
      if (r < 0 && errno != EINTR) {
        c.writer.clear_sleeping();
        throw DistNetworkError("poll: " + errno_text(errno));
      }
      if (fds[1].revents & (POLLHUP | POLLRDHUP | POLLERR)) {
        c.writer.clear_sleeping();
        throw DistNetworkError("the peer closed the connection while we waited for ring space");
      }
      if (fds[0].revents & POLLIN) drain_eventfd(c.space_efd.get());
      c.writer.declare_sleeping();  // it may have been cleared by the reader's wake-up
    }
    c.writer.clear_sleeping();
  }

  // ---- the I/O thread ------------------------------------------------------------------------

  struct Watched {
    std::shared_ptr<InConn> in;
    std::shared_ptr<OutConn> out;
  };

  // ---- who reads: the I/O threads, and callers waiting for a reply ----------------------------
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

  // One I/O thread.
  void io_main() {
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
  bool retry_lead(std::unique_lock<std::mutex>& lead) {
    if (!stopping_.load()) drain_eventfd(wake_efd_.get());
    missed_.store(true);
    return lead.try_lock();
  }

  // Just let go of the lead: if a woken thread found it taken meanwhile, look at the rings again
  // and signal only if a record is waiting (the holder of the moment settles it otherwise).
  void settle(std::unique_lock<std::mutex>& lead) {
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
  void idle_wait() {
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
  int wait_events(std::array<epoll_event, 8>& evs, bool timed) {
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
  bool sleep_rings_or_ready() {
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
  bool other_task_done() {
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
  bool rings_ready() {
    for (auto& c : ins_) {
      try {
        if (c->reader.available() > 0) return true;
      } catch (const RingCorrupt&) {
        return true;  // service() reports it
      }
    }
    return false;
  }
  void wake_rings() {
    unattended_.store(false, std::memory_order_relaxed);  // the lead is held: attended
    for (auto& c : ins_) c->reader.clear_sleeping();
  }

  // With the lead held and records waiting, about to let go of it without declaring the rings
  // sleeping (a stream; the holder runs a task or returns to its caller): the other I/O thread
  // watches from now on, and takes over if this lasts a whole kWatchPeriod (idle_wait()).
  void leave_unattended() {
    unattended_seq_.fetch_add(1);
    unattended_.store(true);
    if (!watching_.load()) signal_eventfd(watch_efd_.get());  // wakes a thread to watch
  }

  // Reads every ring once (with the lead held); true if anything came.
  bool service_all(InlineScope& scope) {
    if (changes_.load(std::memory_order_acquire)) apply_changes();
    bool progress = false;
    for (std::size_t i = 0; i < ins_.size(); ++i) {
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
  InlineTask io_loop(bool woken) {
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

 public:
  // A caller waiting for a reply reads it itself while the lead is free (see above): then no I/O
  // thread wakes for it, and with two cores shared by two processes the spinning threads are
  // the two that matter. Requests read here go to the receiver's pool.
  void drive(const std::function<bool()>& done, std::chrono::steady_clock::time_point until) {
    std::unique_lock<std::mutex> lead(lead_mu_, std::defer_lock);
    while (!done() && !stopping_.load(std::memory_order_relaxed) && Clock::now() < until) {
      if (!lead.owns_lock()) {
        if (!lead.try_lock()) {
          lead_wanted_.store(true, std::memory_order_relaxed);
          ::sched_yield();
          continue;
        }
        wake_rings();  // while this thread reads, writers need not signal
      }
      InlineScope scope;  // a request read here is queued when the scope closes
      if (!service_all(scope)) ::sched_yield();
    }
    // Hand the lead back as found. Records that came meanwhile (a stream of replies) are left
    // unattended: this caller is likely back soon, and the watcher takes over if it is not.
    if (!lead.owns_lock()) return;
    if (sleep_rings_or_ready()) leave_unattended();
    lead.unlock();
    settle(lead);
  }

 private:
  void apply_changes() {
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
  void poll_sockets(int timeout_ms) {
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

  void on_in_socket(std::shared_ptr<InConn> c, std::uint64_t token, std::uint32_t events) {
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
    lose_in(c, token,
            c->mid_record() ? "connection closed by peer in the middle of a message (its process "
                              "exited or was killed)"
                            : "connection closed by peer");
  }

  void on_out_socket(const std::shared_ptr<OutConn>& c, std::uint64_t token, std::uint32_t events) {
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

  bool is_in_watched(std::uint64_t token) const { return watched_.count(token) != 0; }

  void unwatch(std::uint64_t token, int fd) {
    if (fd >= 0) ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd, nullptr);
    watched_.erase(token);
  }

  std::uint64_t token_of(const std::shared_ptr<InConn>& c) const {
    for (const auto& [token, w] : watched_) {
      if (w.in == c) return token;
    }
    return ~std::uint64_t{0};
  }

  // The descriptor of segment `id`, which the writer sent on the socket just before the record
  // naming it (so it is queued there by now). Throws ProtocolError.
  std::shared_ptr<RecvSegment> take_announcement(InConn& c, std::uint32_t id) {
    const auto never = [&](const std::string& why) {
      return wire::ProtocolError("a record names segment " + std::to_string(id) +
                                 ", which was never announced (" + why + ")");
    };
    if (id <= c.last_announced) throw never("ids only grow and it is not in use");
    if (c.segments.size() >= kMaxReceiverSegments) {
      throw wire::ProtocolError("more than " + std::to_string(kMaxReceiverSegments) +
                                " tensor segments in use on one connection");
    }
    Packet pkt;
    const int r = try_recv_packet(c.sock.get(), pkt);
    if (r == EAGAIN) throw never("nothing is queued on the socket");
    if (r == kPeerClosed) throw never("the socket is closed");
    if (r != 0) throw never("reading the socket failed: " + errno_text(r));
    SegmentPacket sp{};
    if (pkt.data.size() != sizeof sp || pkt.fds.size() != 1) {
      throw wire::ProtocolError("malformed segment announcement (" +
                                std::to_string(pkt.data.size()) + " bytes, " +
                                std::to_string(pkt.fds.size()) + " descriptors)");
    }
    std::memcpy(&sp, pkt.data.data(), sizeof sp);
    if (sp.magic != kSegmentPacketMagic) {
      throw wire::ProtocolError("segment announcement with a bad magic number");
    }
    if (sp.id != id) {
      throw wire::ProtocolError("the socket announces segment " + std::to_string(sp.id) +
                                " where the ring's next record names segment " +
                                std::to_string(id));
    }
    c.last_announced = id;
    return adopt_segment(pkt.fds[0].get(), id, sp.capacity, options_.limits.max_message_bytes);
  }

  std::size_t take(InConn& c, char* dst, std::size_t n, std::uint64_t& avail) {
    std::size_t done = 0;
    while (done < n && avail > 0) {
      auto [p, k] = c.reader.span(std::min<std::uint64_t>(n - done, avail));
      if (dst) std::memcpy(dst + done, p, k);
      c.reader.consume(k);
      avail -= k;
      done += k;
    }
    return done;
  }

  // Reads what the ring holds, up to the first request on_message hands back (kept in `scope`);
  // true if it made progress or left bytes for later. Drops the connection on any violation.
  bool service(std::shared_ptr<InConn> cp, InlineScope& scope) {
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
        switch (c.stage) {
          case InConn::Stage::Record: {
            c.record_filled += take(c, c.record.data() + c.record_filled,
                                    kRecordHeaderBytes - c.record_filled, avail);
            if (c.record_filled < kRecordHeaderBytes) break;
            begin_record(c);
            break;
          }
          case InConn::Stage::Frame: {
            auto [p, k] = c.reader.span(std::min<std::uint64_t>(avail, c.decoder.bytes_needed()));
            const std::size_t used = c.decoder.feed(p, k);
            c.reader.consume(used);
            avail -= used;
            if (c.decoder.done()) begin_placement(c);
            break;
          }
          case InConn::Stage::Placement: {
            c.placement_filled += take(c, c.placement.data() + c.placement_filled,
                                       c.placement.size() - c.placement_filled, avail);
            if (c.placement_filled == c.placement.size()) begin_body(c);
            break;
          }
          case InConn::Stage::Body: {
            read_body(c, avail);
            break;
          }
        }
        if (c.stage == InConn::Stage::Body && body_complete(c)) {
          if (c.reader.release()) signal_eventfd(c.space_efd.get());
          deliver(c);
          if (stopping_.load(std::memory_order_relaxed)) return true;
        }
      }
      if (c.reader.release()) signal_eventfd(c.space_efd.get());
    } catch (const std::exception& e) {
      drop_in(cp, token_of(cp), e.what());
    }
    return progress;
  }

  void begin_record(InConn& c) {
    const char* r = c.record.data();
    const auto magic = wire::detail::get_le<std::uint32_t>(r + 0);
    if (magic != kRecordMagic) {
      throw wire::ProtocolError("bad record magic 0x" + wire::detail::hex32(magic).substr(2) +
                                " in the shared ring (the stream is corrupted)");
    }
    c.segment = wire::detail::get_le<std::uint32_t>(r + 4);
    c.flags = wire::detail::get_le<std::uint32_t>(r + 8);
    const auto forget = wire::detail::get_le<std::uint32_t>(r + 12);
    if ((c.flags & ~kRecordOneShot) != 0) {
      throw wire::ProtocolError("record flags " + std::to_string(c.flags) + " are not defined");
    }
    if (forget != 0) {
      if (c.segments.erase(forget) == 0) {
        throw wire::ProtocolError("the peer releases segment " + std::to_string(forget) +
                                  ", which is not in use");
      }
    }
    if (c.segment != 0 && c.segments.count(c.segment) == 0) {
      c.segments[c.segment] = take_announcement(c, c.segment);
    }
    c.record_filled = 0;
    c.decoder.reset();
    c.stage = InConn::Stage::Frame;
  }

  void begin_placement(InConn& c) {
    const wire::FrameHeader& h = c.decoder.header();
    if (h.type == wire::MessageType::Handshake) {
      throw wire::ProtocolError("unexpected Handshake record on an established connection");
    }
    c.placement.assign(8 * h.buffer_bytes.size(), '\0');
    c.placement_filled = 0;
    c.stage = InConn::Stage::Placement;
    if (c.placement.empty()) begin_body(c);
  }

  void begin_body(InConn& c) {
    const wire::FrameHeader& h = c.decoder.header();
    c.msg = wire::Message{};
    c.msg.type = h.type;
    c.msg.id = h.id;
    c.inline_buffers.clear();
    c.body_total = h.payload_bytes;
    std::shared_ptr<RecvSegment> seg;
    if (c.segment != 0) seg = c.segments.at(c.segment);
    at::Tensor seg_storage;
    try {
      c.msg.payload.resize(static_cast<std::size_t>(h.payload_bytes));
      c.msg.buffers.reserve(h.buffer_bytes.size());
      for (std::size_t i = 0; i < h.buffer_bytes.size(); ++i) {
        const std::uint64_t n = h.buffer_bytes[i];
        const auto place = wire::detail::get_le<std::uint64_t>(c.placement.data() + 8 * i);
        if (place == kInline) {
          c.msg.buffers.push_back(at::empty({static_cast<std::int64_t>(n)}, at::kByte));
          c.inline_buffers.push_back(i);
          c.body_total += n;
          continue;
        }
        if (!seg) {
          throw wire::ProtocolError("buffer " + std::to_string(i) +
                                    " is placed in a segment but the record names none");
        }
        if (place > seg->capacity || n > seg->capacity - place) {
          throw wire::ProtocolError("buffer " + std::to_string(i) + " of " + std::to_string(n) +
                                    " bytes at offset " + std::to_string(place) +
                                    " reaches outside segment " + std::to_string(c.segment) +
                                    " of " + std::to_string(seg->capacity) + " bytes");
        }
        if (!seg_storage.defined()) {
          // Every buffer of this message is a view of one storage over the segment; when the last
          // tensor using it dies, the segment goes back to the sender (SegmentUse).
          auto use = std::make_shared<SegmentUse>(seg, (c.flags & kRecordOneShot) != 0);
          seg_storage = at::from_blob(
              seg->data(), {static_cast<std::int64_t>(seg->capacity)}, [use](void*) {},
              at::TensorOptions().dtype(at::kByte));
        }
        c.msg.buffers.push_back(
            seg_storage.narrow(0, static_cast<std::int64_t>(place), static_cast<std::int64_t>(n)));
      }
    } catch (const std::bad_alloc&) {
      // DistNetworkError, as tcp raises it, not ProtocolError: the record was within our limits,
      // so the peer broke nothing (ProtocolError means it did, wire/errors.hpp); this process ran
      // out of memory and the connection is dropped all the same.
      throw DistNetworkError("cannot allocate " + std::to_string(c.body_total) + " bytes for a " +
                             wire::to_string(h.type) + " record");
    }
    if (c.segment != 0 && (c.flags & kRecordOneShot)) c.segments.erase(c.segment);
    c.body_received = 0;
    c.part = 0;
    c.part_off = 0;
    c.stage = InConn::Stage::Body;
  }

  std::pair<char*, std::size_t> part(InConn& c, std::size_t i) {
    if (i == 0) return {c.msg.payload.data(), c.msg.payload.size()};
    const at::Tensor& b = c.msg.buffers[c.inline_buffers[i - 1]];
    return {static_cast<char*>(b.data_ptr()), static_cast<std::size_t>(b.numel())};
  }

  bool body_complete(const InConn& c) const { return c.body_received == c.body_total; }

  void read_body(InConn& c, std::uint64_t& avail) {
    const std::size_t parts = 1 + c.inline_buffers.size();
    while (c.part < parts && avail > 0) {
      auto [ptr, len] = part(c, c.part);
      const std::size_t got = take(c, ptr + c.part_off, len - c.part_off, avail);
      c.part_off += got;
      c.body_received += got;
      if (c.part_off == len) {
        ++c.part;
        c.part_off = 0;
      }
    }
  }

  void deliver(InConn& c) {
    wire::Message m = std::move(c.msg);
    c.msg = wire::Message{};
    c.stage = InConn::Stage::Record;
    c.record_filled = 0;
    if (!callbacks_.on_message) return;
    try {
      callbacks_.on_message(c.peer, std::move(m));
    } catch (const std::exception& e) {
      // The owner's bug, not the peer's: the connection stays.
      std::fprintf(stderr, "distrpc shm: on_message for a message from %s threw: %s\n",
                   c.describe().c_str(), e.what());
    }
  }

  // A protocol violation or corrupted shared memory: logged, then handled like any other loss.
  void drop_in(std::shared_ptr<InConn> c, std::uint64_t token, const std::string& reason) {
    if (stopping_.load()) return;
    log_drop(c->remote, c->describe() + ": " + reason);
    lose_in(c, token, reason);
  }

  void lose_in(std::shared_ptr<InConn> c, std::uint64_t token, const std::string& reason) {
    if (!is_in_watched(token)) return;
    unwatch(token, c->sock.get());
    ins_.erase(std::remove(ins_.begin(), ins_.end(), c), ins_.end());
    c->sock.reset();  // the peer sees the hang-up
    report_lost(c->peer, nullptr, c->generation, reason);
  }

  void report_lost(int peer, const OutConn* out, std::uint64_t generation,
                   const std::string& reason) {
    bool report = false;
    if (auto p = find_peer(peer)) {
      std::lock_guard<std::mutex> lk(p->mu);
      if (out && p->out.get() == out) p->out.reset();
      // A connection of a registration since replaced is ignored.
      if (!p->liveness.current(generation)) return;
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
      std::fprintf(stderr, "distrpc shm: on_peer_lost for worker %d threw: %s\n", peer, e.what());
    }
  }

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

}  // namespace shm_detail

// ---- Shm::Context: forwards to the implementation ---------------------------------------------

inline Shm::Context::Context(const TransportOptions& options, TransportCallbacks callbacks)
    : impl_(std::make_shared<shm_detail::Impl>(options, std::move(callbacks))) {
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
