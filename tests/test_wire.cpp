// The wire layer: tensor fidelity (dtypes, views, spans, identity, sparse), containers and IValues,
// frames and their limits, the handshake, and hostile input (hand-made cases and a fuzz loop).
#include <distrpc/wire.hpp>

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <variant>
#include <vector>

#include "support/fake_cuda.hpp"

namespace wire = distrpc::wire;

namespace {

#define CHECK_ERROR(Type, expr, fragment) \
  CHECK_THROWS_WITH_AS(expr, doctest::Contains(fragment), Type)

// What a stream transport does: frame the message, parse the header, allocate fresh buffers and
// copy the bytes in. The receiver never shares memory with the sender.
wire::Message transmit(const wire::Message& sent) {
  wire::check_limits(sent);
  const std::string header = wire::encode_frame_header(sent);
  wire::FrameDecoder decoder;
  REQUIRE(decoder.feed(header.data(), header.size()) == header.size());
  REQUIRE(decoder.done());
  wire::Message received = wire::allocate_message(decoder.header());
  REQUIRE(received.payload.size() == sent.payload.size());
  std::memcpy(received.payload.data(), sent.payload.data(), sent.payload.size());
  REQUIRE(received.buffers.size() == sent.buffers.size());
  for (std::size_t i = 0; i < sent.buffers.size(); ++i) {
    REQUIRE(received.buffers[i].numel() == sent.buffers[i].numel());
    if (sent.buffers[i].numel() > 0) {
      std::memcpy(received.buffers[i].data_ptr(), sent.buffers[i].data_ptr(),
                  static_cast<std::size_t>(sent.buffers[i].numel()));
    }
  }
  return received;
}

template <class... Ts>
std::tuple<Ts...> round_trip(const Ts&... values) {
  wire::Message m;
  wire::encode(m, values...);
  return wire::decode_as<Ts...>(transmit(m));
}

template <class T>
T round_trip_one(const T& value) {
  return std::get<0>(round_trip(value));
}

// Same dtype, shape, strides, flags and bytes (the bytes of what each tensor views).
void check_same_tensor(const at::Tensor& got, const at::Tensor& want) {
  REQUIRE(got.defined());
  CHECK((got.scalar_type() == want.scalar_type()));
  CHECK(got.sizes() == want.sizes());
  CHECK(got.strides() == want.strides());
  CHECK(got.is_contiguous() == want.is_contiguous());
  CHECK(got.requires_grad() == want.requires_grad());
  CHECK(got.is_conj() == want.is_conj());
  CHECK(got.device() == want.device());
  if (want.scalar_type() == at::kComplexHalf) {
    // Few kernels take ComplexHalf: compare its bytes through a same-size real view.
    CHECK(torch::equal(at::view_as_real(got.resolve_conj()).to(at::kFloat),
                       at::view_as_real(want.resolve_conj()).to(at::kFloat)));
  } else {
    CHECK(torch::equal(got.detach().resolve_conj(), want.detach().resolve_conj()));
  }
}

at::Tensor sample(at::ScalarType dtype) {
  at::Tensor base = at::arange(1, 25, at::kDouble).view({2, 3, 4});
  if (dtype == at::kBool) return base.remainder(3).eq(0);
  if (at::isComplexType(dtype)) {
    at::Tensor z = at::complex(base.to(at::kFloat), -base.to(at::kFloat));
    return dtype == at::kComplexHalf ? z.to(at::kComplexHalf) : z.to(dtype);
  }
  return base.to(dtype);
}

std::string hex_le(std::uint64_t v, int bytes) {
  std::string s(static_cast<std::size_t>(bytes), '\0');
  for (int i = 0; i < bytes; ++i) s[static_cast<std::size_t>(i)] = static_cast<char>(v >> (8 * i));
  return s;
}

void patch(std::string& s, std::size_t at, std::uint64_t v, int bytes) {
  s.replace(at, static_cast<std::size_t>(bytes), hex_le(v, bytes));
}

struct Inner {
  std::string name;
  std::vector<at::Tensor> parts;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(name, parts);
  }
};

struct Outer {
  int64_t step = 0;
  at::Tensor weight;
  Inner inner;  // nested user type: the serializer is re-entrant
  std::optional<at::Tensor> bias;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(step, weight, inner, bias);
  }
};

// Offsets inside the record of a 1-D strided tensor encoded alone (tensor_codec.hpp's layout).
constexpr std::size_t kKind = 0, kDtype = 1, kFlags = 2, kDevType = 3, kNdim = 5, kSize0 = 6,
                      kStride0 = 14, kOffset = 22, kBuffer = 30, kRecordEnd = 34;

wire::Message encode_tensor(const at::Tensor& t) {
  wire::Message m;
  wire::encode(m, t);
  return m;
}

}  // namespace

TEST_CASE("wire: every dtype round-trips with its values, shape and strides") {
  for (at::ScalarType dtype :
       {at::kByte, at::kChar, at::kShort, at::kInt, at::kLong, at::kHalf, at::kFloat, at::kDouble,
        at::kComplexHalf, at::kComplexFloat, at::kComplexDouble, at::kBool, at::kBFloat16}) {
    CAPTURE(dtype);
    const at::Tensor x = sample(dtype);
    const at::Tensor y = round_trip_one(x);
    check_same_tensor(y, x);
  }
}

TEST_CASE("wire: the received tensor adopts the received buffer without a copy") {
  const at::Tensor x = at::arange(16, at::kFloat);
  wire::Message received = transmit(encode_tensor(x));
  at::Tensor y;
  wire::decode(received, y);
  CHECK(y.data_ptr() == received.buffers.at(0).data_ptr());
  CHECK(y.storage().is_alias_of(received.buffers[0].storage()));
  check_same_tensor(y, x);
}

TEST_CASE("wire: large received buffers come resident from RecvStorage and are reused") {
  constexpr std::size_t MiB = std::size_t{1} << 20;
  wire::RecvStorage pool(8 * MiB);  // its own cache; the tensors below die before it

  SUBCASE("a freed block serves the next buffer of its size, the same memory, its bytes intact") {
    void* first = nullptr;
    {
      at::Tensor a = pool.empty_bytes(3 * MiB);
      CHECK(a.numel() == static_cast<std::int64_t>(3 * MiB));
      CHECK((a.scalar_type() == at::kByte));
      CHECK(a.storage().allocator() == &pool);
      first = a.data_ptr();
      a.fill_(7);
      CHECK(a.sum().item<std::int64_t>() == static_cast<std::int64_t>(7 * 3 * MiB));
    }
    CHECK(pool.stats().cached_blocks == 1);
    CHECK(pool.stats().cached_bytes == 3 * MiB);
    at::Tensor b = pool.empty_bytes(3 * MiB);
    CHECK(b.data_ptr() == first);
    CHECK(pool.stats().mapped == 1);
    CHECK(pool.stats().reused == 1);
    CHECK(pool.stats().cached_blocks == 0);
  }
  SUBCASE("a block far larger than asked for is not handed out") {
    { at::Tensor big = pool.empty_bytes(6 * MiB); }
    CHECK(pool.stats().cached_blocks == 1);
    at::Tensor small = pool.empty_bytes(1 * MiB);
    CHECK(pool.stats().mapped == 2);
    CHECK(pool.stats().reused == 0);
    CHECK(pool.stats().cached_blocks == 1);
  }
  SUBCASE(
      "the cache keeps at most its limit: the oldest blocks leave, a larger one is never kept") {
    std::vector<at::Tensor> held;
    for (int i = 0; i < 3; ++i) held.push_back(pool.empty_bytes(3 * MiB));
    held.clear();  // 9 MiB freed into an 8 MiB cache
    CHECK(pool.stats().cached_blocks == 2);
    CHECK(pool.stats().cached_bytes == 6 * MiB);
    { at::Tensor over = pool.empty_bytes(12 * MiB); }
    CHECK(pool.stats().cached_blocks == 2);
    CHECK(pool.stats().cached_bytes == 6 * MiB);
    pool.trim();
    CHECK(pool.stats().cached_blocks == 0);
    CHECK(pool.stats().cached_bytes == 0);
  }
  SUBCASE("blocks of two huge pages or more start on a huge-page boundary") {
    at::Tensor t = pool.empty_bytes(5 * MiB);
    CHECK(reinterpret_cast<std::uintptr_t>(t.data_ptr()) % (2 * MiB) == 0);
  }
  SUBCASE("a pooled tensor resizes like any other, keeping its bytes") {
    at::Tensor t = pool.empty_bytes(2 * MiB);
    t.fill_(3);
    t.resize_({static_cast<std::int64_t>(5 * MiB)});
    CHECK(t.numel() == static_cast<std::int64_t>(5 * MiB));
    CHECK(t.narrow(0, 0, static_cast<std::int64_t>(2 * MiB)).sum().item<std::int64_t>() ==
          static_cast<std::int64_t>(3 * 2 * MiB));
  }
  SUBCASE("below 1 MiB the CPU allocator serves, and nothing is cached") {
    { at::Tensor t = pool.empty_bytes(MiB - 1); }
    CHECK(pool.stats().mapped == 0);
    CHECK(pool.stats().cached_blocks == 0);
  }
  SUBCASE("threads allocating and freeing at once leave the accounting whole") {
    std::vector<std::thread> threads;
    for (int k = 0; k < 4; ++k) {
      threads.emplace_back([&pool, k] {
        for (int i = 0; i < 50; ++i) {
          at::Tensor t = pool.empty_bytes((1 + static_cast<std::size_t>((i + k) % 3)) * MiB);
          static_cast<std::uint8_t*>(t.data_ptr())[0] = 1;
        }
      });
    }
    for (auto& t : threads) t.join();
    const auto st = pool.stats();
    CHECK(st.mapped + st.reused == 200);
    CHECK(st.cached_bytes <= 8 * MiB);
    CHECK(st.cached_blocks >= 1);
  }
}

