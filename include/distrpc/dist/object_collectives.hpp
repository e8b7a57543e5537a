// all_gather_object and broadcast_object_list: values exchanged through a group's backend as
// bytes, encoded with distrpc::wire (any cereal-serializable type; tensors inside travel too).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <cereal/details/traits.hpp>

#include <distrpc/dist/backend.hpp>
#include <distrpc/dist/detail/world.hpp>
#include <distrpc/dist/process_group.hpp>
#include <distrpc/wire/archive.hpp>
#include <distrpc/wire/errors.hpp>

namespace distrpc::dist {

// all_gather_object, broadcast_object_list (always blocking).
struct ObjectCollectiveOptions {
  std::shared_ptr<ProcessGroup> group{};
  std::chrono::milliseconds timeout = kUnsetTimeout;
};

// ---- Objects: any value distrpc::wire encodes (cereal-serializable; tensors inside travel
// too), exchanged as bytes through the group's backend on its default device.

namespace detail {

// A Message flattened to one byte string: [u64 payload size][payload][u64 buffer count]
// ([u64 size][bytes])*, so an encoded value can travel in a byte tensor.
inline std::string flatten(const wire::Message& m) {
  std::string out;
  auto put = [&](std::uint64_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); };
  put(m.payload.size());
  out += m.payload;
  put(m.buffers.size());
  for (const at::Tensor& b : m.buffers) {
    const at::Tensor c = b.contiguous();
    put(static_cast<std::uint64_t>(c.numel()));
    out.append(static_cast<const char*>(c.data_ptr()), static_cast<std::size_t>(c.numel()));
  }
  return out;
}

inline wire::Message unflatten(const std::uint8_t* data, std::size_t size) {
  std::size_t at = 0;
  auto need = [&](std::uint64_t n) {
    if (n > size - at) {
      throw wire::DecodeError("object collective: truncated object bytes (" + std::to_string(size) +
                              " bytes, " + std::to_string(n) + " more needed at offset " +
                              std::to_string(at) + ")");
    }
  };
  auto get = [&]() {
    need(sizeof(std::uint64_t));
    std::uint64_t v = 0;
    std::memcpy(&v, data + at, sizeof v);
    at += sizeof v;
    return v;
  };
  wire::Message m;
  const std::uint64_t payload = get();
  need(payload);
  m.payload.assign(reinterpret_cast<const char*>(data + at), static_cast<std::size_t>(payload));
  at += static_cast<std::size_t>(payload);
  const std::uint64_t count = get();
  if (count > size) {
    throw wire::DecodeError("object collective: " + std::to_string(count) +
                            " buffers announced in " + std::to_string(size) + " bytes");
  }
  for (std::uint64_t i = 0; i < count; ++i) {
    const std::uint64_t n = get();
    need(n);
    at::Tensor b = at::empty({static_cast<std::int64_t>(n)}, at::kByte);
    std::memcpy(b.data_ptr(), data + at, static_cast<std::size_t>(n));
    at += static_cast<std::size_t>(n);
    m.buffers.push_back(std::move(b));
  }
  if (at != size) {
    throw wire::DecodeError("object collective: " + std::to_string(size - at) +
                            " trailing bytes after the object");
  }
  return m;
}

template <class T>
std::string encode_object(const T& value) {
  static_assert(cereal::traits::is_output_serializable<T, wire::OutputArchive>::value &&
                    cereal::traits::is_input_serializable<T, wire::InputArchive>::value,
                "all_gather_object / broadcast_object_list: T must be serializable with cereal: "
                "give it `template <class Archive> void serialize(Archive& ar) { ar(field1, "
                "field2); }` (tensors, strings, containers and arithmetic types already are)");
  wire::Message m;
  wire::encode(m, value);
  return flatten(m);
}

template <class T>
void decode_object(const at::Tensor& bytes, std::int64_t size, T& out) {
  const at::Tensor c = bytes.to(at::kCPU).contiguous();
  wire::decode(unflatten(c.data_ptr<std::uint8_t>(), static_cast<std::size_t>(size)), out);
}

inline at::TensorOptions object_tensor_options(const ProcessGroup& g, at::ScalarType t) {
  return at::TensorOptions().dtype(t).device(c10::Device(g.default_device()));
}

}  // namespace detail

// out receives one value per member (out[r] is member r's obj); blocking.
template <class T>
void all_gather_object(std::vector<T>& out, const T& obj,
                       const ObjectCollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "all_gather_object");
  if (!g) return;
  const std::string bytes = detail::encode_object(obj);
  const int n = g->size();
  // First the sizes, then every member's bytes padded to the largest.
  at::Tensor my_size = at::full({1}, static_cast<std::int64_t>(bytes.size()),
                                detail::object_tensor_options(*g, at::kLong));
  std::vector<std::vector<at::Tensor>> sizes(1);
  for (int r = 0; r < n; ++r) sizes[0].push_back(at::zeros_like(my_size));
  std::vector<at::Tensor> in{my_size};
  detail::finish(g->allgather(sizes, in, {opts.timeout}), false, "all_gather_object");
  std::vector<std::int64_t> lengths;
  std::int64_t longest = 0;
  for (const at::Tensor& s : sizes[0]) {
    lengths.push_back(s.to(at::kCPU).item<std::int64_t>());
    longest = std::max(longest, lengths.back());
  }
  at::Tensor mine = at::zeros({longest}, at::kByte);
  std::memcpy(mine.data_ptr(), bytes.data(), bytes.size());
  mine = mine.to(detail::object_tensor_options(*g, at::kByte).device());
  std::vector<std::vector<at::Tensor>> all(1);
  for (int r = 0; r < n; ++r) all[0].push_back(at::zeros_like(mine));
  std::vector<at::Tensor> in2{mine};
  detail::finish(g->allgather(all, in2, {opts.timeout}), false, "all_gather_object");
  std::vector<T> result(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    detail::decode_object(all[0][static_cast<std::size_t>(r)], lengths[static_cast<std::size_t>(r)],
                          result[static_cast<std::size_t>(r)]);
  }
  out = std::move(result);
}

// objects on src (a global rank) replace objects on every other member; blocking.
template <class T>
void broadcast_object_list(std::vector<T>& objects, int src,
                           const ObjectCollectiveOptions& opts = {}) {
  auto g = detail::group_for(opts.group, "broadcast_object_list");
  if (!g) return;
  BroadcastOptions o;
  o.root_rank = detail::group_rank_of(*g, src, "broadcast_object_list", "src:");
  o.timeout = opts.timeout;
  const bool root = g->rank() == o.root_rank;
  const std::string bytes = root ? detail::encode_object(objects) : std::string();
  std::vector<at::Tensor> size{at::full({1}, static_cast<std::int64_t>(bytes.size()),
                                        detail::object_tensor_options(*g, at::kLong))};
  detail::finish(g->broadcast(size, o), false, "broadcast_object_list");
  const std::int64_t n = size[0].to(at::kCPU).item<std::int64_t>();
  at::Tensor data = at::zeros({n}, at::kByte);
  if (root) std::memcpy(data.data_ptr(), bytes.data(), bytes.size());
  std::vector<at::Tensor> ts{data.to(detail::object_tensor_options(*g, at::kByte).device())};
  detail::finish(g->broadcast(ts, o), false, "broadcast_object_list");
  if (!root) {
    std::vector<T> received;
    detail::decode_object(ts[0], n, received);
    objects = std::move(received);
  }
}

}  // namespace distrpc::dist
