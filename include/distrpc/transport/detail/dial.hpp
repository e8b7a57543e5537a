// The transports' connect loop: a peer that does not listen yet (it is starting up) is retried,
// backing off from 10 ms, doubling to 500 ms, until connect_timeout; a refusal (ECONNREFUSED)
// that lasts refused_retry means nothing listens there any more; shutdown stops it at once.
//
// The transport gives one attempt (a socket and a connect: tcp's per resolved address, shm's on an
// abstract socket) and the way its errors are phrased, so every text keeps its transport's prefix.
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

#include "distrpc/transport/detail/wait_fd.hpp"

namespace distrpc::transport::detail {

// Why one attempt failed: the errno of its last connect (0 when it is not a connect's), and text.
struct DialFailure {
  int err = 0;
  std::string text;
};

struct DialTiming {
  std::chrono::steady_clock::time_point start;
  std::chrono::milliseconds connect_timeout;
  std::chrono::milliseconds refused_retry;
  std::chrono::steady_clock::time_point deadline() const { return start + connect_timeout; }
};

inline constexpr std::chrono::milliseconds kDialFirstBackoff{10};
inline constexpr std::chrono::milliseconds kDialMaxBackoff{500};

// Calls attempt(DialFailure&) until it returns a value, and returns that value. Throws
// error(text) (the transport's exception, its prefix and the peer's description added by it):
// "the transport is shut down" once `stopping` is set; "connection refused: nothing listens there
// any more (...)" when attempts were refused for refused_retry; "no connection within N ms
// (connect_timeout): <last failure>" past the deadline. An attempt may throw itself (a failure no
// retry can mend).
template <class Attempt, class Error>
auto dial_with_backoff(const DialTiming& timing, const std::atomic<bool>& stopping,
                       Attempt&& attempt, Error&& error) ->
    typename std::invoke_result_t<Attempt&, DialFailure&>::value_type {
  using Clock = std::chrono::steady_clock;
  const auto deadline = timing.deadline();
  auto backoff = kDialFirstBackoff;
  DialFailure last;
  for (;;) {
    if (stopping.load()) throw error(std::string("the transport is shut down"));
    DialFailure failure;
    if (auto done = attempt(failure)) return std::move(*done);
    last = std::move(failure);
    const auto now = Clock::now();
    if (last.err == ECONNREFUSED && now - timing.start >= timing.refused_retry) {
      throw error(std::string(
          "connection refused: nothing listens there any more (the worker exited or crashed)"));
    }
    if (now >= deadline) {
      throw error("no connection within " + std::to_string(timing.connect_timeout.count()) +
                  " ms (connect_timeout): " + last.text);
    }
    const auto until = std::min(now + backoff, deadline);
    while (Clock::now() < until && !stopping.load()) {
      std::this_thread::sleep_for(
          std::min<Clock::duration>(until - Clock::now(), std::chrono::milliseconds(kPollSliceMs)));
    }
    backoff = std::min(backoff * 2, kDialMaxBackoff);
  }
}

}  // namespace distrpc::transport::detail
