// Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/TARGET/) from real traffic: every
// seed is made by the library's own encoders (frames, Hellos, tensors, IValues, payloads, TCPStore
// requests in both numberings, a ring header). Run by `tests/fuzz/run.sh --make-seeds`; the
// output is committed, so this runs only when an encoding changes.
#include "bodies.hpp"

#include <distrpc/store/detail/tcp_store_protocol.hpp>
#include <distrpc/transport/shm/detail/protocol.hpp>
#include <distrpc/transport/shm/detail/record.hpp>
#include <distrpc/transport/shm/ring.hpp>
#include <distrpc/wire/handshake.hpp>

#include <complex>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace {

using namespace distrpc;
namespace fs = std::filesystem;

fs::path out_dir;
std::size_t total_bytes = 0;

void write_seed(const std::string& target, const std::string& name, const std::string& bytes) {
  const fs::path dir = out_dir / target;
  fs::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  total_bytes += bytes.size();
}

// A message as the Tcp transport writes it: frame header, payload, then each buffer's bytes.
std::string frame(const wire::Message& m) {
  std::string s = wire::encode_frame_header(m) + m.payload;
  for (const at::Tensor& b : m.buffers) {
    s.append(static_cast<const char*>(b.data_ptr()), static_cast<std::size_t>(b.numel()));
  }
  return s;
}

template <class... Ts>
std::string frame_of(std::uint64_t id, const Ts&... values) {
  wire::Message m;
  m.id = id;
  wire::encode(m, values...);
  return frame(m);
}

at::Tensor sparse_example() {
  return at::sparse_coo_tensor(at::tensor({0, 1, 1, 2}, at::kLong).view({2, 2}),
                               at::tensor({1.0, 2.0}), {3, 3})
      .coalesce();
}

c10::IValue ivalue_example() {
  c10::impl::GenericList list(c10::OptionalType::create(c10::TensorType::get()));
  list.push_back(c10::IValue(at::arange(4, at::kFloat)));
  list.push_back(c10::IValue());
  return c10::IValue(c10::ivalue::Tuple::create(
      {c10::IValue(list), c10::IValue(std::vector<std::int64_t>{1, 2}),
       c10::IValue(std::string("s")), c10::IValue(true), c10::IValue(2.5),
       c10::IValue(c10::complex<double>(1.0, -1.0)), c10::IValue(c10::Device(c10::kCPU)),
       c10::IValue(std::vector<double>{0.5}), c10::IValue(std::vector<bool>{true, false})}));
}

void frame_seeds() {
  const at::Tensor base = at::arange(16, at::kFloat).view({4, 4});
  const wire::Message one = [&] {
    wire::Message m;
    m.id = 7;
    m.type = wire::MessageType::Response;
    wire::encode(m, base, std::vector<at::Tensor>{at::ones({3}), at::zeros({2, 2})});
    return m;
  }();
  wire::Message control;
  control.type = wire::control_message_type(3);
  control.id = 1;
  control.payload = "x";
  // The first byte: the size of the pieces the target feeds (1 + byte % 64).
  write_seed("fuzz_frame", "three_buffers", std::string(1, '\x07') + frame(one));
  write_seed("fuzz_frame", "two_frames", std::string(1, '\x3f') + frame(control) + frame(one));
  write_seed(
      "fuzz_frame", "handshake",
      std::string(1, '\x00') +
          frame(wire::encode_hello({wire::kProtocolVersion, "w", 0, "127.0.0.1:1", {}, {}})));
}

