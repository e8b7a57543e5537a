// TCPStore's client side (c10d's protocol): one blocking socket per connection, dialled with
// backoff, each request answered before the next (a store object keeps a small pool of them).
#pragma once

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <fcntl.h>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "distrpc/log.hpp"
#include "distrpc/net/dial.hpp"
#include "distrpc/net/errno_text.hpp"
#include "distrpc/net/fd.hpp"
#include "distrpc/net/tls.hpp"
#include "distrpc/store/detail/common.hpp"
#include "distrpc/store/store.hpp"

#include "distrpc/store/detail/tcp_store_protocol.hpp"

namespace distrpc::store::detail {
// ------------------------------------------------------------------------------------------------
// The client side: one blocking socket per connection.

// The server went away (EOF, reset): every later operation of the object fails fast.
class ConnectionLost : public DistNetworkError {
 public:
  using DistNetworkError::DistNetworkError;
};

// No reply before the deadline; the connection is out of step and dropped.
class ReplyTimeout : public StoreTimeoutError {
 public:
  using StoreTimeoutError::StoreTimeoutError;
};

class Connection {
 public:
  // Connects, retrying until `timeout` (the server may start later), authenticates when it has a
  // `secret` (tcp_store_protocol.hpp: the secret itself is never sent), then checks that the peer
  // speaks c10d's TCPStore protocol: a CHECK of no keys must be answered READY. (c10d has no
  // handshake; this one is valid on every c10d server of the legacy numbering.)
  // With `tls` (net::tls::make_context), a TLS handshake comes first, in which each side checks
  // the other's certificate against the CA; everything after it (authentication included) runs
  // inside it.
  // `reached`: the caller reached this server before, with this configuration. Without it a
  // refusal is retried like any failure, since the server may start later; with it a refusal
  // means the server is gone (ConnectionLost at once: retrying would only delay it).
  Connection(const std::string& host, int port, std::chrono::milliseconds timeout,
             const std::optional<std::string>& secret, SSL_CTX* tls = nullptr, bool reached = false)
      : where_(host_port(host, port)) {
    const Deadline deadline(timeout);
    // Retried until the deadline (none with kNoTimeout); nothing stops the loop early (a store
    // has no shutdown flag).
    static const std::atomic<bool> kNeverStopped{false};
    const net::DialTiming timing{
        .start = deadline.at() - timeout,
        .connect_timeout = timeout,
        .refused_retry = reached ? std::chrono::milliseconds(0) : std::chrono::milliseconds::max(),
        .first_backoff = std::chrono::milliseconds(5),
        .max_backoff = std::chrono::milliseconds(200),
        .unbounded = deadline.infinite()};
    fd_ = net::dial_with_backoff(
        timing, kNeverStopped,
        [&](net::DialFailure& failure) { return try_connect(host, port, deadline, failure); },
        [&](const net::DialGiveUp& end) {
          if (end.end == net::DialEnd::Refused) {
            throw ConnectionLost("TCPStore: the server at " + where_ +
                                 " refused a new connection: nothing listens there any more (the "
                                 "process hosting the store exited or crashed)");
          }
          return DistNetworkError("TCPStore: could not connect to " + where_ + " within " +
                                  std::to_string(timeout.count()) +
                                  " ms (last error: " + end.last.text + ")");
        });
    try {
      if (tls) tls_handshake(tls, deadline);
      if (secret) authenticate(*secret, deadline);
      Buffer& b = out();
      b.push_back(kCheckByte);
      put_le<std::uint64_t>(b, 0);
      auto what = [] { return std::string("the first request"); };
      send(deadline, what);
      const std::uint8_t r = read_u8(deadline, what);
      if (!ssl_ && (r == 0x15 || r == 0x16)) {
        // A TLS record's first byte (an alert, a handshake): the server refused our plain bytes.
        throw DistNetworkError("TCPStore: the server at " + where_ +
                               " answered with TLS: it has TLS configured, and this client has "
                               "none (TCPStoreOptions::tls or DISTRPC_TLS_CERT/_KEY/_CA)");
      }
      if (r != kReady) {
        throw DistNetworkError("TCPStore: " + where_ + " answered " + std::to_string(r) +
                               " to a CHECK of no keys: not a TCPStore server");
      }
      greeted_ = true;
    } catch (const ConnectionLost& e) {
      fd_.reset();
      // A connection to a server reached before with this configuration, lost now, means a
      // server going away, not a mismatch.
      if (secret || ssl_ || reached) throw;
      // A server with a secret closes the connection of a client without one at its first byte,
      // and one with TLS the connection of a client without TLS.
      throw ConnectionLost(std::string(e.what()) +
                           " (a server with a shared secret refuses a client without one, and a "
                           "server with TLS a client without TLS: see the server's log)");
    } catch (const std::exception& e) {
      fd_.reset();
      if (dynamic_cast<const DistNetworkError*>(&e)) throw;
      throw DistNetworkError("TCPStore: " + where_ +
                             " did not answer as a TCPStore server: " + e.what());
    }
  }

  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;
  ~Connection() {
    // close_notify: the server sees an orderly end, not a truncated stream. Best effort (the
    // socket's 100 ms send timeout bounds it).
    if (ssl_ && fd_ && !broken_) SSL_shutdown(ssl_.get());
  }

