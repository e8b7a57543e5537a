// libFuzzer target: the IValue codec (wire/ivalue_codec.hpp), on a stream of frames as
// fuzz_tensor. Only wire::DecodeError may come out of decoding; every decoded IValue is walked
// (tensors read at their first and last byte, strings and lists read).
#include "bodies.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace distrpc;
  try {
    fuzz::for_each_frame(data, size, [](const wire::Message& m) {
      if (m.id % fuzz::kIValueBodies == 0) {
        fuzz::decode_body<fuzz::IValueBody0>(m,
                                             [](auto& b) { fuzz::touch_ivalue(std::get<0>(b)); });
      } else {
        fuzz::decode_body<fuzz::IValueBody1>(m, [](auto& b) {
          for (const c10::IValue& v : std::get<0>(b)) fuzz::touch_ivalue(v);
        });
      }
    });
  } catch (const wire::ProtocolError&) {
  }
  return 0;
}
