#pragma once
// Storage for the large buffers of received messages: anonymous mappings populated in bulk (with
// transparent huge pages where they fit) and a bounded cache of freed ones for the next message.
//
// Why not libtorch's CPU allocator: a fresh 64 MiB block from malloc is a fresh mmap, and its
// pages are faulted in one by one while recv() copies into them, or, prefaulted, are still zeroed
// by the kernel on every message: either costs about as much as moving the bytes over loopback.
// A block freed by the previous message is already resident, so a reply or the next request of
// the same size is read into it with no fault and no zeroing. Blocks of 1 MiB and more sent at a
// high rate also leave glibc's arenas fragmented (the resident size of a long-running worker
// creeps up); a mapping is returned whole to the kernel when it leaves the cache.
//
// The cache holds at most `DISTRPC_RECV_CACHE_MB` MiB (default 128; 0 disables it; a value that is
// not a whole number of MiB fails the transports' start); a freed
// block that would exceed it evicts the oldest ones. Freeing happens on whichever thread drops
// the last reference to the tensor, so the cache is guarded by a mutex held only for the scan.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/Storage.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <iterator>
#include <mutex>
#include <new>
#include <stdexcept>
#include <utility>

#include "distrpc/net/env_number.hpp"

namespace distrpc::wire {

// Buffers at least this large come from RecvStorage (smaller ones from libtorch's CPU allocator:
// malloc is cheaper there and the pages are few).
inline constexpr std::size_t kRecvPooledBytes = std::size_t{1} << 20;

class RecvStorage final : public c10::Allocator {
 public:
  // The process's one instance. Never destroyed: a tensor freed during static destruction still
  // returns its block here.
  static RecvStorage& instance() {
    static RecvStorage* const storage = new RecvStorage(limit_or_default());
    return *storage;
  }

  // The cache limit `DISTRPC_RECV_CACHE_MB` asks for, in bytes (default 128 MiB). Throws
  // std::invalid_argument naming the variable and its value when that is not a whole number of
  // MiB in range. The transports call it when they start, so a bad value fails there rather
  // than on a reading thread at the first large message.
  static std::size_t limit_from_env() {
    return static_cast<std::size_t>(net::whole_number_from_env(
               "DISTRPC_RECV_CACHE_MB", kDefaultCacheMiB, kMaxCacheMiB, "MiB"))
           << 20;
  }
  static constexpr unsigned long long kDefaultCacheMiB = 128;
  static constexpr unsigned long long kMaxCacheMiB = 1ull << 20;  // 1 TiB

 private:
  // The limit for instance(), made on first use, which may be on a reading thread: a bad value
  // (the transports refused it at their start; set since, or no transport started) gives the
  // default there instead of an exception.
  static std::size_t limit_or_default() {
    try {
      return limit_from_env();
    } catch (const std::invalid_argument&) {
      return static_cast<std::size_t>(kDefaultCacheMiB) << 20;
    }
  }

 public:
  explicit RecvStorage(std::size_t cache_limit_bytes) : limit_(cache_limit_bytes) {}
  RecvStorage(const RecvStorage&) = delete;
  RecvStorage& operator=(const RecvStorage&) = delete;