TEST_CASE("wire: allocate_message takes buffers of 1 MiB and more from RecvStorage") {
  wire::Message sent;
  sent.payload = "p";
  sent.buffers = {at::zeros({1024}, at::kByte), at::zeros({std::int64_t{1} << 20}, at::kByte)};
  const std::string header = wire::encode_frame_header(sent);
  const wire::Message shaped = wire::allocate_message(wire::decode_frame_header(header));
  REQUIRE(shaped.buffers.size() == 2);
  CHECK(shaped.buffers[0].storage().allocator() != &wire::RecvStorage::instance());
  CHECK(shaped.buffers[1].storage().allocator() == &wire::RecvStorage::instance());
  CHECK(shaped.buffers[1].numel() == std::int64_t{1} << 20);
}

TEST_CASE("wire: non-contiguous views keep their strides and values") {
  const at::Tensor base = at::arange(60, at::kFloat).view({5, 12});
  SUBCASE("transpose") {
    const at::Tensor x = base.t();
    const at::Tensor y = round_trip_one(x);
    CHECK_FALSE(y.is_contiguous());
    CHECK(y.strides() == x.strides());
    check_same_tensor(y, x);
  }
  SUBCASE("slice with a step") {
    const at::Tensor x = base.slice(1, 1, 12, 3);
    const at::Tensor y = round_trip_one(x);
    CHECK_FALSE(y.is_contiguous());
    CHECK(y.strides() == std::vector<int64_t>{12, 3});
    check_same_tensor(y, x);
  }
  SUBCASE("expanded (stride 0) sends one row") {
    const at::Tensor x = at::arange(3, at::kLong).expand({4, 3});
    wire::Message m = encode_tensor(x);
    CHECK(m.buffers.at(0).numel() == 3 * 8);
    const at::Tensor y = std::get<0>(wire::decode_as<at::Tensor>(transmit(m)));
    CHECK(y.strides() == std::vector<int64_t>{0, 1});
    check_same_tensor(y, x);
  }
  SUBCASE("channels-last stays channels-last") {
    const at::Tensor x =
        at::arange(120, at::kFloat).view({2, 3, 4, 5}).contiguous(at::MemoryFormat::ChannelsLast);
    const at::Tensor y = round_trip_one(x);
    CHECK(y.is_contiguous(at::MemoryFormat::ChannelsLast));
    check_same_tensor(y, x);
  }
  SUBCASE("conjugate view keeps its conjugate bit") {
    const at::Tensor x = sample(at::kComplexFloat).conj();
    REQUIRE(x.is_conj());
    const at::Tensor y = round_trip_one(x);
    CHECK(y.is_conj());
    check_same_tensor(y, x);
  }
}

