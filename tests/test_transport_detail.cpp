// The OS-level helpers every client shares (include/distrpc/net/: the owned descriptor, the dial
// loop's timing and refusal rule) and the transports' shared connection layer
// (include/distrpc/transport/detail/: the generation guard of a peer's lost state, the
// handshake's identity check), without processes and without libtorch.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>

#include <doctest/doctest.h>

#include "distrpc/net/dial.hpp"
#include "distrpc/net/errno_text.hpp"
#include "distrpc/net/fd.hpp"
#include "distrpc/transport/detail/identity.hpp"
#include "distrpc/transport/detail/peer_liveness.hpp"
#include "multiprocess.hpp"

namespace {

using distrpc::net::DialFailure;
using distrpc::net::DialTiming;
using distrpc::net::Fd;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

bool is_open(int fd) {
  return ::fcntl(fd, F_GETFD) != -1;
}

// One plain blocking connect to 127.0.0.1:port, as an attempt of the dial loop.
std::optional<Fd> connect_once(int port, DialFailure& failure) {
  Fd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  REQUIRE(s);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) return s;
  failure.err = errno;
  failure.text = "connect: " + distrpc::net::errno_text(failure.err);
  return std::nullopt;
}

struct Refused : std::runtime_error {
  using std::runtime_error::runtime_error;
};
Refused make_error(const std::string& what) {
  return Refused("distrpc test: " + what);
}

}  // namespace

TEST_CASE("net: Fd owns, moves and releases a descriptor") {
  int raw = -1;
  {
    Fd a(::socket(AF_INET, SOCK_STREAM, 0));
    REQUIRE(a);
    raw = a.get();
    Fd b(std::move(a));
    CHECK_FALSE(a);
    CHECK(b.get() == raw);
    CHECK(is_open(raw));
  }
  CHECK_FALSE(is_open(raw));  // closed with its owner
  Fd c(::socket(AF_INET, SOCK_STREAM, 0));
  raw = c.release();
  CHECK_FALSE(c);
  CHECK(is_open(raw));  // released: the caller's now
  ::close(raw);
}

TEST_CASE("net: dialling where nothing listens fails within connect_timeout") {
  const int port = distrpc::testing::free_loopback_port();
  std::atomic<bool> stopping{false};
  int attempts = 0;
  const DialTiming timing{Clock::now(), 600ms, std::chrono::hours(24)};
  std::string text;
  try {
    (void)distrpc::net::dial_with_backoff(
        timing, stopping,
        [&](DialFailure& f) {
          ++attempts;
          return connect_once(port, f);
        },
        make_error);
  } catch (const Refused& e) {
    text = e.what();
  }
  const auto took = Clock::now() - timing.start;
  CHECK(text.find("distrpc test: no connection within 600 ms (connect_timeout): connect: ") == 0);
  CHECK(took >= 600ms);   // it retried until the deadline...
  CHECK(took < 1200ms);   // ...and not much longer
  CHECK(attempts >= 4);   // 10, 20, 40, 80, ... ms apart
  CHECK(attempts <= 12);  // backing off, not spinning
}

TEST_CASE("net: with a short refused_retry a refused dial fails fast") {
  const int port = distrpc::testing::free_loopback_port();
  std::atomic<bool> stopping{false};
  const DialTiming timing{Clock::now(), 10s, 50ms};
  std::string text;
  try {
    (void)distrpc::net::dial_with_backoff(
        timing, stopping, [&](DialFailure& f) { return connect_once(port, f); }, make_error);
  } catch (const Refused& e) {
    text = e.what();
  }
  CHECK(text ==
        "distrpc test: connection refused: nothing listens there any more (the worker "
        "exited or crashed)");
  CHECK(Clock::now() - timing.start < 1s);
}

