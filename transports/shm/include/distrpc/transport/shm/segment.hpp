// Tensor segments: the large out-of-band buffers of a message do not go through the ring. The
// sender copies them once into a shared memfd segment and the receiver builds the buffers straight
// over its mapping of that segment (at::from_blob with a deleter): one copy per direction.
//
// Fresh shared memory is slow (every page faulted and zeroed: ~60 ms for 64 MiB on the development
// VM), so segments are reused. A segment's first page holds `state`: the sender sets it to kBusy
// when a message uses the segment, and the receiver sets it back to kFree when the last tensor of
// that message dies; the sender reuses only free segments. Both sides keep their mappings, so a
// reused segment costs one memcpy and nothing else. The cache is bounded (count and bytes per
// connection); beyond it a segment is "one-shot": announced, used by one message, then dropped by
// both sides (the memory lives until the receiver's tensors die).
//
// A segment's descriptor travels over the connection's Unix socket (SCM_RIGHTS) before the first
// ring record that names it; records name segments by an id that is never reused on a connection.
#pragma once

#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "distrpc/transport/shm/system.hpp"

namespace distrpc::transport::shm::detail {

inline constexpr std::uint64_t kSegmentMagic = 0x4745534d48535244ull;  // "DRSHMSEG"
inline constexpr std::size_t kSegmentHeaderBytes = 4096;
// Buffers of at least this many bytes go to a segment; smaller ones are copied through the ring.
inline constexpr std::size_t kSegmentThreshold = 64 * 1024;
// Buffers inside a segment start at this alignment (enough for every dtype and for vector loads).
inline constexpr std::size_t kSegmentAlign = 64;
// New segments are rounded up to this, so slightly different sizes reuse one segment.
inline constexpr std::uint64_t kSegmentGranule = std::uint64_t{1} << 20;
// Cache bounds per connection (sender side; the receiver mirrors what the sender announces).
// Eight: a pipelined ring all-reduce at world 4 keeps up to 2(n-1) = 6 chunks in flight on one
// connection; with fewer cached segments the rest went one-shot (a fresh, prefaulted mapping per
// chunk), a third of the bandwidth.
inline constexpr std::size_t kMaxCachedSegments = 8;
inline constexpr std::uint64_t kMaxCachedSegmentBytes = std::uint64_t{256} << 20;
inline constexpr std::uint64_t kMaxCachedTotalBytes = std::uint64_t{512} << 20;
// A receiver refuses to track more segments than this per connection (an honest writer keeps at
// most kMaxCachedSegments plus the one-shot of the record being read): a protocol error, not a
// leak.
inline constexpr std::size_t kMaxReceiverSegments = 64;

inline constexpr std::uint32_t kSegmentFree = 0;
inline constexpr std::uint32_t kSegmentBusy = 1;

struct SegmentControl {
  std::uint64_t magic;
  std::uint64_t capacity;  // data bytes after the header page
  alignas(64) std::atomic<std::uint32_t> state;
};
static_assert(sizeof(SegmentControl) <= kSegmentHeaderBytes);

// The packet that announces a segment on the Unix socket (the memfd rides along as SCM_RIGHTS).
inline constexpr std::uint32_t kSegmentPacketMagic = 0x53475344u;  // "DSGS"
struct SegmentPacket {
  std::uint32_t magic;
  std::uint32_t id;
  std::uint64_t capacity;
};

// ---- sender ---------------------------------------------------------------------------------

struct SendSegment {
  std::uint32_t id = 0;
  std::uint64_t capacity = 0;
  std::shared_ptr<Mapping> map;
  std::uint64_t last_use = 0;
  SegmentControl* control() const { return reinterpret_cast<SegmentControl*>(map->base()); }
  char* data() const { return map->base() + kSegmentHeaderBytes; }
  bool free() const { return control()->state.load(std::memory_order_acquire) == kSegmentFree; }
};

// What the sender decided for one message.
struct SegmentChoice {
  SendSegment segment;
  bool fresh = false;        // announce it (send its descriptor) before the record
  Fd fd;                     // the descriptor to announce, when fresh
  bool one_shot = false;     // the receiver drops it after this message
  std::uint32_t forget = 0;  // a cached segment both sides drop now (0: none)
};

// The sender's cache of one connection. Used under the connection's write mutex.
class SegmentCache {
 public:
  explicit SegmentCache(std::string label) : label_(std::move(label)) {}

  // A segment with at least `needed` data bytes for the next message, marked busy.
  SegmentChoice acquire(std::uint64_t needed) {
    SegmentChoice c;
    ++clock_;
    SendSegment* best = nullptr;
    for (auto& s : cached_) {
      if (s.capacity >= needed && s.free() && (!best || s.capacity < best->capacity)) best = &s;
    }
    if (best) {
      best->last_use = clock_;
      c.segment = *best;
      mark_busy(c.segment);
      return c;
    }
    const std::uint64_t capacity =
        (needed + kSegmentGranule - 1) / kSegmentGranule * kSegmentGranule;
    c.fresh = true;
    c.segment.id = next_id_++;
    c.segment.capacity = capacity;
    c.segment.last_use = clock_;
    c.fd = make_memfd("distrpc-shm segment " + label_ + " #" + std::to_string(c.segment.id),
                      kSegmentHeaderBytes + capacity);
    // Faulted in bulk now: page by page inside the memcpy costs several times more.
    c.segment.map = map_shared(c.fd.get(), kSegmentHeaderBytes + capacity, /*prefault=*/true);
    auto* ctl = new (c.segment.map->base()) SegmentControl{};
    ctl->magic = kSegmentMagic;
    ctl->capacity = capacity;
    ctl->state.store(kSegmentFree, std::memory_order_relaxed);
    if (capacity <= kMaxCachedSegmentBytes) {
      // Room by count: the least recently used free segment goes.
      if (cached_.size() >= kMaxCachedSegments) evict_one(c);
      if (cached_.size() < kMaxCachedSegments && cached_bytes_ + capacity > kMaxCachedTotalBytes &&
          c.forget == 0) {
        evict_one(c);
      }
      if (cached_.size() < kMaxCachedSegments && cached_bytes_ + capacity <= kMaxCachedTotalBytes) {
        cached_.push_back(c.segment);
        cached_bytes_ += capacity;
        mark_busy(c.segment);
        return c;
      }
    }
    c.one_shot = true;
    mark_busy(c.segment);
    return c;
  }

