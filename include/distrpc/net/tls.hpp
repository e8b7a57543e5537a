// Mutual TLS on OpenSSL's libssl, shared by the TCP transport and the TCPStore (docs/security.md,
// "TLS"): where the certificate, key and CA come from (options, else DISTRPC_TLS_*), an SSL_CTX
// that requires and verifies the peer's certificate on both sides (TLS 1.2 at least), the text of
// a failure, and blocking-with-deadline handshake, read and write on a non-blocking descriptor.
//
// Why an SSL* bound straight to the descriptor (SSL_set_fd) rather than Asio's ssl::stream for
// the transport: its established connections are read by epoll threads on raw descriptors; an
// SSL* on the descriptor lets those threads keep doing exactly that, with SSL_read/SSL_write in
// place of recv/sendmsg, and leaves the plain path untouched. (The TCPStore server, all Asio,
// uses asio::ssl::stream on a context configured by configure() below.)
#pragma once

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509err.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "distrpc/error.hpp"
#include "distrpc/net/errno_text.hpp"
#include "distrpc/net/wait_fd.hpp"
#include "distrpc/tls_options.hpp"

namespace distrpc::net::tls {

inline constexpr const char* kCertEnv = "DISTRPC_TLS_CERT";
inline constexpr const char* kKeyEnv = "DISTRPC_TLS_KEY";
inline constexpr const char* kCaEnv = "DISTRPC_TLS_CA";

// A read or write failed in TLS itself (not in the socket): the text says why.
inline constexpr int kTlsFailed = -2;

struct SslFree {
  void operator()(SSL* s) const { SSL_free(s); }
};
using SslPtr = std::unique_ptr<SSL, SslFree>;
struct SslCtxFree {
  void operator()(SSL_CTX* c) const { SSL_CTX_free(c); }
};
using SslCtxPtr = std::shared_ptr<SSL_CTX>;

// The TLS options in force: `o` when any of its fields is set, else DISTRPC_TLS_CERT / _KEY / _CA;
// nullopt when neither names anything (TLS off). Throws DistError naming the missing one when only
// some are given.
inline std::optional<TlsOptions> resolve(const TlsOptions& o) {
  TlsOptions r = o;
  bool from_env = false;
  if (o.empty()) {
    const auto env = [](const char* n) {
      const char* v = std::getenv(n);
      return std::string(v ? v : "");
    };
    r.cert_file = env(kCertEnv);
    r.key_file = env(kKeyEnv);
    r.ca_file = env(kCaEnv);
    if (r.empty()) return std::nullopt;
    from_env = true;
  }
  const auto need = [&](const std::string& v, const char* field, const char* env) {
    if (!v.empty()) return;
    throw DistError(std::string("TLS: ") + (from_env ? env : field) +
                    " is not set, but other TLS settings are: a certificate, its key and a CA " +
                    "file are all needed (" + (from_env ? "the environment" : "TlsOptions") + ")");
  };
  need(r.cert_file, "TlsOptions::cert_file", kCertEnv);
  need(r.key_file, "TlsOptions::key_file", kKeyEnv);
  need(r.ca_file, "TlsOptions::ca_file", kCaEnv);
  return r;
}

// OpenSSL's reason for the earliest failure queued on this thread ("certificate verify failed"),
// emptying the queue; "" when none is queued.
inline std::string openssl_reason() {
  const unsigned long first = ERR_get_error();
  ERR_clear_error();
  if (first == 0) return "";
  const char* reason = ERR_reason_error_string(first);
  if (reason) return reason;
  char buf[256];
  ERR_error_string_n(first, buf, sizeof buf);
  return buf;
}

// Why an SSL call returned `ret` (SSL_get_error gave `err`): the OpenSSL reason, with the
// certificate check's own verdict when that is what failed.
inline std::string failure_text(SSL* ssl, int ret, int err) {
  if (err == SSL_ERROR_ZERO_RETURN) return "the peer closed the TLS session";
  if (err == SSL_ERROR_SYSCALL) {
    const int e = errno;
    std::string reason = openssl_reason();
    if (!reason.empty()) return reason;
    if (ret == 0 || e == 0 || e == ECONNRESET || e == EPIPE) {
      return "the peer closed the connection";
    }
    return errno_text(e);
  }
  std::string reason = openssl_reason();
  if (reason.empty()) reason = "TLS error " + std::to_string(err);
  if (ssl) {
    const long v = SSL_get_verify_result(ssl);
    if (v != X509_V_OK) reason += std::string(" (") + X509_verify_cert_error_string(v) + ")";
  }
  return reason;
}

namespace detail {
inline void check_readable(const std::string& path, const char* what) {
  std::ifstream in(path);
  if (!in) {
    throw DistError(std::string("TLS: cannot read the ") + what + " '" + path +
                    "': " + std::strerror(errno));
  }
}
}  // namespace detail

// Loads the certificate, key and CA into `ctx` and makes it mutual: the peer must present a
// certificate the CA signed, on either side of the connection; TLS 1.2 at least (1.3 is
// negotiated when both have it). Throws DistError naming the file that is missing, unreadable or
// not what it should be.
inline void configure(SSL_CTX* ctx, const TlsOptions& o) {
  ERR_clear_error();
  detail::check_readable(o.cert_file, "certificate file");
  detail::check_readable(o.key_file, "private key file");
  detail::check_readable(o.ca_file, "CA file");
  const auto fail = [&](const std::string& what) {
    return DistError("TLS: " + what + ": " + openssl_reason());
  };
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  if (SSL_CTX_use_certificate_chain_file(ctx, o.cert_file.c_str()) != 1) {
    throw fail("the certificate file '" + o.cert_file + "' holds no usable PEM certificate");
  }
  if (SSL_CTX_use_PrivateKey_file(ctx, o.key_file.c_str(), SSL_FILETYPE_PEM) != 1) {
    // OpenSSL checks the key against the certificate as it loads it.
    if (ERR_GET_REASON(ERR_peek_error()) == X509_R_KEY_VALUES_MISMATCH) {
      throw fail("the private key file '" + o.key_file + "' does not match the certificate file '" +
                 o.cert_file + "'");
    }
    throw fail("the private key file '" + o.key_file + "' holds no usable PEM private key");
  }
  if (SSL_CTX_check_private_key(ctx) != 1) {
    throw fail("the private key file '" + o.key_file + "' does not match the certificate file '" +
               o.cert_file + "'");
  }
  if (SSL_CTX_load_verify_locations(ctx, o.ca_file.c_str(), nullptr) != 1) {
    throw fail("the CA file '" + o.ca_file + "' holds no usable PEM certificate");
  }
  // An acceptor names the CA it wants a client certificate from.
  if (STACK_OF(X509_NAME)* names = SSL_load_client_CA_file(o.ca_file.c_str())) {
    SSL_CTX_set_client_CA_list(ctx, names);
  }
  ERR_clear_error();
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  // Writes report what went out so far (as sendmsg does) and may be retried from a moved buffer.
  SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  // Connections are long-lived and few: no session resumption, so no tickets arrive after the
  // handshake for a reader to process. A peer's bare close (no close_notify) is the end of the
  // stream; the frame layer above tells a truncated frame.
  SSL_CTX_set_num_tickets(ctx, 0);
  SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_OFF);
  SSL_CTX_set_options(ctx, SSL_OP_IGNORE_UNEXPECTED_EOF | SSL_OP_NO_RENEGOTIATION);
}