TEST_CASE("net: a host's addresses read as refused only when nothing there may be a live server") {
  using distrpc::net::AddressFailures;
  const auto fold = [](std::initializer_list<int> errs) {
    AddressFailures f;
    for (int e : errs) f.add(e);
    return f.err();
  };
  CHECK(fold({ECONNREFUSED}) == ECONNREFUSED);
  CHECK(fold({ECONNREFUSED, ECONNREFUSED}) == ECONNREFUSED);  // 127.0.0.1 and ::1
  // ::1 unusable on a machine without IPv6: it says nothing about the server.
  CHECK(fold({EADDRNOTAVAIL, ECONNREFUSED}) == ECONNREFUSED);
  CHECK(fold({ECONNREFUSED, EAFNOSUPPORT}) == ECONNREFUSED);
  CHECK(fold({ENETUNREACH, ECONNREFUSED}) == ECONNREFUSED);
  // One address timing out or unreachable may be the live server: not a refusal.
  CHECK(fold({ETIMEDOUT, ECONNREFUSED}) == 0);
  CHECK(fold({ECONNREFUSED, EHOSTUNREACH}) == 0);
  // Nothing refused at all.
  CHECK(fold({}) == 0);
  CHECK(fold({EADDRNOTAVAIL}) == 0);
  CHECK(fold({ETIMEDOUT}) == 0);
}

TEST_CASE("net: the dial loop returns what an attempt made, and stops on shutdown") {
  std::atomic<bool> stopping{false};
  int calls = 0;
  const int got = distrpc::net::dial_with_backoff(
      DialTiming{Clock::now(), 5s, std::chrono::hours(24)}, stopping,
      [&](DialFailure& f) -> std::optional<int> {
        if (++calls < 3) {
          f.err = ECONNREFUSED;
          f.text = "not yet";
          return std::nullopt;
        }
        return 42;
      },
      make_error);
  CHECK(got == 42);
  CHECK(calls == 3);

  // A stopping flag set while it backs off ends the loop at once with the shutdown text.
  std::thread stopper([&] {
    std::this_thread::sleep_for(100ms);
    stopping = true;
  });
  const auto t0 = Clock::now();
  std::string text;
  try {
    (void)distrpc::net::dial_with_backoff(
        DialTiming{Clock::now(), 30s, std::chrono::hours(24)}, stopping,
        [&](DialFailure& f) -> std::optional<int> {
          f.text = "not yet";
          return std::nullopt;
        },
        make_error);
  } catch (const Refused& e) {
    text = e.what();
  }
  stopper.join();
  CHECK(text == "distrpc test: the transport is shut down");
  CHECK(Clock::now() - t0 < 2s);
}

TEST_CASE("net: a caller may phrase the end itself, retry refusals and pick its backoff") {
  // TCPStore's use: refusals retried until the deadline (the server may start later), its own
  // backoff, and its own text built from the last failure.
  const int port = distrpc::testing::free_loopback_port();
  std::atomic<bool> stopping{false};
  int attempts = 0;
  const DialTiming timing{.start = Clock::now(),
                          .connect_timeout = 300ms,
                          .refused_retry = std::chrono::milliseconds::max(),
                          .first_backoff = 5ms,
                          .max_backoff = 20ms};
  std::string text;
  distrpc::net::DialEnd end = distrpc::net::DialEnd::Stopped;
  try {
    (void)distrpc::net::dial_with_backoff(
        timing, stopping,
        [&](DialFailure& f) {
          ++attempts;
          return connect_once(port, f);
        },
        [&](const distrpc::net::DialGiveUp& g) {
          end = g.end;
          CHECK(g.last.err == ECONNREFUSED);
          return Refused("mine: " + g.last.text + " | " + g.text);
        });
  } catch (const Refused& e) {
    text = e.what();
  }
  const auto took = Clock::now() - timing.start;
  CHECK(end == distrpc::net::DialEnd::TimedOut);
  CHECK(text ==
        "mine: connect: Connection refused | no connection within 300 ms (connect_timeout): "
        "connect: Connection refused");
  CHECK(took >= 300ms);
  CHECK(took < 900ms);
  CHECK(attempts >= 12);  // 5, 10, 20, 20, ... ms apart: the short backoff was used
  CHECK(attempts <= 40);

  // Unbounded: no deadline at all; it ends when an attempt succeeds.
  int calls = 0;
  const int got = distrpc::net::dial_with_backoff(
      DialTiming{.start = Clock::now() - 24h,
                 .connect_timeout = 0ms,
                 .refused_retry = std::chrono::milliseconds::max(),
                 .first_backoff = 1ms,
                 .max_backoff = 1ms,
                 .unbounded = true},
      stopping,
      [&](DialFailure& f) -> std::optional<int> {
        if (++calls < 5) {
          f.err = ECONNREFUSED;
          return std::nullopt;
        }
        return 7;
      },
      make_error);
  CHECK(got == 7);
  CHECK(calls == 5);
}

