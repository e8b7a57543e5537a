// libFuzzer target: what a shared-memory connection reads from its peer besides the ring header:
// the records in the ring (RecordParser in transports/shm detail/record.hpp: record header,
// frame header, placement table, payload, inline buffers) and the tensor segments they name
// (adopt_segment in segment.hpp: the memfd's size and the header the peer wrote in it).
//
// Input: u64 segment magic | u64 segment capacity field | u64 memfd data bytes | ring bytes.
// Each segment a record names is a fresh memfd of that size whose header holds that magic and
// capacity, adopted as the reader adopts an announced one. The ring bytes go through a 64 KiB ring
// in pieces (as a writer streams a record larger than the ring) and are parsed into messages,
// whose payload and buffers are read in full. Only the documented errors may come out of the
// parser: wire::ProtocolError (a DistNetworkError) for a malformed record or segment, and
// DistNetworkError when a record's buffers cannot be allocated.
#include "common.hpp"

#include <distrpc/transport/shm/detail/record.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <new>

namespace {

using namespace distrpc;
using namespace distrpc::transport::shm::detail;

constexpr std::uint64_t kCapacity = kMinRingCapacity;

std::uint64_t le64(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return v;
}

// Read by touch(), so the reads are not optimized away.
volatile unsigned sink = 0;

void touch(const wire::Message& m) {
  unsigned sum = 0;
  for (char c : m.payload) sum += static_cast<unsigned char>(c);
  for (const at::Tensor& b : m.buffers) {
    if (!b.defined() || b.scalar_type() != at::kByte || b.dim() != 1) __builtin_trap();
    const auto* p = static_cast<const volatile unsigned char*>(b.data_ptr());
    for (std::int64_t i = 0; i < b.numel(); i += 1024) sum += p[i];
    if (b.numel() > 0) sum += p[b.numel() - 1];
  }
  sink = sink + sum;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 24) return 0;
  const std::uint64_t seg_magic = le64(data);
  const std::uint64_t seg_capacity = le64(data + 8);
  const std::uint64_t seg_bytes = 1 + le64(data + 16) % (256 * 1024);
  data += 24;
  size -= 24;

  static char* base = [] {
    char* p = static_cast<char*>(std::aligned_alloc(4096, kRingHeaderBytes + kCapacity));
    if (p == nullptr) throw std::bad_alloc();
    return p;
  }();
  init_ring(base, kCapacity);
  RingWriter writer(base, kCapacity);
  RingReader reader(base, kCapacity);

  RecordParser parser(fuzz::fuzz_limits(), [&](std::uint32_t id) {
    const Fd fd =
        make_memfd("fuzz segment", static_cast<std::size_t>(kSegmentHeaderBytes + seg_bytes));
    const std::uint64_t header[2] = {seg_magic, seg_capacity};
    if (::pwrite(fd.get(), header, sizeof header, 0) != static_cast<ssize_t>(sizeof header)) {
      __builtin_trap();
    }
    return adopt_segment(fd.get(), id, seg_capacity, std::uint64_t{1} << 20);
  });
  try {
    std::size_t at = 0;
    while (at < size) {
      // Pieces of up to 4 KiB: records cross the ring's end and arrive in parts.
      const std::size_t n =
          std::min<std::size_t>({static_cast<std::size_t>(writer.free_space()), size - at, 4096});
      writer.copy_in(data + at, n);
      writer.publish();
      at += n;
      std::uint64_t avail = reader.available();
      while (avail > 0) {
        std::optional<wire::Message> m = parser.parse(reader, avail);
        if (!m) break;
        touch(*m);
      }
      reader.release();
    }
  } catch (const DistNetworkError&) {
  }
  return 0;
}