TEST_CASE("wire: a view of a large tensor sends only the span it covers") {
  const at::Tensor big = at::arange(1'000'000, at::kFloat);
  SUBCASE("narrow of a 1-D tensor") {
    const at::Tensor x = big.narrow(0, 123'456, 1000);
    wire::Message m = encode_tensor(x);
    REQUIRE(m.buffers.size() == 1);
    CHECK(m.buffers[0].numel() == 1000 * 4);
    CHECK(m.buffers[0].data_ptr() == x.data_ptr());  // a view over the original storage
    const at::Tensor y = std::get<0>(wire::decode_as<at::Tensor>(transmit(m)));
    CHECK(y.storage_offset() == 0);
    CHECK(y.storage().nbytes() == 1000 * 4);
    check_same_tensor(y, x);
  }
  SUBCASE("rows of a 2-D view") {
    const at::Tensor x = big.view({1000, 1000}).slice(0, 10, 20);
    wire::Message m = encode_tensor(x);
    CHECK(m.buffers.at(0).numel() == 10 * 1000 * 4);
    check_same_tensor(std::get<0>(wire::decode_as<at::Tensor>(transmit(m))), x);
  }
  SUBCASE("a column spans its rows") {
    const at::Tensor x = big.view({1000, 1000}).narrow(1, 10, 2).narrow(0, 0, 3);
    wire::Message m = encode_tensor(x);
    CHECK(m.buffers.at(0).numel() == (1 + 2 * 1000 + 1) * 4);
    check_same_tensor(std::get<0>(wire::decode_as<at::Tensor>(transmit(m))), x);
  }
}

TEST_CASE("wire: zero-element and zero-dimensional tensors") {
  for (const at::Tensor& x : {at::empty({0}, at::kFloat), at::empty({3, 0, 2}, at::kLong),
                              at::ones({4, 5}, at::kDouble).narrow(1, 2, 0)}) {
    wire::Message m = encode_tensor(x);
    CHECK(m.buffers.empty());
    const at::Tensor y = std::get<0>(wire::decode_as<at::Tensor>(transmit(m)));
    CHECK(y.numel() == 0);
    CHECK(y.sizes() == x.sizes());
    CHECK(y.strides() == x.strides());
    CHECK((y.scalar_type() == x.scalar_type()));
  }
  const at::Tensor s = at::scalar_tensor(3.5, at::kDouble);
  const at::Tensor ys = round_trip_one(s);
  CHECK(ys.dim() == 0);
  CHECK(ys.item<double>() == 3.5);
  const at::Tensor element = at::arange(12, at::kInt).view({3, 4})[2][1];  // 0-dim with an offset
  wire::Message m = encode_tensor(element);
  CHECK(m.buffers.at(0).numel() == 4);
  const at::Tensor ye = std::get<0>(wire::decode_as<at::Tensor>(transmit(m)));
  CHECK(ye.dim() == 0);
  CHECK(ye.item<int>() == 9);
}

TEST_CASE("wire: requires_grad arrives on a leaf") {
  const at::Tensor leaf = at::randn({3, 2}).requires_grad_(true);
  const at::Tensor computed = leaf * 2;
  auto [a, b, c] = round_trip(leaf, computed, at::arange(3));
  CHECK(a.requires_grad());
  CHECK(a.is_leaf());
  CHECK(b.requires_grad());
  CHECK(b.is_leaf());
  CHECK_FALSE(c.requires_grad());
  check_same_tensor(a, leaf);
  a.sum().backward();
  CHECK(torch::equal(a.grad(), at::ones({3, 2})));
}

TEST_CASE("wire: the same tensor several times arrives as one tensor") {
  const at::Tensor a = at::arange(10, at::kFloat);
  const at::Tensor b = a.view({2, 5});  // a different tensor over the same storage
  wire::Message m;
  wire::encode(m, std::vector<at::Tensor>{a, a, b}, a, c10::IValue(a));
  CHECK(m.buffers.size() == 2);
  auto [v, again, iv] =
      wire::decode_as<std::vector<at::Tensor>, at::Tensor, c10::IValue>(transmit(m));
  REQUIRE(v.size() == 3);
  CHECK(v[0].is_same(v[1]));
  CHECK(v[0].is_same(again));
  CHECK(v[0].is_same(iv.toTensor()));
  CHECK_FALSE(v[0].is_same(v[2]));
  check_same_tensor(v[2], b);
}

TEST_CASE("wire: sparse COO tensors, coalesced or not") {
  const at::Tensor indices = at::tensor({1, 0, 1, 0, 2, 1, 2, 0}, at::kLong).view({2, 4});
  const at::Tensor values = at::tensor({3.f, 4.f, 5.f, 6.f});
  const at::Tensor raw = at::sparse_coo_tensor(indices, values, {2, 3});
  REQUIRE_FALSE(raw.is_coalesced());
  const at::Tensor coalesced = raw.coalesce();
  const at::Tensor hybrid =
      at::sparse_coo_tensor(indices, at::arange(8, at::kDouble).view({4, 2}), {2, 3, 2});
  const at::Tensor with_grad = coalesced.detach().clone().requires_grad_(true);
  for (const at::Tensor& x : {raw, coalesced, hybrid, with_grad}) {
    const at::Tensor y = round_trip_one(x);
    CHECK(y.is_sparse());
    CHECK(y.is_coalesced() == x.is_coalesced());
    CHECK(y.sparse_dim() == x.sparse_dim());
    CHECK(y.dense_dim() == x.dense_dim());
    CHECK(y._nnz() == x._nnz());
    CHECK(y.requires_grad() == x.requires_grad());
    CHECK(torch::equal(y._indices(), x._indices()));
    CHECK(torch::equal(y.detach().to_dense(), x.detach().to_dense()));
  }
  // In containers, next to dense tensors, and twice.
  auto [v, d] = round_trip(std::vector<at::Tensor>{coalesced, raw, coalesced}, at::ones({2}));
  CHECK(v[0].is_same(v[2]));
  CHECK(torch::equal(v[1].to_dense(), raw.to_dense()));
  CHECK(torch::equal(d, at::ones({2})));
}

TEST_CASE("wire: nested containers and user types with tensors") {
  const at::Tensor t1 = at::arange(6, at::kFloat).view({2, 3});
  const at::Tensor t2 = at::ones({4}, at::kInt);
  using Entry = std::tuple<std::string, at::Tensor, std::map<std::string, std::vector<at::Tensor>>>;
  const std::vector<Entry> nested = {
      {"first", t1, {{"a", {t1, t2}}, {"b", {}}}},
      {"second", t2.t(), {{"c", {t2, t1.t()}}}},
  };
  const std::optional<at::Tensor> some = t1;
  const std::optional<at::Tensor> none;
  const Outer outer{7, t1, Inner{"inner", {t2, t1}}, t2};
  const std::variant<int, at::Tensor> var = t2;
  const std::unordered_map<std::string, int> counts = {{"x", 1}, {"y", 2}};
  const std::array<at::Tensor, 2> arr = {t1, at::Tensor()};
  const auto shared = std::make_shared<Inner>(Inner{"shared", {t1}});
  const std::pair<std::shared_ptr<Inner>, std::shared_ptr<Inner>> twice{shared, shared};

  auto [n, s, e, o, va, c, ar, tw] = round_trip(nested, some, none, outer, var, counts, arr, twice);
  REQUIRE(n.size() == 2);
  CHECK(std::get<0>(n[0]) == "first");
  check_same_tensor(std::get<1>(n[0]), t1);
  CHECK(std::get<1>(n[0]).is_same(std::get<2>(n[0]).at("a")[0]));
  CHECK(std::get<2>(n[0]).at("b").empty());
  check_same_tensor(std::get<1>(n[1]), t2.t());
  CHECK(std::get<1>(n[0]).is_same(s.value()));
  CHECK_FALSE(e.has_value());
  CHECK(o.step == 7);
  CHECK(o.weight.is_same(std::get<1>(n[0])));
  CHECK(o.inner.name == "inner");
  REQUIRE(o.inner.parts.size() == 2);
  CHECK(o.inner.parts[0].is_same(o.bias.value()));
  check_same_tensor(o.inner.parts[0], t2);
  REQUIRE(std::holds_alternative<at::Tensor>(va));
  CHECK(std::get<at::Tensor>(va).is_same(o.bias.value()));
  CHECK(c == counts);
  CHECK(ar[0].is_same(o.weight));
  CHECK_FALSE(ar[1].defined());
  CHECK(tw.first == tw.second);  // cereal keeps shared_ptr identity too
  CHECK(tw.first->parts.at(0).is_same(o.weight));
}

TEST_CASE("wire: IValues for calls by schema") {
  const at::Tensor t = at::arange(4, at::kFloat);
  c10::impl::GenericList optional_tensors(c10::OptionalType::create(c10::TensorType::get()));
  optional_tensors.push_back(c10::IValue(t));
  optional_tensors.push_back(c10::IValue());
  const std::vector<c10::IValue> values = {
      c10::IValue(),
      c10::IValue(true),
      c10::IValue(int64_t{-42}),
      c10::IValue(2.5),
      c10::IValue(c10::complex<double>(1.5, -2.0)),
      c10::IValue(std::string("relu")),
      c10::IValue(t),
      c10::IValue(std::vector<int64_t>{1, 2, 3}),
      c10::IValue(std::vector<double>{0.5, -1.5}),
      c10::IValue(c10::List<bool>({true, false, true})),
      c10::IValue(std::vector<at::Tensor>{t, t * 2}),
      c10::IValue(optional_tensors),
      c10::IValue(
          c10::ivalue::Tuple::create({c10::IValue(int64_t{1}), c10::IValue(std::string("x")),
                                      c10::IValue(c10::ivalue::Tuple::create({c10::IValue(t)}))})),
      c10::IValue(c10::Device(c10::DeviceType::CPU)),
  };
  const std::vector<c10::IValue> got = round_trip_one(values);
  REQUIRE(got.size() == values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i].tagKind() == values[i].tagKind());
  }
  CHECK(got[0].isNone());
  CHECK(got[1].toBool());
  CHECK(got[2].toInt() == -42);
  CHECK(got[3].toDouble() == 2.5);
  CHECK(got[4].toComplexDouble() == c10::complex<double>(1.5, -2.0));
  CHECK(got[5].toStringRef() == "relu");
  CHECK(torch::equal(got[6].toTensor(), t));
  CHECK(got[7].toIntVector() == std::vector<int64_t>{1, 2, 3});
  CHECK(got[8].toDoubleVector() == std::vector<double>{0.5, -1.5});
  CHECK(got[9].toBoolList().vec() == std::vector<bool>{true, false, true});
  REQUIRE(got[10].isTensorList());
  CHECK(torch::equal(got[10].toTensorVector().at(1), t * 2));
  CHECK(got[10].toTensorVector().at(0).is_same(got[6].toTensor()));
  REQUIRE(got[11].isList());
  CHECK((*got[11].toList().elementType() == *c10::OptionalType::create(c10::TensorType::get())));
  CHECK(got[11].toListRef().at(0).toTensor().is_same(got[6].toTensor()));
  CHECK(got[11].toListRef().at(1).isNone());
  const auto& tuple = got[12].toTupleRef().elements();
  REQUIRE(tuple.size() == 3);
  CHECK(tuple[1].toStringRef() == "x");
  CHECK(tuple[2].toTupleRef().elements().at(0).toTensor().is_same(got[6].toTensor()));
  CHECK(got[13].toDevice() == c10::Device(c10::DeviceType::CPU));

  // Boxed arguments decoded from the wire run a builtin operator by its schema name.
  const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::add", "Tensor");
  std::vector<c10::IValue> stack =
      round_trip_one(std::vector<c10::IValue>{c10::IValue(t), c10::IValue(t), c10::IValue(2)});
  op.callBoxed(&stack);
  CHECK(torch::equal(stack.at(0).toTensor(), t * 3));
}

TEST_CASE("wire: Scalar, ScalarType, Layout, MemoryFormat and Device") {
  auto [d, i, z, b, st, lay, mf] = round_trip(
      c10::Scalar(2.5), c10::Scalar(int64_t{-7}), c10::Scalar(c10::complex<double>(0.5, 1.0)),
      c10::Scalar(true), at::kBFloat16, at::kSparse, at::MemoryFormat::ChannelsLast);
  CHECK(d.isFloatingPoint());
  CHECK(d.toDouble() == 2.5);
  CHECK(i.isIntegral(false));
  CHECK(i.toLong() == -7);
  CHECK(z.isComplex());
  CHECK(z.toComplexDouble() == c10::complex<double>(0.5, 1.0));
  CHECK(b.isBoolean());
  CHECK(b.toBool());
  CHECK((st == at::kBFloat16));
  CHECK((lay == at::kSparse));
  CHECK((mf == at::MemoryFormat::ChannelsLast));
  // c10::Device has no default constructor, so it is decoded into an existing value.
  wire::Message dm;
  wire::encode(dm, c10::Device("cpu"));
  c10::Device dev(c10::DeviceType::CUDA, 1);
  wire::decode(transmit(dm), dev);
  CHECK(dev == c10::Device("cpu"));
  patch(dm.payload, 0, 100, 1);
  CHECK_ERROR(wire::DecodeError, wire::decode(dm, dev), "unknown device type 100");

  wire::Message m;
  wire::encode(m, at::kFloat);
  m.payload[0] = static_cast<char>(99);
  at::ScalarType out{};
  CHECK_ERROR(wire::DecodeError, wire::decode(m, out), "ScalarType value 99 out of range");
}