TEST_CASE("transport detail: a late hang-up of an old connection does not mark the new one lost") {
  distrpc::transport::detail::PeerLiveness p;
  const auto first = p.generation();
  CHECK_FALSE(p.lost());
  // Both connections of the first registration break: reported once, with the first reason.
  REQUIRE(p.current(first));
  CHECK(p.mark_lost("connection closed by peer"));
  CHECK_FALSE(p.mark_lost("the other one broke too"));
  CHECK(p.lost_reason() == "connection closed by peer");
  // add_peer() again: a fresh incarnation, and the old pair's events are stale.
  CHECK(p.renew());
  CHECK_FALSE(p.lost());
  const auto second = p.generation();
  CHECK(second != first);
  CHECK_FALSE(p.current(first));
  CHECK(p.current(second));
  // Repeating add_peer() while nothing was lost keeps the connections made meanwhile current.
  CHECK_FALSE(p.renew());
  CHECK(p.current(second));
  // The new incarnation can be lost (and reported) again.
  CHECK(p.mark_lost("reset"));
  CHECK(p.lost_reason() == "reset");
  // Registered at a new address before its loss was noticed (a replacement process): a fresh
  // incarnation all the same, and the old connections' hang-up, arriving later, is stale.
  CHECK(p.renew());
  const auto third = p.generation();
  CHECK(p.renew(/*moved=*/true));
  CHECK_FALSE(p.current(third));
  CHECK_FALSE(p.lost());
}

TEST_CASE(
    "transport detail: a replacement's connection adopted before its registration is its own once "
    "registered") {
  using distrpc::transport::detail::PeerLiveness;
  // Kept with an incoming connection only when the dialler listens where the peer is not
  // registered.
  CHECK(PeerLiveness::ahead_of("h:1", "h:2") == "h:2");
  CHECK(PeerLiveness::ahead_of("h:1", "h:1").empty());
  CHECK(PeerLiveness::ahead_of("", "h:2").empty());  // not registered yet: the usual rule
  CHECK(PeerLiveness::ahead_of("h:1", "").empty());  // the dialler did not say
  PeerLiveness p;
  // Adopted while the peer is registered at h:1, from a dialler listening at h:2.
  struct {
    std::uint64_t generation = 99;
    std::string ahead;
  } adopted;
  p.stamp_adopted(adopted, "h:1", "h:2");
  const auto g = adopted.generation;
  const std::string ahead = adopted.ahead;
  CHECK(g == p.generation());
  CHECK(ahead == "h:2");
  CHECK_FALSE(p.current(g, ahead, "h:1"));  // nobody's until the move
  CHECK(p.current(g));                      // an ordinary connection of that time is current
  // add_peer() at another address first (say, a refused joiner's), then at h:2.
  CHECK(p.renew(/*moved=*/true));
  CHECK_FALSE(p.current(g, ahead, "h:3"));
  CHECK(p.renew(/*moved=*/true));
  CHECK(p.current(g, ahead, "h:2"));  // the registration it dialled ahead of
  CHECK_FALSE(p.current(g));          // the ordinary one of the old generation is stale
  // A connection adopted ahead after the move, or claiming another address, is not.
  CHECK_FALSE(p.current(p.generation(), ahead, "h:2"));
  CHECK_FALSE(p.current(g, "h:9", "h:2"));
  // The registration at h:2 lost and registered again (a new process there): stale.
  CHECK(p.mark_lost("reset"));
  CHECK(p.renew());
  CHECK_FALSE(p.current(g, ahead, "h:2"));
}

TEST_CASE("transport detail: the handshake's identity check names who answered") {
  using distrpc::transport::detail::identity_mismatch;
  CHECK(identity_mismatch(2, "w2", 2, "w2").empty());
  CHECK(identity_mismatch(2, "", 2, "anything").empty());  // no name given: any name
  CHECK(identity_mismatch(2, "w2", 1, "w1") == "reached worker 1 ('w1') instead");
  CHECK(identity_mismatch(2, "w2", 2, "impostor") == "the peer there is named 'impostor'");
}