  std::size_t cached_count() const { return cached_.size(); }

 private:
  static void mark_busy(const SendSegment& s) {
    // Relaxed: the ring record that names the segment is published with release after this.
    s.control()->state.store(kSegmentBusy, std::memory_order_relaxed);
  }

  void evict_one(SegmentChoice& c) {
    auto victim = cached_.end();
    for (auto it = cached_.begin(); it != cached_.end(); ++it) {
      if (it->free() && (victim == cached_.end() || it->last_use < victim->last_use)) victim = it;
    }
    if (victim == cached_.end()) return;
    c.forget = victim->id;
    cached_bytes_ -= victim->capacity;
    cached_.erase(victim);
  }

  std::string label_;
  std::vector<SendSegment> cached_;
  std::uint64_t cached_bytes_ = 0;
  std::uint32_t next_id_ = 1;
  std::uint64_t clock_ = 0;
};

// ---- receiver -------------------------------------------------------------------------------

struct RecvSegment {
  std::shared_ptr<Mapping> map;
  std::uint64_t capacity = 0;
  SegmentControl* control() const { return reinterpret_cast<SegmentControl*>(map->base()); }
  char* data() const { return map->base() + kSegmentHeaderBytes; }
};

// One message's use of a segment: when the last tensor built over it dies, the segment is handed
// back to the sender (unless it was one-shot), and the mapping is released with the last owner.
class SegmentUse {
 public:
  SegmentUse(std::shared_ptr<RecvSegment> s, bool one_shot)
      : segment_(std::move(s)), one_shot_(one_shot) {}
  ~SegmentUse() {
    if (!one_shot_) segment_->control()->state.store(kSegmentFree, std::memory_order_release);
  }
  SegmentUse(const SegmentUse&) = delete;
  SegmentUse& operator=(const SegmentUse&) = delete;
  const RecvSegment& segment() const { return *segment_; }

 private:
  std::shared_ptr<RecvSegment> segment_;
  bool one_shot_;
};

// The largest segment a peer that keeps to `limits` can announce: the buffers it places there, each
// at a kSegmentAlign boundary, rounded up to kSegmentGranule. (max_message_bytes itself is too
// small whenever it is not a multiple of the granule: such a message was refused on arrival.)
inline std::uint64_t max_segment_bytes(const wire::Limits& limits) {
  const std::uint64_t placed =
      std::min<std::uint64_t>(limits.max_buffers, limits.max_message_bytes / kSegmentThreshold + 1);
  const std::uint64_t bytes = limits.max_message_bytes + placed * kSegmentAlign;
  return (bytes + kSegmentGranule - 1) / kSegmentGranule * kSegmentGranule;
}

// Maps a segment announced by the peer, after checking the descriptor and the header it holds.
inline std::shared_ptr<RecvSegment> adopt_segment(int fd, std::uint32_t id, std::uint64_t announced,
                                                  std::uint64_t max_bytes) {
  const std::string what = "segment " + std::to_string(id);
  const std::uint64_t size =
      checked_memfd_size(fd, what, kSegmentHeaderBytes + 1, kSegmentHeaderBytes + max_bytes);
  if (size != kSegmentHeaderBytes + announced) {
    throw wire::ProtocolError(what + " was announced with " + std::to_string(announced) +
                              " data bytes but its memfd holds " +
                              std::to_string(size - kSegmentHeaderBytes));
  }
  auto s = std::make_shared<RecvSegment>();
  // The writer filled its pages: mapped in bulk, this only fills page tables, once per segment.
  s->map = map_peer_memory(fd, static_cast<std::size_t>(size));
  s->capacity = announced;
  const auto* ctl = s->control();
  if (ctl->magic != kSegmentMagic || ctl->capacity != announced) {
    throw wire::ProtocolError(what + " has a corrupted header");
  }
  return s;
}

// The error for a record naming segment `id` that the socket did not announce.
inline wire::ProtocolError never_announced(std::uint32_t id, const std::string& why) {
  return wire::ProtocolError("a record names segment " + std::to_string(id) +
                             ", which was never announced (" + why + ")");
}

// The descriptor of segment `id`, which the writer sent on the socket `sock` just before the
// record naming it (so it is queued there by now), mapped. Throws ProtocolError.
inline std::shared_ptr<RecvSegment> receive_announced_segment(int sock, std::uint32_t id,
                                                              std::uint64_t max_bytes) {
  Packet pkt;
  const int r = try_recv_packet(sock, pkt);
  if (r == EAGAIN) throw never_announced(id, "nothing is queued on the socket");
  if (r == kPeerClosed) throw never_announced(id, "the socket is closed");
  if (r != 0) throw never_announced(id, "reading the socket failed: " + errno_text(r));
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
  return adopt_segment(pkt.fds[0].get(), id, sp.capacity, max_bytes);
}

}  // namespace distrpc::transport::shm::detail
