// libFuzzer target: the frame header decoder (wire/frame.hpp) on a stream of arbitrary bytes, fed
// in pieces of varying size as a socket delivers them, and decode_frame_header on the whole input.
// Only wire::ProtocolError may come out; an accepted header must respect the limits and be safe
// to allocate a message from.
#include "common.hpp"

#include <algorithm>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace distrpc;
  if (size == 0) return 0;
  // The first byte sets the size of the pieces the stream arrives in (1 to 64 bytes).
  const std::size_t piece = 1 + data[0] % 64;
  const auto* in = reinterpret_cast<const char*>(data + 1);
  const std::size_t n = size - 1;
  const wire::Limits limits = fuzz::fuzz_limits();
  try {
    wire::FrameDecoder decoder(limits);
    std::size_t at = 0;
    while (at < n) {
      const std::size_t want = std::min({piece, n - at, decoder.bytes_needed()});
      const std::size_t used = decoder.feed(in + at, want);
      if (used != want) __builtin_trap();  // feed takes what it was offered, up to bytes_needed
      at += used;
      if (!decoder.done()) continue;
      const wire::FrameHeader& h = decoder.header();
      if (h.payload_bytes > limits.max_payload_bytes ||
          h.buffer_bytes.size() > limits.max_buffers || h.body_bytes() > limits.max_message_bytes)
        __builtin_trap();
      const wire::Message m = wire::allocate_message(h);
      if (m.payload.size() != h.payload_bytes || m.buffers.size() != h.buffer_bytes.size())
        __builtin_trap();
      // Skip the body, then the next frame.
      at += static_cast<std::size_t>(std::min<std::uint64_t>(h.body_bytes(), n - at));
      decoder.reset();
    }
  } catch (const wire::ProtocolError&) {
  }
  try {
    (void)wire::decode_frame_header(std::string_view(in, n), limits);
  } catch (const wire::ProtocolError&) {
  }
  return 0;
}