// A context for both ends of connections (a transport dials and accepts).
inline SslCtxPtr make_context(const TlsOptions& o) {
  SSL_CTX* raw = SSL_CTX_new(TLS_method());
  if (!raw) throw DistError("TLS: SSL_CTX_new failed: " + openssl_reason());
  SslCtxPtr ctx(raw, SslCtxFree{});
  configure(ctx.get(), o);
  return ctx;
}

namespace detail {
// A socket BIO of our own, because OpenSSL's writes with write(2): a peer gone away would raise
// SIGPIPE and end the process. This one sends with MSG_NOSIGNAL (EPIPE is an error like any
// other) and otherwise does what OpenSSL's socket BIO does: a would-block is a retry, a read of 0
// is the end of the stream. The descriptor is not owned.
inline int bio_fd(BIO* b) {
  return static_cast<int>(reinterpret_cast<std::intptr_t>(BIO_get_data(b)));
}
inline bool would_block(int e) {
  return e == EAGAIN || e == EWOULDBLOCK || e == EINTR;
}
inline int bio_write(BIO* b, const char* data, int len) {
  BIO_clear_retry_flags(b);
  const ssize_t n = ::send(bio_fd(b), data, static_cast<std::size_t>(len), MSG_NOSIGNAL);
  if (n < 0 && would_block(errno)) BIO_set_retry_write(b);
  return static_cast<int>(n);
}
inline int bio_read(BIO* b, char* data, int len) {
  BIO_clear_retry_flags(b);
  if (!data) return 0;
  const ssize_t n = ::recv(bio_fd(b), data, static_cast<std::size_t>(len), 0);
  if (n < 0 && would_block(errno)) BIO_set_retry_read(b);
  if (n == 0) BIO_set_flags(b, BIO_FLAGS_IN_EOF);
  return static_cast<int>(n);
}
inline int bio_puts(BIO* b, const char* str) {
  return bio_write(b, str, static_cast<int>(std::strlen(str)));
}
inline long bio_ctrl(BIO* b, int cmd, long, void* ptr) {
  switch (cmd) {
    case BIO_CTRL_FLUSH:
      return 1;
    case BIO_CTRL_EOF:
      return BIO_test_flags(b, BIO_FLAGS_IN_EOF) != 0 ? 1 : 0;
    case BIO_C_GET_FD:
      if (ptr) *static_cast<int*>(ptr) = bio_fd(b);
      return bio_fd(b);
    default:
      return 0;
  }
}
inline int bio_create(BIO* b) {
  BIO_set_init(b, 1);
  return 1;
}
inline const BIO_METHOD* socket_method() {
  static BIO_METHOD* const method = [] {
    BIO_METHOD* m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK | BIO_TYPE_DESCRIPTOR,
                                 "distrpc socket");
    if (!m) return m;
    BIO_meth_set_write(m, bio_write);
    BIO_meth_set_read(m, bio_read);
    BIO_meth_set_puts(m, bio_puts);
    BIO_meth_set_ctrl(m, bio_ctrl);
    BIO_meth_set_create(m, bio_create);
    return m;
  }();
  return method;
}
}  // namespace detail

