// libFuzzer target: message payloads (wire/archive.hpp: cereal's containers, strings, variants,
// optionals, user types with serialize(), scalars, tensors and IValues in one payload), on a
// stream of frames as fuzz_tensor. Only wire::DecodeError may come out of decoding.
#include "bodies.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace distrpc;
  try {
    fuzz::for_each_frame(data, size, [](const wire::Message& m) {
      if (m.id % fuzz::kMessageBodies == 0) {
        fuzz::decode_body<fuzz::MessageBody0>(m, [](auto& b) {
          fuzz::touch_tensor(std::get<1>(b));
          for (const at::Tensor& t : std::get<2>(b)) fuzz::touch_tensor(t);
          fuzz::touch_ivalue(std::get<4>(b));
          if (std::get<5>(b)) fuzz::touch_tensor(*std::get<5>(b));
          const fuzz::Outer& o = std::get<9>(b);
          fuzz::touch_tensor(o.weight);
          for (const at::Tensor& t : o.inner.parts) fuzz::touch_tensor(t);
          if (o.bias) fuzz::touch_tensor(*o.bias);
        });
      } else {
        fuzz::decode_body<fuzz::MessageBody1>(m, [](auto&) {});
      }
    });
  } catch (const wire::ProtocolError&) {
  }
  return 0;
}
