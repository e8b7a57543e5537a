// The TCP transport policy: moves wire::Message values between processes over plain TCP, writing
// tensor bytes straight from their storage and reading them straight into fresh tensors.
//
// Connection model (docs/transports.md, "Tcp"): each process opens at most one connection to each
// peer, lazily on the first send, and SENDS only on the connections it opened; it RECEIVES on those
// and on the ones its peers opened to it. Two peers that start sending to each other at the same
// moment therefore open two independent connections instead of racing to agree on one.
//
// Threads: the calling thread connects (with retries until connect_timeout), handshakes and writes
// (a gathered write under a per-connection mutex: no queue, no hand-off, which is what keeps a
// small call fast). One listener thread (Asio) accepts and handshakes incoming connections. Two
// reading threads share one epoll set of the established connections (one-shot registrations, so
// the kernel hands each ready connection to one of them) and run the callbacks; one of them may run
// a request it read while the other keeps reading (leader/follower, transport.hpp InlineScope and
// docs/threading.md). Handshakes never wait for the reading threads, so a send made from inside a
// callback (a reply) cannot deadlock two processes connecting to each other at the same time.
//
// TLS (TransportOptions::tls, docs/security.md "TLS"): an OpenSSL SSL* bound to the connection's
// descriptor (SSL_set_fd), not Asio's ssl::stream, because established connections are read by the
// epoll threads on raw descriptors: the TLS handshake runs first (on the listener's Asio loop for
// an incoming connection, on the calling thread for an outgoing one), then the Hello and the
// secret's challenge-response inside it, and the reading threads and writers call
// SSL_read/SSL_write where the plain path calls recv/readv/sendmsg. A connection without TLS takes
// one predictable branch more on each read and write, nothing else.
#pragma once

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <asio/buffer.hpp>
#include <asio/executor_work_guard.hpp>
#include <asio/io_context.hpp>
#include <asio/ip/host_name.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/post.hpp>
#include <asio/read.hpp>
#include <asio/steady_timer.hpp>
#include <asio/write.hpp>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "distrpc/bounded_thread.hpp"
#include "distrpc/error.hpp"
#include "distrpc/log.hpp"
#include "distrpc/net/dial.hpp"
#include "distrpc/net/errno_text.hpp"
#include "distrpc/net/fd.hpp"
#include "distrpc/net/handoff.hpp"
#include "distrpc/net/ready_set.hpp"
#include "distrpc/net/spin.hpp"
#include "distrpc/net/tls.hpp"
#include "distrpc/net/wait_fd.hpp"
#include "distrpc/transport/detail/dial_registered.hpp"
#include "distrpc/transport/detail/identity.hpp"
#include "distrpc/transport/detail/impl_context.hpp"
#include "distrpc/transport/detail/peer_liveness.hpp"
#include "distrpc/transport/detail/self.hpp"
#include "distrpc/transport/transport.hpp"
#include "distrpc/wire/errors.hpp"
#include "distrpc/wire/frame.hpp"
#include "distrpc/wire/handshake.hpp"
#include "distrpc/wire/message.hpp"

namespace distrpc::transport {

struct Tcp {
  static constexpr std::string_view name = "tcp";
  // Loopback TCP exists wherever this builds.
  static bool viable() { return true; }
  // TCP reaches every host, so every peer shares one domain.
  static std::string domain_key() { return "tcp"; }
  class Context;
};

namespace tcp::detail {
class Impl;
}  // namespace tcp::detail

// Per-agent state of the TCP policy. Not copyable or movable: its threads refer to it. The
// concept's calls (transport/detail/impl_context.hpp) forward to tcp::detail::Impl. Here:
// address() is "host:port" of the listener ("[v6]:port" for IPv6 hosts); the constructor listens
// on options.listen_host (port 0) and starts the listener and reading threads; send() writes the
// frame, payload and tensor bytes with one gathered write on the calling thread.
class Tcp::Context : public detail::ImplContext<tcp::detail::Impl> {
 public:
  using ImplContext::ImplContext;
};

// ---- the implementation ------------------------------------------------------------------------

namespace tcp::detail {

using Clock = std::chrono::steady_clock;

// Bytes read per receive into a connection's buffer; several small frames fit in one read.
inline constexpr std::size_t kReadBufferBytes = 64 * 1024;
// Threads reading established connections, one-shot registrations in one epoll set
// (net::ReadySet), so the kernel hands a ready connection to one of them and no thread wakes
// another for it. Two, so one can run a request it read (leader/follower, transport.hpp
// InlineScope) while the other keeps reading: at most kReadThreads - 1 run tasks at a time.
inline constexpr int kReadThreads = 2;
// How long a reading thread that just handled a message keeps polling the epoll set (yielding
// the CPU each round) before it sleeps, unless DISTRPC_TCP_SPIN_US says otherwise (0: never).
// A conversation's next message then finds a thread awake instead of paying for a wake-up on
// another core; an idle connection costs this once, then nothing.
inline constexpr int kDefaultSpinUs = 100;
// A body with at least this much still to come is read straight into its tensors, not via the
// buffer.
inline constexpr std::size_t kDirectReadBytes = 32 * 1024;
// Receive buffers at least this large are pre-faulted in bulk before the read (see prefault()).
inline constexpr std::size_t kPrefaultBytes = std::size_t{1} << 20;
// MADV_POPULATE_WRITE (Linux 5.14); older headers lack the name, older kernels return EINVAL.
inline constexpr int kMadvPopulateWrite = 23;
// A handshake frame is a Hello: name and token are bounded by the wire layer, so this is ample.
inline constexpr std::uint64_t kMaxHelloFrameBytes = 8 * 1024;
// Blocking waits on the calling thread wake this often to notice shutdown().
inline constexpr int kPollSliceMs = net::kPollSliceMs;
// Keepalive notices a peer whose host vanished (no reset ever comes): about 45 s.
inline constexpr int kKeepIdleS = 30, kKeepIntervalS = 5, kKeepCount = 3;

using net::errno_text;
using net::Fd;

// Handshake frames are refused beyond these before anything is allocated: an unauthenticated
// connection must not make us reserve the limits meant for data.
inline wire::Limits hello_limits() {
  wire::Limits l;
  l.max_payload_bytes = kMaxHelloFrameBytes;
  l.max_buffers = 0;
  l.max_message_bytes = kMaxHelloFrameBytes;
  return l;
}

struct HostPort {
  std::string host;
  std::string port;
};

// "host:port" or "[v6-address]:port" (what address() publishes). Throws naming the address.
inline HostPort split_host_port(const std::string& address) {
  const auto bad = [&](const char* why) {
    return DistNetworkError("distrpc tcp: bad address '" + address + "': " + why +
                            " (expected host:port or [ipv6]:port)");
  };
  HostPort hp;
  if (!address.empty() && address.front() == '[') {
    const auto close = address.find(']');
    if (close == std::string::npos || close + 1 >= address.size() || address[close + 1] != ':') {
      throw bad("unterminated [ipv6] part or no port");
    }
    hp.host = address.substr(1, close - 1);
    hp.port = address.substr(close + 2);
  } else {
    const auto colon = address.rfind(':');
    if (colon == std::string::npos) throw bad("no port");
    hp.host = address.substr(0, colon);
    hp.port = address.substr(colon + 1);
    if (hp.host.find(':') != std::string::npos) throw bad("an IPv6 address needs brackets");
  }
  if (hp.host.empty()) throw bad("empty host");
  if (hp.port.empty() || hp.port.size() > 5 ||
      !std::all_of(hp.port.begin(), hp.port.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
      std::stoi(hp.port) == 0 || std::stoi(hp.port) > 65535) {
    throw bad("the port is not a number in 1..65535");
  }
  return hp;
}

inline std::string join_host_port(const std::string& host, unsigned port) {
  if (host.find(':') != std::string::npos) return "[" + host + "]:" + std::to_string(port);
  return host + ":" + std::to_string(port);
}

inline std::string endpoint_text(const asio::ip::tcp::endpoint& ep) {
  return join_host_port(ep.address().to_string(), ep.port());
}

// Latency first (no Nagle delay on small frames), and keepalive so a vanished host is noticed.
inline void tune_socket(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &kKeepIdleS, sizeof kKeepIdleS);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &kKeepIntervalS, sizeof kKeepIntervalS);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &kKeepCount, sizeof kKeepCount);
}

