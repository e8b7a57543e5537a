// The single-producer single-consumer byte ring that carries one direction of a shared-memory
// connection, and the wake-up protocol around it.
//
// Layout of the ring's memfd: one 4 KiB header page (below), then `capacity` data bytes (a power of
// two). `head` and `tail` are byte counts that only grow; the data of position p lives at
// p & (capacity - 1). Each side keeps its own copy of the position it owns and of the capacity,
// and validates everything it reads from the shared header, because the peer (or a stray write)
// can put anything there: a corrupted header is reported as a RingCorrupt error, never followed.
//
// Sleeping: a reader with nothing to read sets `reader_sleeping`, issues a seq_cst fence, re-reads
// `tail`, and only then sleeps on its eventfd; a writer publishes `tail`, issues a seq_cst fence
// and signals the eventfd only if `reader_sleeping` was set. The two fences order each side's store
// before its load (a Dekker handshake), so at least one side sees the other: either the reader
// sees the new tail, or the writer sees the flag and wakes it. A busy pair therefore makes no
// syscall at all. The same protocol, with `writer_sleeping`, wakes a writer waiting for space.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "distrpc/transport/shm/system.hpp"
#include "distrpc/wire/errors.hpp"

namespace distrpc::transport::shm::detail {

inline constexpr std::uint64_t kRingMagic = 0x474e495248535244ull;  // "DRSHRING"
inline constexpr std::uint32_t kRingVersion = 1;
inline constexpr std::size_t kRingHeaderBytes = 4096;
inline constexpr std::uint64_t kMinRingCapacity = std::uint64_t{64} << 10;
inline constexpr std::uint64_t kMaxRingCapacity = std::uint64_t{1} << 30;

struct RingHeader {
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t reserved;
  std::uint64_t capacity;
  alignas(64) std::atomic<std::uint64_t> head;  // consumer position, written by the reader only
  alignas(64) std::atomic<std::uint64_t> tail;  // producer position, written by the writer only
  alignas(64) std::atomic<std::uint32_t> reader_sleeping;
  alignas(64) std::atomic<std::uint32_t> writer_sleeping;
};
static_assert(sizeof(RingHeader) <= kRingHeaderBytes);
static_assert(std::atomic<std::uint64_t>::is_always_lock_free,
              "shared-memory atomics must be lock-free to work across processes");
static_assert(std::atomic<std::uint32_t>::is_always_lock_free);

// What was wrong with the shared header, for the log line and on_peer_lost. A ProtocolError, as
// every transport raises for bytes a peer got wrong (wire/errors.hpp): the header is the peer's
// to write, and the connection cannot be trusted any more.
class RingCorrupt : public wire::ProtocolError {
 public:
  using wire::ProtocolError::ProtocolError;
};

inline void init_ring(char* base, std::uint64_t capacity) {
  auto* h = new (base) RingHeader{};
  h->magic = kRingMagic;
  h->version = kRingVersion;
  h->capacity = capacity;
  h->head.store(0, std::memory_order_relaxed);
  h->tail.store(0, std::memory_order_relaxed);
  h->reader_sleeping.store(0, std::memory_order_relaxed);
  h->writer_sleeping.store(0, std::memory_order_release);
}

// Checks a freshly received ring before it is used (the size of the memfd was checked already).
inline void check_new_ring(const char* base, std::uint64_t capacity) {
  const auto* h = reinterpret_cast<const RingHeader*>(base);
  if (h->magic != kRingMagic) throw wire::ProtocolError("the shared ring has a bad magic number");
  if (h->version != kRingVersion) {
    throw wire::ProtocolError("the shared ring has layout version " + std::to_string(h->version) +
                              ", this build speaks " + std::to_string(kRingVersion));
  }
  if (h->capacity != capacity) {
    throw wire::ProtocolError("the shared ring's header claims " + std::to_string(h->capacity) +
                              " data bytes, its setup record " + std::to_string(capacity));
  }
  if (h->head.load() != 0 || h->tail.load() != 0) {
    throw wire::ProtocolError("a new shared ring does not start empty");
  }
}

// How long a writer waits for a reader declared sleeping to wake its ring by itself before it
// signals (RingWriter::publish()).
inline constexpr auto kWakeGrace = std::chrono::microseconds(3);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class RingBase {
 public:
  RingBase(char* base, std::uint64_t capacity)
      : h_(reinterpret_cast<RingHeader*>(base)),
        data_(base + kRingHeaderBytes),
        capacity_(capacity),
        mask_(capacity - 1) {}

  RingHeader& header() const { return *h_; }
  std::uint64_t capacity() const { return capacity_; }

 protected:
  void check_magic() const {
    // Relaxed: a torn or garbage value is what we look for; nothing is ordered by it.
    const auto* raw = reinterpret_cast<const volatile std::uint64_t*>(&h_->magic);
    const auto* cap = reinterpret_cast<const volatile std::uint64_t*>(&h_->capacity);
    if (*raw != kRingMagic || *cap != capacity_) {
      throw RingCorrupt("the shared ring header is corrupted (magic 0x" + hex(*raw) +
                        ", capacity " + std::to_string(*cap) + ", expected capacity " +
                        std::to_string(capacity_) + ")");
    }
  }
  static std::string hex(std::uint64_t v) {
    static constexpr char d[] = "0123456789abcdef";
    std::string s(16, '0');
    for (int i = 0; i < 16; ++i) s[15 - i] = d[(v >> (4 * i)) & 0xF];
    return s;
  }

  RingHeader* h_;
  char* data_;
  const std::uint64_t capacity_;
  const std::uint64_t mask_;
};

// The producer side. Used under the connection's write mutex.
class RingWriter : public RingBase {
 public:
  using RingBase::RingBase;