// An SSL* on `fd` (not owned), to dial (client) or accept.
inline SslPtr make_ssl(SSL_CTX* ctx, int fd, bool client) {
  SslPtr s(SSL_new(ctx));
  const BIO_METHOD* method = detail::socket_method();
  BIO* bio = s && method ? BIO_new(method) : nullptr;
  if (!bio) throw DistError("TLS: cannot set up a TLS session: " + openssl_reason());
  BIO_set_data(bio, reinterpret_cast<void*>(static_cast<std::intptr_t>(fd)));
  SSL_set_bio(s.get(), bio, bio);  // one reference, owned by the session from here
  if (client) {
    SSL_set_connect_state(s.get());
  } else {
    SSL_set_accept_state(s.get());
  }
  return s;
}

// What one SSL call did: r > 0 done; else `err` (SSL_get_error) and, for a failure, `why`.
// `mu` (may be null) is held for the call only: an SSL* is not safe for two threads at once, and
// a connection is read by one thread while others write to it.
struct Step {
  int ret = 0;
  int err = SSL_ERROR_NONE;
  bool eof = false;    // the peer ended the stream (close_notify, or a bare close)
  bool reset = false;  // the peer reset the connection (it closed with our bytes unread)
  std::string why;
};
template <class Op>
Step step(SSL* ssl, std::mutex* mu, Op&& op) {
  std::unique_lock<std::mutex> lk;
  if (mu) lk = std::unique_lock<std::mutex>(*mu);
  ERR_clear_error();
  Step s;
  s.ret = op(ssl);
  if (s.ret > 0) return s;
  s.err = SSL_get_error(ssl, s.ret);
  if (s.err == SSL_ERROR_WANT_READ || s.err == SSL_ERROR_WANT_WRITE) return s;
  const int e = errno;
  s.eof = s.err == SSL_ERROR_ZERO_RETURN ||
          (s.err == SSL_ERROR_SYSCALL && ERR_peek_error() == 0 && (s.ret == 0 || e == 0));
  s.reset = s.err == SSL_ERROR_SYSCALL && ERR_peek_error() == 0 && (e == ECONNRESET || e == EPIPE);
  errno = e;
  s.why = failure_text(ssl, s.ret, s.err);
  return s;
}

// Repeats `op` until it succeeds, waiting on the (non-blocking) descriptor between tries: 0, or
// ETIMEDOUT / ECANCELED / an errno from the wait, kEndOfStream when the peer closed, or
// kTlsFailed with `why` set.
inline constexpr int kEndOfStream = -1;
template <class Op>
int drive(SSL* ssl, int fd, std::mutex* mu, Op&& op,
          std::optional<std::chrono::steady_clock::time_point> deadline,
          const std::atomic<bool>& stopping, std::string& why) {
  for (;;) {
    Step s = step(ssl, mu, op);
    if (s.ret > 0) return 0;
    if (s.err == SSL_ERROR_WANT_READ || s.err == SSL_ERROR_WANT_WRITE) {
      const short ev = s.err == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT;
      if (const int e = wait_fd(fd, ev, deadline, stopping)) return e;
      continue;
    }
    why = std::move(s.why);
    // A reset here (a handshake, or a blocking exchange) means the same as an orderly close: the
    // peer hung up on us.
    return s.eof || s.reset ? kEndOfStream : kTlsFailed;
  }
}