  // The request buffer: cleared by send(); append a query byte and its fields.
  Buffer& out() { return out_; }
  // True once the connection is out of step with the server (a reply never came); not reusable.
  bool broken() const { return broken_; }
  void set_broken() { broken_ = true; }

  // Sends out() and clears it. Throws ConnectionLost when the server goes away,
  // StoreTimeoutError past the deadline. `describe()` names the operation in error texts; it is
  // only called when one is thrown, so the fast path builds no strings.
  template <class Describe>
  void send(const Deadline& deadline, const Describe& describe) {
    std::size_t done = 0;
    while (done < out_.size()) {
      const ssize_t n =
          ssl_ ? tls_io(/*write=*/true, out_.data() + done, out_.size() - done, describe)
               : ::send(fd_.get(), out_.data() + done, out_.size() - done, MSG_NOSIGNAL);
      if (n >= 0) {
        done += static_cast<std::size_t>(n);
        continue;
      }
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (deadline.expired()) no_answer(describe());
        continue;
      }
      lost(describe(), net::errno_text(errno));
    }
    out_.clear();
  }

  template <class Describe>
  std::uint8_t read_u8(const Deadline& deadline, const Describe& describe) {
    std::uint8_t v = 0;
    read_exact(&v, 1, deadline, describe);
    return v;
  }
  template <class T, class Describe>
  T read_le(const Deadline& deadline, const Describe& describe) {
    std::uint8_t raw[sizeof(T)];
    read_exact(raw, sizeof raw, deadline, describe);
    std::make_unsigned_t<T> v = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i) {
      v |= static_cast<std::make_unsigned_t<T>>(raw[i]) << (8 * i);
    }
    return static_cast<T>(v);
  }
  // A byte vector (u64 length, bytes), its length checked against Store::kMaxValueBytes.
  template <class Describe>
  Bytes read_bytes(const Deadline& deadline, const Describe& describe) {
    const auto n = read_le<std::uint64_t>(deadline, describe);
    if (n > Store::kMaxValueBytes) {
      broken_ = true;
      throw DistNetworkError("TCPStore: malformed reply from " + where_ + " during " + describe() +
                             " (a value of " + std::to_string(n) + " bytes, over the limit of " +
                             std::to_string(Store::kMaxValueBytes) + ")");
    }
    Bytes v(static_cast<std::size_t>(n));
    if (n > 0) read_exact(v.data(), v.size(), deadline, describe);
    return v;
  }

  const std::string& where() const { return where_; }

 private:
  // The challenge-response of tcp_store_protocol.hpp. Throws DistNetworkError naming the server
  // and what failed; never with the secret in the text.
  void authenticate(const std::string& secret, const Deadline& deadline) {
    const auto failed = [&](const std::string& why) {
      broken_ = true;
      return DistNetworkError("TCPStore: authentication with the server at " + where_ +
                              " failed: " + why);
    };
    auto what = [] { return std::string("authentication"); };
    const wire::auth::Nonce mine = wire::auth::make_nonce();
    out_.push_back(kAuthByte);
    put_le<std::uint32_t>(out_, kAuthMagic);
    out_.insert(out_.end(), mine.begin(), mine.end());
    send(deadline, what);
    const std::uint8_t kind = read_u8(deadline, what);
    if (kind == kAuthNoSecret) {
      throw failed("it has no shared secret configured, and this client has one");
    }
    if (kind != kAuthChallenge) {
      throw failed("it answered " + std::to_string(kind) +
                   " to our challenge (not a TCPStore "
                   "server of distrpc)");
    }
    wire::auth::Nonce theirs{};
    wire::auth::Proof proof{};
    read_exact(theirs.data(), theirs.size(), deadline, what);
    read_exact(proof.data(), proof.size(), deadline, what);
    const wire::auth::Proof expected = wire::auth::compute_proof(
        secret, wire::auth::Prover::kAcceptor, mine, theirs, kStoreClientParty, kStoreServerParty);
    if (!wire::auth::same_proof(expected, proof)) {
      throw failed(
          "it answered our challenge with a wrong proof (a different shared secret, or a "
          "replayed answer)");
    }
    const wire::auth::Proof answer = wire::auth::compute_proof(
        secret, wire::auth::Prover::kDialler, mine, theirs, kStoreClientParty, kStoreServerParty);
    out_.insert(out_.end(), answer.begin(), answer.end());
    send(deadline, what);
    try {
      if (read_u8(deadline, what) != kAuthAccepted) throw failed("it did not accept our proof");
    } catch (const ConnectionLost&) {
      throw failed("it closed the connection instead of accepting our proof (see its log)");
    }
  }

  // One attempt per resolved address; nullopt with `failure` set when none answers: the last
  // error's text, and as its errno ECONNREFUSED only when the addresses say nothing listens
  // (net::AddressFailures; dial.hpp gives up early on a refusal only).
  static std::optional<net::Fd> try_connect(const std::string& host, int port,
                                            const Deadline& deadline, net::DialFailure& failure) {
    std::string& last_error = failure.text;
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const std::string service = std::to_string(port);
    const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
    if (rc != 0) {
      last_error = std::string("cannot resolve host: ") + ::gai_strerror(rc);
      return std::nullopt;
    }
    std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> list(res, &::freeaddrinfo);
    net::Fd fd;
    net::AddressFailures failures;  // a socket() that fails is this machine's, not the server's
    for (addrinfo* a = res; a && !fd; a = a->ai_next) {
      net::Fd s(
          ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol));
      if (!s) {
        last_error = net::errno_text(errno);
        continue;
      }
      int err = 0;
      if (::connect(s.get(), a->ai_addr, a->ai_addrlen) != 0) {
        err = errno;
        if (err == EINPROGRESS) {
          // Bounded per attempt so a black-holed address is retried rather than waited on.
          int wait_ms = 1000;
          if (!deadline.infinite()) {
            wait_ms = static_cast<int>(std::min<long>(1000, deadline.remaining().count()));
          }
          pollfd p{s.get(), POLLOUT, 0};
          const int pr = ::poll(&p, 1, wait_ms);
          socklen_t len = sizeof err;
          if (pr == 1) {
            ::getsockopt(s.get(), SOL_SOCKET, SO_ERROR, &err, &len);
          } else {
            err = pr == 0 ? ETIMEDOUT : errno;
          }
        }
      }
      if (err != 0) {
        failures.add(err);
        last_error = net::errno_text(err);
        continue;  // `s` closes
      }
      fd = std::move(s);
    }
    if (!fd) {
      failure.err = failures.err();
      return std::nullopt;
    }
    // Blocking from here on; the 100 ms socket timeouts only let a blocked call look at its
    // deadline.
    const int flags = ::fcntl(fd.get(), F_GETFL);
    ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
    int one = 1;
    ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    timeval tick{0, 100'000};
    ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tick, sizeof tick);
    ::setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tick, sizeof tick);
    return fd;
  }

  [[noreturn]] void lost(const std::string& what, const std::string& why) {
    broken_ = true;
    throw ConnectionLost("TCPStore: the connection to the server at " + where_ +
                         " was lost during " + what + ": " + why);
  }

  [[noreturn]] void no_answer(const std::string& what) {
    broken_ = true;
    throw ReplyTimeout("TCPStore(" + where_ + "): Timeout: no answer from the server within " +
                       "the deadline of " + what);
  }

  template <class Describe>
  void read_exact(void* dst, std::size_t n, const Deadline& deadline, const Describe& what) {
    auto* p = static_cast<std::uint8_t*>(dst);
    std::size_t have = 0;
    while (have < n) {
      const ssize_t got = ssl_ ? tls_io(/*write=*/false, p + have, n - have, what)
                               : ::recv(fd_.get(), p + have, n - have, 0);
      if (got > 0) {
        have += static_cast<std::size_t>(got);
        continue;
      }
      if (got == 0) lost(what(), "the server closed the connection");
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (deadline.expired()) no_answer(what());
        continue;
      }
      lost(what(), net::errno_text(errno));
    }
  }

  // The TLS handshake on the connected (blocking, 100 ms timeouts) socket, until the deadline.
  void tls_handshake(SSL_CTX* tls, const Deadline& deadline) {
    ssl_ = net::tls::make_ssl(tls, fd_.get(), /*client=*/true);
    for (;;) {
      net::tls::Step st =
          net::tls::step(ssl_.get(), nullptr, [](SSL* s) { return SSL_do_handshake(s); });
      if (st.ret > 0) return;
      if (st.err == SSL_ERROR_WANT_READ || st.err == SSL_ERROR_WANT_WRITE) {
        if (deadline.expired()) no_answer("the TLS handshake");
        continue;
      }
      broken_ = true;
      throw DistNetworkError(
          "TCPStore: TLS handshake with " + where_ + " failed: " +
          (st.eof || st.reset
               ? std::string("the server closed the connection (does it have TLS configured?)")
               : st.why));
    }
  }

  // One SSL_write or SSL_read: what send(2)/recv(2) would return (-1 with errno EAGAIN for a
  // retry). A TLS failure throws: before the first reply it is the handshake's (with TLS 1.3 the
  // server checks our certificate after our side of the handshake is done).
  template <class Describe>
  ssize_t tls_io(bool write, void* buf, std::size_t n, const Describe& describe) {
    const int len = static_cast<int>(std::min<std::size_t>(n, INT_MAX));
    net::tls::Step st = net::tls::step(ssl_.get(), nullptr, [&](SSL* s) {
      return write ? SSL_write(s, buf, len) : SSL_read(s, buf, len);
    });
    if (st.ret > 0) return st.ret;
    if (st.err == SSL_ERROR_WANT_READ || st.err == SSL_ERROR_WANT_WRITE) {
      errno = EAGAIN;
      return -1;
    }
    if (write && !greeted_ && (st.eof || st.reset)) {
      // A server that refused our certificate sends an alert, then hangs up: a write racing the
      // hang-up fails first, and the alert, still to be read, says why.
      char byte = 0;
      net::tls::Step probe =
          net::tls::step(ssl_.get(), nullptr, [&](SSL* s) { return SSL_read(s, &byte, 1); });
      if (probe.ret <= 0 && !probe.eof && !probe.reset && probe.err != SSL_ERROR_WANT_READ &&
          probe.err != SSL_ERROR_WANT_WRITE) {
        broken_ = true;
        throw DistNetworkError("TCPStore: TLS handshake with " + where_ + " failed: " + probe.why);
      }
    }
    if (st.eof || st.reset) return write ? (errno = EPIPE, -1) : 0;
    broken_ = true;
    if (!greeted_) {
      throw DistNetworkError("TCPStore: TLS handshake with " + where_ + " failed: " + st.why);
    }
    lost(describe(), "TLS: " + st.why);
  }

  std::string where_;
  net::Fd fd_;
  net::tls::SslPtr ssl_;  // with TLS: the session on fd_
  bool greeted_ = false;  // the server answered our first request
  Buffer out_;
  bool broken_ = false;
};

}  // namespace distrpc::store::detail