void handshake_seeds() {
  wire::Hello plain;
  plain.worker_name = "trainer1";
  plain.worker_id = 1;
  plain.listen_address = "10.0.0.1:29500";
  write_seed("fuzz_handshake", "hello", transport::shm::detail::hello_packet(plain));
  // Fixed nonces (not make_nonce()), so that regenerated seeds are the same files.
  wire::Hello dialler = plain;
  dialler.nonce.emplace();
  dialler.nonce->fill(0x11);
  write_seed("fuzz_handshake", "hello_challenge", transport::shm::detail::hello_packet(dialler));
  wire::Hello acceptor;  // what make_acceptor_hello answers, with a fixed nonce
  acceptor.worker_name = "ps";
  acceptor.worker_id = 0;
  acceptor.listen_address = "10.0.0.2:29500";
  acceptor.nonce.emplace();
  acceptor.nonce->fill(0x22);
  acceptor.proof = wire::auth::compute_proof(
      "secret", wire::auth::Prover::kAcceptor, *dialler.nonce, *acceptor.nonce,
      {dialler.worker_name, dialler.worker_id}, {acceptor.worker_name, acceptor.worker_id});
  write_seed("fuzz_handshake", "hello_answer", transport::shm::detail::hello_packet(acceptor));
  const auto proof = wire::answer_acceptor(dialler, acceptor, std::string("secret"));
  write_seed("fuzz_handshake", "auth_answer", transport::shm::detail::auth_answer_packet(*proof));
  write_seed("fuzz_handshake", "confirm", frame(wire::encode_confirm()));
}

void tensor_seeds() {
  const at::Tensor base = at::arange(64, at::kFloat).view({8, 8});
  const std::uint64_t b0 = 0, b1 = 1, b2 = 2;  // ids pick the body type (bodies.hpp)
  write_seed("fuzz_tensor", "matrix", frame_of(b0, base));
  write_seed("fuzz_tensor", "transposed", frame_of(b0, base.t()));
  write_seed("fuzz_tensor", "slice", frame_of(b0, base.slice(0, 2, 5).slice(1, 1, 7, 2)));
  write_seed("fuzz_tensor", "expanded", frame_of(b0, at::ones({1, 3}).expand({4, 3})));
  write_seed("fuzz_tensor", "scalar", frame_of(b0, at::scalar_tensor(3, at::kLong)));
  write_seed("fuzz_tensor", "empty", frame_of(b0, at::empty({0, 3})));
  write_seed("fuzz_tensor", "undefined", frame_of(b0, at::Tensor()));
  write_seed("fuzz_tensor", "sparse", frame_of(b0, sparse_example()));
  write_seed("fuzz_tensor", "requires_grad", frame_of(b0, at::ones({2}).requires_grad_()));
  write_seed("fuzz_tensor", "conj", frame_of(b0, at::ones({2}, at::kComplexFloat).conj()));
  write_seed("fuzz_tensor", "neg", frame_of(b0, at::_neg_view(at::ones({2}, at::kComplexDouble))));
  write_seed(
      "fuzz_tensor", "dtypes",
      frame_of(b1, std::vector<at::Tensor>{at::ones({2}, at::kBool), at::ones({2}, at::kByte),
                                           at::ones({2}, at::kChar), at::ones({2}, at::kShort),
                                           at::ones({2}, at::kInt), at::ones({2}, at::kHalf),
                                           at::ones({2}, at::kBFloat16), at::ones({2}, at::kDouble),
                                           at::ones({2}, at::kComplexHalf)}));
  write_seed("fuzz_tensor", "shared_storage",
             frame_of(b1, std::vector<at::Tensor>{base, base.slice(0, 1, 3), base}));
  write_seed("fuzz_tensor", "back_reference",
             frame_of(b2, base, std::optional<at::Tensor>(base), sparse_example()));
  write_seed("fuzz_tensor", "no_optional",
             frame_of(b2, at::ones({2}), std::optional<at::Tensor>(), at::ones({2})));
}

void ivalue_seeds() {
  write_seed("fuzz_ivalue", "tuple", frame_of(0, ivalue_example()));
  write_seed("fuzz_ivalue", "tensor", frame_of(0, c10::IValue(at::ones({2, 2}))));
  write_seed("fuzz_ivalue", "none", frame_of(0, c10::IValue()));
  write_seed("fuzz_ivalue", "int", frame_of(0, c10::IValue(std::int64_t{-5})));
  c10::List<at::Tensor> tensors;
  tensors.push_back(at::ones({2}));
  tensors.push_back(at::zeros({1}));
  write_seed(
      "fuzz_ivalue", "list",
      frame_of(1, std::vector<c10::IValue>{c10::IValue(tensors), c10::IValue(std::string("name")),
                                           c10::IValue(c10::List<std::int64_t>({1, 2, 3})),
                                           c10::IValue(c10::List<double>({1.5}))}));
}