// A fresh tensor's pages are faulted in one at a time while recv() copies into them, and a fault
// is costly (on the VMs measured, 64 MiB took 378 ms of first-touch faults against 11 ms when
// populated in bulk with transparent huge pages). Both calls are advice: failure changes nothing.
inline void prefault(void* data, std::size_t size) {
  if (size < kPrefaultBytes) return;
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = (reinterpret_cast<std::uintptr_t>(data) + page - 1) & ~(page - 1);
  const auto end = (reinterpret_cast<std::uintptr_t>(data) + size) & ~(page - 1);
  if (end <= begin) return;
  void* p = reinterpret_cast<void*>(begin);
  ::madvise(p, end - begin, MADV_HUGEPAGE);
  ::madvise(p, end - begin, kMadvPopulateWrite);
}

using net::wait_fd;  // distrpc/net/wait_fd.hpp

// Writes every byte of `iov` (consumed in place). The fd may be non-blocking (the reader makes it
// so for its reads), hence EAGAIN → poll. MSG_NOSIGNAL: a dead peer is an error, not SIGPIPE.
inline int write_all(int fd, iovec* iov, std::size_t count,
                     std::optional<Clock::time_point> deadline, const std::atomic<bool>& stopping) {
  while (count > 0 && iov->iov_len == 0) {
    ++iov;
    --count;
  }
  while (count > 0) {
    msghdr mh{};
    mh.msg_iov = iov;
    mh.msg_iovlen = std::min<std::size_t>(count, IOV_MAX);
    const ssize_t n = ::sendmsg(fd, &mh, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (const int err = wait_fd(fd, POLLOUT, deadline, stopping)) return err;
        continue;
      }
      return errno;
    }
    auto left = static_cast<std::size_t>(n);
    while (count > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --count;
    }
    if (count > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return 0;
}

inline constexpr int kEndOfStream = -1;

// Reads exactly `n` bytes: 0, kEndOfStream when the peer closed first, or an errno value.
inline int read_exact(int fd, char* buf, std::size_t n, Clock::time_point deadline,
                      const std::atomic<bool>& stopping) {
  std::size_t got = 0;
  while (got < n) {
    const ssize_t r = ::recv(fd, buf + got, n - got, 0);
    if (r > 0) {
      got += static_cast<std::size_t>(r);
      continue;
    }
    if (r == 0) return kEndOfStream;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (const int err = wait_fd(fd, POLLIN, deadline, stopping)) return err;
      continue;
    }
    return errno;
  }
  return 0;
}

// One established (handshaken) TCP connection, in either direction.
//
// Its fd (non-blocking) is written by sending threads (raw sendmsg, under write_mu) and read by
// one reading thread at a time (the one-shot epoll registration hands it to exactly one). It is
// closed only by the reading thread that holds it, or by shutdown() once those threads stopped,
// and only while holding write_mu, so a writer never touches a closed (possibly reused) fd;
// ::shutdown() first, so a writer blocked on a full socket wakes at once instead of holding
// write_mu.
struct Connection {
  int fd = -1;
  std::uint64_t token = 0;  // its key in the epoll set (never reused, never 0)
  bool outgoing = false;
  int peer = -1;
  std::uint64_t generation = 0;  // of the Peer's liveness when it was made or adopted
  std::string ahead;             // incoming, from an incarnation not registered yet: its address
  std::string peer_name;
  std::string remote;  // "host:port" of the other end, for logs and errors
  // With TLS: the session on `fd`. One thread reads and others write, and an SSL* is not safe for
  // two threads at once: ssl_mu is held for each SSL call (never across a wait).
  net::tls::SslPtr ssl;
  std::mutex ssl_mu;
  std::string tls_failure;  // the reading thread's last TLS error

  std::mutex write_mu;              // one frame at a time: frames never interleave
  std::string header_scratch;       // under write_mu: reused so a send allocates nothing
  std::atomic<bool> closed{false};  // set holding write_mu and close_mu
  std::mutex close_mu;              // orders ::shutdown(fd) against close(fd)
  std::mutex failure_mu;
  std::string failure;  // why a writer broke the connection, reported instead of the bare EOF

  // Receive state, touched only by the reading thread that holds the connection.
  std::unique_ptr<char[]> rbuf;
  std::size_t rbeg = 0, rend = 0;
  std::optional<wire::FrameDecoder> decoder;
  std::size_t header_bytes = 0;  // of the frame being read
  bool in_body = false;
  wire::Message msg;
  std::size_t seg = 0, seg_off = 0;  // segment 0 is the payload, segment i > 0 is buffer i - 1
  std::uint64_t body_total = 0, body_received = 0;

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
  // Wakes a blocked writer and ends pending reads; the fd stays open until close().
  void shutdown_fd() {
    std::lock_guard<std::mutex> lk(close_mu);
    if (!closed.load()) ::shutdown(fd, SHUT_RDWR);
  }
  // True if this call closed it.
  bool close() {
    {
      std::lock_guard<std::mutex> lk(close_mu);
      if (closed.load()) return false;
      ::shutdown(fd, SHUT_RDWR);
    }
    {
      std::scoped_lock lk(write_mu, close_mu);
      closed.store(true);
      ::close(fd);  // also leaves the epoll set
    }
    return true;
  }
};

// What this process knows about one worker: where it listens, the connection it opened to it.
struct Peer {
  explicit Peer(int id_) : id(id_) {}
  const int id;

  std::mutex connect_mu;                   // one connect attempt at a time, held across it
  std::atomic<std::uint64_t> attempts{0};  // finished failed attempts
  std::string last_failure;                // under connect_mu: the error of the latest attempt

  std::mutex mu;  // guards the fields below
  std::string name;
  std::string address;
  std::shared_ptr<Connection> out;
  // A handshaken connection broke: sends fail fast until add_peer(); with the generation guard
  // (a late hang-up of the old pair must not mark a fresh registration lost).
  transport::detail::PeerLiveness liveness;

  std::string describe_locked() const {
    return "worker " + std::to_string(id) + " ('" + name + "')" +
           (address.empty() ? std::string() : " at " + address);
  }
};

// An incoming connection between accept and the end of its handshake (listener thread only).
struct PendingHandshake {
  PendingHandshake(asio::ip::tcp::socket s, asio::io_context& lio)
      : sock(std::move(s)), timer(lio), decoder(hello_limits()) {}
  asio::ip::tcp::socket sock;
  asio::steady_timer timer;
  wire::FrameDecoder decoder;
  std::array<char, wire::kFrameFixedBytes> fixed{};
  wire::Message request;
  wire::Hello hello;
  wire::Hello mine;  // the Hello sent back: its nonce is what the dialler's answer must cover
  wire::Message reply;
  std::string reply_bytes;  // our Hello's frame, header and payload
  std::string remote;
  net::tls::SslPtr ssl;  // with TLS: the session, handshaken before the Hello
  bool finished = false;
};

class Impl : public std::enable_shared_from_this<Impl> {
 public:
  Impl(const TransportOptions& options, TransportCallbacks callbacks)
      : options_(options),
        callbacks_(std::move(callbacks)),
        lio_work_(asio::make_work_guard(lio_)),
        acceptor_(lio_),
        accept_retry_(lio_) {
    // A bad DISTRPC_RECV_CACHE_MB fails the start, not a reading thread's first large message.
    (void)wire::RecvStorage::limit_from_env();
    token_ = transport::detail::transport_secret(options_);
    if (const auto tls = net::tls::resolve(options_.tls)) tls_ = net::tls::make_context(*tls);
    listen();
  }

  // Separate from the constructor: the threads hold a shared_ptr to this.
  void start() {
    accept_next();
    auto self = shared_from_this();
    listen_thread_ = std::thread([self] { self->run_loop(self->lio_, "distrpc-tcp-lsn"); });
    for (int i = 0; i < kReadThreads; ++i) {
      read_threads_.emplace_back([self] { self->read_loop(); });
    }
  }