namespace {
// A route as the agent sets one: CPU tensors go to `to`, anything else is refused.
struct CpuRoute final : wire::DeviceRoute {
  c10::Device to;
  explicit CpuRoute(c10::Device d) : to(d) {}
  c10::Device target(c10::Device from) const override {
    if (from.is_cpu()) return to;
    throw wire::EncodeError("no route for " + from.str());
  }
};
}  // namespace

TEST_CASE("wire: a device route decides each tensor's recorded device; the receiver checks it") {
  const at::Tensor t = at::arange(4, at::kFloat);
  {
    // The identity route: the record says CPU and the tensor arrives as it left.
    CpuRoute cpu(c10::Device(c10::kCPU));
    wire::DeviceRouteScope scope(&cpu);
    const wire::Message m = encode_tensor(t);
    CHECK(static_cast<int>(m.payload[kDevType]) == 0);
    CHECK(static_cast<int>(m.payload[kDevType + 1]) == -1);
    at::Tensor back;
    wire::decode(m, back);
    CHECK(at::equal(back, t));
    // The route refuses what it has no entry for, with its own text.
    CHECK_ERROR(wire::EncodeError, encode_tensor(at::empty({2}, at::device(at::kMeta))),
                "no route for meta");
  }
  {
    CpuRoute far(c10::Device(c10::kCUDA, 100));
    wire::DeviceRouteScope scope(&far);
    const wire::Message m = encode_tensor(t.clone().requires_grad_());
    CHECK(static_cast<int>(m.payload[kDevType]) == 1);
    CHECK(static_cast<int>(m.payload[kDevType + 1]) == 100);
    at::Tensor back;
    CHECK_ERROR(wire::DecodeError, wire::decode(m, back), "tensor recorded for cuda:100");
    // A sparse tensor's indices and values carry the route's device too.
    const wire::Message sparse = encode_tensor(at::eye(3).to_sparse());
    CHECK_ERROR(wire::DecodeError, wire::decode(sparse, back), "tensor recorded for cuda:100");
  }
  // The scope restored "no route": CPU only, the codec's own text.
  CHECK_ERROR(wire::EncodeError, encode_tensor(at::empty({2}, at::device(at::kMeta))),
              "only CPU tensors can be sent without a device map (device meta)");
}

TEST_CASE("wire: values that cannot be sent are refused with their name") {
  wire::Message m;
  CHECK_ERROR(wire::EncodeError, wire::encode(m, at::empty({2}, at::device(at::kMeta))),
              "only CPU tensors can be sent without a device map (device meta)");
  CHECK_ERROR(wire::EncodeError,
              wire::encode(m, at::quantize_per_tensor(at::ones({2}), 0.1, 0, at::kQInt8)),
              "quantized tensors are not supported (dtype QInt8)");
  CHECK_ERROR(wire::EncodeError, wire::encode(m, at::eye(3).to_sparse_csr()),
              "layout SparseCsr: only strided and sparse COO tensors are supported");
  CHECK_ERROR(wire::EncodeError,
              wire::encode(m, at::_nested_tensor_from_tensor_list({at::ones({2}), at::ones({3})})),
              "nested tensors are not supported");
  if (at::hasMKLDNN()) {
    CHECK_ERROR(wire::EncodeError, wire::encode(m, at::ones({2, 2}).to_mkldnn()), "layout Mkldnn");
  }
  c10::impl::GenericDict dict(c10::StringType::get(), c10::IntType::get());
  CHECK_ERROR(wire::EncodeError, wire::encode(m, c10::IValue(dict)),
              "cannot encode an IValue of kind GenericDict");
  c10::IValue deep(int64_t{1});
  for (int i = 0; i < 100; ++i) deep = c10::IValue(c10::ivalue::Tuple::create({deep}));
  CHECK_ERROR(wire::EncodeError, wire::encode(m, deep), "nested deeper than 64 levels");
}

TEST_CASE("wire: frame header round trip and incremental decoding") {
  wire::Message m;
  m.type = wire::MessageType::Response;
  m.id = 0x0123456789abcdefULL;
  wire::encode(m, std::string("payload"), at::arange(10, at::kFloat), at::ones({3}, at::kLong));
  const std::string header = wire::encode_frame_header(m);
  CHECK(header.size() == wire::kFrameFixedBytes + 8 * 2);
  CHECK(header.substr(0, 4) == "DRPC");

  wire::FrameDecoder decoder;
  std::size_t fed = 0;
  while (!decoder.done()) {  // one byte at a time, as a slow stream would deliver it
    REQUIRE(decoder.bytes_needed() > 0);
    fed += decoder.feed(header.data() + fed, 1);
  }
  CHECK(fed == header.size());
  CHECK(decoder.feed(header.data(), header.size()) == 0);  // a complete header takes no more
  const wire::FrameHeader& h = decoder.header();
  CHECK(h.type == wire::MessageType::Response);
  CHECK(h.id == m.id);
  CHECK(h.payload_bytes == m.payload.size());
  CHECK(h.buffer_bytes == std::vector<std::uint64_t>{40, 24});
  CHECK(h.body_bytes() == m.payload.size() + 64);

  decoder.reset();
  CHECK(decoder.bytes_needed() == wire::kFrameFixedBytes);
  const wire::FrameHeader again = wire::decode_frame_header(header);
  CHECK(again.id == m.id);

  // Control kinds in the reserved range pass the frame decoder; their meaning is the agent's.
  wire::Message control;
  control.type = wire::control_message_type(3);
  CHECK(wire::to_string(control.type) == "Control+3");
  CHECK(wire::decode_frame_header(wire::encode_frame_header(control)).type == control.type);
  CHECK_ERROR(wire::ProtocolError, wire::decode_frame_header(header.substr(0, 20)),
              "frame header truncated: 20 bytes given, 12 more needed");
}

TEST_CASE("wire: frame limits and malformed headers are protocol errors naming the field") {
  wire::Message m;
  wire::encode(m, at::arange(4, at::kFloat));
  const std::string good = wire::encode_frame_header(m);
  const auto with = [&](std::size_t at, std::uint64_t v, int bytes) {
    std::string h = good;
    patch(h, at, v, bytes);
    return h;
  };
  CHECK_ERROR(wire::ProtocolError, wire::decode_frame_header(with(16, ~0ULL, 8)),
              "frame payload length 18446744073709551615 exceeds limit 1073741824");
  CHECK_ERROR(wire::ProtocolError, wire::decode_frame_header(with(24, 70000, 4)),
              "frame buffer count 70000 exceeds limit 65536");
  CHECK_ERROR(wire::ProtocolError, wire::decode_frame_header(with(32, ~0ULL, 8)),
              "frame buffer 0 length 18446744073709551615 exceeds limit 17179869184");
  CHECK_ERROR(wire::ProtocolError, wire::decode_frame_header(with(0, 0x54544820, 4)),
              "bad frame magic 0x54544820");
  CHECK_ERROR(wire::ProtocolError, wire::decode_frame_header(with(4, 9, 2)),
              "frame version 9 is not supported: this build speaks frame version 1");
  CHECK_ERROR(wire::ProtocolError, wire::decode_frame_header(with(6, 200, 1)),
              "frame message type 200 is unknown");
  CHECK_ERROR(wire::ProtocolError, wire::decode_frame_header(with(6, 0, 1)),
              "frame message type 0 is unknown");
  // The transport range (a decorator policy's own kinds) ends at 143.
  CHECK_ERROR(wire::ProtocolError, wire::decode_frame_header(with(6, 144, 1)),
              "frame message type 144 is unknown (accepted: 1-4, the control range 16-127 and the "
              "transport range 128-143)");
  CHECK(wire::decode_frame_header(with(6, 128, 1)).type == wire::MessageType::kFirstTransport);
  CHECK(wire::decode_frame_header(with(6, 143, 1)).type == wire::MessageType::kLastTransport);
  CHECK(wire::to_string(wire::transport_message_type(1)) == "Transport+1");
  CHECK_ERROR(wire::ProtocolError, wire::decode_frame_header(with(7, 1, 1)), "frame flags 1");
  CHECK_ERROR(wire::ProtocolError, wire::decode_frame_header(with(28, 5, 4)),
              "frame reserved field 5 must be 0");

  wire::Limits small;
  small.max_payload_bytes = 16;
  small.max_buffers = 2;
  small.max_message_bytes = 100;
  wire::Message big;
  big.payload.assign(10, 'x');
  big.buffers = {at::empty({50}, at::kByte), at::empty({50}, at::kByte)};
  CHECK_ERROR(wire::ProtocolError, wire::decode_frame_header(wire::encode_frame_header(big), small),
              "frame total length (payload and buffers 0..1) 110 exceeds limit 100");

  // Sender side: refused before anything is written, with the size and the limit.
  CHECK_ERROR(wire::EncodeError, wire::check_limits(big, small),
              "message of 110 bytes (payload and buffers) exceeds the limit of 100 bytes");
  big.payload.assign(17, 'x');
  CHECK_ERROR(wire::EncodeError, wire::check_limits(big, small),
              "payload of 17 bytes exceeds the limit of 16 bytes (Limits::max_payload_bytes)");
  big.payload.clear();
  big.buffers.push_back(at::empty({1}, at::kByte));
  CHECK_ERROR(wire::EncodeError, wire::check_limits(big, small),
              "3 out-of-band buffers exceed the limit of 2 (Limits::max_buffers)");
  big.buffers = {at::empty({2}, at::kFloat)};
  CHECK_ERROR(wire::EncodeError, wire::check_limits(big, small),
              "buffer 0 is not a 1-D contiguous kByte CPU tensor");
}