void message_seeds() {
  const at::Tensor base = at::arange(64, at::kFloat).view({8, 8});
  write_seed(
      "fuzz_message", "everything",
      frame_of(
          0, std::string("name"), base.t(), std::vector<at::Tensor>{base, sparse_example(), base},
          std::map<std::string, std::vector<std::int64_t>>{{"k", {1, 2, 3}}}, ivalue_example(),
          std::optional<at::Tensor>(at::ones({2}, at::kBool)),
          std::variant<int, std::string>(std::string("v")), c10::Scalar(1.5),
          std::vector<std::string>{"a", "bc"},
          fuzz::Outer{1, base.slice(0, 2, 4), fuzz::Inner{"i", {sparse_example()}}, std::nullopt}));
  write_seed(
      "fuzz_message", "plain",
      frame_of(1, std::int64_t{42}, 0.25, true, std::string("text"),
               std::vector<std::uint8_t>{1, 2, 3}, std::set<int>{3, 1},
               std::make_pair(std::string("p"), std::vector<double>{1.0, 2.0}),
               std::vector<bool>{true, false, true},
               std::optional<std::map<int, std::string>>(std::map<int, std::string>{{1, "one"}})));
}

void store_seeds() {
  using namespace store::detail;
  // The first byte: 0 a server without a secret, 1 with one.
  const auto seed = [](const std::string& name, std::uint8_t mode, const Buffer& b) {
    write_seed("fuzz_store", name,
               std::string(1, static_cast<char>(mode)) + std::string(b.begin(), b.end()));
  };
  const store::Bytes value{'v', '1'};
  Buffer legacy;  // PyTorch 1.13 to 2.1, and distrpc's client
  legacy.push_back(kSetByte), put_key(legacy, "a"), put_str(legacy, value);
  legacy.push_back(kGetByte), put_key(legacy, "a");
  legacy.push_back(kAddByte), put_key(legacy, "n"), put_le<std::int64_t>(legacy, 3);
  legacy.push_back(kCompareSetByte), put_key(legacy, "a"), put_str(legacy, value),
      put_str(legacy, std::string_view("v2"));
  legacy.push_back(kCheckByte), put_le<std::uint64_t>(legacy, 2), put_key(legacy, "a"),
      put_key(legacy, "n");
  legacy.push_back(kNumKeysByte);
  legacy.push_back(kDeleteByte), put_key(legacy, "a");
  legacy.push_back(kWaitByte), put_le<std::uint64_t>(legacy, 1), put_key(legacy, "n");
  legacy.push_back(9), put_key(legacy, "s"), put_str(legacy, value);             // APPEND
  legacy.push_back(10), put_le<std::uint64_t>(legacy, 1), put_key(legacy, "s");  // MULTI_GET
  legacy.push_back(11), put_le<std::uint64_t>(legacy, 1), put_key(legacy, "m"),
      put_str(legacy, value);  // MULTI_SET
  seed("legacy", 0, legacy);
  Buffer waiting;  // a wait parked, then cancelled
  waiting.push_back(kWaitByte), put_le<std::uint64_t>(waiting, 1), put_key(waiting, "never");
  waiting.push_back(12);  // CANCEL_WAIT
  seed("wait_cancel", 0, waiting);
  Buffer validated;  // PyTorch >= 2.2: VALIDATE, then the new numbering
  validated.push_back(kValidateByte), put_le<std::uint32_t>(validated, kValidateMagic);
  validated.push_back(1), put_key(validated, "a"), put_str(validated, value);  // SET
  validated.push_back(3), put_key(validated, "a");                             // GET
  validated.push_back(13), put_le<std::uint32_t>(validated, 77);               // PING
  validated.push_back(7);                                                      // NUM_KEYS
  seed("validated", 0, validated);
  Buffer prefixed;  // the magic before every query type
  put_le<std::uint32_t>(prefixed, kValidateMagic), prefixed.push_back(kValidateByte),
      put_le<std::uint32_t>(prefixed, kValidateMagic);
  put_le<std::uint32_t>(prefixed, kValidateMagic), prefixed.push_back(4), put_key(prefixed, "n"),
      put_le<std::int64_t>(prefixed, 1);  // ADD
  seed("prefixed", 0, prefixed);
  Buffer auth;  // distrpc's challenge, then a (wrong) proof
  auth.push_back(kAuthByte), put_le<std::uint32_t>(auth, kAuthMagic);
  wire::auth::Nonce nonce{};
  nonce.fill(0x33);
  auth.insert(auth.end(), nonce.begin(), nonce.end());
  auth.insert(auth.end(), wire::auth::kProofBytes, 0);
  seed("auth", 1, auth);
  Buffer auth_refused;  // a client with a secret, a server without
  auth_refused.push_back(kAuthByte), put_le<std::uint32_t>(auth_refused, kAuthMagic);
  auth_refused.insert(auth_refused.end(), nonce.begin(), nonce.end());
  seed("auth_no_secret", 0, auth_refused);
}

