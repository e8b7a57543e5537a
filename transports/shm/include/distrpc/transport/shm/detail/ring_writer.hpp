// Sending, on the calling thread: a message's record goes into the ring under the connection's
// write mutex (large buffers into a shared segment first), waiting for space as the reader frees
// it, so a message larger than the ring streams through.
#pragma once

#include <poll.h>
#include <sched.h>
#include <algorithm>
#include <array>
#include <cstring>
#include <string>
#include "distrpc/transport/shm/detail/record.hpp"

#include "distrpc/transport/shm/detail/impl.hpp"

namespace distrpc::transport::shm::detail {

inline void Impl::write_message(OutConn& c, const wire::Message& m) {
  std::lock_guard<std::mutex> lk(c.write_mu);
  if (c.closed.load() || c.broken.load()) {
    if (stopping_.load()) {
      throw DistNetworkError("distrpc shm: cannot send to " + c.describe() + ": the transport of " +
                             self_text() + " is shut down");
    }
    const std::string why = c.recorded_failure();
    throw DistNetworkError("distrpc shm: cannot send to " + c.describe() +
                           ": the connection was lost" + (why.empty() ? "" : " (" + why + ")"));
  }
  const auto send_failed = [&](const std::string& why) {
    return "distrpc shm: send of " + wire::to_string(m.type) + " message " + std::to_string(m.id) +
           " to " + c.describe() + " failed: " + why;
  };
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
  if (seg_bytes > 0) {
    try {
      seg = c.segments.acquire(seg_bytes);
    } catch (const std::exception& e) {
      // Out of memory or descriptors here: nothing was written, so the connection stays usable
      // and only this send fails, naming the message and the peer.
      throw DistNetworkError(
          send_failed("cannot make a " + std::to_string(seg_bytes) +
                      "-byte segment for its tensors: " + reason_without_prefix(e)));
    }
  }
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
    c.scratch.clear();
    append_record_head(c.scratch, m, seg.segment.id, seg.one_shot ? kRecordOneShot : 0, seg.forget,
                       c.place);
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
    // shutdown as a hang-up, closes the connection and reports this reason. A reason recorded
    // before (the peer was lost or registered again, which shut the socket down under this
    // write: a hang-up the peer did not cause) is the one to give.
    const std::string earlier = c.recorded_failure();
    c.record_failure("write failed: " + text);
    c.shutdown_sock();
    throw DistNetworkError(send_failed(earlier.empty() ? text : earlier));
  }
}

// Copies `n` bytes into the ring, waiting for space as needed (a message larger than the ring
// streams through it while the reader consumes).
inline void Impl::ring_write(OutConn& c, const char* p, std::size_t n) {
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

inline void Impl::wait_for_space(OutConn& c) {
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
      // Our own shutdown() hung the socket up too.
      if (stopping_.load()) throw DistNetworkError("the transport was shut down");
      throw DistNetworkError("the peer closed the connection while we waited for ring space");
    }
    if (fds[0].revents & POLLIN) drain_eventfd(c.space_efd.get());
    c.writer.declare_sleeping();  // it may have been cleared by the reader's wake-up
  }
  c.writer.clear_sleeping();
}

}  // namespace distrpc::transport::shm::detail