TEST_CASE(
    "wire: handshake carries name, id, listen address, version, and a nonce and proof, never a "
    "secret") {
  namespace auth = wire::auth;
  wire::Hello hello;
  hello.worker_name = "worker3";
  hello.worker_id = 3;
  hello.listen_address = "10.0.0.3:29500";  // 14 bytes
  hello.nonce = auth::make_nonce();
  hello.proof = auth::compute_proof("s3cret", auth::Prover::kAcceptor, auth::make_nonce(),
                                    *hello.nonce, {"w0", 0}, {"worker3", 3});
  const wire::Message m = wire::encode_hello(hello);
  CHECK(m.type == wire::MessageType::Handshake);
  CHECK(m.payload.size() == 4 + 4 + 7 + 8 + 4 + 14 + 1 + 32 + 32);
  CHECK(m.payload.find("s3cret") == std::string::npos);
  const wire::Hello got = wire::decode_hello(transmit(m));
  CHECK(got.protocol_version == wire::kProtocolVersion);
  CHECK(got.worker_name == "worker3");
  CHECK(got.worker_id == 3);
  CHECK(got.listen_address == "10.0.0.3:29500");
  REQUIRE(got.nonce.has_value());
  CHECK(*got.nonce == *hello.nonce);
  REQUIRE(got.proof.has_value());
  CHECK(*got.proof == *hello.proof);

  wire::Hello challenge = hello;  // what a dialler sends: a nonce, no proof
  challenge.proof.reset();
  const wire::Hello got_challenge = wire::decode_hello(wire::encode_hello(challenge));
  CHECK(got_challenge.nonce == hello.nonce);
  CHECK_FALSE(got_challenge.proof.has_value());
  wire::Hello anonymous;
  anonymous.worker_name = "w0";
  anonymous.worker_id = 0;
  const wire::Hello got_anonymous = wire::decode_hello(wire::encode_hello(anonymous));
  CHECK_FALSE(got_anonymous.nonce.has_value());
  CHECK_FALSE(got_anonymous.proof.has_value());
  CHECK(got_anonymous.listen_address.empty());  // not said: encoded as length 0
  CHECK(wire::encode_hello(anonymous).payload.size() == 4 + 4 + 2 + 8 + 4 + 1);
  wire::Hello far = anonymous;
  far.listen_address.assign(wire::kMaxHelloAddressBytes, 'a');
  CHECK(wire::decode_hello(wire::encode_hello(far)).listen_address == far.listen_address);
  far.listen_address.push_back('a');
  CHECK_THROWS_WITH_AS(wire::encode_hello(far),
                       "handshake listen address of 1025 bytes exceeds the limit of 1024",
                       wire::EncodeError);
  wire::Hello proof_only = anonymous;
  proof_only.proof = auth::Proof{};
  CHECK_THROWS_WITH_AS(wire::encode_hello(proof_only),
                       "handshake with a proof but no nonce (the acceptor sends both)",
                       wire::EncodeError);

  // Version 7: the version stays the first field, so an older or newer peer is told in words.
  CHECK(wire::kProtocolVersion == 7);
  wire::Hello old = hello;
  old.protocol_version = 6;
  CHECK_THROWS_WITH_AS(wire::decode_hello(wire::encode_hello(old)),
                       "peer speaks distrpc protocol version 6 but this build speaks version 7",
                       wire::ProtocolError);
  wire::Message not_hello = m;
  not_hello.type = wire::MessageType::Request;
  CHECK_ERROR(wire::ProtocolError, wire::decode_hello(not_hello),
              "expected a Handshake message first");
  for (std::size_t n = 0; n < m.payload.size(); ++n) {
    wire::Message cut = m;
    cut.payload.resize(n);
    CHECK_THROWS_AS(wire::decode_hello(cut), wire::ProtocolError);
  }
  wire::Message bad_kind = m;
  bad_kind.payload[4 + 4 + 7 + 8 + 4 + 14] = 3;
  CHECK_THROWS_WITH_AS(wire::decode_hello(bad_kind),
                       "handshake authentication kind 3 is none of 0 (none), 1 (challenge), 2 "
                       "(answer)",
                       wire::ProtocolError);
  wire::Message huge = m;
  patch(huge.payload, 4, 0xFFFFFFFF, 4);
  CHECK_ERROR(wire::ProtocolError, wire::decode_hello(huge),
              "handshake worker name length 4294967295 exceeds limit 1024");
  wire::Message far_off = m;
  patch(far_off.payload, 4 + 4 + 7 + 8, 1025, 4);
  CHECK_ERROR(wire::ProtocolError, wire::decode_hello(far_off),
              "handshake listen address length 1025 exceeds limit 1024");
  wire::Message short_address = m;
  patch(short_address.payload, 4 + 4 + 7 + 8, 200, 4);
  CHECK_ERROR(wire::ProtocolError, wire::decode_hello(short_address),
              "handshake truncated at listen_address: 200 bytes needed");

  // The dialler's answer frame.
  const wire::Message answer = wire::encode_auth_answer(*hello.proof);
  CHECK(wire::decode_auth_answer(transmit(answer), "worker 'w' (id 1)") == *hello.proof);
  CHECK_THROWS_WITH_AS(wire::decode_auth_answer(m, "worker 'w' (id 1)"),
                       "authentication failed: worker 'w' (id 1) did not answer our challenge "
                       "with a proof (got a Handshake frame of 106 payload bytes)",
                       wire::ProtocolError);

  // The dialler's Confirm frame (no secret): the version alone, and nothing else passes for it.
  const wire::Message confirm = wire::encode_confirm();
  CHECK(confirm.payload.size() == 4);
  CHECK_NOTHROW(wire::check_confirm(transmit(confirm), "worker 'w' (id 1)"));
  const std::string not_confirmed = "worker 'w' (id 1) did not confirm the handshake (got a ";
  CHECK_THROWS_WITH_AS(wire::check_confirm(m, "worker 'w' (id 1)"),
                       (not_confirmed + "Handshake frame of 106 payload bytes)").c_str(),
                       wire::ProtocolError);
  CHECK_THROWS_WITH_AS(wire::check_confirm(answer, "worker 'w' (id 1)"),
                       (not_confirmed + "Handshake frame of 36 payload bytes)").c_str(),
                       wire::ProtocolError);
  wire::Message older = confirm;
  patch(older.payload, 0, 5, 4);
  CHECK_THROWS_WITH_AS(wire::check_confirm(older, "worker 'w' (id 1)"),
                       "worker 'w' (id 1) confirmed the handshake with protocol version 5 but "
                       "this build speaks version 7",
                       wire::ProtocolError);
  wire::Message request = confirm;
  request.type = wire::MessageType::Request;
  CHECK_THROWS_WITH_AS(wire::check_confirm(request, "worker 'w' (id 1)"),
                       (not_confirmed + "Request frame of 4 payload bytes)").c_str(),
                       wire::ProtocolError);
}

