// libFuzzer target: the tensor codec (wire/tensor_codec.hpp). The input is a stream of frames
// (header, payload, buffers: what the Tcp transport reads); each message is decoded as one of
// the tensor bodies of bodies.hpp (by its id). Only wire::DecodeError may come out of decoding
// (wire::ProtocolError out of the framing); every decoded tensor is read at its first and last
// byte, and a lone dense tensor must survive being sent again unchanged.
#include "bodies.hpp"

#include <cstring>

namespace {

using namespace distrpc;

// A decoded dense tensor, sent again, must arrive the same: dtype, sizes, strides, conjugate and
// negative bits, requires_grad, and the same bytes (compared raw, so NaNs compare too).
void check_round_trip(const at::Tensor& t) {
  if (!t.defined() || t.is_sparse()) return;
  const auto item = static_cast<std::int64_t>(t.element_size());
  if (t.numel() > (1 << 16) / item) return;
  wire::Message sent;
  wire::encode(sent, t);
  wire::Message received;
  received.payload = sent.payload;
  for (const at::Tensor& b : sent.buffers) received.buffers.push_back(b.clone());
  at::Tensor u;
  wire::decode(received, u);  // a DecodeError here is a finding: it decoded once already
  if (u.scalar_type() != t.scalar_type() || u.sizes() != t.sizes() || u.strides() != t.strides() ||
      u.is_conj() != t.is_conj() || u.is_neg() != t.is_neg() ||
      u.requires_grad() != t.requires_grad()) {
    __builtin_trap();
  }
  const at::Tensor a = t.contiguous();
  const at::Tensor b = u.contiguous();
  if (a.numel() > 0 &&
      std::memcmp(a.data_ptr(), b.data_ptr(), static_cast<std::size_t>(a.numel() * item)) != 0) {
    __builtin_trap();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace distrpc;
  try {
    fuzz::for_each_frame(data, size, [](const wire::Message& m) {
      switch (m.id % fuzz::kTensorBodies) {
        case 0:
          fuzz::decode_body<fuzz::TensorBody0>(m, [](auto& b) {
            fuzz::touch_tensor(std::get<0>(b));
            check_round_trip(std::get<0>(b));
          });
          break;
        case 1:
          fuzz::decode_body<fuzz::TensorBody1>(m, [](auto& b) {
            for (const at::Tensor& t : std::get<0>(b)) fuzz::touch_tensor(t);
          });
          break;
        default:
          fuzz::decode_body<fuzz::TensorBody2>(m, [](auto& b) {
            fuzz::touch_tensor(std::get<0>(b));
            if (std::get<1>(b)) fuzz::touch_tensor(*std::get<1>(b));
            fuzz::touch_tensor(std::get<2>(b));
          });
          break;
      }
    });
  } catch (const wire::ProtocolError&) {
  }
  return 0;
}