  // Bytes that can be written now. Throws RingCorrupt when the shared head is impossible.
  std::uint64_t free_space() {
    check_magic();
    const std::uint64_t head = h_->head.load(std::memory_order_acquire);
    if (head < last_head_ || head > tail_ || tail_ - head > capacity_) {
      throw RingCorrupt("the shared ring header is corrupted (head " + std::to_string(head) +
                        " while this writer's tail is " + std::to_string(tail_) +
                        ", the last head seen " + std::to_string(last_head_) + ", capacity " +
                        std::to_string(capacity_) + ")");
    }
    last_head_ = head;
    return capacity_ - (tail_ - head);
  }

  // Copies `n` bytes at the unpublished tail; the caller checked free_space() >= n.
  void copy_in(const void* src, std::size_t n) {
    const std::size_t at = static_cast<std::size_t>(tail_ & mask_);
    const std::size_t first = std::min<std::size_t>(n, capacity_ - at);
    std::memcpy(data_ + at, src, first);
    if (n > first) std::memcpy(data_, static_cast<const char*>(src) + first, n - first);
    tail_ += n;
  }

  bool has_unpublished() const { return tail_ != published_; }

  // Makes the copied bytes visible; true when the reader had declared it was going to sleep (the
  // caller must then signal its eventfd).
  bool publish() {
    if (tail_ == published_) return false;
    published_ = tail_;
    h_->tail.store(tail_, std::memory_order_release);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (h_->reader_sleeping.load(std::memory_order_relaxed) == 0) return false;
    // A reader about to read anyway (a caller that sent a request and starts polling for the
    // reply just after it came) clears the flag itself within a moment: give it that moment
    // before paying for a signal and the wake-up of one of its threads.
    const auto until = std::chrono::steady_clock::now() + kWakeGrace;
    do {
      for (int i = 0; i < 64; ++i) {
        if (h_->reader_sleeping.load(std::memory_order_relaxed) == 0) return false;
        cpu_relax();
      }
    } while (std::chrono::steady_clock::now() < until);
    // One wake per sleep: several publishes before the reader wakes cost one syscall.
    return h_->reader_sleeping.exchange(0, std::memory_order_relaxed) != 0;
  }

  // Declares that this writer is about to sleep for space; the caller re-checks free_space()
  // before sleeping (see the file comment).
  void declare_sleeping() {
    h_->writer_sleeping.store(1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
  void clear_sleeping() { h_->writer_sleeping.store(0, std::memory_order_relaxed); }

 private:
  std::uint64_t tail_ = 0;
  std::uint64_t published_ = 0;
  std::uint64_t last_head_ = 0;
};

// The consumer side. Used by the I/O thread only.
class RingReader : public RingBase {
 public:
  using RingBase::RingBase;

  // Bytes readable now. Throws RingCorrupt when the shared tail is impossible.
  std::uint64_t available() {
    check_magic();
    const std::uint64_t tail = h_->tail.load(std::memory_order_acquire);
    if (tail < last_tail_ || tail < head_ || tail - head_ > capacity_) {
      throw RingCorrupt("the shared ring header is corrupted (tail " + std::to_string(tail) +
                        " while this reader's head is " + std::to_string(head_) +
                        ", the last tail seen " + std::to_string(last_tail_) + ", capacity " +
                        std::to_string(capacity_) + ")");
    }
    last_tail_ = tail;
    return tail - head_;
  }

  // The readable bytes starting at the head, up to `max`, contiguous in the ring (a wrap splits
  // them: call again after consume()).
  std::pair<const char*, std::size_t> span(std::uint64_t max) const {
    const std::size_t at = static_cast<std::size_t>(head_ & mask_);
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(max, capacity_ - at));
    return {data_ + at, n};
  }

  void consume(std::size_t n) { head_ += n; }

  // Publishes the consumed position; true when the writer was waiting for space (signal it).
  bool release() {
    if (head_ == released_) return false;
    released_ = head_;
    h_->head.store(head_, std::memory_order_release);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (h_->writer_sleeping.load(std::memory_order_relaxed) == 0) return false;
    return h_->writer_sleeping.exchange(0, std::memory_order_relaxed) != 0;
  }

  // Before sleeping: declare it, then the caller re-checks available() (see the file comment).
  void declare_sleeping() { h_->reader_sleeping.store(1, std::memory_order_relaxed); }
  void clear_sleeping() { h_->reader_sleeping.store(0, std::memory_order_relaxed); }

 private:
  std::uint64_t head_ = 0;
  std::uint64_t released_ = 0;
  std::uint64_t last_tail_ = 0;
};

}  // namespace distrpc::transport::shm::detail
