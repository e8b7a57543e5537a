// Bounded waits on a socket descriptor, shared by the transports' blocking paths (connect,
// handshake, writes into a full socket): they poll in short slices so shutdown() is noticed.
#pragma once

#include <poll.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <optional>

namespace distrpc::net {

// Blocking waits on a calling thread wake this often to notice shutdown().
inline constexpr int kPollSliceMs = 50;

// Waits until `fd` is ready for `events`: 0 when ready (or hung up: the next call says how),
// ETIMEDOUT past `deadline`, ECANCELED once `stopping` is set, else errno.
inline int wait_fd(int fd, short events,
                   std::optional<std::chrono::steady_clock::time_point> deadline,
                   const std::atomic<bool>& stopping) {
  using Clock = std::chrono::steady_clock;
  for (;;) {
    if (stopping.load(std::memory_order_relaxed)) return ECANCELED;
    int slice = kPollSliceMs;
    if (deadline) {
      const auto now = Clock::now();
      if (now >= *deadline) return ETIMEDOUT;
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(*deadline - now).count() + 1;
      slice = static_cast<int>(std::min<long long>(slice, left));
    }
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, slice);
    if (r > 0) return 0;
    if (r < 0 && errno != EINTR) return errno;
  }
}

}  // namespace distrpc::net
