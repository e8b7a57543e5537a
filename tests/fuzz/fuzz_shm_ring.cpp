// libFuzzer target: the shared-memory ring's checks of its header (transports/shm ring.hpp), the
// memory the peer can write anything to. The first sizeof(RingHeader) bytes of the input are a
// ring header as received (check_new_ring); the rest is a script of steps on a valid ring of
// 64 KiB, in which the peer overwrites the header's fields between this side's reads and writes:
// each step is one opcode byte and an 8-byte little-endian value. Only wire::ProtocolError
// (RingCorrupt) may come out, and whatever the header says, the reader's spans and the writer's
// copies stay inside the ring's data bytes.
#include <distrpc/transport/shm/ring.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

namespace {

using namespace distrpc;
using namespace distrpc::transport::shm::detail;

constexpr std::uint64_t kCapacity = kMinRingCapacity;

struct Memory {
  Memory() {
    base = static_cast<char*>(std::aligned_alloc(4096, kRingHeaderBytes + kCapacity));
    if (base == nullptr) throw std::bad_alloc();
  }
  ~Memory() { std::free(base); }
  char* base;
  char* data() const { return base + kRingHeaderBytes; }
};

std::uint64_t le64(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return v;
}

void check_span(const Memory& mem, const char* p, std::size_t n) {
  if (p < mem.data() || p + n > mem.data() + kCapacity) __builtin_trap();
  for (std::size_t i = 0; i < n; i += 4096) (void)*static_cast<const volatile char*>(p + i);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static Memory mem;
  std::memset(mem.base, 0, kRingHeaderBytes);
  const std::size_t header = std::min(size, sizeof(RingHeader));
  std::memcpy(mem.base, data, header);
  try {
    check_new_ring(mem.base, kCapacity);
  } catch (const wire::ProtocolError&) {
  }

  init_ring(mem.base, kCapacity);
  RingHeader& h = *reinterpret_cast<RingHeader*>(mem.base);
  RingReader reader(mem.base, kCapacity);
  RingWriter writer(mem.base, kCapacity);
  static char source[kCapacity];
  for (std::size_t at = header; at + 9 <= size; at += 9) {
    const std::uint8_t op = data[at];
    const std::uint64_t value = le64(data + at + 1);
    try {
      switch (op % 8) {
        case 0:  // the peer (the writer) claims a tail
          h.tail.store(value, std::memory_order_relaxed);
          break;
        case 1:  // the peer (the reader) claims a head
          h.head.store(value, std::memory_order_relaxed);
          break;
        case 2:  // a stray write over the magic or the capacity
          if (value & 1) {
            h.magic = value;
          } else {
            h.capacity = value >> 1;
          }
          break;
        case 3: {  // this side reads what is available, in spans, up to `value` bytes
          const std::uint64_t n = reader.available();
          if (n > kCapacity) __builtin_trap();
          std::uint64_t left = std::min(n, value);
          while (left > 0) {
            const auto [p, len] = reader.span(left);
            if (len == 0) __builtin_trap();
            check_span(mem, p, len);
            reader.consume(len);
            left -= len;
          }
          (void)reader.release();
          break;
        }
        case 4: {  // this side writes up to `value` bytes of what is free
          const std::uint64_t free = writer.free_space();
          if (free > kCapacity) __builtin_trap();
          const std::size_t n = static_cast<std::size_t>(std::min(free, value));
          writer.copy_in(source, n);
          (void)writer.publish();
          break;
        }
        case 5:
          reader.declare_sleeping();
          h.reader_sleeping.store(static_cast<std::uint32_t>(value), std::memory_order_relaxed);
          (void)writer.publish();
          break;
        case 6:
          writer.declare_sleeping();
          h.writer_sleeping.store(static_cast<std::uint32_t>(value), std::memory_order_relaxed);
          (void)reader.release();
          break;
        default:  // the header as it was set up
          init_ring(mem.base, kCapacity);
          break;
      }
    } catch (const wire::ProtocolError&) {
    }
  }
  return 0;
}
