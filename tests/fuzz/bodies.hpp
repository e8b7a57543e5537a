// The payload types the decoding targets read, shared with the seed generator (make_seeds.cpp) so
// that the seeds are real messages of exactly these types. A message's id picks the type, so one
// corpus reaches every decoder of a target.
#pragma once

#include "common.hpp"

#include <distrpc/wire/archive.hpp>
#include <distrpc/wire/ivalue_codec.hpp>
#include <distrpc/wire/scalar_codec.hpp>
#include <distrpc/wire/tensor_codec.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

namespace distrpc::fuzz {

// A user type with a serialize() of its own, nested: the archive is re-entrant.
struct Inner {
  std::string name;
  std::vector<at::Tensor> parts;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(name, parts);
  }
};

struct Outer {
  std::int64_t step = 0;
  at::Tensor weight;
  Inner inner;
  std::optional<at::Tensor> bias;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(step, weight, inner, bias);
  }
};

// fuzz_tensor: by id % 3.
using TensorBody0 = std::tuple<at::Tensor>;
using TensorBody1 = std::tuple<std::vector<at::Tensor>>;
using TensorBody2 = std::tuple<at::Tensor, std::optional<at::Tensor>, at::Tensor>;
inline constexpr std::uint64_t kTensorBodies = 3;

// fuzz_ivalue: by id % 2.
using IValueBody0 = std::tuple<c10::IValue>;
using IValueBody1 = std::tuple<std::vector<c10::IValue>>;
inline constexpr std::uint64_t kIValueBodies = 2;

// fuzz_message: by id % 2. The first is a bit of everything (as an RPC's arguments), the second
// the plain values cereal itself decodes.
using MessageBody0 = std::tuple<std::string, at::Tensor, std::vector<at::Tensor>,
                                std::map<std::string, std::vector<std::int64_t>>, c10::IValue,
                                std::optional<at::Tensor>, std::variant<int, std::string>,
                                c10::Scalar, std::vector<std::string>, Outer>;
using MessageBody1 = std::tuple<std::int64_t, double, bool, std::string, std::vector<std::uint8_t>,
                                std::set<int>, std::pair<std::string, std::vector<double>>,
                                std::vector<bool>, std::optional<std::map<int, std::string>>>;
inline constexpr std::uint64_t kMessageBodies = 2;

// A decoded value, encoded again, decoded and encoded once more, must give the same payload and
// buffer bytes: what the decoder accepts the encoder takes, and nothing is lost or changed on the
// second trip (a set arriving unsorted is sorted on the first).
template <class Body>
void check_reencode(const Body& body) {
  const auto encode_body = [](const Body& b) {
    wire::Message m;
    std::apply([&](const auto&... v) { wire::encode(m, v...); }, b);
    return m;
  };
  const auto same_bytes = [](const at::Tensor& x, const at::Tensor& y) {
    return x.numel() == y.numel() &&
           (x.numel() == 0 ||
            std::memcmp(x.data_ptr(), y.data_ptr(), static_cast<std::size_t>(x.numel())) == 0);
  };
  const wire::Message first = encode_body(body);
  wire::Message received;
  received.payload = first.payload;
  for (const at::Tensor& b : first.buffers) received.buffers.push_back(b.clone());
  Body again;
  std::apply([&](auto&... v) { wire::decode(received, v...); }, again);
  const wire::Message second = encode_body(again);
  if (second.payload != first.payload || second.buffers.size() != first.buffers.size()) {
    __builtin_trap();
  }
  for (std::size_t i = 0; i < first.buffers.size(); ++i) {
    if (!same_bytes(first.buffers[i], second.buffers[i])) __builtin_trap();
  }
}

// Decodes `m` as `Body`; true when it decoded. Only wire::DecodeError may come out of decode().
template <class Body, class Check>
bool decode_body(const wire::Message& m, Check&& check) {
  Body body;
  try {
    std::apply([&](auto&... v) { wire::decode(m, v...); }, body);
  } catch (const wire::DecodeError&) {
    return false;
  }
  check(body);
  check_reencode(body);
  return true;
}

// Walks a decoded IValue: every tensor is touched, every string and list read.
inline void touch_ivalue(const c10::IValue& v, int depth = 0) {
  if (depth > 200) __builtin_trap();  // the decoder bounds nesting at 64
  if (v.isTensor()) {
    touch_tensor(v.toTensor());
  } else if (v.isString()) {
    (void)v.toStringRef().size();
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) touch_ivalue(e, depth + 1);
  } else if (v.isTuple()) {
    for (const c10::IValue& e : v.toTupleRef().elements()) touch_ivalue(e, depth + 1);
  } else if (v.isIntList()) {
    (void)v.toIntVector();
  }
}

}  // namespace distrpc::fuzz