  const std::string& address() const { return address_; }

  void add_peer(int id, const std::string& name, const std::string& address) {
    if (id < 0) {
      throw DistNetworkError("distrpc tcp: add_peer: worker id " + std::to_string(id) + " ('" +
                             name + "') is negative");
    }
    try {
      split_host_port(address);
    } catch (const DistNetworkError& e) {
      throw DistNetworkError("distrpc tcp: add_peer: worker " + std::to_string(id) + " ('" + name +
                             "'): " + e.what());
    }
    auto p = peer_entry(id);
    std::lock_guard<std::mutex> lk(p->mu);
    const bool moved = !p->address.empty() && p->address != address;
    p->name = name;
    p->address = address;
    // A fresh registration (after a loss, or at a new address) is a fresh incarnation: it may be
    // connected (and lost) again. The connection opened to the old one is not used for it (as a
    // lost peer loses both of its connections): shut down, its end is ignored (an older
    // generation), and the next send dials.
    if (p->liveness.renew(moved) && p->out) {
      const auto old = std::move(p->out);
      old->record_failure("worker " + std::to_string(id) +
                          " was registered again (after a loss, or at a new address)");
      old->shutdown_fd();
    }
  }

  void send(int peer, wire::Message&& m) {
    if (stopping_.load()) {
      throw DistNetworkError("distrpc tcp: cannot send to worker " + std::to_string(peer) +
                             ": the transport of " + self_text() + " is shut down");
    }
    try {
      wire::check_limits(m, options_.limits);
    } catch (const wire::EncodeError& e) {
      throw wire::EncodeError("distrpc tcp: refusing to send to worker " + std::to_string(peer) +
                              ": " + e.what());
    }
    write_message(*connection_to(peer), m);
  }

  // Returns how many reading threads it abandoned: still running a handed-back task (a request
  // handler that did not return) at `deadline`, they are detached instead of joined. Such a thread
  // owns this Impl (its shared_ptr) and touches no socket when its task returns: it meets
  // `stopping_` and exits.
  std::size_t shutdown(Clock::time_point deadline) {
    const auto guard = transport::detail::lock_for_shutdown(shutdown_mu_);
    if (!guard.owns_lock() || shut_down_) return 0;
    std::vector<std::shared_ptr<Connection>> conns;
    {
      std::lock_guard<std::mutex> lk(mu_);
      stopping_.store(true);
      conns.assign(conns_.begin(), conns_.end());
    }
    for (auto& c : conns) c->shutdown_fd();
    ready_.stop();
    lio_work_.reset();
    lio_.stop();
    // Called from a callback, the thread it runs on is detached: it returns to a stopped loop
    // and exits, holding the last reference to this object if the Context is gone by then.
    const std::size_t abandoned =
        transport::detail::stop_threads(listen_thread_, read_threads_, deadline).abandoned;
    // Nor a caller in drive() (it saw stopping_), except one past `deadline` in a library task.
    transport::detail::close_drive_gate(drivers_, deadline, log_who(), "tcp");
    // No other thread touches the sockets any more.
    asio::error_code ec;
    acceptor_.close(ec);
    accept_retry_.cancel();
    for (auto& c : conns) c->close();
    {
      std::lock_guard<std::mutex> lk(mu_);
      conns_.clear();
      by_token_.clear();
      for (auto& [id, p] : peers_) {
        std::lock_guard<std::mutex> plk(p->mu);
        p->out.reset();
      }
    }
    shut_down_ = true;
    return abandoned;
  }

 private:
  std::string self_text() const { return transport::detail::worker_text(options_); }
  std::string log_who() const { return transport::detail::log_who(options_); }

  // A connection refused or closed for what the peer did (one line; the listener goes on).
  void log_drop(const std::string& remote, const std::string& reason) const {
    distrpc::detail::log_warning(log_who(),
                                 "tcp: dropping connection from " + remote + ": " + reason);
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

  bool register_connection(const std::shared_ptr<Connection>& c) {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_.load()) return false;
    c->token = ++next_token_;
    conns_.insert(c);
    by_token_.emplace(c->token, c);
    return true;
  }

