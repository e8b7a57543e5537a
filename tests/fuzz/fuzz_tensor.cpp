// libFuzzer target: the tensor codec (wire/tensor_codec.hpp). The input is a stream of frames
// (header, payload, buffers: what the Tcp transport reads); each message is decoded as one of
// the tensor bodies of bodies.hpp (by its id). Only wire::DecodeError may come out of decoding
// (wire::ProtocolError out of the framing); every decoded tensor is read at its first and last
// byte.
#include "bodies.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace distrpc;
  try {
    fuzz::for_each_frame(data, size, [](const wire::Message& m) {
      switch (m.id % fuzz::kTensorBodies) {
        case 0:
          fuzz::decode_body<fuzz::TensorBody0>(m,
                                               [](auto& b) { fuzz::touch_tensor(std::get<0>(b)); });
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