void ring_seeds() {
  using namespace transport::shm::detail;
  std::vector<char> mem(kRingHeaderBytes);
  init_ring(mem.data(), kMinRingCapacity);
  std::string s(mem.data(), sizeof(RingHeader));
  const auto step = [&](std::uint8_t op, std::uint64_t value) {
    s.push_back(static_cast<char>(op));
    for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>(value >> (8 * i)));
  };
  step(4, 1000);  // write 1000 bytes
  step(3, 600);   // read 600
  step(4, kMinRingCapacity);
  step(3, ~0ull);
  step(0, 5);  // a tail behind the reader
  step(3, 10);
  write_seed("fuzz_shm_ring", "steps", s);
}

// Ring records as the shm writer lays them out: the record head (record header, frame header,
// placement table), the payload, then the inline buffers. After the target's 24-byte prefix: the
// segment's magic, capacity and memfd size.
void record_seeds() {
  using namespace transport::shm::detail;
  const auto prefix = [](std::uint64_t magic, std::uint64_t capacity) {
    std::string s(24, '\0');
    wire::detail::put_le<std::uint64_t>(s.data(), magic);
    wire::detail::put_le<std::uint64_t>(s.data() + 8, capacity);
    wire::detail::put_le<std::uint64_t>(s.data() + 16, capacity - 1);  // memfd: 1 + this
    return s;
  };
  const auto record = [](const wire::Message& m, std::uint32_t segment, std::uint32_t flags,
                         std::uint32_t forget, const std::vector<std::uint64_t>& place) {
    std::string s;
    append_record_head(s, m, segment, flags, forget, place);
    s += m.payload;
    for (std::size_t i = 0; i < m.buffers.size(); ++i) {
      if (place[i] != kInline) continue;
      const at::Tensor& b = m.buffers[i];
      s.append(static_cast<const char*>(b.data_ptr()), static_cast<std::size_t>(b.numel()));
    }
    return s;
  };
  wire::Message m;
  m.id = 3;
  wire::encode(m, at::arange(8, at::kFloat), at::ones({1024}, at::kFloat), std::string("x"));
  const std::vector<std::uint64_t> inline_all(m.buffers.size(), kInline);
  std::vector<std::uint64_t> placed(m.buffers.size(), kInline);
  placed.back() = 64;  // the large tensor in segment 1, 64 bytes in
  wire::Message control;
  control.type = wire::control_message_type(1);
  control.payload = "ping";
  write_seed(
      "fuzz_shm_record", "inline",
      prefix(kSegmentMagic, 65536) + record(m, 0, 0, 0, inline_all) + record(control, 0, 0, 0, {}));
  write_seed("fuzz_shm_record", "segment",
             prefix(kSegmentMagic, 65536) + record(m, 1, 0, 0, placed) +
                 record(m, 2, kRecordOneShot, 1, placed));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds OUTPUT_DIR (tests/fuzz/corpus)\n");
    return 2;
  }
  out_dir = argv[1];
  frame_seeds();
  handshake_seeds();
  tensor_seeds();
  ivalue_seeds();
  message_seeds();
  store_seeds();
  ring_seeds();
  record_seeds();
  std::printf("%zu bytes of seeds written under %s\n", total_bytes, out_dir.c_str());
  return 0;
}