inline int handshake(SSL* ssl, int fd, std::chrono::steady_clock::time_point deadline,
                     const std::atomic<bool>& stopping, std::string& why) {
  return drive(
      ssl, fd, nullptr, [](SSL* s) { return SSL_do_handshake(s); }, deadline, stopping, why);
}

// Reads exactly `n` bytes: 0, kEndOfStream when the peer closed first, an errno, or kTlsFailed
// with `why`.
inline int read_exact(SSL* ssl, int fd, char* buf, std::size_t n,
                      std::chrono::steady_clock::time_point deadline,
                      const std::atomic<bool>& stopping, std::string& why) {
  std::size_t got = 0;
  while (got < n) {
    int r = 0;
    const int e = drive(
        ssl, fd, nullptr,
        [&](SSL* s) {
          r = SSL_read(s, buf + got, static_cast<int>(std::min<std::size_t>(n - got, INT_MAX)));
          return r;
        },
        deadline, stopping, why);
    if (e != 0) return e;
    got += static_cast<std::size_t>(r);
  }
  return 0;
}

// Writes every byte of `iov`. Small pieces are gathered into one record (a frame header and a
// small payload go out as one TLS record, one system call); a large piece is written from where
// it lies. 0, an errno, kEndOfStream, or kTlsFailed with `why`.
inline int write_all(SSL* ssl, int fd, std::mutex* mu, const iovec* iov, std::size_t count,
                     std::optional<std::chrono::steady_clock::time_point> deadline,
                     const std::atomic<bool>& stopping, std::string& why) {
  constexpr std::size_t kStage = 16 * 1024;  // one TLS record's worth
  char stage[kStage];
  std::size_t staged = 0;
  const auto put = [&](const char* p, std::size_t len) -> int {
    while (len > 0) {
      int r = 0;
      const int e = drive(
          ssl, fd, mu,
          [&](SSL* s) {
            r = SSL_write(s, p, static_cast<int>(std::min<std::size_t>(len, INT_MAX)));
            return r;
          },
          deadline, stopping, why);
      if (e != 0) return e;
      p += r;
      len -= static_cast<std::size_t>(r);
    }
    return 0;
  };
  for (std::size_t i = 0; i < count; ++i) {
    const char* p = static_cast<const char*>(iov[i].iov_base);
    const std::size_t len = iov[i].iov_len;
    if (len <= kStage - staged) {
      std::memcpy(stage + staged, p, len);
      staged += len;
      continue;
    }
    if (staged > 0) {
      if (const int e = put(stage, staged)) return e;
      staged = 0;
    }
    if (len <= kStage) {
      std::memcpy(stage, p, len);
      staged = len;
    } else if (const int e = put(p, len)) {
      return e;
    }
  }
  return staged > 0 ? put(stage, staged) : 0;
}

// One non-blocking read: bytes read (> 0), 0 at the end of the stream, -1 with errno EAGAIN when
// nothing is there yet, or kTlsFailed with `why` set.
inline long read_some(SSL* ssl, std::mutex* mu, char* buf, std::size_t n, std::string& why) {
  Step s = step(ssl, mu, [&](SSL* x) {
    return SSL_read(x, buf, static_cast<int>(std::min<std::size_t>(n, INT_MAX)));
  });
  if (s.ret > 0) return s.ret;
  // WANT_WRITE while reading (a TLS 1.3 key update to answer) is retried on the next readiness.
  if (s.err == SSL_ERROR_WANT_READ || s.err == SSL_ERROR_WANT_WRITE) {
    errno = EAGAIN;
    return -1;
  }
  if (s.eof) return 0;
  why = std::move(s.why);
  return kTlsFailed;
}

// True when `bytes` (at least 2) open a TLS record (a handshake or an alert): what a peer with TLS
// sends to, or answers, one without it.
inline bool looks_like_tls(const unsigned char* bytes) {
  return (bytes[0] == 0x16 || bytes[0] == 0x15) && bytes[1] == 0x03;
}

}  // namespace distrpc::net::tls