TEST_CASE("wire: auth proofs are HMAC-SHA256 over both nonces, both identities and the direction") {
  namespace auth = wire::auth;
  auth::Nonce a{}, b{};
  for (std::size_t i = 0; i < 32; ++i) {
    a[i] = static_cast<unsigned char>(i);
    b[i] = static_cast<unsigned char>(32 + i);
  }
  // Known answer, computed independently with Python's hmac module over the transcript
  // "distrpc-auth-v1" | prover byte | nonces | (u32 name length | name | i64 id) x 2.
  const auth::Proof p =
      auth::compute_proof("k3y", auth::Prover::kAcceptor, a, b, {"w1", 1}, {"server", -1});
  static const char* kHex = "0123456789abcdef";
  std::string hex;
  for (unsigned char c : p) {
    hex += kHex[c >> 4];
    hex += kHex[c & 15];
  }
  CHECK(hex == "51fa6546b70b8916ef105ee603cc50298a25a125f3dd154a986f977c01c61b6f");
  // Any change in what is signed changes the proof.
  auth::Nonce a2 = a;
  a2[31] ^= 1;
  auth::Nonce b2 = b;
  b2[0] ^= 1;
  const std::vector<auth::Proof> others = {
      auth::compute_proof("k3Y", auth::Prover::kAcceptor, a, b, {"w1", 1}, {"server", -1}),
      auth::compute_proof("k3y", auth::Prover::kDialler, a, b, {"w1", 1}, {"server", -1}),
      auth::compute_proof("k3y", auth::Prover::kAcceptor, a2, b, {"w1", 1}, {"server", -1}),
      auth::compute_proof("k3y", auth::Prover::kAcceptor, a, b2, {"w1", 1}, {"server", -1}),
      auth::compute_proof("k3y", auth::Prover::kAcceptor, a, b, {"w2", 1}, {"server", -1}),
      auth::compute_proof("k3y", auth::Prover::kAcceptor, a, b, {"w1", 2}, {"server", -1}),
      auth::compute_proof("k3y", auth::Prover::kAcceptor, a, b, {"w1", 1}, {"server2", -1}),
      auth::compute_proof("k3y", auth::Prover::kAcceptor, a, b, {"w1", 1}, {"server", 0}),
      auth::compute_proof("k3y", auth::Prover::kAcceptor, b, a, {"w1", 1}, {"server", -1})};
  for (const auth::Proof& o : others) {
    CHECK_FALSE(auth::same_proof(p, o));
  }
  CHECK(auth::same_proof(
      p, auth::compute_proof("k3y", auth::Prover::kAcceptor, a, b, {"w1", 1}, {"server", -1})));
  // Fresh nonces: never the same twice, never all zero.
  const auth::Nonce n1 = auth::make_nonce(), n2 = auth::make_nonce();
  CHECK(n1 != n2);
  CHECK(n1 != auth::Nonce{});
}

TEST_CASE("wire: the authenticated handshake, its refusals, a replay and a reflection") {
  namespace auth = wire::auth;
  const std::optional<std::string> secret = "s3cret";
  wire::Hello dialler;
  dialler.worker_name = "w7";
  dialler.worker_id = 7;
  dialler.nonce = auth::make_nonce();
  wire::Hello acceptor_base;
  acceptor_base.worker_name = "w0";
  acceptor_base.worker_id = 0;

  // The right secret on both sides.
  CHECK_NOTHROW(wire::check_auth_offer(dialler, true));
  const wire::Hello reply = wire::make_acceptor_hello(acceptor_base, dialler, secret);
  REQUIRE(reply.nonce.has_value());
  REQUIRE(reply.proof.has_value());
  const std::optional<auth::Proof> answer = wire::answer_acceptor(dialler, reply, secret);
  REQUIRE(answer.has_value());
  CHECK_NOTHROW(wire::verify_dialler_answer(reply, dialler, *answer, *secret));
  for (const wire::Message& m : {wire::encode_hello(dialler), wire::encode_hello(reply),
                                 wire::encode_auth_answer(*answer)}) {
    CHECK(m.payload.find(*secret) == std::string::npos);
  }

  const std::string wrong_proof_of_w0 =
      "authentication failed: worker 'w0' (id 0) answered our challenge with a wrong proof (a "
      "different shared secret, or a replayed answer)";
  const std::string wrong_proof_of_w7 =
      "authentication failed: worker 'w7' (id 7) answered our challenge with a wrong proof (a "
      "different shared secret, or a replayed answer)";
  // A wrong secret: the dialler finds the acceptor's proof wrong, and the other way round.
  CHECK_THROWS_WITH_AS(wire::answer_acceptor(dialler, reply, std::string("guess")),
                       wrong_proof_of_w0.c_str(), wire::ProtocolError);
  const auth::Proof guessed = *wire::answer_acceptor(
      dialler, wire::make_acceptor_hello(acceptor_base, dialler, std::string("guess")),
      std::string("guess"));
  CHECK_THROWS_WITH_AS(wire::verify_dialler_answer(reply, dialler, guessed, *secret),
                       wrong_proof_of_w7.c_str(), wire::ProtocolError);
  // A replay: the answer recorded above, on a new connection (the acceptor's nonce is new).
  const wire::Hello reply2 = wire::make_acceptor_hello(acceptor_base, dialler, secret);
  CHECK(*reply2.nonce != *reply.nonce);
  CHECK_THROWS_WITH_AS(wire::verify_dialler_answer(reply2, dialler, *answer, *secret),
                       wrong_proof_of_w7.c_str(), wire::ProtocolError);
  // ... and a recorded acceptor reply played to a dialler with a new nonce.
  wire::Hello dialler2 = dialler;
  dialler2.nonce = auth::make_nonce();
  CHECK_THROWS_WITH_AS(wire::answer_acceptor(dialler2, reply, secret), wrong_proof_of_w0.c_str(),
                       wire::ProtocolError);
  // A reflection: the acceptor's own proof sent back as the dialler's answer.
  CHECK_THROWS_WITH_AS(wire::verify_dialler_answer(reply, dialler, *reply.proof, *secret),
                       wrong_proof_of_w7.c_str(), wire::ProtocolError);
  // An identity other than the one the proof was made for.
  wire::Hello impostor = dialler;
  impostor.worker_name = "w8";
  CHECK_THROWS_AS(wire::verify_dialler_answer(reply, impostor, *answer, *secret),
                  wire::ProtocolError);

  // A secret on one side only.
  wire::Hello bare = dialler;
  bare.nonce.reset();
  CHECK_THROWS_WITH_AS(wire::check_auth_offer(bare, true),
                       "authentication failed: worker 'w7' (id 7) has no shared secret "
                       "configured, and this worker requires one",
                       wire::ProtocolError);
  CHECK_THROWS_WITH_AS(wire::check_auth_offer(dialler, false),
                       "authentication failed: worker 'w7' (id 7) has a shared secret "
                       "configured, and this worker has none",
                       wire::ProtocolError);
  CHECK_THROWS_WITH_AS(wire::check_auth_offer(reply, true),
                       "authentication failed: worker 'w0' (id 0) sent a proof before it was "
                       "challenged",
                       wire::ProtocolError);
  const wire::Hello open_reply = wire::make_acceptor_hello(acceptor_base, bare, std::nullopt);
  CHECK_FALSE(open_reply.nonce.has_value());
  CHECK_FALSE(wire::answer_acceptor(bare, open_reply, std::nullopt).has_value());
  CHECK_THROWS_WITH_AS(wire::answer_acceptor(dialler, open_reply, secret),
                       "authentication failed: worker 'w0' (id 0) did not answer our challenge "
                       "(it has no shared secret configured)",
                       wire::ProtocolError);
  CHECK_THROWS_WITH_AS(wire::answer_acceptor(bare, reply, std::nullopt),
                       "authentication failed: worker 'w0' (id 0) has a shared secret "
                       "configured, and this worker has none",
                       wire::ProtocolError);
}

TEST_CASE(
    "wire: a device buffer is marked in use on the stream current where it is decoded (stand-in "
    "CUDA)") {
  distrpc::testing::FakeCudaScope cuda;
  if (!cuda.active()) {
    MESSAGE("skipped: this libtorch has CUDA; the GPU cases cover device buffers there");
    return;
  }
  // A float tensor's record moved to cuda:0, its bytes in a buffer that claims to be there (as a
  // transport that moves device memory hands it over).
  wire::Message m = encode_tensor(at::arange(4, at::kFloat));
  patch(m.payload, kDevType, 1 | (0 << 8), 2);
  m.buffers.at(0) = distrpc::testing::tensor_on<std::uint8_t>(distrpc::testing::gpu(0), 16);
  const c10::Stream pool =
      c10::impl::VirtualGuardImpl(c10::kCUDA).getStreamFromGlobalPool(distrpc::testing::gpu(0));
  const c10::StreamGuard on(pool);
  (void)cuda.fake.take();
  at::Tensor t;
  wire::decode(m, t);
  CHECK(t.device() == distrpc::testing::gpu(0));
  CHECK(t.sizes() == at::IntArrayRef{4});
  // The allocator hears that the code reading it works on this thread's current stream.
  CHECK(cuda.fake.take() == std::vector<distrpc::testing::Op>{{"in_use", 0, 0, pool.id()}});
}

