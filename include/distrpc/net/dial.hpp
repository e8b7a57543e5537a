// The connect loop of every client in distrpc (the transports' and TCPStore's): a peer that does
// not listen yet (it is starting up) is retried, backing off (by default from 10 ms, doubling to
// 500 ms), until the connect timeout; a refusal (ECONNREFUSED) that lasts refused_retry means
// nothing listens there any more; a stop flag ends it at once.
//
// The caller gives one attempt (a socket and a connect: tcp's per resolved address, shm's on an
// abstract socket, the store's per resolved address) and the way its errors are phrased, so every
// text keeps its component's prefix. Part of the net layer (OS-level helpers below the wire
// format), so the store, which sits below the transports, can use it too.
#pragma once

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>

#include "distrpc/net/wait_fd.hpp"

namespace distrpc::net {

// Why one attempt failed: the errno of its last connect (0 when it is not a connect's), and text.
struct DialFailure {
  int err = 0;
  std::string text;
};

// Folds the failed connects of one attempt's addresses (a host name may resolve to several, e.g.
// 127.0.0.1 and ::1) into the errno the loop judges: ECONNREFUSED only when some address refused
// and none failed in a way a live server could explain (a timeout, an unreachable host: it may be
// there, slow or behind a busy link). An address this machine cannot use at all (no IPv6:
// EAFNOSUPPORT, EADDRNOTAVAIL, ENETUNREACH) says nothing about the server and does not count.
class AddressFailures {
 public:
  void add(int err) {
    if (err == ECONNREFUSED) {
      refused_ = true;
    } else if (err != EAFNOSUPPORT && err != EADDRNOTAVAIL && err != ENETUNREACH) {
      maybe_live_ = true;
    }
  }
  int err() const { return refused_ && !maybe_live_ ? ECONNREFUSED : 0; }

 private:
  bool refused_ = false;
  bool maybe_live_ = false;
};

inline constexpr std::chrono::milliseconds kDialFirstBackoff{10};
inline constexpr std::chrono::milliseconds kDialMaxBackoff{500};

struct DialTiming {
  std::chrono::steady_clock::time_point start;
  std::chrono::milliseconds connect_timeout;
  // A refusal lasting this long ends the loop; milliseconds::max(): refusals are retried until
  // the deadline like any failure (a server that may start later).
  std::chrono::milliseconds refused_retry;
  std::chrono::milliseconds first_backoff = kDialFirstBackoff;
  std::chrono::milliseconds max_backoff = kDialMaxBackoff;
  bool unbounded = false;  // no deadline: connect_timeout is ignored, the loop ends on success only
  std::chrono::steady_clock::time_point deadline() const {
    return unbounded ? std::chrono::steady_clock::time_point::max() : start + connect_timeout;
  }
};

// How the loop gave up, for a caller that phrases the end itself (TCPStore keeps its own texts).
enum class DialEnd { Stopped, Refused, TimedOut };
struct DialGiveUp {
  DialEnd end;
  std::string text;  // the loop's own phrasing, as error(text) would get it
  DialFailure last;  // the last attempt's failure (empty when Stopped before any)
};

// Calls attempt(DialFailure&) until it returns a value, and returns that value. Throws
// error(text) (the caller's exception, its prefix and the peer's description added by it):
// "the transport is shut down" once `stopping` is set; "connection refused: nothing listens there
// any more (...)" when attempts were refused for refused_retry; "no connection within N ms
// (connect_timeout): <last failure>" past the deadline. An `error` that takes a DialGiveUp gets
// that instead (the same text, plus why and the last failure). An attempt may throw itself (a
// failure no retry can mend).
template <class Attempt, class Error>
auto dial_with_backoff(const DialTiming& timing, const std::atomic<bool>& stopping,
                       Attempt&& attempt, Error&& error) ->
    typename std::invoke_result_t<Attempt&, DialFailure&>::value_type {
  using Clock = std::chrono::steady_clock;
  const auto give_up = [&](DialEnd end, std::string text, DialFailure last) {
    if constexpr (std::is_invocable_v<Error&, const DialGiveUp&>) {
      return error(DialGiveUp{end, std::move(text), std::move(last)});
    } else {
      return error(text);
    }
  };
  const auto deadline = timing.deadline();
  auto backoff = timing.first_backoff;
  DialFailure last;
  for (;;) {
    if (stopping.load()) {
      throw give_up(DialEnd::Stopped, "the transport is shut down", std::move(last));
    }
    DialFailure failure;
    if (auto done = attempt(failure)) return std::move(*done);
    last = std::move(failure);
    const auto now = Clock::now();
    if (last.err == ECONNREFUSED && timing.refused_retry != std::chrono::milliseconds::max() &&
        now - timing.start >= timing.refused_retry) {
      throw give_up(
          DialEnd::Refused,
          "connection refused: nothing listens there any more (the worker exited or crashed)",
          std::move(last));
    }
    if (now >= deadline) {
      std::string text = "no connection within " + std::to_string(timing.connect_timeout.count()) +
                         " ms (connect_timeout): " + last.text;
      throw give_up(DialEnd::TimedOut, std::move(text), std::move(last));
    }
    const auto until = std::min(now + backoff, deadline);
    while (Clock::now() < until && !stopping.load()) {
      std::this_thread::sleep_for(
          std::min<Clock::duration>(until - Clock::now(), std::chrono::milliseconds(kPollSliceMs)));
    }
    backoff = std::min(backoff * 2, timing.max_backoff);
  }
}

}  // namespace distrpc::net