  std::shared_ptr<Connection> by_token(std::uint64_t token) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = by_token_.find(token);
    return it == by_token_.end() ? nullptr : it->second;
  }

  // Hands the connection to the reading threads: the first readiness goes to one of them.
  void start_reading(const std::shared_ptr<Connection>& c) {
    c->rbuf = std::make_unique<char[]>(kReadBufferBytes);
    c->decoder.emplace(options_.limits);
    const int flags = ::fcntl(c->fd, F_GETFL);
    if (flags < 0 || ::fcntl(c->fd, F_SETFL, flags | O_NONBLOCK) < 0) {
      return lose(c, "cannot make the socket non-blocking: " + errno_text(errno));
    }
    epoll_event ev{};
    ev.events = kReadEvents;
    ev.data.u64 = c->token;
    if (::epoll_ctl(ready_.fd(), EPOLL_CTL_ADD, c->fd, &ev) < 0) {
      lose(c, "cannot watch the socket: " + errno_text(errno));
    }
  }

  // ---- listener ------------------------------------------------------------------------------

  void listen() {
    const std::string& host = options_.listen_host;
    asio::error_code ec;
    asio::ip::tcp::endpoint ep;
    const auto addr = asio::ip::make_address(host, ec);
    if (!ec) {
      ep = asio::ip::tcp::endpoint(addr, 0);
    } else {
      asio::ip::tcp::resolver resolver(lio_);
      const auto results = resolver.resolve(host, "0", ec);
      if (ec || results.empty()) {
        throw DistNetworkError(
            "distrpc tcp: " + self_text() + " cannot listen on '" + host +
            "': cannot resolve it: " + (ec ? ec.message() : std::string("no address")));
      }
      ep = results.begin()->endpoint();
    }
    const auto fail = [&](const char* step) {
      return DistNetworkError("distrpc tcp: " + self_text() + " cannot listen on '" + host + "' (" +
                              ep.address().to_string() + "): " + step + ": " + ec.message());
    };
    acceptor_.open(ep.protocol(), ec);
    if (ec) throw fail("socket");
    acceptor_.set_option(asio::socket_base::reuse_address(true), ec);
    acceptor_.bind(ep, ec);
    if (ec) throw fail("bind");
    acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) throw fail("listen");
    const auto bound = acceptor_.local_endpoint(ec);
    if (ec) throw fail("getsockname");
    // What peers dial: the owner's choice (the agent picks one reachable from the other hosts),
    // else the bound address; a wildcard cannot be dialled, so then this host's name.
    const std::string published = !options_.advertise_host.empty()   ? options_.advertise_host
                                  : bound.address().is_unspecified() ? asio::ip::host_name()
                                                                     : bound.address().to_string();
    address_ = join_host_port(published, bound.port());
  }

  void accept_next() {
    acceptor_.async_accept([this](const asio::error_code& ec, asio::ip::tcp::socket sock) {
      if (stopping_.load() || ec == asio::error::operation_aborted) return;
      if (ec) {
        // EMFILE and friends: keep serving, without spinning on the error.
        distrpc::detail::log_warning(
            log_who(), "tcp: accept on " + address_ + " failed: " + ec.message() + " (retrying)");
        accept_retry_.expires_after(std::chrono::milliseconds(100));
        accept_retry_.async_wait([this](const asio::error_code& tec) {
          if (!tec && !stopping_.load()) accept_next();
        });
        return;
      }
      start_handshake(std::move(sock));
      accept_next();
    });
  }

  void start_handshake(asio::ip::tcp::socket sock) {
    auto h = std::make_shared<PendingHandshake>(std::move(sock), lio_);
    asio::error_code ec;
    const auto ep = h->sock.remote_endpoint(ec);
    h->remote = ec ? std::string("(unknown address)") : endpoint_text(ep);
    tune_socket(h->sock.native_handle());
    // The TLS handshake, the Hello and the secret's challenge-response all fall within it.
    h->timer.expires_after(options_.connect_timeout);
    h->timer.async_wait([this, h](const asio::error_code& tec) {
      if (tec || h->finished) return;
      fail_handshake(
          *h, "no handshake within " + std::to_string(options_.connect_timeout.count()) + " ms");
    });
    if (!tls_) return read_hello(h);
    try {
      h->sock.non_blocking(true);
      h->ssl = net::tls::make_ssl(tls_.get(), h->sock.native_handle(), /*client=*/false);
    } catch (const std::exception& e) {
      return fail_handshake(*h, e.what());
    }
    tls_async(
        h, [](SSL* s) { return SSL_do_handshake(s); },
        [this, h](const std::string& err) {
          if (!err.empty()) return fail_handshake(*h, "TLS handshake failed: " + err);
          read_hello(h);
        });
  }

  // One non-blocking SSL call, repeated whenever the socket is ready for what it waits on;
  // done("") once it succeeds, done(why) when it fails. Listener thread only.
  template <class Op, class Done>
  void tls_async(const std::shared_ptr<PendingHandshake>& h, Op op, Done done) {
    if (h->finished || stopping_.load()) return;
    net::tls::Step st = net::tls::step(h->ssl.get(), nullptr, op);
    if (st.ret > 0) return done(std::string());
    if (st.err == SSL_ERROR_WANT_READ || st.err == SSL_ERROR_WANT_WRITE) {
      const auto what = st.err == SSL_ERROR_WANT_READ ? asio::ip::tcp::socket::wait_read
                                                      : asio::ip::tcp::socket::wait_write;
      h->sock.async_wait(what, [this, h, op = std::move(op),
                                done = std::move(done)](const asio::error_code& ec) mutable {
        if (h->finished || stopping_.load()) return;
        if (ec) return done("waiting on the socket failed: " + ec.message());
        tls_async(h, std::move(op), std::move(done));
      });
      return;
    }
    done(st.eof ? std::string("the peer closed the connection during the TLS handshake") : st.why);
  }

  // Reads exactly `n` bytes of the handshake (through TLS when it is on); done("") or done(why).
  template <class Done>
  void hs_read(const std::shared_ptr<PendingHandshake>& h, char* buf, std::size_t n, Done done) {
    if (!h->ssl) {
      asio::async_read(h->sock, asio::buffer(buf, n),
                       [this, h, done = std::move(done)](const asio::error_code& ec, std::size_t) {
                         if (h->finished || stopping_.load()) return;
                         done(ec ? handshake_read_error(ec) : std::string());
                       });
      return;
    }
    auto got = std::make_shared<std::size_t>(0);
    tls_async(
        h,
        [buf, n, got](SSL* s) {
          while (*got < n) {
            const int r = SSL_read(s, buf + *got, static_cast<int>(n - *got));
            if (r <= 0) return r;
            *got += static_cast<std::size_t>(r);
          }
          return 1;
        },
        [done = std::move(done)](const std::string& err) {
          done(err.empty() ? err : "reading the handshake failed: " + err);
        });
  }

  template <class Done>
  void hs_write(const std::shared_ptr<PendingHandshake>& h, const std::string& bytes, Done done) {
    if (!h->ssl) {
      asio::async_write(
          h->sock, asio::buffer(bytes),
          [this, h, done = std::move(done)](const asio::error_code& ec, std::size_t) {
            if (h->finished || stopping_.load()) return;
            done(ec ? "sending the handshake reply failed: " + ec.message() : std::string());
          });
      return;
    }
    auto sent = std::make_shared<std::size_t>(0);
    tls_async(
        h,
        [&bytes, sent](SSL* s) {
          while (*sent < bytes.size()) {
            const int r =
                SSL_write(s, bytes.data() + *sent, static_cast<int>(bytes.size() - *sent));
            if (r <= 0) return r;
            *sent += static_cast<std::size_t>(r);
          }
          return 1;
        },
        [done = std::move(done)](const std::string& err) {
          done(err.empty() ? err : "sending the handshake reply failed: " + err);
        });
  }

  static std::string handshake_read_error(const asio::error_code& ec) {
    if (ec == asio::error::eof) return "the peer closed the connection during the handshake";
    return "reading the handshake failed: " + ec.message();
  }

  void read_hello(const std::shared_ptr<PendingHandshake>& h) {
    hs_read(h, h->fixed.data(), h->fixed.size(),
            [this, h](const std::string& err) { on_hello_header(h, err); });
  }

  void on_hello_header(const std::shared_ptr<PendingHandshake>& h, const std::string& err) {
    if (h->finished || stopping_.load()) return;
    if (!err.empty()) return fail_handshake(*h, err);
    if (!h->ssl &&
        net::tls::looks_like_tls(reinterpret_cast<const unsigned char*>(h->fixed.data()))) {
      return fail_handshake(*h,
                            "the peer speaks TLS, and this worker has no TLS configured "
                            "(TransportOptions::tls or DISTRPC_TLS_CERT/_KEY/_CA)");
    }
    try {
      h->decoder.feed(h->fixed.data(), h->fixed.size());
      // hello_limits() allows no buffers, so a complete fixed part is a complete header.
      if (!h->decoder.done()) throw wire::ProtocolError("handshake frame header incomplete");
      h->request = wire::allocate_message(h->decoder.header());
    } catch (const std::exception& e) {
      return fail_handshake(*h, std::string("bad handshake: ") + e.what());
    }
    hs_read(h, h->request.payload.data(), h->request.payload.size(),
            [this, h](const std::string& rerr) { on_hello_body(h, rerr); });
  }

  void on_hello_body(const std::shared_ptr<PendingHandshake>& h, const std::string& err) {
    if (h->finished || stopping_.load()) return;
    if (!err.empty()) return fail_handshake(*h, err);
    try {
      h->hello = wire::decode_hello(h->request);
      wire::check_auth_offer(h->hello, token_.has_value());
      check_claimed_identity(h->hello);
      h->mine = wire::make_acceptor_hello(my_hello(), h->hello, token_);
      h->reply = wire::encode_hello(h->mine);
      h->reply_bytes = wire::encode_frame_header(h->reply) + h->reply.payload;
    } catch (const std::exception& e) {
      return fail_handshake(*h, std::string("bad handshake: ") + e.what());
    }
    hs_write(h, h->reply_bytes, [this, h](const std::string& werr) {
      if (h->finished || stopping_.load()) return;
      if (!werr.empty()) return fail_handshake(*h, werr);
      read_auth_answer(h);
    });
  }

  // The dialler's third frame comes next: with a secret its proof (an AuthAnswer), without one a
  // Confirm. Nothing is adopted before it checks out, so a dialler that finds it reached the wrong
  // worker hangs up on a connection that never was a peer's, and nobody is reported lost.
  void read_auth_answer(const std::shared_ptr<PendingHandshake>& h) {
    hs_read(h, h->fixed.data(), h->fixed.size(),
            [this, h](const std::string& err) { on_answer_header(h, err); });
  }

  void on_answer_header(const std::shared_ptr<PendingHandshake>& h, const std::string& err) {
    if (h->finished || stopping_.load()) return;
    if (!err.empty()) return fail_handshake(*h, err);
    try {
      wire::FrameDecoder decoder(hello_limits());
      decoder.feed(h->fixed.data(), h->fixed.size());
      if (!decoder.done()) throw wire::ProtocolError("handshake frame header incomplete");
      h->request = wire::allocate_message(decoder.header());
    } catch (const std::exception& e) {
      return fail_handshake(*h, std::string("bad handshake: ") + e.what());
    }
    hs_read(h, h->request.payload.data(), h->request.payload.size(),
            [this, h](const std::string& rerr) { on_answer_body(h, rerr); });
  }

  void on_answer_body(const std::shared_ptr<PendingHandshake>& h, const std::string& err) {
    if (h->finished || stopping_.load()) return;
    if (!err.empty()) return fail_handshake(*h, err);
    try {
      if (token_) {
        const wire::auth::Proof answer =
            wire::decode_auth_answer(h->request, wire::hello_who(h->hello));
        wire::verify_dialler_answer(h->mine, h->hello, answer, *token_);
      } else {
        wire::check_confirm(h->request, wire::hello_who(h->hello));
      }
    } catch (const std::exception& e) {
      return fail_handshake(*h, std::string("bad handshake: ") + e.what());
    }
    h->finished = true;
    h->timer.cancel();
    adopt_incoming(*h);
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

  void fail_handshake(PendingHandshake& h, const std::string& reason) {
    h.finished = true;
    h.timer.cancel();
    log_drop(h.remote, reason);
    asio::error_code ec;
    h.sock.shutdown(asio::socket_base::shutdown_both, ec);
    h.sock.close(ec);
  }

  // Moves a handshaken socket from the listener's loop to the I/O loop.
  void adopt_incoming(PendingHandshake& h) {
    asio::error_code ec;
    const int fd = h.sock.release(ec);
    if (ec) return fail_handshake(h, "cannot take over the socket: " + ec.message());
    auto c = std::make_shared<Connection>();
    c->fd = fd;
    c->outgoing = false;
    c->peer = static_cast<int>(h.hello.worker_id);
    c->peer_name = h.hello.worker_name;
    c->remote = h.remote;
    c->ssl = std::move(h.ssl);
    if (!register_connection(c)) {
      c->close();
      return;
    }
    auto p = peer_entry(c->peer);
    {
      std::lock_guard<std::mutex> lk(p->mu);
      if (p->name.empty()) p->name = c->peer_name;
      p->liveness.stamp_adopted(*c, p->address, h.hello.listen_address);
    }
    start_reading(c);
  }

  // ---- connecting (calling thread) -----------------------------------------------------------

  // The connection this process opened to worker `id`, opened now if there is none yet.
  std::shared_ptr<Connection> connection_to(int id) {
    auto p = find_peer(id);
    if (!p) {
      throw DistNetworkError("distrpc tcp: cannot send to worker " + std::to_string(id) +
                             ": its address is unknown (add_peer() was not called for it)");
    }
    const auto usable = [&]() -> std::shared_ptr<Connection> {
      std::lock_guard<std::mutex> lk(p->mu);
      // Checked before `out`: the loss is reported once, when the first of the peer's two
      // connections breaks, so a message sent on the other one before it notices would hang.
      if (p->liveness.lost()) {
        throw DistNetworkError("distrpc tcp: cannot send to " + p->describe_locked() +
                               ": the connection was lost (" + p->liveness.lost_reason() + ")");
      }
      if (p->out) return p->out;
      if (p->address.empty()) {
        throw DistNetworkError("distrpc tcp: cannot send to " + p->describe_locked() +
                               ": its address is unknown (add_peer() was not called for it)");
      }
      return nullptr;
    };
    if (auto c = usable()) return c;
    const std::uint64_t seen = p->attempts.load();
    std::lock_guard<std::mutex> ck(p->connect_mu);
    if (auto c = usable()) return c;
    // Another thread's attempt failed while this one waited: its error stands for both, so N
    // waiting senders do not wait N connect timeouts.
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
      auto [c, address] = transport::detail::dial_registered(
          *p, [&](const std::string& name, const std::string& at) { return dial(id, name, at); });
      if (!c) continue;  // moved while it was dialled: the new address next
      bool moved = false;
      std::string now_at;
      {
        std::lock_guard<std::mutex> lk(p->mu);
        // Moved after the dial's last look (before its Confirm): what answered at the old address
        // is the incarnation being replaced, so the message goes to the new one instead. The
        // connection keeps the generation it was dialled in (no longer current), so closing it is
        // no loss.
        moved = p->address != address;
        now_at = p->address;
        c->generation = moved ? generation : p->liveness.generation();
        if (!moved) p->out = c;
      }
      if (!moved) {
        start_reading(c);
        return c;
      }
      lose(c, "worker " + std::to_string(id) + " was registered at a new address (" + now_at +
                  ") while it was dialled");
    }
  }

  // True when add_peer() has registered worker `id` at another address than `address`.
  bool moved_away(int id, const std::string& address) {
    auto p = find_peer(id);
    return p && transport::detail::moved_away(*p, address);
  }

  std::shared_ptr<Connection> dial(int id, const std::string& name, const std::string& address) {
    const std::string who = "worker " + std::to_string(id) + " ('" + name + "') at " + address;
    const auto error = [&](const std::string& what) {
      return DistNetworkError("distrpc tcp: cannot connect to " + who + ": " + what);
    };
    const HostPort hp = split_host_port(address);
    const net::DialTiming timing{Clock::now(), options_.connect_timeout, options_.refused_retry};
    // The peer may not listen yet (it is starting up): retried, backing off, until the deadline.
    Fd fd = net::dial_with_backoff(
        timing, stopping_,
        [&](net::DialFailure& failure) -> std::optional<Fd> {
          if (moved_away(id, address)) throw error("it was registered at a new address");
          const int raw = try_connect(hp, timing.deadline(), failure.text, failure.err);
          if (raw >= 0) return Fd(raw);
          return std::nullopt;
        },
        error);
    return handshake(std::move(fd), id, name, address, who, timing.deadline());
  }

  // One non-blocking connect per resolved address; -1 with `error` (and `err`, the last errno)
  // set when none answers.
  int try_connect(const HostPort& hp, Clock::time_point deadline, std::string& error, int& err) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    addrinfo* found = nullptr;
    if (const int rc = ::getaddrinfo(hp.host.c_str(), hp.port.c_str(), &hints, &found)) {
      error = "cannot resolve '" + hp.host + "': " + ::gai_strerror(rc);
      return -1;
    }
    std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> list(found, &::freeaddrinfo);
    for (const addrinfo* ai = found; ai; ai = ai->ai_next) {
      Fd fd(::socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
      if (fd.get() < 0) {
        err = errno;
        error = "socket: " + errno_text(err);
        continue;
      }
      err = 0;
      if (::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
        err = errno;
        if (err == EINPROGRESS || err == EINTR) {
          err = wait_fd(fd.get(), POLLOUT, deadline, stopping_);
          if (err == 0) {
            socklen_t len = sizeof err;
            if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
          }
        }
      }
      if (err == 0) {
        tune_socket(fd.get());
        return fd.release();
      }
      error = "connect: " + errno_text(err);
    }
    return -1;
  }

  std::shared_ptr<Connection> handshake(Fd fd, int id, const std::string& name,
                                        const std::string& address, const std::string& who,
                                        Clock::time_point deadline) {
    const auto error = [&](const std::string& what) {
      return DistNetworkError("distrpc tcp: handshake with " + who + " failed: " + what);
    };
    // With TLS, a TLS failure after our handshake completed is still the handshake's: in TLS 1.3
    // the acceptor checks our certificate after we are done, and says so on our first read.
    const auto tls_error = [&](const std::string& what) {
      return DistNetworkError("distrpc tcp: TLS handshake with " + who + " failed: " + what);
    };
    std::string tls_why;
    const auto io_text = [&](int err) {
      // A reset is a close with our bytes unread: the peer refused what we sent all the same.
      if (err == kEndOfStream || err == ECONNRESET) {
        return std::string(
            "the peer closed the connection (it refused our handshake: see its log; a shared "
            "secret on one side only, TLS on one side only, a protocol version or a worker "
            "identity are the usual reasons)");
      }
      if (err == ETIMEDOUT) {
        return "no reply within " + std::to_string(options_.connect_timeout.count()) +
               " ms (connect_timeout)";
      }
      if (err == ECANCELED) return std::string("the transport is shut down");
      if (err == net::tls::kTlsFailed) return tls_why;
      return errno_text(err);
    };
    net::tls::SslPtr ssl;
    if (tls_) {
      ssl = net::tls::make_ssl(tls_.get(), fd.get(), /*client=*/true);
      const int err = net::tls::handshake(ssl.get(), fd.get(), deadline, stopping_, tls_why);
      if (err == kEndOfStream) {
        throw tls_error(
            "the peer closed the connection during the TLS handshake (does it have TLS "
            "configured?)");
      }
      if (err != 0) throw tls_error(io_text(err));
    }
    const auto send_bytes = [&](iovec* iov, std::size_t n) {
      if (ssl)
        return net::tls::write_all(ssl.get(), fd.get(), nullptr, iov, n, deadline, stopping_,
                                   tls_why);
      return write_all(fd.get(), iov, n, deadline, stopping_);
    };
    const auto recv_bytes = [&](char* buf, std::size_t n) {
      if (ssl)
        return net::tls::read_exact(ssl.get(), fd.get(), buf, n, deadline, stopping_, tls_why);
      return read_exact(fd.get(), buf, n, deadline, stopping_);
    };
    const auto failed = [&](const std::string& step, int err) {
      if (err == net::tls::kTlsFailed) return tls_error(tls_why);
      // With TLS, an acceptor that refused our certificate sends an alert, then hangs up: a write
      // racing the hang-up fails first, and the alert, still to be read, says why.
      if (ssl && err == kEndOfStream) {
        char byte = 0;
        const auto soon = std::min(deadline, Clock::now() + std::chrono::seconds(1));
        if (net::tls::read_exact(ssl.get(), fd.get(), &byte, 1, soon, stopping_, tls_why) ==
            net::tls::kTlsFailed) {
          return tls_error(tls_why);
        }
      }
      return error(step + io_text(err));
    };
    const wire::Hello mine = my_hello();
    wire::Message hello = wire::encode_hello(mine);
    std::string header = wire::encode_frame_header(hello);
    std::array<iovec, 2> iov{iovec{header.data(), header.size()},
                             iovec{hello.payload.data(), hello.payload.size()}};
    if (const int err = send_bytes(iov.data(), iov.size()))
      throw failed("sending our Hello: ", err);
    std::array<char, wire::kFrameFixedBytes> fixed{};
    if (const int err = recv_bytes(fixed.data(), fixed.size())) {
      throw failed("reading its Hello: ", err);
    }
    if (!ssl && net::tls::looks_like_tls(reinterpret_cast<const unsigned char*>(fixed.data()))) {
      throw error(
          "the peer answered with TLS: it has TLS configured, and this worker has none "
          "(TransportOptions::tls or DISTRPC_TLS_CERT/_KEY/_CA)");
    }
    wire::Hello theirs;
    std::optional<wire::auth::Proof> answer;
    try {
      wire::FrameDecoder decoder(hello_limits());
      decoder.feed(fixed.data(), fixed.size());
      if (!decoder.done()) throw wire::ProtocolError("handshake frame header incomplete");
      wire::Message reply = wire::allocate_message(decoder.header());
      if (const int err = recv_bytes(reply.payload.data(), reply.payload.size())) {
        throw failed("reading its Hello: ", err);
      }
      theirs = wire::decode_hello(reply);
      answer = wire::answer_acceptor(mine, theirs, token_);
    } catch (const wire::ProtocolError& e) {
      throw error(e.what());
    }
    if (const std::string wrong =
            transport::detail::identity_mismatch(id, name, theirs.worker_id, theirs.worker_name);
        !wrong.empty()) {
      throw error(wrong);
    }
    // Moved meanwhile: hung up before this frame, so the old incarnation takes nothing into use
    // (and reports nobody lost); the caller dials the new address.
    if (moved_away(id, address)) throw error("it was registered at a new address");
    {
      // The acceptor takes the connection into use only after this frame (see read_auth_answer).
      const wire::Message m = answer ? wire::encode_auth_answer(*answer) : wire::encode_confirm();
      std::string answer_header = wire::encode_frame_header(m);
      std::array<iovec, 2> aiov{iovec{answer_header.data(), answer_header.size()},
                                iovec{const_cast<char*>(m.payload.data()), m.payload.size()}};
      if (const int err = send_bytes(aiov.data(), aiov.size())) {
        throw failed(
            answer ? "sending our answer to its challenge: " : "confirming the handshake: ", err);
      }
    }
    auto c = std::make_shared<Connection>();
    c->fd = fd.release();
    c->ssl = std::move(ssl);
    c->outgoing = true;
    c->peer = id;
    c->peer_name = theirs.worker_name;
    c->remote = address;
    if (!register_connection(c)) {
      c->close();
      throw error("the transport is shut down");
    }
    return c;
  }

  // ---- sending (calling thread) --------------------------------------------------------------

  void write_message(Connection& c, const wire::Message& m) {
    std::lock_guard<std::mutex> lk(c.write_mu);
    if (c.closed.load()) {
      if (stopping_.load()) {
        throw DistNetworkError("distrpc tcp: cannot send to " + c.describe() +
                               ": the transport of " + self_text() + " is shut down");
      }
      const std::string why = c.recorded_failure();
      throw DistNetworkError("distrpc tcp: cannot send to " + c.describe() +
                             ": the connection was lost" + (why.empty() ? "" : " (" + why + ")"));
    }
    c.header_scratch.clear();
    wire::append_frame_header(c.header_scratch, m);
    // Header, payload, then every buffer straight from its tensor's memory: no copy of tensor
    // bytes.
    constexpr std::size_t kInline = 16;
    std::array<iovec, kInline> inline_iov;
    std::vector<iovec> heap_iov;
    iovec* iov = inline_iov.data();
    if (2 + m.buffers.size() > kInline) {
      heap_iov.resize(2 + m.buffers.size());
      iov = heap_iov.data();
    }
    std::size_t n = 0;
    iov[n++] = iovec{c.header_scratch.data(), c.header_scratch.size()};
    iov[n++] = iovec{const_cast<char*>(m.payload.data()), m.payload.size()};
    for (const at::Tensor& b : m.buffers) {
      iov[n++] = iovec{b.data_ptr(), static_cast<std::size_t>(b.numel())};
    }
    std::string tls_why;
    const int err = c.ssl ? net::tls::write_all(c.ssl.get(), c.fd, &c.ssl_mu, iov, n, std::nullopt,
                                                stopping_, tls_why)
                          : write_all(c.fd, iov, n, std::nullopt, stopping_);
    if (err == 0) return;
    const std::string text = err == ECANCELED ? std::string("the transport was shut down mid-write")
                             : err == kEndOfStream ? std::string("the peer closed the connection")
                             : err == net::tls::kTlsFailed ? "TLS: " + tls_why
                                                           : errno_text(err);
    // Part of a frame may be on the wire: the stream is unusable. A reading thread sees the
    // shutdown as the end of the stream, closes the connection and reports this reason. A reason
    // recorded before (the peer was lost, which shut the socket down under this write) is the
    // one to give.
    const std::string earlier = c.recorded_failure();
    c.record_failure("write failed: " + text);
    c.shutdown_fd();
    throw DistNetworkError("distrpc tcp: send of a " +
                           std::to_string(m.payload.size() + c.header_scratch.size()) +
                           "-byte frame (+" + std::to_string(m.buffers.size()) + " buffers) to " +
                           c.describe() + " failed: " + (earlier.empty() ? text : earlier));
  }

  // ---- receiving (reading threads) ----------------------------------------------------------

  static constexpr std::uint32_t kReadEvents = EPOLLIN | EPOLLRDHUP | EPOLLONESHOT;

  void read_loop() {
    ::pthread_setname_np(::pthread_self(), "distrpc-tcp-rd");
    mark_transport_thread();
    bool handled = false;  // this thread handled a message since it last slept
    for (;;) {
      // One event per wait: a thread that goes on to run a handed-back task holds no other
      // connection's readiness hostage.
      epoll_event ev{};
      int n = handled ? poll_a_while(ev) : net::ReadySet::kNothing;
      handled = false;
      while (n == net::ReadySet::kNothing && !stopping_.load()) n = ready_.wait(ev);
      if (stopping_.load() || n == net::ReadySet::kStopped) return;
      if (n < 0) {
        distrpc::detail::log_error(log_who(), "tcp: epoll_wait failed: " + errno_text(errno));
        return;
      }
      if (auto c = by_token(ev.data.u64)) {
        handled = true;
        try {
          on_readable(c);
        } catch (const std::exception& e) {
          // Handlers catch what they expect; anything else must not take the thread down.
          distrpc::detail::log_error(log_who(), "tcp: unexpected error while reading from " +
                                                    c->describe() + ": " + e.what());
        }
      }
    }
  }

  // After a message: polls the epoll set without sleeping for up to spin_us_, while no other
  // thread polls it (the other reading thread, or a caller in drive(): one poller per process
  // is enough, two would take both cores of a small machine). Meanwhile the other reading
  // thread is not woken for readiness (net/ready_set.hpp). 1 with `ev` filled, else kNothing
  // (time up, or a caller began to drive: the sleeping wait follows).
  int poll_a_while(epoll_event& ev) {
    if (spin_us_ <= 0 || !ready_.try_begin_polling()) return net::ReadySet::kNothing;
    const auto until = Clock::now() + std::chrono::microseconds(spin_us_);
    int n = net::ReadySet::kNothing;
    while (!stopping_.load(std::memory_order_relaxed) && ready_.pollers() == 1) {
      n = ready_.poll(ev);
      if (n != net::ReadySet::kNothing || Clock::now() >= until) break;
      ::sched_yield();  // a thread of this core that has work goes first
    }
    ready_.end_polling();
    return n > 0 ? n : net::ReadySet::kNothing;
  }

  // This thread holds `c` (its one-shot registration fired): read what is there, deliver it,
  // give the connection back to the epoll set, then run what on_message handed back (a reading
  // thread) or queue it (a caller in progress(): it never runs other calls' handlers).
  void on_readable(const std::shared_ptr<Connection>& c, bool run_inline = true) {
    net::handoff_acquire(c.get());  // from the thread that re-armed it (net/handoff.hpp)
    InlineScope inline_scope;
    if (!drain(c, inline_scope)) return;  // lost: the scope queues a handed-back task
    epoll_event ev{};
    ev.events = kReadEvents;
    ev.data.u64 = c->token;
    net::handoff_release(c.get());
    if (::epoll_ctl(ready_.fd(), EPOLL_CTL_MOD, c->fd, &ev) < 0) {
      if (!stopping_.load()) lose(c, "cannot watch the socket again: " + errno_text(errno));
      return;
    }
    if (run_inline) {
      run_handed_back(inline_scope);
    } else {
      inline_scope.take().run_library_here();  // a waiting caller (drive())
    }
  }

 public:
  // A caller waiting for a reply reads the epoll set itself, without blocking: when the reply
  // is there, no reading thread has to wake up and hand it over (one kernel wake-up less per
  // small call: about a third of its latency on loopback). The one-shot registration gives a
  // ready connection to exactly one of the caller and the reading threads, and while the caller
  // polls no sleeping reading thread is woken for readiness (net/ready_set.hpp); one that was
  // polling stops. Requests read here go to the pool; control messages run here
  // (InlineTask::run_library_here()).
  void drive(const std::function<bool()>& done, std::chrono::steady_clock::time_point until) {
    const distrpc::detail::EntryGate::Scope in(drivers_);
    if (!in) return;  // shut down
    net::ReadySet::Polling polling(ready_);
    while (!done() && !stopping_.load(std::memory_order_relaxed) &&
           std::chrono::steady_clock::now() < until) {
      epoll_event ev{};
      if (ready_.poll(ev) != 1) {
        ::sched_yield();  // the peer may need this core to answer
        continue;
      }
      if (auto c = by_token(ev.data.u64)) {
        // What it read may take long to handle (a library task: a backward pass this caller
        // waits for); the reading threads then watch the other connections again after a while
        // (net/ready_set.hpp).
        try {
          on_readable(c, /*run_inline=*/false);
        } catch (const std::exception& e) {
          distrpc::detail::log_error(log_who(), "tcp: unexpected error while reading from " +
                                                    c->describe() + ": " + e.what());
        }
      }
    }
  }



 private:
  // Reads until the socket is empty; false when the connection is gone. A task handed back is
  // run here only if the socket then turns out empty (a lone call: the latency case); when more
  // bytes keep coming (a stream of calls: the throughput case) it is queued at once instead, so
  // it never waits behind later frames and this thread keeps reading.
  // A read into rbuf shorter than asked already shows the socket empty: no second read to see
  // EAGAIN (a system call is a good part of a small call's cost on a virtual machine). Bytes
  // that arrive after it make the re-armed (level-triggered) registration fire again, so nothing
  // waits unseen. A large body read straight into its tensors goes on until EAGAIN: it streams.
  bool drain(const std::shared_ptr<Connection>& c, InlineScope& scope) {
    for (;;) {
      if (c->closed.load() || stopping_.load()) return false;
      ssize_t r;
      const bool direct = c->in_body && c->body_total - c->body_received >= kDirectReadBytes;
      if (c->ssl) {
        r = tls_read(*c, direct);
      } else if (direct) {
        r = read_body_direct(*c);
      } else {
        r = ::recv(c->fd, c->rbuf.get(), kReadBufferBytes, 0);
      }
      if (r == 0) {
        end_of_stream(c);
        return false;
      }
      if (r < 0) {
        if (r == net::tls::kTlsFailed) {
          read_failed(c, "TLS: " + c->tls_failure);
          return false;
        }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
        read_failed(c, errno_text(errno));
        return false;
      }
      scope.release_to_fallback();
      try {
        if (direct) {
          c->body_received += static_cast<std::size_t>(r);
          if (c->body_received == c->body_total) {
            c->seg = segment_count(*c);
            deliver(c);
          } else {
            seek_segment(*c);  // the rest may come through rbuf: it must know where to go
          }
        } else {
          c->rbeg = 0;
          c->rend = static_cast<std::size_t>(r);
          process(c);
        }
      } catch (const std::exception& e) {
        drop(c, e.what());
        return false;
      }
      // A TLS read returns one record at most: a short one does not show the socket empty, and
      // the next read tells (EAGAIN).
      if (!direct && static_cast<std::size_t>(r) < kReadBufferBytes && !c->ssl) return true;
    }
  }

  // One SSL_read, into the buffer or straight into the body's current segment. OpenSSL reads
  // one record from the socket at a time (no read-ahead), so what it has not handed out yet is
  // still in the socket and the level-triggered registration sees it.
  ssize_t tls_read(Connection& c, bool direct) {
    char* dst = c.rbuf.get();
    std::size_t len = kReadBufferBytes;
    if (direct) {
      std::size_t skip = c.body_received;
      for (std::size_t i = 0; i < segment_count(c); ++i) {
        auto [ptr, seg_len] = segment(c, i);
        if (skip >= seg_len) {
          skip -= seg_len;
          continue;
        }
        dst = ptr + skip;
        len = seg_len - skip;
        break;
      }
    }
    return net::tls::read_some(c.ssl.get(), &c.ssl_mu, dst, len, c.tls_failure);
  }

  // One readv straight into the message's remaining segments (no copy through rbuf).
  ssize_t read_body_direct(Connection& c) {
    std::array<iovec, 64> iov;
    std::size_t n = 0, skip = c.body_received;
    for (std::size_t i = 0; i < segment_count(c) && n < iov.size(); ++i) {
      auto [ptr, len] = segment(c, i);
      if (skip >= len) {
        skip -= len;
        continue;
      }
      iov[n++] = iovec{ptr + skip, len - skip};
      skip = 0;
    }
    return ::readv(c.fd, iov.data(), static_cast<int>(n));
  }

  std::pair<char*, std::size_t> segment(Connection& c, std::size_t i) {
    if (i == 0) return {c.msg.payload.data(), c.msg.payload.size()};
    const at::Tensor& b = c.msg.buffers[i - 1];
    return {static_cast<char*>(b.data_ptr()), static_cast<std::size_t>(b.numel())};
  }
  std::size_t segment_count(const Connection& c) const { return 1 + c.msg.buffers.size(); }
  // Points seg/seg_off at body byte `body_received`.
  void seek_segment(Connection& c) {
    std::size_t left = c.body_received;
    c.seg = 0;
    c.seg_off = 0;
    while (c.seg < segment_count(c) && left >= segment(c, c.seg).second) {
      left -= segment(c, c.seg).second;
      ++c.seg;
    }
    c.seg_off = left;
  }
  void skip_empty_segments(Connection& c) {
    while (c.seg < segment_count(c) && segment(c, c.seg).second == 0) ++c.seg;
  }

  // Decodes what rbuf holds (all of it: bytes once read are never left behind) and delivers the
  // complete frames.
  void process(const std::shared_ptr<Connection>& c) {
    for (;;) {
      if (!c->in_body) {
        if (c->rbeg == c->rend) return;
        const std::size_t used = c->decoder->feed(c->rbuf.get() + c->rbeg, c->rend - c->rbeg);
        c->rbeg += used;
        c->header_bytes += used;
        if (!c->decoder->done()) return;
        begin_body(*c);
      }
      while (c->seg < segment_count(*c) && c->rbeg < c->rend) {
        auto [ptr, len] = segment(*c, c->seg);
        const std::size_t take = std::min(len - c->seg_off, c->rend - c->rbeg);
        std::memcpy(ptr + c->seg_off, c->rbuf.get() + c->rbeg, take);
        c->rbeg += take;
        c->seg_off += take;
        c->body_received += take;
        if (c->seg_off == len) {
          ++c->seg;
          c->seg_off = 0;
          skip_empty_segments(*c);
        }
      }
      if (c->seg < segment_count(*c)) return;
      deliver(c);
      if (c->closed.load() || stopping_.load()) return;
    }
  }

  void begin_body(Connection& c) {
    const wire::FrameHeader& h = c.decoder->header();
    c.body_total = h.body_bytes();
    c.body_received = 0;
    try {
      c.msg = wire::allocate_message(h);
    } catch (const std::bad_alloc&) {
      // DistNetworkError, not ProtocolError (shm raises the same): the frame was within our
      // limits, so the peer broke nothing; this process ran out of memory.
      throw DistNetworkError("cannot allocate " + std::to_string(c.body_total) + " bytes for a " +
                             wire::to_string(h.type) + " frame");
    }
    // The buffers come resident (wire::RecvStorage); a large payload string does not.
    prefault(c.msg.payload.data(), c.msg.payload.size());
    c.in_body = true;
    c.seg = 0;
    c.seg_off = 0;
    skip_empty_segments(c);
  }

  void deliver(const std::shared_ptr<Connection>& c) {
    wire::Message m = std::move(c->msg);
    c->msg = wire::Message{};
    c->in_body = false;
    c->header_bytes = 0;
    c->decoder->reset();
    if (m.type == wire::MessageType::Handshake) {
      throw wire::ProtocolError("unexpected Handshake frame on an established connection");
    }
    if (!callbacks_.on_message) return;
    try {
      callbacks_.on_message(c->peer, std::move(m));
    } catch (const std::exception& e) {
      // The owner's bug, not the peer's: the connection stays.
      distrpc::detail::log_error(
          log_who(), "tcp: on_message for a message from " + c->describe() + " threw: " + e.what());
    }
  }

  // Reading is re-armed: run the task on_message handed back, if another reading thread is free
  // to keep doing I/O meanwhile; otherwise queue it where the receiver said.
  void run_handed_back(InlineScope& scope) {
    InlineTask t = scope.take();
    if (t.empty()) return;
    if (inline_running_.fetch_add(1) + 1 < kReadThreads && !stopping_.load()) {
      // Bounds shutdown's join of this thread while the task runs (bounded_thread.hpp); not
      // entered when shutdown already decided to join this thread: then it goes to the fallback.
      BoundedThread::UserCodeScope user;
      if (user.entered()) {
        t.run_here();
        inline_running_.fetch_sub(1);
        return;
      }
    }
    inline_running_.fetch_sub(1);
    t.queue();
  }

  void end_of_stream(const std::shared_ptr<Connection>& c) {
    if (c->closed.load() || stopping_.load()) return;
    // A local write failure shut the socket down: that is the real reason.
    if (std::string why = c->recorded_failure(); !why.empty()) return lose(c, why);
    if (c->in_body) {
      return drop(c, "truncated frame: the stream ended after " + std::to_string(c->body_received) +
                         " of the " + std::to_string(c->body_total) + " body bytes of a " +
                         wire::to_string(c->msg.type) + " frame");
    }
    if (c->header_bytes > 0) {
      return drop(c, "truncated frame: the stream ended after " + std::to_string(c->header_bytes) +
                         " bytes of a frame header");
    }
    lose(c, "connection closed by peer");
  }

  void read_failed(const std::shared_ptr<Connection>& c, const std::string& why) {
    if (c->closed.load() || stopping_.load()) return;
    if (std::string recorded = c->recorded_failure(); !recorded.empty()) return lose(c, recorded);
    lose(c, why);
  }

  // A protocol violation: logged, then handled like any other loss.
  void drop(const std::shared_ptr<Connection>& c, const std::string& reason) {
    if (stopping_.load()) return;
    log_drop(c->remote, c->describe() + ": " + reason);
    lose(c, reason);
  }

  void lose(const std::shared_ptr<Connection>& c, const std::string& reason) {
    if (!c->close()) return;
    {
      std::lock_guard<std::mutex> lk(mu_);
      conns_.erase(c);
      by_token_.erase(c->token);
    }
    bool report = false;
    std::shared_ptr<Connection> other;
    if (auto p = find_peer(c->peer)) {
      std::lock_guard<std::mutex> lk(p->mu);
      if (p->out == c) p->out.reset();
      // Both connections with a dead peer break together: the owner hears about the peer once;
      // a connection of a registration since replaced is ignored.
      if (p->liveness.current(c->generation, c->ahead, p->address)) {
        report = p->liveness.mark_lost(reason);
      }
      // The peer is lost, and so is our connection to it: a send blocked there (its host vanished
      // with our bytes unacknowledged, which TCP retries for many minutes) fails now, saying why.
      if (report && p->out && p->liveness.current(p->out->generation)) other = p->out;
    }
    if (other) {
      other->record_failure("worker " + std::to_string(c->peer) + " was lost: " + reason);
      other->shutdown_fd();
    }
    if (!report || stopping_.load() || !callbacks_.on_peer_lost) return;
    try {
      callbacks_.on_peer_lost(c->peer, reason);
    } catch (const std::exception& e) {
      distrpc::detail::log_error(log_who(),
                                 "tcp: on_peer_lost for " + c->describe() + " threw: " + e.what());
    }
  }

  void run_loop(asio::io_context& io, const char* thread_name) {
    ::pthread_setname_np(::pthread_self(), thread_name);
    mark_transport_thread();
    for (;;) {
      try {
        io.run();
        return;
      } catch (const std::exception& e) {
        // Handlers catch what they expect; anything else must not take the thread down silently.
        distrpc::detail::log_error(log_who(), std::string("tcp: unexpected error on thread ") +
                                                  thread_name + ": " + e.what());
      }
    }
  }

  const TransportOptions options_;
  const TransportCallbacks callbacks_;
  std::optional<std::string> token_;
  net::tls::SslCtxPtr tls_;  // with TLS: the context every connection's session comes from
  std::string address_;

  // Declared before everything holding sockets or timers, so it is destroyed after them.
  asio::io_context lio_;  // the listener thread: accepts and incoming handshakes
  asio::executor_work_guard<asio::io_context::executor_type> lio_work_;
  asio::ip::tcp::acceptor acceptor_;
  asio::steady_timer accept_retry_;

  std::atomic<bool> stopping_{false};
  distrpc::detail::EntryGate drivers_;  // callers in drive(), waited for by shutdown()
  std::mutex mu_;  // guards peers_ and conns_
  std::map<int, std::shared_ptr<Peer>> peers_;
  std::set<std::shared_ptr<Connection>> conns_;

  std::mutex shutdown_mu_;
  bool shut_down_ = false;
  std::thread listen_thread_;
  std::vector<BoundedThread> read_threads_;
  net::ReadySet ready_{"distrpc tcp"};  // the connections' readiness (one-shot registrations)
  std::uint64_t next_token_ = 0;  // under mu_
  std::unordered_map<std::uint64_t, std::shared_ptr<Connection>> by_token_;  // under mu_
  std::atomic<int> inline_running_{0};  // reading threads now running a handed-back task
  const int spin_us_ = net::spin_us_from_env("DISTRPC_TCP_SPIN_US", kDefaultSpinUs);
};

}  // namespace tcp::detail

static_assert(check_transport<Tcp>());

}  // namespace distrpc::transport