  // c10::Allocator's entry point: const in libtorch 1.13, not in 2.x, so both are declared and
  // neither says `override` (the one the base declares overrides it).
  c10::DataPtr allocate(std::size_t n) const {
    if (n < kRecvPooledBytes) return c10::GetCPUAllocator()->allocate(n);
    auto* self = const_cast<RecvStorage*>(this);
    Block* block = self->take(n);
    if (block == nullptr) block = map_block(n);
    return {block->data, block, &RecvStorage::release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DataPtr allocate(std::size_t n) { return std::as_const(*this).allocate(n); }

  // libtorch 2.x declares this pure (1.13 does not have it): a plain copy, as for CPU memory.
  void copy_data(void* dest, const void* src, std::size_t count) const {
    std::memcpy(dest, src, count);
  }

  // A 1-D kByte tensor of `n` bytes whose storage comes from here (and can be resized, as a
  // tensor from at::empty can).
  at::Tensor empty_bytes(std::size_t n) {
    c10::Storage storage(c10::Storage::use_byte_size_t(), n, this, /*resizable=*/true);
    at::Tensor t = at::empty({0}, at::kByte);
    t.set_(std::move(storage), 0, {static_cast<std::int64_t>(n)}, {1});
    return t;
  }

  // What the cache holds now (blocks and bytes), for tests and diagnostics.
  struct Stats {
    std::size_t cached_blocks = 0;
    std::size_t cached_bytes = 0;
    std::uint64_t mapped = 0;  // fresh mappings made so far
    std::uint64_t reused = 0;  // allocations served from the cache so far
  };
  Stats stats() const {
    std::lock_guard<std::mutex> lk(mu_);
    return {cache_.size(), cached_bytes_, mapped_, reused_};
  }

  // Unmaps every cached block (a worker that finished its large transfers can give the memory
  // back at once).
  void trim() {
    std::deque<Block*> gone;
    {
      std::lock_guard<std::mutex> lk(mu_);
      gone.swap(cache_);
      cached_bytes_ = 0;
    }
    for (Block* b : gone) unmap(b);
  }

 private:
  struct Block {
    RecvStorage* owner;
    void* data;
    std::size_t capacity;  // mapped bytes (a multiple of the page size)
  };

  static std::size_t page_size() {
    static const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    return page;
  }

  // Huge pages are 2 MiB on x86-64 and most arm64 kernels; a mapping of at least two of them is
  // aligned to one so that its interior can be backed by them.
  static constexpr std::size_t kHuge = std::size_t{2} << 20;

  // A cached block that fits `n` without wasting more than a quarter of it (beyond the rounding of
  // a fresh block); the most recently freed first (its pages are the likeliest to be in the CPU's
  // caches).
  Block* take(std::size_t n) {
    const std::size_t slack = n / 4 + (n >= 2 * kHuge ? kHuge : page_size());
    std::lock_guard<std::mutex> lk(mu_);
    for (auto it = cache_.rbegin(); it != cache_.rend(); ++it) {
      Block* b = *it;
      if (b->capacity >= n && b->capacity - n <= slack) {
        cache_.erase(std::next(it).base());
        cached_bytes_ -= b->capacity;
        ++reused_;
        return b;
      }
    }
    return nullptr;
  }

  Block* map_block(std::size_t n) const {
    const std::size_t page = page_size();
    const bool huge = n >= 2 * kHuge;
    const std::size_t capacity =
        huge ? (n + kHuge - 1) / kHuge * kHuge : (n + page - 1) / page * page;
    const std::size_t span = huge ? capacity + kHuge : capacity;
    void* raw = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) throw std::bad_alloc();
    auto* base = static_cast<char*>(raw);
    char* data = base;
    if (huge) {  // keep the 2 MiB-aligned part, give the head and tail back
      const auto addr = reinterpret_cast<std::uintptr_t>(base);
      data = base + ((kHuge - addr % kHuge) % kHuge);
      if (data > base) ::munmap(base, static_cast<std::size_t>(data - base));
      const std::size_t tail = span - static_cast<std::size_t>(data - base) - capacity;
      if (tail > 0) ::munmap(data + capacity, tail);
      ::madvise(data, capacity, MADV_HUGEPAGE);
    }
    // Populate in one call (MADV_POPULATE_WRITE, Linux 5.14) rather than a fault per page while
    // recv() writes; advice only: an older kernel refuses it and the pages fault in as usual.
    constexpr int kMadvPopulateWrite = 23;
    ::madvise(data, capacity, kMadvPopulateWrite);
    Block* b = new (std::nothrow) Block{const_cast<RecvStorage*>(this), data, capacity};
    if (b == nullptr) {
      ::munmap(data, capacity);
      throw std::bad_alloc();
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      ++mapped_;
    }
    return b;
  }

  static void unmap(Block* b) {
    ::munmap(b->data, b->capacity);
    delete b;
  }

  // The DataPtr's deleter: back into the cache, the oldest blocks out when it is over its limit.
  static void release(void* ctx) {
    auto* b = static_cast<Block*>(ctx);
    RecvStorage& self = *b->owner;
    std::deque<Block*> gone;
    {
      std::lock_guard<std::mutex> lk(self.mu_);
      if (b->capacity > self.limit_) {
        gone.push_back(b);
      } else {
        self.cache_.push_back(b);
        self.cached_bytes_ += b->capacity;
        while (self.cached_bytes_ > self.limit_) {
          gone.push_back(self.cache_.front());
          self.cached_bytes_ -= self.cache_.front()->capacity;
          self.cache_.pop_front();
        }
      }
    }
    for (Block* g : gone) unmap(g);  // outside the lock: munmap can take a while
  }

  const std::size_t limit_;
  mutable std::mutex mu_;
  std::deque<Block*> cache_;  // oldest first
  std::size_t cached_bytes_ = 0;
  mutable std::uint64_t mapped_ = 0;
  std::uint64_t reused_ = 0;
};

}  // namespace distrpc::wire
