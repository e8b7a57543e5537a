// libFuzzer target: the TCPStore server's request parser (store/detail/tcp_store_protocol.hpp's
// Reader, tcp_store_server.hpp's serve_one: c10d's protocol in both numberings of query types,
// the magic-prefixed form, VALIDATE, and distrpc's authentication), driven as a client would:
// each input is a fresh server on 127.0.0.1 and one connection that sends the input's bytes, then
// half-closes and reads until the server closes. The first byte picks a server without (even) or
// with (odd) a shared secret. Findings: a sanitizer report, an error logged by the server's I/O
// thread (an exception no handler expected), or a connection the server does not close within
// 10 s of the client's end of input (a hang).
#include <distrpc/log.hpp>
#include <distrpc/store/detail/tcp_store_server.hpp>

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>

namespace {

using namespace distrpc;

void fail(const char* what) {
  std::fprintf(stderr, "fuzz_store: %s\n", what);
  std::abort();
}

void fail_errno(const char* what) {
  std::fprintf(stderr, "fuzz_store: %s: %s\n", what, std::strerror(errno));
  std::abort();
}

// Sends `data` and reads replies until the server closes the connection.
void converse(std::uint16_t port, const std::uint8_t* data, std::size_t size) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) fail("socket() failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  // Non-blocking from the start: libFuzzer's -timeout arms a SIGALRM (every timeout/2 + 1 s)
  // whose handler is installed without SA_RESTART, and a blocking connect() it interrupts fails
  // with EINTR while the connection goes on being made. Waiting with poll() survives that.
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    if (errno != EINPROGRESS && errno != EINTR) fail_errno("connect() to the store server failed");
    pollfd w{fd, POLLOUT, 0};
    while (::poll(&w, 1, 10000) < 0 && errno == EINTR) {
    }
    int error = 0;
    socklen_t len = sizeof error;
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len);
    if (!(w.revents & POLLOUT) || error != 0) {
      errno = error != 0 ? error : ETIMEDOUT;
      fail_errno("connect() to the store server failed");
    }
  }
  // Closed with a reset: thousands of connections a second must not leave TIME_WAIT behind.
  const linger reset{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof reset);
  std::size_t sent = 0;
  bool half_closed = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  char sink[64 * 1024];
  for (;;) {
    if (sent == size && !half_closed) {
      ::shutdown(fd, SHUT_WR);
      half_closed = true;
    }
    pollfd p{fd, static_cast<short>(POLLIN | (half_closed ? 0 : POLLOUT)), 0};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) fail("the server kept the connection open 10 s after the input ended");
    if (::poll(&p, 1, static_cast<int>(left.count())) < 0) continue;
    if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
      const ssize_t n = ::recv(fd, sink, sizeof sink, MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) break;  // closed: done
    }
    if (!half_closed && (p.revents & POLLOUT)) {
      const ssize_t n = ::send(fd, data + sent, size - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        sent += static_cast<std::size_t>(n);
      } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
        half_closed = true;  // the server closed on us: read what is left
      }
    }
  }
  ::close(fd);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // The server logs why it closes a connection (a warning, expected here: quiet unless asked);
  // an error is an exception its handlers did not expect.
  static const bool verbose = std::getenv("DISTRPC_FUZZ_VERBOSE") != nullptr;
  set_log_sink([](LogLevel level, std::string_view who, std::string_view text) {
    if (verbose || level == LogLevel::error) {
      std::fprintf(stderr, "[distrpc] %.*s: %.*s\n", static_cast<int>(who.size()), who.data(),
                   static_cast<int>(text.size()), text.data());
    }
    if (level == LogLevel::error) std::abort();
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  std::optional<std::string> secret;
  if (data[0] & 1) secret = "fuzzing secret";
  store::detail::Server server("127.0.0.1", 0, std::chrono::milliseconds(20000), secret);
  converse(server.port(), data + 1, size - 1);
  return 0;
}