TEST_CASE("wire: malformed tensor records are decode errors with a reason") {
  const wire::Message good = encode_tensor(at::arange(4, at::kFloat));
  REQUIRE(good.payload.size() == kRecordEnd);
  const auto decode_patched = [&](std::size_t at, std::uint64_t v, int bytes) {
    wire::Message m = good;
    patch(m.payload, at, v, bytes);
    at::Tensor t;
    wire::decode(m, t);
  };
  CHECK_ERROR(wire::DecodeError, decode_patched(kKind, 9, 1), "unknown tensor record kind 9");
  CHECK_ERROR(wire::DecodeError, decode_patched(kDtype, 99, 1), "unknown tensor dtype code 99");
  CHECK_ERROR(wire::DecodeError, decode_patched(kDtype, 12, 1), "unknown tensor dtype code 12");
  CHECK_ERROR(wire::DecodeError, decode_patched(kFlags, 0x80, 1), "flags 128 has unknown bits");
  CHECK_ERROR(wire::DecodeError, decode_patched(kDevType, 1, 1),
              "tensor recorded on device type 1 index -1: only CPU (type 0, index -1 or 0) and "
              "CUDA (type 1, index >= 0) tensors are supported");
  CHECK_ERROR(wire::DecodeError, decode_patched(kDevType, 2 | (0 << 8), 2),
              "device type 2 index 0");
  // CUDA index 100: no machine has it.
  const std::string no_such_gpu = "tensor recorded for cuda:100, but this worker has " +
                                  std::to_string(distrpc::compat::cuda_device_count()) +
                                  " CUDA device(s)";
  CHECK_ERROR(wire::DecodeError, decode_patched(kDevType, 1 | (100 << 8), 2), no_such_gpu.c_str());
  CHECK_ERROR(wire::DecodeError, decode_patched(kNdim, 200, 1), "200 dimensions");
  CHECK_ERROR(wire::DecodeError, decode_patched(kSize0, 5, 8), "reaches outside buffer 0 of 16");
  CHECK_ERROR(wire::DecodeError, decode_patched(kSize0, ~0ULL, 8), "negative values");
  CHECK_ERROR(wire::DecodeError, decode_patched(kStride0, ~0ULL, 8), "negative values");
  CHECK_ERROR(wire::DecodeError, decode_patched(kStride0, 1ULL << 62, 8), "reaches outside");
  CHECK_ERROR(wire::DecodeError, decode_patched(kOffset, 1, 8), "reaches outside");
  CHECK_ERROR(wire::DecodeError, decode_patched(kOffset, ~0ULL, 8),
              "negative tensor storage offset");
  CHECK_ERROR(wire::DecodeError, decode_patched(kBuffer, 7, 4),
              "buffer index 7 out of range: the message has 1 buffers");

  wire::Message long_rg = encode_tensor(at::arange(4, at::kLong));
  long_rg.payload[kFlags] = 1;
  at::Tensor t;
  CHECK_ERROR(wire::DecodeError, wire::decode(long_rg, t),
              "requires_grad set on a tensor of dtype Long");
  // Found by fuzzing (tests/fuzz/regressions/fuzz_tensor): a bool tensor with the negative bit
  // decoded, and every use of it threw inside libtorch.
  wire::Message bool_neg = encode_tensor(at::ones({4}, at::kBool));
  bool_neg.payload[kFlags] = 4;
  CHECK_ERROR(wire::DecodeError, wire::decode(bool_neg, t),
              "negative bit set on a tensor of dtype Bool");

  wire::Message no_buffer = good;
  no_buffer.buffers.clear();
  CHECK_ERROR(wire::DecodeError, wire::decode(no_buffer, t), "buffer index 0 out of range");
  wire::Message float_buffer = good;
  float_buffer.buffers[0] = at::zeros({4}, at::kFloat);
  CHECK_ERROR(wire::DecodeError, wire::decode(float_buffer, t),
              "buffer 0 is not a 1-D contiguous kByte CPU or CUDA tensor");
  wire::Message meta_buffer = good;
  meta_buffer.buffers[0] = at::empty({16}, at::device(at::kMeta).dtype(at::kByte));
  CHECK_ERROR(wire::DecodeError, wire::decode(meta_buffer, t),
              "buffer 0 is not a 1-D contiguous kByte CPU or CUDA tensor");
  wire::Message extra = good;
  extra.buffers.push_back(at::empty({8}, at::kByte));
  CHECK_ERROR(wire::DecodeError, wire::decode(extra, t),
              "carries 2 out-of-band buffers but the payload referenced 1");
  wire::Message trailing = good;
  trailing.payload.push_back('\0');
  CHECK_ERROR(wire::DecodeError, wire::decode(trailing, t), "1 trailing bytes");

  wire::Message bools = encode_tensor(at::ones({3}, at::kBool));
  bools = transmit(bools);
  bools.buffers[0][1] = 2;
  CHECK_ERROR(wire::DecodeError, wire::decode(bools, t), "bool tensor holds byte 2");

  wire::Message back_ref;
  wire::encode(back_ref, at::Tensor());
  back_ref.payload = std::string(1, '\3') + hex_le(0, 4);
  CHECK_ERROR(wire::DecodeError, wire::decode(back_ref, t),
              "tensor back-reference 0 out of range: 0 tensors decoded so far");
}

TEST_CASE("wire: a buffer not aligned for its dtype is copied, values intact") {
  const at::Tensor x = at::arange(8, at::kDouble);
  wire::Message m = transmit(encode_tensor(x));
  at::Tensor padded = at::empty({m.buffers[0].numel() + 1}, at::kByte);
  padded.narrow(0, 1, m.buffers[0].numel()).copy_(m.buffers[0]);
  m.buffers[0] = padded.narrow(0, 1, m.buffers[0].numel());
  at::Tensor y;
  wire::decode(m, y);
  CHECK(reinterpret_cast<std::uintptr_t>(y.data_ptr()) % 8 == 0);
  check_same_tensor(y, x);
}

TEST_CASE("wire: malformed sparse records are decode errors") {
  const at::Tensor indices = at::tensor({0, 1, 1, 2}, at::kLong).view({2, 2});
  const at::Tensor raw = at::sparse_coo_tensor(indices, at::tensor({1.f, 2.f}), {2, 3});
  wire::Message m = transmit(encode_tensor(raw.coalesce()));
  at::Tensor t;
  SUBCASE("index outside the sizes") {
    m.buffers[0].view(at::kLong)[3] = 3;  // column 3 of a 3-column tensor
    CHECK_ERROR(wire::DecodeError, wire::decode(m, t), "invalid sparse tensor");
  }
  SUBCASE("falsely marked coalesced") {
    m.buffers[0].view(at::kLong).copy_(at::tensor({1, 0, 1, 1}, at::kLong));  // unsorted
    CHECK_ERROR(wire::DecodeError, wire::decode(m, t), "marked coalesced has unsorted");
  }
  SUBCASE("indices of the wrong dtype") {
    wire::Message bad;
    const at::Tensor s = at::sparse_coo_tensor(indices, at::tensor({1.f, 2.f}), {2, 3});
    wire::encode(bad, s);
    bad.payload[3 + 16 + 1] = 3;  // indices dtype: int32
    bad.buffers[0] = at::empty({16}, at::kByte).zero_();
    CHECK_ERROR(wire::DecodeError, wire::decode(bad, t), "sparse indices must be int64");
  }
}

TEST_CASE("wire: hostile size prefixes never drive an allocation") {
  const auto with_prefix = [](auto value, std::uint64_t count) {
    wire::Message m;
    wire::encode(m, value);
    patch(m.payload, 0, count, 8);
    return m;
  };
  std::vector<std::int64_t> ints;
  CHECK_ERROR(wire::DecodeError,
              wire::decode(with_prefix(std::vector<std::int64_t>{1, 2}, 1ULL << 62), ints),
              "vector element count 4611686018427387904");
  std::string str;
  CHECK_ERROR(wire::DecodeError, wire::decode(with_prefix(std::string("abc"), ~0ULL), str),
              "container element count 18446744073709551615");
  std::vector<std::string> strs;
  CHECK_ERROR(wire::DecodeError,
              wire::decode(with_prefix(std::vector<std::string>{"a"}, 1ULL << 40), strs),
              "container element count 1099511627776");
  std::unordered_map<std::string, at::Tensor> map;
  CHECK_ERROR(
      wire::DecodeError,
      wire::decode(with_prefix(std::unordered_map<std::string, at::Tensor>{}, 1ULL << 50), map),
      "container element count");
  std::vector<at::Tensor> tensors;
  CHECK_ERROR(wire::DecodeError,
              wire::decode(with_prefix(std::vector<at::Tensor>{}, 1ULL << 61), tensors),
              "container element count");

  bool flag = false;
  wire::Message b;
  wire::encode(b, true);
  b.payload[0] = 2;
  CHECK_ERROR(wire::DecodeError, wire::decode(b, flag), "bool byte 2 at offset 0");

  std::variant<int, std::string> var;
  wire::Message v;
  wire::encode(v, std::variant<int, std::string>(5));
  v.payload[0] = 9;
  CHECK_THROWS_AS(wire::decode(v, var), wire::DecodeError);

  std::shared_ptr<Inner> ptr;
  wire::Message p;
  wire::encode(p, std::make_shared<Inner>());
  patch(p.payload, 0, 5, 4);  // a back-reference to a shared pointer never seen
  CHECK_THROWS_AS(wire::decode(p, ptr), wire::DecodeError);

  // IValues: nesting, list element types, tags.
  c10::IValue iv;
  wire::Message deep;
  for (int i = 0; i < 100; ++i) deep.payload += std::string(1, '\x0c') + hex_le(1, 8);
  deep.payload += std::string(1, '\0');
  CHECK_ERROR(wire::DecodeError, wire::decode(deep, iv), "values nested deeper than 64 levels");
  wire::Message mixed;
  mixed.payload = std::string(1, '\x0b') + std::string(1, '\x03') + hex_le(1, 8) +
                  std::string(1, '\x05') + hex_le(1, 8) + "x";
  CHECK_ERROR(wire::DecodeError, wire::decode(mixed, iv),
              "IValue list of element type int holds a String at index 0");
  wire::Message unknown;
  unknown.payload = std::string(1, '\x63');
  CHECK_ERROR(wire::DecodeError, wire::decode(unknown, iv), "unknown IValue tag 99");
  wire::Message truncated;
  truncated.payload = std::string(1, '\x02') + "abc";
  CHECK_ERROR(wire::DecodeError, wire::decode(truncated, iv),
              "truncated: 8 bytes needed at offset 1, 3 left in a payload of 4 bytes");
}

