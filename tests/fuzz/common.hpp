// Shared by the libFuzzer targets that decode messages: how a fuzz input becomes messages (the
// Tcp transport's receive path: frame headers, then the bodies they announce), and checks on what
// a decoder returned.
#pragma once

#include <distrpc/wire/frame.hpp>

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace distrpc::fuzz {

// Small limits, so that a header the decoder accepts is cheap to allocate from.
inline wire::Limits fuzz_limits() {
  wire::Limits l;
  l.max_payload_bytes = 1 << 20;
  l.max_buffers = 64;
  l.max_message_bytes = 1 << 20;
  return l;
}

// Reads the frames of `data` as the Tcp transport does (FrameDecoder, allocate_message, body bytes
// straight into the payload and the buffers) and calls `on_message` for each complete one. A
// frame cut short by the end of the input ends the stream. Throws what the frame decoder throws
// (wire::ProtocolError).
template <class F>
void for_each_frame(const std::uint8_t* data, std::size_t size, F&& on_message) {
  const auto* in = reinterpret_cast<const char*>(data);
  wire::FrameDecoder decoder(fuzz_limits());
  std::size_t at = 0;
  while (at < size) {
    at += decoder.feed(in + at, size - at);
    if (!decoder.done()) return;
    const wire::FrameHeader& h = decoder.header();
    if (h.body_bytes() > decoder.limits().max_message_bytes) __builtin_trap();  // the promise
    wire::Message m = wire::allocate_message(h);
    if (m.buffers.size() != h.buffer_bytes.size()) __builtin_trap();
    if (h.body_bytes() > size - at) return;
    std::memcpy(m.payload.data(), in + at, m.payload.size());
    at += m.payload.size();
    for (at::Tensor& b : m.buffers) {
      const auto n = static_cast<std::size_t>(b.numel());
      if (n != 0) std::memcpy(b.data_ptr(), in + at, n);
      at += n;
    }
    decoder.reset();
    on_message(m);
  }
}

// Reads the first and the last byte a decoded tensor can reach through its sizes and strides,
// and copies it when small: a tensor built over a received buffer that reaches outside it is
// caught here by AddressSanitizer. (A zero stride can make a small buffer look large,
// legitimately: such tensors are only copied when small.)
inline void touch_tensor(const at::Tensor& t) {
  if (!t.defined()) return;
  if (t.is_sparse()) {
    touch_tensor(t._indices());
    touch_tensor(t._values());
    return;
  }
  if (t.numel() == 0) return;
  std::int64_t last = 0;  // elements past data_ptr(); libtorch strides are never negative
  for (std::int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const auto* first = static_cast<const volatile unsigned char*>(t.data_ptr());
  const auto item = static_cast<std::int64_t>(t.element_size());
  (void)first[0];
  (void)first[last * item + item - 1];
  if (t.numel() > (1 << 16) / item) return;
  try {
    (void)t.resolve_conj().resolve_neg().clone();
  } catch (const c10::Error&) {
    // libtorch refusing an operation for a dtype (the conjugate of a ComplexHalf tensor: "not
    // implemented for 'ComplexHalf'") is an error it reports, not a fault: such a tensor is one a
    // sender can hold, and its receiver gets the same error from the same operation.
  }
}

}  // namespace distrpc::fuzz