namespace {

// Everything the fuzz loop decodes: most decoders are reachable from some byte of it.
using FuzzBody = std::tuple<std::string, at::Tensor, std::vector<at::Tensor>,
                            std::map<std::string, std::vector<std::int64_t>>, c10::IValue,
                            std::optional<at::Tensor>, std::variant<int, std::string>, c10::Scalar,
                            std::vector<std::string>, at::Tensor, Outer>;

wire::Message fuzz_seed() {
  const at::Tensor base = at::arange(64, at::kFloat).view({8, 8});
  const at::Tensor sparse = at::sparse_coo_tensor(at::tensor({0, 1, 1, 2}, at::kLong).view({2, 2}),
                                                  at::tensor({1.0, 2.0}), {3, 3})
                                .coalesce();
  c10::impl::GenericList list(c10::OptionalType::create(c10::TensorType::get()));
  list.push_back(c10::IValue(base));
  list.push_back(c10::IValue());
  const c10::IValue iv(
      c10::ivalue::Tuple::create({c10::IValue(list), c10::IValue(std::vector<int64_t>{1, 2}),
                                  c10::IValue(std::string("s")), c10::IValue(true)}));
  wire::Message m;
  wire::encode(m, std::string("name"), base.t(), std::vector<at::Tensor>{base, sparse, base},
               std::map<std::string, std::vector<std::int64_t>>{{"k", {1, 2, 3}}}, iv,
               std::optional<at::Tensor>(at::ones({2}, at::kBool)),
               std::variant<int, std::string>(std::string("v")), c10::Scalar(1.5),
               std::vector<std::string>{"a", "bc"}, at::empty({0, 3}),
               Outer{1, base.slice(0, 2, 4), Inner{"i", {sparse}}, std::nullopt});
  return transmit(m);
}

// Decodes a mutated message; only DecodeError may come out.
bool decode_only_throws_decode_error(const wire::Message& m) {
  try {
    FuzzBody body;
    std::apply([&](auto&... v) { wire::decode(m, v...); }, body);
  } catch (const wire::DecodeError&) {
  } catch (const std::exception& e) {
    FAIL_CHECK("unexpected exception type: " << e.what());
    return false;
  }
  return true;
}

}  // namespace

TEST_CASE("wire: fuzzed payloads, buffers and truncations only raise DecodeError") {
  const wire::Message seed = fuzz_seed();
  {
    FuzzBody body;
    std::apply([&](auto&... v) { wire::decode(seed, v...); }, body);  // the seed itself is valid
  }
  for (std::size_t n = 0; n < seed.payload.size(); ++n) {
    wire::Message cut = seed;
    cut.payload.resize(n);
    FuzzBody body;
    bool threw = false;
    try {
      std::apply([&](auto&... v) { wire::decode(cut, v...); }, body);
    } catch (const wire::DecodeError&) {
      threw = true;
    }
    CHECK_MESSAGE(threw, "truncation to " << n << " bytes decoded");
  }

  std::mt19937_64 rng(20240611);
  const auto pick = [&](std::uint64_t n) { return n == 0 ? 0 : rng() % n; };
  const std::uint64_t extremes[] = {
      0,          1,          2,          0x7F,       0x80, 0xFF, 0xFFFF, 0xFFFFFFFFULL,
      1ULL << 31, 1ULL << 32, 1ULL << 62, 1ULL << 63, ~0ULL};
  int failures = 0;
  for (int iter = 0; iter < 3000 && failures < 5; ++iter) {
    wire::Message m = seed;
    std::string& p = m.payload;
    const int edits = 1 + static_cast<int>(pick(4));
    for (int e = 0; e < edits; ++e) {
      switch (pick(7)) {
        case 0:  // flip a byte
          p[pick(p.size())] = static_cast<char>(rng());
          break;
        case 1: {  // an extreme little-endian value over 1, 4 or 8 bytes
          const int width = std::array<int, 3>{1, 4, 8}[pick(3)];
          const std::size_t at = pick(p.size() - static_cast<std::size_t>(width));
          patch(p, at, extremes[pick(std::size(extremes))], width);
          break;
        }
        case 2:  // delete a range
          p.erase(pick(p.size()), 1 + pick(8));
          break;
        case 3:  // insert random bytes
          p.insert(pick(p.size()), std::string(1 + pick(8), static_cast<char>(rng())));
          break;
        case 4:  // drop, shrink or add a buffer
          if (!m.buffers.empty() && pick(2) == 0) {
            m.buffers.erase(m.buffers.begin() +
                            static_cast<std::ptrdiff_t>(pick(m.buffers.size())));
          } else if (!m.buffers.empty() && pick(2) == 0) {
            at::Tensor& b = m.buffers[pick(m.buffers.size())];
            b = b.narrow(0, 0,
                         static_cast<std::int64_t>(pick(static_cast<std::uint64_t>(b.numel()))));
          } else {
            m.buffers.push_back(at::zeros({static_cast<std::int64_t>(pick(64))}, at::kByte));
          }
          break;
        case 5:  // scribble over buffer bytes (indices of sparse tensors, bools)
          if (!m.buffers.empty()) {
            at::Tensor b = m.buffers[pick(m.buffers.size())].clone();
            if (b.numel() > 0)
              b[static_cast<std::int64_t>(pick(static_cast<std::uint64_t>(b.numel())))] =
                  static_cast<std::int64_t>(rng() & 0xFF);
            m.buffers[pick(m.buffers.size())] = b;
          }
          break;
        default:  // a buffer of the wrong kind
          if (!m.buffers.empty()) m.buffers[pick(m.buffers.size())] = at::zeros({4}, at::kFloat);
          break;
      }
      if (p.empty()) p.push_back('\0');
    }
    if (!decode_only_throws_decode_error(m)) ++failures;
  }
  CHECK(failures == 0);
}

TEST_CASE("wire: fuzzed frame headers only raise ProtocolError") {
  wire::Message m;
  wire::encode(m, at::arange(4), std::vector<at::Tensor>{at::ones({3}), at::zeros({2, 2})});
  const std::string good = wire::encode_frame_header(m);
  std::mt19937_64 rng(7);
  int accepted = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::string h = good;
    if (iter % 4 == 0) {
      h.assign(good.size() + rng() % 64, '\0');
      for (char& c : h) c = static_cast<char>(rng());
      if (iter % 8 == 0) h.replace(0, 6, good.substr(0, 6));  // get past magic and version
    } else {
      for (int e = 0; e < 1 + static_cast<int>(rng() % 3); ++e) {
        h[rng() % h.size()] = static_cast<char>(rng());
      }
    }
    wire::Limits limits;
    limits.max_message_bytes = 1ULL << 20;
    wire::FrameDecoder decoder(limits);
    try {
      std::size_t pos = 0;
      while (!decoder.done() && pos < h.size()) {
        pos += decoder.feed(h.data() + pos, std::min<std::size_t>(1 + rng() % 13, h.size() - pos));
      }
      if (decoder.done()) {
        ++accepted;
        CHECK(decoder.header().body_bytes() <= limits.max_message_bytes);
        // Accepted headers must be safe to allocate from.
        const wire::Message shaped = wire::allocate_message(decoder.header());
        CHECK(shaped.buffers.size() == decoder.header().buffer_bytes.size());
      }
    } catch (const wire::ProtocolError&) {
    } catch (const std::exception& e) {
      FAIL_CHECK("unexpected exception type: " << e.what());
    }
  }
  CHECK(accepted > 0);
}
