// The process-group front end (distrpc/dist.hpp, distrpc/dist/process_group.hpp) over two test
// backends defined here, so that these tests do not depend on the real backends:
//  - "dummy": PyTorch's DummyProcessGroup (test_c10d_common.py): all_gather copies the input,
//    all_reduce adds 2, broadcast adds 1, reduce_scatter copies input[rank], send adds 1, recv
//    adds 2, barrier is a store counter. It proves the front end calls the backend.
//  - "storetest": all_gather, all_reduce (any op), broadcast and barrier really exchanged through
//    the group's store, for the checks that need values from other members (groups with the same
//    members, the object collectives, sequence numbers).
#include <ATen/ATen.h>
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "distrpc/dist.hpp"
#include "distrpc/dist/distrpc_backend.hpp"
#include "distrpc/log.hpp"
#include "distrpc/store/hash_store.hpp"
#include "distrpc/store/tcp_store.hpp"
#include "distrpc/transport/tcp.hpp"
#ifdef USE_C10D_GLOO
#include "distrpc/dist/gloo_backend.hpp"
#endif
#include "multiprocess.hpp"
#include "support/error_text.hpp"
#include "support/scoped_env.hpp"
#include "support/tls_certs.hpp"

namespace dist = distrpc::dist;
using distrpc::testing::run_ranks;
using distrpc::testing::RunOptions;
using std::chrono::milliseconds;

namespace {

using distrpc::testing::error_text;

bool identical(const at::Tensor& a, const at::Tensor& b) {
  return at::equal(a, b);
}

// A completed Work carrying outputs.
std::shared_ptr<dist::Work> done(const char* op, std::vector<at::Tensor> outputs,
                                 std::uint64_t seq) {
  auto w = std::make_shared<dist::Work>(op, static_cast<std::int64_t>(seq));
  w->finish(std::move(outputs));
  return w;
}

class DummyBackend : public dist::Backend {
 public:
  DummyBackend(std::shared_ptr<distrpc::store::Store> store, int rank, int size, milliseconds t)
      : Backend(rank, size, t), store_(std::move(store)) {}
  std::string name() const override { return "Dummy"; }

  std::shared_ptr<dist::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const dist::AllgatherOptions&) override {
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      for (at::Tensor& o : outputs[i]) o.copy_(inputs[i]);
    }
    return done("allgather", {}, next_sequence_number());
  }
  std::shared_ptr<dist::Work> allreduce(std::vector<at::Tensor>& ts,
                                        const dist::AllreduceOptions&) override {
    for (at::Tensor& t : ts) t.add_(2);
    return done("allreduce", ts, next_sequence_number());
  }
  std::shared_ptr<dist::Work> broadcast(std::vector<at::Tensor>& ts,
                                        const dist::BroadcastOptions&) override {
    for (at::Tensor& t : ts) t.add_(1);
    return done("broadcast", ts, next_sequence_number());
  }
  std::shared_ptr<dist::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                             std::vector<std::vector<at::Tensor>>& inputs,
                                             const dist::ReduceScatterOptions&) override {
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      outputs[i].copy_(inputs[i][static_cast<std::size_t>(rank())]);
    }
    return done("reduce_scatter", outputs, next_sequence_number());
  }
  std::shared_ptr<dist::Work> send(std::vector<at::Tensor>& ts, int, int) override {
    for (at::Tensor& t : ts) t.add_(1);
    return done("send", ts, next_sequence_number());
  }
  std::shared_ptr<dist::Work> recv(std::vector<at::Tensor>& ts, int, int) override {
    for (at::Tensor& t : ts) t.add_(2);
    return done("recv", ts, next_sequence_number());
  }
  // PyTorch's: the others count themselves in, rank 0 waits until all have (one key per call).
  std::shared_ptr<dist::Work> barrier(const dist::BarrierOptions&) override {
    const std::uint64_t seq = next_sequence_number();
    const std::string key = "TEST:DummyProcessGroup:barrier:" + std::to_string(seq);
    if (rank() == 0) {
      const auto deadline = std::chrono::steady_clock::now() + timeout();
      while (store_->add(key, 0) < size() - 1) {
        if (std::chrono::steady_clock::now() > deadline) {
          throw distrpc::DistBackendError("Dummy barrier: timed out");
        }
        std::this_thread::sleep_for(milliseconds(5));
      }
    } else {
      store_->add(key, 1);
    }
    return done("barrier", {}, seq);
  }

  std::shared_ptr<distrpc::store::Store> store_;
};

// Exchanges through the store: member r of call n writes "<n>/<r>", then reads everyone's.
class StoreBackend : public dist::Backend {
 public:
  StoreBackend(std::shared_ptr<distrpc::store::Store> store, int rank, int size, milliseconds t)
      : Backend(rank, size, t), store_(std::move(store)) {}
  std::string name() const override { return "storetest"; }

  std::shared_ptr<dist::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const dist::AllgatherOptions&) override {
    const std::uint64_t seq = next_sequence_number();
    put(seq, inputs[0]);
    for (int r = 0; r < size(); ++r) {
      outputs[0][static_cast<std::size_t>(r)].copy_(take(seq, r, inputs[0]));
    }
    return done("allgather", outputs[0], seq);
  }
  std::shared_ptr<dist::Work> allreduce(std::vector<at::Tensor>& ts,
                                        const dist::AllreduceOptions& o) override {
    const std::uint64_t seq = next_sequence_number();
    put(seq, ts[0]);
    at::Tensor acc = dist::start_reduction(take(seq, 0, ts[0]), o.op);
    for (int r = 1; r < size(); ++r) dist::reduce_into(acc, take(seq, r, ts[0]), o.op);
    dist::finish_reduction(acc, o.op, size());
    ts[0].copy_(acc);
    return done("allreduce", ts, seq);
  }
  std::shared_ptr<dist::Work> broadcast(std::vector<at::Tensor>& ts,
                                        const dist::BroadcastOptions& o) override {
    const std::uint64_t seq = next_sequence_number();
    if (rank() == o.root_rank) put(seq, ts[0]);
    ts[0].copy_(take(seq, o.root_rank, ts[0]));
    return done("broadcast", ts, seq);
  }
  std::shared_ptr<dist::Work> allreduce_coalesced(
      std::vector<at::Tensor>& ts, const dist::AllreduceCoalescedOptions& o) override {
    for (at::Tensor& t : ts) {
      std::vector<at::Tensor> one{t};
      allreduce(one, {o.op, o.timeout});
    }
    return done("allreduce_coalesced", ts, sequence_number());
  }
  // Point to point: the k-th message from src to dst with a tag is key "p2p/src/dst/tag/k".
  std::shared_ptr<dist::Work> send(std::vector<at::Tensor>& ts, int dst, int tag) override {
    const std::uint64_t seq = next_sequence_number();
    const at::Tensor c = ts[0].contiguous();
    const auto* p = static_cast<const std::uint8_t*>(c.data_ptr());
    store_->set(next_p2p(rank(), dst, tag), distrpc::store::Bytes(p, p + c.nbytes()));
    return done("send", ts, seq);
  }
  std::shared_ptr<dist::Work> recv(std::vector<at::Tensor>& ts, int src, int tag) override {
    const std::uint64_t seq = next_sequence_number();
    copy_in(ts[0], store_->get(next_p2p(src, rank(), tag)));
    return done("recv", ts, seq);
  }
  std::shared_ptr<dist::Work> recv_anysource(std::vector<at::Tensor>& ts, int tag) override {
    const std::uint64_t seq = next_sequence_number();
    const auto deadline = std::chrono::steady_clock::now() + timeout();
    while (std::chrono::steady_clock::now() < deadline) {
      for (int src = 0; src < size(); ++src) {
        if (src == rank()) continue;
        const std::string key = peek_p2p(src, rank(), tag);
        if (store_->check({key})) {
          copy_in(ts[0], store_->get(next_p2p(src, rank(), tag)));
          auto w = std::make_shared<dist::Work>("recv_anysource", static_cast<std::int64_t>(seq));
          w->finish_recv(ts, src);
          return w;
        }
      }
      std::this_thread::sleep_for(milliseconds(2));
    }
    throw distrpc::DistBackendError("storetest: recv_anysource timed out");
  }
  std::shared_ptr<dist::Work> barrier(const dist::BarrierOptions&) override {
    const std::uint64_t seq = next_sequence_number();
    const std::string key = "barrier/" + std::to_string(seq);
    if (store_->add(key, 1) == size()) store_->set(key + "/done", std::string_view("1"));
    store_->wait({key + "/done"}, timeout());
    return done("barrier", {}, seq);
  }

 private:
  static std::string key(std::uint64_t seq, int r) {
    return std::to_string(seq) + "/" + std::to_string(r);
  }
  void put(std::uint64_t seq, const at::Tensor& t) {
    const at::Tensor c = t.contiguous();
    const auto* p = static_cast<const std::uint8_t*>(c.data_ptr());
    store_->set(key(seq, rank()), distrpc::store::Bytes(p, p + c.nbytes()));
  }
  std::string peek_p2p(int src, int dst, int tag) {
    std::lock_guard<std::mutex> lock(mu_);
    const std::string base =
        "p2p/" + std::to_string(src) + "/" + std::to_string(dst) + "/" + std::to_string(tag);
    return base + "/" + std::to_string(p2p_count_[base]);
  }
  std::string next_p2p(int src, int dst, int tag) {
    std::lock_guard<std::mutex> lock(mu_);
    const std::string base =
        "p2p/" + std::to_string(src) + "/" + std::to_string(dst) + "/" + std::to_string(tag);
    return base + "/" + std::to_string(p2p_count_[base]++);
  }
  static void copy_in(at::Tensor& t, const distrpc::store::Bytes& b) {
    at::Tensor out = at::empty_like(t, at::MemoryFormat::Contiguous);
    REQUIRE(b.size() == out.nbytes());
    std::memcpy(out.data_ptr(), b.data(), b.size());
    t.copy_(out);
  }
  at::Tensor take(std::uint64_t seq, int r, const at::Tensor& like) {
    distrpc::store::Bytes b = store_->get(key(seq, r));
    at::Tensor out = at::empty_like(like, at::MemoryFormat::Contiguous);
    REQUIRE(b.size() == out.nbytes());
    std::memcpy(out.data_ptr(), b.data(), b.size());
    return out;
  }

  std::shared_ptr<distrpc::store::Store> store_;
  std::mutex mu_;
  std::map<std::string, std::uint64_t> p2p_count_;  // messages per (src, dst, tag) so far
};

// "splittest": storetest whose new groups are split from the default group's backend, as the
// nccl backend splits its communicator. split() is a collective over the parent group (every
// process must call it, or the ones that did wait and fail), and the new group's backend
// exchanges through a store prefix named by the split's number.
class SplitBackend : public StoreBackend {
 public:
  SplitBackend(std::shared_ptr<distrpc::store::Store> store, int rank, int size, milliseconds t,
               bool from_split = false)
      : StoreBackend(store, rank, size, t), base_(std::move(store)), from_split_(from_split) {}
  std::string name() const override { return "splittest"; }
  bool can_split() const noexcept override { return true; }
  std::shared_ptr<dist::Backend> split(const std::vector<int>& ranks, int new_rank,
                                       milliseconds timeout) override {
    calls_.emplace_back(ranks, new_rank);
    const std::string key = "split/" + std::to_string(calls_.size());
    base_->add(key + "/arrived", 1);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (base_->add(key + "/arrived", 0) < size()) {
      if (std::chrono::steady_clock::now() > deadline) {
        throw distrpc::DistBackendError("splittest: not every member split");
      }
      std::this_thread::sleep_for(milliseconds(5));
    }
    if (new_rank < 0) return nullptr;
    return std::make_shared<SplitBackend>(std::make_shared<distrpc::store::PrefixStore>(key, base_),
                                          new_rank, static_cast<int>(ranks.size()), timeout, true);
  }
  bool from_split() const { return from_split_; }
  const std::vector<std::pair<std::vector<int>, int>>& calls() const { return calls_; }

 private:
  std::shared_ptr<distrpc::store::Store> base_;
  bool from_split_;
  std::vector<std::pair<std::vector<int>, int>> calls_;  // (ranks, new_rank) per split()
};

void register_test_backends() {
  if (!dist::is_backend_available("dummy")) {
    // Registered in mixed case: the registry keeps names lower-case.
    dist::register_backend("DuMmY", [](auto store, int rank, int size, auto timeout) {
      return std::make_shared<DummyBackend>(std::move(store), rank, size, timeout);
    });
  }
  if (!dist::is_backend_available("storetest")) {
    dist::register_backend("storetest", [](auto store, int rank, int size, auto timeout) {
      return std::make_shared<StoreBackend>(std::move(store), rank, size, timeout);
    });
  }
  if (!dist::is_backend_available("splittest")) {
    dist::register_backend("splittest", [](auto store, int rank, int size, auto timeout) {
      return std::make_shared<SplitBackend>(std::move(store), rank, size, timeout);
    });
  }
}

// Destroys the default group at the end of a scope, so one failed check does not leave the next
// test case "initialized twice".
struct DestroyAtEnd {
  ~DestroyAtEnd() {
    if (dist::is_initialized()) dist::destroy_process_group();
  }
};

using distrpc::testing::ScopedEnv;

// Collects the log lines for a scope.
class LogCapture {
 public:
  LogCapture() {
    distrpc::set_log_sink(
        [this](distrpc::LogLevel level, std::string_view who, std::string_view text) {
          std::lock_guard<std::mutex> lock(mu_);
          lines_.push_back(std::string(distrpc::to_string(level)) + " " + std::string(who) + ": " +
                           std::string(text));
        });
  }
  ~LogCapture() { distrpc::set_log_sink(nullptr); }
  std::vector<std::string> lines() {
    std::lock_guard<std::mutex> lock(mu_);
    return lines_;
  }

 private:
  std::mutex mu_;
  std::vector<std::string> lines_;
};

std::shared_ptr<distrpc::store::HashStore> hash_store() {
  return std::make_shared<distrpc::store::HashStore>(milliseconds(5000));
}

}  // namespace

// ---- One process.

TEST_CASE("dist front: ProcessGroup holds ranks, store, name and one backend per backend name") {
  register_test_backends();
  auto store = std::make_shared<distrpc::store::PrefixStore>("g", hash_store());
  dist::ProcessGroup pg(store, 1, 3, dist::BackendConfig("DUMMY"), milliseconds(2000), "mine",
                        {2, 5, 7});
  CHECK(pg.rank() == 1);
  CHECK(pg.size() == 3);
  CHECK(pg.is_member());
  CHECK(pg.global_ranks() == std::vector<int>{2, 5, 7});
  CHECK(pg.group_name() == "mine");
  CHECK(pg.store() == store);
  CHECK(pg.name() == "dummy");
  CHECK(pg.backend_config().to_string() == "cpu:dummy,cuda:dummy");
  // "dummy" serves cpu and cuda: one object for both, as PyTorch builds it.
  CHECK(pg.backend("cpu") == pg.backend("CUDA"));
  CHECK(pg.backend("cpu")->name() == "Dummy");
  CHECK(pg.backend("cpu")->rank() == 1);
  CHECK(pg.backend("cpu")->size() == 3);
  CHECK(pg.backend("cpu")->timeout() == milliseconds(2000));
  CHECK(pg.default_device() == "cpu");
  CHECK(error_text<std::invalid_argument>([&] { pg.backend("xpu"); }) ==
        "ProcessGroup mine: no backend for device type xpu (backend config "
        "'cpu:dummy,cuda:dummy')");
  CHECK(pg.group_rank(5) == 1);
  CHECK(pg.global_rank(2) == 7);
  CHECK(error_text<std::invalid_argument>([&] { pg.group_rank(3); }) ==
        "Global rank 3 is not part of group mine");
  CHECK(error_text<std::invalid_argument>([&] { pg.global_rank(3); }) ==
        "Group rank 3 is not part of group mine (of size 3)");

  // Two backend names: two objects, and name() is the canonical config string.
  dist::ProcessGroup two(store, 0, 1, dist::BackendConfig("cpu:storetest,cuda:dummy"),
                         milliseconds(2000));
  CHECK(two.name() == "cpu:storetest,cuda:dummy");
  CHECK(two.backend("cpu")->name() == "storetest");
  CHECK(two.backend("cuda")->name() == "Dummy");
  CHECK(two.group_name() == "default_pg");
  CHECK(two.global_ranks() == std::vector<int>{0});

  // Sequence numbers come from the cpu backend, +1 per call.
  dist::ProcessGroup one(store, 0, 1, dist::BackendConfig("dummy"), milliseconds(2000));
  CHECK(one.sequence_number() == 0);
  std::vector<at::Tensor> t{at::zeros({2})};
  one.allreduce(t)->wait();
  one.broadcast(t)->wait();
  CHECK(one.sequence_number() == 2);
  CHECK(identical(t[0], at::full({2}, 3.0f)));
}

TEST_CASE("dist front: ProcessGroup refuses bad construction with what was wrong") {
  register_test_backends();
  auto store = std::make_shared<distrpc::store::PrefixStore>("g", hash_store());
  const dist::BackendConfig dummy("dummy");
  const milliseconds t(1000);
  using E = std::invalid_argument;
  CHECK(error_text<E>([&] { dist::ProcessGroup(nullptr, 0, 1, dummy, t); }) ==
        "ProcessGroup: the store is null");
  CHECK(error_text<E>([&] { dist::ProcessGroup(store, 0, 0, dummy, t); }) ==
        "ProcessGroup: the group size must be at least 1, got 0");
  CHECK(error_text<E>([&] { dist::ProcessGroup(store, 2, 2, dummy, t); }) ==
        "ProcessGroup: rank 2 is outside the group of size 2");
  CHECK(error_text<E>([&] { dist::ProcessGroup(store, 0, 1, dummy, milliseconds(0)); }) ==
        "ProcessGroup: the timeout must be positive, got 0 ms");
  CHECK(error_text<E>([&] { dist::ProcessGroup(store, 0, 2, dummy, t, "g", {1}); }) ==
        "ProcessGroup: 1 global ranks given for a group of size 2");
  CHECK(error_text<E>([&] {
          dist::ProcessGroup(store, 0, 2, dummy, t, "g", {3, 1});
        }) ==
        "ProcessGroup: the global ranks must be non-negative, ascending and distinct, got [3, 1]");
  CHECK(error_text<E>([&] {
          dist::ProcessGroup(store, 0, 1, dist::BackendConfig("cpu:nosuch"), t);
        }) == "Backend 'nosuch' is not registered");
  if (!dist::is_backend_available("nullmaker")) {
    dist::register_backend("nullmaker",
                           [](auto, int, int, auto) { return std::shared_ptr<dist::Backend>(); });
  }
  CHECK(error_text<E>([&] {
          dist::ProcessGroup(store, 0, 1, dist::BackendConfig("nullmaker"), t);
        }) == "ProcessGroup: the creator of backend 'nullmaker' returned no backend");
  if (!dist::is_backend_available("wrongrank")) {
    dist::register_backend("wrongrank", [](auto store, int, int size, auto timeout) {
      return std::make_shared<DummyBackend>(std::move(store), 0, size + 1, timeout);
    });
  }
  CHECK(error_text<std::logic_error>([&] {
          dist::ProcessGroup(store, 1, 2, dist::BackendConfig("wrongrank"), t);
        }) == "ProcessGroup: backend 'wrongrank' was made for rank 1 of 2 but reports rank 0 of 3");

  // The non-member handle has no backend to give.
  const auto& nm = dist::ProcessGroup::non_member();
  CHECK_FALSE(nm->is_member());
  CHECK(nm->rank() == -1);
  CHECK(nm->size() == -1);
  CHECK(error_text<std::logic_error>([&] { nm->backend("cpu"); }) ==
        "ProcessGroup::backend: this process is not a member of the group (NON_GROUP_MEMBER)");
}

TEST_CASE("dist front: world of one with the Dummy backend; case-insensitive names (scenario 4)") {
  register_test_backends();
  DestroyAtEnd guard;
  CHECK_FALSE(dist::is_initialized());
  dist::init_process_group("DUMMY", hash_store(), 0, 1, milliseconds(5000));
  CHECK(dist::is_initialized());
  CHECK(dist::get_rank() == 0);
  CHECK(dist::get_world_size() == 1);
  CHECK(dist::get_backend() == "dummy");
  CHECK(dist::get_process_group_ranks(nullptr) == std::vector<int>{0});

  at::Tensor t = at::ones({2, 2}) * 7;
  auto w = dist::all_reduce(t);
  REQUIRE(w);
  CHECK(w->is_completed());  // blocking: already waited
  CHECK(identical(t, at::ones({2, 2}) * 9));
  at::Tensor z = at::zeros({2, 2});
  auto aw = dist::broadcast(z, 0, {.async_op = true});
  REQUIRE(aw);
  CHECK(aw->wait());
  CHECK(identical(z, at::ones({2, 2})));
  std::vector<at::Tensor> outs{at::zeros({2, 2})};
  dist::all_gather(outs, t);
  CHECK(identical(outs[0], t));
  at::Tensor rs = at::zeros({2, 2});
  dist::reduce_scatter(rs, {at::ones({2, 2}) * 4});
  CHECK(identical(rs, at::ones({2, 2}) * 4));
  dist::barrier();
  CHECK(dist::get_default_group()->sequence_number() == 5);
  CHECK(dist::get_default_group()->name() == "dummy");
  // An operation the backend leaves out is reported with the backend's name.
  CHECK(error_text<std::logic_error>([&] { dist::reduce(t, 0); }) ==
        "Backend Dummy does not support reduce");
}

// A port a TCPStore could listen on just now (a master bound to port 0, then closed), for a
// group whose rank 0 must host its store at a known port.
int free_store_port() {
  distrpc::store::TCPStoreOptions o;
  o.is_master = true;
  return distrpc::store::TCPStore(o).port();
}

TEST_CASE("dist front: the rendezvous store takes InitOptions::auth_secret") {
  register_test_backends();
  DestroyAtEnd guard;
  namespace st = distrpc::store;
  const int port = free_store_port();
  dist::init_process_group({.backend = "dummy",
                            .init_method = "tcp://127.0.0.1:" + std::to_string(port),
                            .rank = 0,
                            .world_size = 1,
                            .timeout = milliseconds(5000),
                            .auth_secret = "group secret"});
  st::TCPStoreOptions client;
  client.port = port;
  client.timeout = milliseconds(5000);
  client.auth_secret = "not the group's";
  CHECK(error_text<distrpc::DistNetworkError>([&] {
          st::TCPStore bad(client);
        }).find("failed: it answered our challenge with a wrong proof") != std::string::npos);
  client.auth_secret = "group secret";
  st::TCPStore member(client);
  member.set("probe", "1");
  CHECK(member.get_string("probe") == "1");
}

TEST_CASE("dist front: the rendezvous store takes InitOptions::tls") {
  register_test_backends();
  DestroyAtEnd guard;
  namespace st = distrpc::store;
  const auto& certs = distrpc::testing::tls_files();
  const int port = free_store_port();
  dist::init_process_group({.backend = "dummy",
                            .init_method = "tcp://127.0.0.1:" + std::to_string(port),
                            .rank = 0,
                            .world_size = 1,
                            .timeout = milliseconds(5000),
                            .tls = certs.server});
  st::TCPStoreOptions client;
  client.port = port;
  client.timeout = milliseconds(5000);
  CHECK(error_text<distrpc::DistNetworkError>([&] {
          st::TCPStore plain(client);
        }).find("a server with TLS a client without TLS") != std::string::npos);
  client.tls = certs.client;
  st::TCPStore member(client);
  member.set("probe", "1");
  CHECK(member.get_string("probe") == "1");
}

TEST_CASE("dist front: mixed dtypes are refused by every listed collective (scenario 9)") {
  register_test_backends();
  DestroyAtEnd guard;
  dist::init_process_group("dummy", hash_store(), 0, 1, milliseconds(5000));
  const int world = 1;
  at::Tensor tensor = at::ones({2, 2}) * 7;
  at::Tensor tensor_h = tensor.to(at::kHalf);
  std::vector<at::Tensor> list;
  for (int i = 0; i < world; ++i) list.push_back(at::zeros({2, 2}));
  std::vector<at::Tensor> list_h(list);
  list_h[0] = list_h[0].to(at::kHalf);
  const std::string float_half =
      "Invalid usage of tensors with different dtypes Found Float and Half";
  const std::string half_float =
      "Invalid usage of tensors with different dtypes Found Half and Float";
  using E = std::invalid_argument;

  CHECK(error_text<E>([&] { dist::all_gather(list_h, tensor); }) == half_float);
  CHECK(error_text<E>([&] { dist::all_gather(list, tensor_h); }) == float_half);
  std::vector<at::Tensor> coalesced{at::zeros({2}), at::zeros({2}).to(at::kHalf)};
  CHECK(error_text<E>([&] { dist::all_reduce_coalesced(coalesced); }) == float_half);
  CHECK(error_text<E>([&] { dist::reduce_scatter(tensor, list_h); }) == float_half);
  CHECK(error_text<E>([&] { dist::reduce_scatter(tensor_h, list); }) == half_float);
  CHECK(error_text<E>([&] { dist::all_to_all_single(tensor_h, tensor); }) == half_float);
  CHECK(error_text<E>([&] { dist::all_to_all(list_h, list); }) == half_float);
  CHECK(error_text<E>([&] { dist::all_to_all(list, list_h); }) == float_half);
  CHECK(error_text<E>([&] { dist::scatter(tensor, list_h); }) == float_half);
  CHECK(error_text<E>([&] { dist::scatter(tensor_h, list); }) == half_float);
  CHECK(error_text<E>([&] { dist::gather(tensor_h, list); }) == half_float);
  CHECK(error_text<E>([&] { dist::gather(tensor, list_h); }) == float_half);
  // Refused before the backend is reached: nothing was issued.
  CHECK(dist::get_default_group()->sequence_number() == 0);

  // A complex view counts as its real dtype: accepted, in every combination (PyTorch's
  // _test_tensor_dtype_complex), and then mixed with another dtype it is still refused.
  at::Tensor real = at::rand({2});
  at::Tensor complex = at::view_as_complex(at::rand({2, 2}));
  std::vector<at::Tensor> out_real{at::zeros({2})};
  std::vector<at::Tensor> out_complex{at::view_as_complex(at::zeros({2, 2}))};
  CHECK(dist::all_gather(out_real, real));
  // One complex element of the output holds two floats of the input.
  std::vector<at::Tensor> out_one_complex{at::view_as_complex(at::zeros({2}))};
  CHECK(dist::all_gather(out_one_complex, real));
  CHECK(identical(at::view_as_real(out_one_complex[0]), real));
  CHECK(dist::all_gather(out_complex, complex));
  CHECK(identical(out_complex[0], complex));
  CHECK_NOTHROW(dist::detail::check_same_dtype(out_real, complex));
  CHECK(dist::get_default_group()->sequence_number() == 3);
  CHECK(error_text<E>([&] { dist::all_gather(list_h, complex); }) ==
        "Invalid usage of tensors with different dtypes Found Half and ComplexFloat");
}

TEST_CASE("dist front: rank checks and sending to oneself name what was wrong") {
  register_test_backends();
  DestroyAtEnd guard;
  dist::init_process_group("dummy", hash_store(), 0, 1, milliseconds(5000));
  at::Tensor t = at::zeros({2});
  using E = std::invalid_argument;
  CHECK(error_text<E>([&] { dist::send(t, 0); }) ==
        "Invalid destination rank: destination rank should not be the same as the rank of the "
        "current process.");
  CHECK(error_text<E>([&] { dist::recv(t, 0); }) ==
        "Invalid source rank: source rank should not be the same as the rank of the current "
        "process.");
  CHECK(error_text<E>([&] { dist::send(t, 3); }) ==
        "send: dst: Global rank 3 is not part of group default_pg");
  CHECK(error_text<E>([&] { dist::broadcast(t, 1); }) ==
        "broadcast: src: Global rank 1 is not part of group default_pg");
  CHECK(error_text<E>([&] { dist::reduce(t, -1); }) ==
        "reduce: dst: Global rank -1 is not part of group default_pg");
  CHECK(error_text<E>([&] { dist::gather(t, {}, {.dst = 2}); }) ==
        "gather: dst: Global rank 2 is not part of group default_pg");
  CHECK(error_text<E>([&] { dist::scatter(t, {}, {.src = 5}); }) ==
        "scatter: src: Global rank 5 is not part of group default_pg");
  // The facade itself takes group ranks.
  auto g = dist::get_default_group();
  std::vector<at::Tensor> ts{t};
  CHECK(error_text<E>([&] { g->broadcast(ts, {.root_rank = 1}); }) ==
        "broadcast: root rank 1 is out of range for group default_pg of size 1");
  CHECK(error_text<E>([&] { g->send(ts, 4, 0); }) ==
        "send: destination rank 4 is out of range for group default_pg of size 1");
  // Shapes of the lists and tensors.
  std::vector<at::Tensor> two{at::zeros({2}), at::zeros({2})};
  CHECK(error_text<E>([&] { dist::all_gather(two, t); }) ==
        "allgather: the output list has 2 tensors but the group has 1 members");
  at::Tensor undefined;
  CHECK(error_text<E>([&] { dist::all_reduce(undefined); }) == "allreduce: a tensor is undefined");
  std::vector<at::Tensor> none;
  CHECK(error_text<E>([&] { dist::all_reduce_coalesced(none); }) ==
        "allreduce_coalesced: no tensor given");
  at::Tensor big = at::zeros({3});
  CHECK(error_text<E>([&] { dist::all_gather_into_tensor(big, t); }) ==
        "allgather_into_tensor: the output has 3 elements but the group of size 1 needs 2 (size x "
        "the input's 2)");
  CHECK(error_text<E>([&] {
          dist::all_to_all_single(t, t, {.output_split_sizes = {1, 1}});
        }) == "alltoall_base: 2 output split sizes for a group of size 1");
  // What a rank sends itself must fit its own output: refused before anything is sent.
  const at::Tensor three = at::zeros({3});
  CHECK(error_text<E>([&] { dist::all_to_all_single(t, three); }) ==
        "alltoall_base: rank 0 sends itself 3 elements but its output takes 2 from it (the "
        "input's and output's split sizes for rank 0 must match)");
  std::vector<at::Tensor> outs{at::zeros({2})};
  std::vector<at::Tensor> ins{at::zeros({3})};
  CHECK(error_text<E>([&] { dist::all_to_all(outs, ins); }) ==
        "alltoall: rank 0 sends itself 3 elements (input 0) but its output 0 holds 2");
  at::Tensor ints = at::zeros({2}, at::kInt);
  CHECK(error_text<E>([&] { dist::all_reduce(ints, {.op = dist::ReduceOp::AVG}); }) ==
        "Cannot use ReduceOp.AVG with integral dtype Int: the mean is not representable");
  CHECK(dist::get_default_group()->sequence_number() == 0);  // nothing reached the backend
}

TEST_CASE("dist front: init_process_group's bad input, URLs and environment") {
  register_test_backends();
  DestroyAtEnd guard;
  using E = std::invalid_argument;
  at::Tensor one = at::zeros({1});
  CHECK(error_text<std::logic_error>([&] { dist::all_reduce(one); }) ==
        "Default process group has not been initialized, please make sure to call "
        "init_process_group.");
  CHECK(error_text<std::logic_error>([] { dist::get_rank(); }) ==
        "Default process group has not been initialized, please make sure to call "
        "init_process_group.");
  CHECK(error_text<std::logic_error>([] { dist::destroy_process_group(); }) ==
        "Default process group has not been initialized, please make sure to call "
        "init_process_group.");
  CHECK(error_text<E>([] {
          dist::init_process_group({.backend = "dummy",
                                    .init_method = "env://",
                                    .store = hash_store(),
                                    .rank = 0,
                                    .world_size = 1});
        }) == "init_process_group: Cannot specify both init_method and store.");
  CHECK(error_text<E>([] { dist::init_process_group("dummy", hash_store(), -1, 1); }) ==
        "init_process_group: rank (>= 0) and world_size (>= 1) must be given with a store, got "
        "rank -1 and world_size 1");
  CHECK(error_text<E>([] { dist::init_process_group("dummy", hash_store(), 2, 2); }) ==
        "init_process_group: rank 2 is not below world_size 2");
  CHECK(error_text<E>([] {
          dist::init_process_group("dummy", std::shared_ptr<distrpc::store::Store>(), 0, 1);
        }) == "init_process_group: the store is null");
  CHECK(error_text<E>([] {
          dist::init_process_group("dummy", hash_store(), 0, 1, milliseconds(0));
        }) == "init_process_group: the timeout must be positive, got 0 ms");
  CHECK(error_text<E>([] { dist::init_process_group("nosuch", hash_store(), 0, 1); }) ==
        "init_process_group: backend 'nosuch' is not registered (register_backend(name, "
        "creator))");
  CHECK(error_text<E>([] { dist::init_process_group("cpu:dummy,", hash_store(), 0, 1); })
            .rfind("Invalid device:backend pairing: . The custom backend string argument is "
                   "invalid: cpu:dummy,",
                   0) == 0);

  // Malformed URLs: the rendezvous's texts, which quote the URL and the accepted forms.
  using distrpc::DistError;
  CHECK(error_text<DistError>([] { dist::init_process_group("dummy", "tcp://localhost", 0, 1); }) ==
        "rendezvous: malformed URL 'tcp://localhost': no port after the host (expected "
        "tcp://host:port[?rank=R&world_size=N], file:///absolute/path[?rank=R&world_size=N] or "
        "env://)");
  CHECK(error_text<DistError>([] { dist::init_process_group("dummy", "bogus://x", 0, 1); }) ==
        "rendezvous: unknown scheme 'bogus' in 'bogus://x' (expected "
        "tcp://host:port[?rank=R&world_size=N], file:///absolute/path[?rank=R&world_size=N] or "
        "env://)");
  CHECK(error_text<DistError>([] { dist::init_process_group("dummy", "file://relative", 0, 1); }) ==
        "rendezvous: malformed URL 'file://relative': a file:// URL needs an absolute path, as in "
        "file:///tmp/store (expected tcp://host:port[?rank=R&world_size=N], "
        "file:///absolute/path[?rank=R&world_size=N] or env://)");
  {
    // env:// (the default) names the missing variable.
    ScopedEnv addr("MASTER_ADDR", nullptr);
    CHECK(error_text<DistError>([] { dist::init_process_group("dummy"); }) ==
          "Error initializing distrpc using env:// rendezvous: environment variable MASTER_ADDR "
          "expected, but not set");
    addr.set("127.0.0.1");
    ScopedEnv port("MASTER_PORT", "port");
    CHECK(error_text<DistError>([] { dist::init_process_group("dummy", "", 0, 1); }) ==
          "Error initializing distrpc using env:// rendezvous: environment variable "
          "MASTER_PORT='port' is not an integer in 0..65535");
    port.set("0");
    ScopedEnv ranks(ScopedEnv::unset, {"RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"});
    CHECK(error_text<DistError>([] { dist::init_process_group("dummy", "env://", -1, 1); }) ==
          "Error initializing distrpc using env:// rendezvous: environment variable RANK "
          "expected, but not set (nor OMPI_COMM_WORLD_RANK or SLURM_PROCID, as mpirun and srun "
          "set)");
    // Everything given: a world of one over env://, rank 0 hosting the store on a free port.
    dist::init_process_group("dummy", "env://", 0, 1, milliseconds(5000));
    CHECK(dist::get_world_size() == 1);
    CHECK(error_text<std::logic_error>([] {
            dist::init_process_group("dummy", hash_store(), 0, 1);
          }) == "trying to initialize the default process group twice!");
    dist::destroy_process_group();
  }
  CHECK_FALSE(dist::is_initialized());
  CHECK(error_text<std::logic_error>([] { dist::get_default_store(); }) ==
        "Default process group has not been initialized, please make sure to call "
        "init_process_group.");

  // The default backend: distrpc for cpu where registered, else gloo; nccl for cuda.
  const bool any_default = dist::is_backend_available("distrpc") ||
                           dist::is_backend_available("gloo") || dist::is_backend_available("nccl");
  if (!any_default) {
    CHECK(error_text<E>([] { dist::init_process_group("", hash_store(), 0, 1); }) ==
          "init_process_group: no backend named and no default available: register 'distrpc' "
          "(register_distrpc_backend<Transport>()) or 'gloo', or name a registered backend");
    CHECK(error_text<E>([] {
            dist::init_process_group("undefined", hash_store(), 0, 1);
          }).find("no default available") != std::string::npos);
  } else {
    dist::init_process_group("", hash_store(), 0, 1, milliseconds(5000));
    const std::string b = dist::get_backend();
    CHECK((b == "distrpc" || b == "gloo" || b.find("cuda:nccl") != std::string::npos));
    if (dist::is_backend_available("distrpc")) {
      CHECK(dist::get_default_group()->backend_config().backend_for("cpu") == "distrpc");
    }
    dist::destroy_process_group();
  }
}

TEST_CASE("dist front: init_process_group fails on time when a rank never arrives") {
  register_test_backends();
  DestroyAtEnd guard;
  const auto start = std::chrono::steady_clock::now();
  const std::string text = error_text<distrpc::DistStoreError>(
      [] { dist::init_process_group("dummy", hash_store(), 0, 2, milliseconds(300)); });
  const auto took = std::chrono::steady_clock::now() - start;
  CHECK(text ==
        "Timed out initializing process group in store based barrier on rank 0, for key: "
        "store_based_barrier_key:init (world_size=2, num_workers_joined=1, timeout=300 ms)");
  CHECK(took >= milliseconds(300));
  CHECK(took < milliseconds(3000));
  CHECK_FALSE(dist::is_initialized());  // nothing left behind: init may be called again
  dist::init_process_group("dummy", hash_store(), 0, 1, milliseconds(1000));
  CHECK(dist::is_initialized());
}

// For every backend this binary has: a world of one is rank 0 of 1, named by its backend
// string, and a barrier completes (PyTorch's test_init_process_group_for_all_backends).
TEST_CASE("dist front: a world of one for every registered backend") {
  register_test_backends();
  if (!dist::is_backend_available("distrpc")) {
    dist::register_distrpc_backend<distrpc::transport::Tcp>();
  }
#ifdef USE_C10D_GLOO
  if (!dist::is_backend_available("gloo")) dist::register_gloo_backend();
#endif
  int tried = 0;
  for (const char* name : {"distrpc", "gloo", "dummy", "storetest"}) {
    if (!dist::is_backend_available(name)) continue;
    CAPTURE(name);
    DestroyAtEnd guard;
    dist::init_process_group(name, hash_store(), 0, 1, milliseconds(5000));
    CHECK(dist::get_rank() == 0);
    CHECK(dist::get_world_size() == 1);
    CHECK(dist::get_backend() == name);
    CHECK(dist::get_default_group()->name() == name);
    CHECK(dist::barrier());
    if (std::string(name) == "distrpc" || std::string(name) == "gloo") {
      // A complex tensor mixed with real ones of its real dtype (PyTorch's
      // _test_tensor_dtype_complex): the backend sees one dtype, the values land where they go.
      const at::Tensor pair = at::rand({2});
      std::vector<at::Tensor> reals{at::zeros({2})};
      CHECK(dist::all_gather(reals, at::view_as_complex(pair.clone())));
      CHECK(at::equal(reals[0], pair));
      std::vector<at::Tensor> complexes{at::view_as_complex(at::zeros({2}))};
      CHECK(dist::all_gather(complexes, pair));
      CHECK(complexes[0].is_complex());  // the caller's list keeps its tensors
      CHECK(at::equal(at::view_as_real(complexes[0]), pair));
      const at::Tensor rows = at::rand({1, 2});
      at::Tensor out = at::view_as_complex(at::zeros({1, 2}));
      CHECK(dist::all_to_all_single(out, rows));
      CHECK(at::equal(at::view_as_real(out), rows));
    }
    dist::destroy_process_group();
    ++tried;
  }
  CHECK(tried >= 3);
}

TEST_CASE("dist front: TORCH_DISTRIBUTED_DEBUG and LOCAL_RANK tables (scenario 10)") {
  ScopedEnv debug("TORCH_DISTRIBUTED_DEBUG", nullptr);
  CHECK(dist::debug_level() == dist::DebugLevel::OFF);
  const std::pair<const char*, dist::DebugLevel> table[] = {
      {"OFF", dist::DebugLevel::OFF},       {"off", dist::DebugLevel::OFF},
      {"oFf", dist::DebugLevel::OFF},       {"INFO", dist::DebugLevel::INFO},
      {"info", dist::DebugLevel::INFO},     {"INfO", dist::DebugLevel::INFO},
      {"DETAIL", dist::DebugLevel::DETAIL}, {"detail", dist::DebugLevel::DETAIL},
      {"DeTaIl", dist::DebugLevel::DETAIL},
  };
  for (const auto& [value, level] : table) {
    CAPTURE(value);
    debug.set(value);
    CHECK(dist::debug_level() == level);
  }
  CHECK(std::string(dist::to_string(dist::DebugLevel::DETAIL)) == "DETAIL");
  for (const char* bad : {"foo", "0", "1", "-1"}) {
    CAPTURE(bad);
    debug.set(bad);
    CHECK(error_text<std::invalid_argument>([] { dist::debug_level(); }) ==
          "The value of TORCH_DISTRIBUTED_DEBUG must be OFF, INFO, or DETAIL. Got '" +
              std::string(bad) + "'.");
  }

  ScopedEnv local("LOCAL_RANK", nullptr);
  CHECK(error_text<std::runtime_error>([] { dist::node_local_rank(); }) ==
        "LOCAL_RANK is not in the environment. Set it (torchrun and distrpc-run do) or pass a "
        "fallback rank to node_local_rank() to run locally.");
  CHECK(dist::node_local_rank(2) == 2);
  for (int r = 0; r < 4; ++r) {
    local.set(std::to_string(r).c_str());
    CHECK(dist::node_local_rank(123) == r);  // the variable wins over the fallback
    CHECK(dist::node_local_rank() == r);
  }
  local.set("two");
  CHECK(error_text<std::invalid_argument>([] { dist::node_local_rank(); }) ==
        "LOCAL_RANK='two' is not a non-negative integer");
}

// ---- Several processes.

namespace {

// env:// for the ranks of a run: the parent picks the port, each rank sets its own RANK.
RunOptions env_run(int world, int limit_s) {
  RunOptions o;
  o.world = world;
  o.limit = std::chrono::seconds(limit_s);
  o.env = {"MASTER_ADDR=127.0.0.1",
           "MASTER_PORT=" + std::to_string(distrpc::testing::free_loopback_port()),
           "WORLD_SIZE=" + std::to_string(world)};
  return o;
}

void set_rank_env(const distrpc::testing::RankContext& ctx) {
  ::setenv("RANK", std::to_string(ctx.rank).c_str(), 1);
}

}  // namespace

// PyTorch's PythonProcessGroupExtensionTest.test_collectives and test_send_recv in one run.
DISTRPC_MP_TARGET("dist front target: the Dummy backend over env://") {
  register_test_backends();
  set_rank_env(ctx);
  dist::init_process_group("Dummy");  // env://, rank and world size from the environment
  REQUIRE(dist::is_initialized());
  CHECK(dist::get_rank() == ctx.rank);
  CHECK(dist::get_world_size() == ctx.world);
  CHECK(dist::get_backend() == "dummy");
  auto pg = dist::get_default_group();
  CHECK(pg->sequence_number() == 0);  // equal on every member after init

  at::Tensor input = at::ones({2, 2}) * 7;
  std::vector<at::Tensor> outputs;
  for (int i = 0; i < ctx.world; ++i) outputs.push_back(at::zeros({2, 2}));
  dist::all_gather(outputs, input);
  for (const at::Tensor& o : outputs) CHECK(identical(o, input));

  at::Tensor reduced = at::ones({2, 2}) * 7;
  dist::all_reduce(reduced);
  CHECK(identical(reduced, at::ones({2, 2}) * 7 + 2));

  at::Tensor b = at::zeros({2, 2});
  auto w = dist::broadcast(b, 0, {.async_op = true});
  REQUIRE(w);
  CHECK(w->wait());
  CHECK(identical(b, at::ones({2, 2})));

  at::Tensor out = at::zeros({2, 2});
  std::vector<at::Tensor> ins;
  for (int i = 0; i < ctx.world; ++i) ins.push_back(at::ones({2, 2}) * (i + 1));
  dist::reduce_scatter(out, ins);
  CHECK(identical(out, at::ones({2, 2}) * (ctx.rank + 1)));  // input[rank]

  at::Tensor s = at::zeros({2, 2});
  dist::send(s, (ctx.rank + 1) % ctx.world);
  CHECK(identical(s, at::zeros({2, 2}) + 1));
  CHECK(error_text<std::invalid_argument>([&] { dist::send(s, dist::get_rank()); }) ==
        "Invalid destination rank: destination rank should not be the same as the rank of the "
        "current process.");

  at::Tensor r = at::zeros({2, 2});
  CHECK(dist::recv(r, (ctx.rank + 1) % ctx.world) == (ctx.rank + 1) % ctx.world);
  CHECK(identical(r, at::zeros({2, 2}) + 2));

  dist::barrier();
  // all_gather, all_reduce, broadcast, reduce_scatter, send, recv, barrier: +1 each.
  CHECK(pg->sequence_number() == 7);
  ctx.publish("seq" + std::to_string(ctx.rank), std::to_string(pg->sequence_number()));
  for (int i = 0; i < ctx.world; ++i) CHECK(ctx.lookup("seq" + std::to_string(i)) == "7");
  dist::barrier();  // rank 0 (the store's host) waits for everyone here
  dist::destroy_process_group();
  CHECK_FALSE(dist::is_initialized());
}

TEST_CASE("dist front: a custom backend over env:// with 4 processes (scenario 5)") {
  auto r = run_ranks("dist front target: the Dummy backend over env://", env_run(4, 90));
  INFO(r.report());
  CHECK(r.ok);
}

// Scenario 8: rank translation and its texts, non-member warnings, local-sync groups, groups
// with the same members, sequence numbers per group.
DISTRPC_MP_TEST("dist front: groups, ranks and non-members over file:// (scenario 8)", 4, 120) {
  register_test_backends();
  LogCapture log;
  dist::init_process_group("storetest", ctx.file_url(), ctx.rank, ctx.world, milliseconds(30000));
  const int rank = dist::get_rank();
  CHECK(dist::get_default_group()->sequence_number() == 0);

  // new_group([1]): every process calls it (PyTorch's default), only rank 1 is a member.
  auto group = dist::new_group({1});
  REQUIRE(group);
  if (rank == 1) {
    CHECK(group->is_member());
    CHECK(dist::get_group_rank(group, 1) == 0);
    CHECK(dist::get_global_rank(group, 0) == 1);
    CHECK(dist::get_process_group_ranks(group) == std::vector<int>{1});
    CHECK(error_text<std::invalid_argument>([&] { dist::get_group_rank(group, 0); }) ==
          "Global rank 0 is not part of group group1");
    CHECK(error_text<std::invalid_argument>([&] { dist::get_global_rank(group, 1); }) ==
          "Group rank 1 is not part of group group1 (of size 1)");
    CHECK(dist::get_rank(group) == 0);
    CHECK(dist::get_world_size(group) == 1);
    CHECK(dist::get_backend(group) == "storetest");
  } else {
    CHECK(group == dist::ProcessGroup::non_member());
    CHECK(dist::get_rank(group) == -1);
    CHECK(dist::get_world_size(group) == -1);
  }
  // A group this process made itself, not through new_group.
  auto unregistered = std::make_shared<dist::ProcessGroup>(
      std::make_shared<distrpc::store::PrefixStore>("x", hash_store()), 0, 1,
      dist::BackendConfig("dummy"), milliseconds(1000), "mine");
  CHECK(error_text<std::invalid_argument>([&] { dist::get_group_rank(unregistered, 0); }) ==
        "get_group_rank: Group mine is not registered, please create group with "
        "distrpc::dist::new_group");
  CHECK(error_text<std::invalid_argument>([&] { dist::get_global_rank(unregistered, 0); }) ==
        "get_global_rank: Group mine is not registered, please create group with "
        "distrpc::dist::new_group");
  CHECK(error_text<std::invalid_argument>([&] {
          dist::new_group({0, 4});
        }) == "new_group: rank 4 is outside the world of size 4");
  CHECK(error_text<std::invalid_argument>([&] {
          dist::new_group({2, 2});
        }) == "new_group: rank 2 is listed more than once");

  // Non-members of [0, 2] call collectives on it: nothing happens, one warning per operation.
  auto even = dist::new_group({2, 0});
  REQUIRE(even);
  at::Tensor x = at::full({2}, static_cast<float>(rank + 1));
  std::vector<at::Tensor> xs{at::zeros({2}), at::zeros({2})};
  if (rank % 2 == 1) {
    for (int i = 0; i < 2; ++i) {
      CHECK(dist::all_gather(xs, x, {.group = even}) == nullptr);
      CHECK(dist::all_reduce(x, {.group = even}) == nullptr);
      CHECK(dist::barrier({.group = even}) == nullptr);
      CHECK(dist::broadcast(x, 0, {.group = even}) == nullptr);
    }
    CHECK(identical(x, at::full({2}, static_cast<float>(rank + 1))));  // untouched
    CHECK(identical(xs[0], at::zeros({2})));
    std::vector<std::string> warnings;
    for (const std::string& line : log.lines()) {
      if (line.find("does not belong") != std::string::npos) warnings.push_back(line);
    }
    const std::string r = std::to_string(rank);
    CHECK(warnings ==
          std::vector<std::string>{"warning distrpc::dist: Running all_gather on global rank " + r +
                                       " which does not belong to the given group.",
                                   "warning distrpc::dist: Running all_reduce on global rank " + r +
                                       " which does not belong to the given group.",
                                   "warning distrpc::dist: Running barrier on global rank " + r +
                                       " which does not belong to the given group.",
                                   "warning distrpc::dist: Running broadcast on global rank " + r +
                                       " which does not belong to the given group."});
  } else {
    CHECK(even->sequence_number() == 0);
    dist::all_gather(xs, x, {.group = even});
    CHECK(identical(xs[0], at::full({2}, 1.0f)));  // global rank 0 contributed 1
    CHECK(identical(xs[1], at::full({2}, 3.0f)));  // global rank 2 contributed 3
    dist::all_reduce(x, {.group = even});
    CHECK(identical(x, at::full({2}, 4.0f)));
    dist::barrier({.group = even});
    at::Tensor b = at::full({2}, static_cast<float>(rank));
    dist::broadcast(b, 2, {.group = even});  // src is a global rank
    CHECK(identical(b, at::full({2}, 2.0f)));
    CHECK(even->sequence_number() == 4);  // +1 per collective
    for (const std::string& line : log.lines())
      CHECK(line.find("does not belong") == std::string::npos);
  }

  // Local synchronization: each process makes [rank, rank + 2] and asks for the other pair
  // too; only members meet, non-members get null.
  std::vector<int> ranks_in{rank, (rank + 2) % 4};
  std::vector<int> ranks_out;
  for (int r = 0; r < 4; ++r) {
    if (r != ranks_in[0] && r != ranks_in[1]) ranks_out.push_back(r);
  }
  CHECK(dist::new_group(ranks_out, {.use_local_synchronization = true}) == nullptr);
  auto local = dist::new_group(ranks_in, {.use_local_synchronization = true});
  REQUIRE(local);
  std::sort(ranks_in.begin(), ranks_in.end());
  CHECK(dist::get_process_group_ranks(local) == ranks_in);
  CHECK(dist::get_group_rank(local, rank) == (rank == ranks_in[0] ? 0 : 1));
  CHECK(local->sequence_number() == 0);

  // Two groups with the same members (pairs [0,1] and [2,3]) do not clash.
  const int pair = rank / 2;
  std::vector<int> members{pair * 2, pair * 2 + 1};
  auto first = dist::new_group(members, {.use_local_synchronization = true});
  auto second = dist::new_group(members, {.use_local_synchronization = true});
  REQUIRE(first);
  REQUIRE(second);
  CHECK(first->group_name() != second->group_name());
  CHECK(first->store()->prefix() != second->store()->prefix());
  for (int round = 0; round < 2; ++round) {
    for (const auto& g : {first, second, first}) {
      at::Tensor in = at::tensor({pair, rank}, at::kLong) + round * 100;
      std::vector<at::Tensor> got{at::full({2}, -1, at::kLong), at::full({2}, -1, at::kLong)};
      dist::all_gather(got, in, {.group = g});
      CHECK(identical(got[0], at::tensor({pair, members[0]}, at::kLong) + round * 100));
      CHECK(identical(got[1], at::tensor({pair, members[1]}, at::kLong) + round * 100));
    }
  }
  CHECK(first->sequence_number() == 4);
  CHECK(second->sequence_number() == 2);
  // Every member agrees on the sequence numbers.
  std::vector<std::uint64_t> seqs;
  dist::all_gather_object(seqs, first->sequence_number(), {.group = first});
  CHECK(seqs == std::vector<std::uint64_t>{4, 4});
  CHECK(first->sequence_number() == 6);  // all_gather_object is two allgathers
  dist::barrier();
  dist::destroy_process_group();
}

// A backend that can split its communicator: new_group splits it, on every process, members and
// not, only when every process calls new_group, and only for a group of the same backend.
DISTRPC_MP_TEST("dist front: new_group splits the default group's backend where it can", 3, 120) {
  register_test_backends();
  dist::init_process_group("splittest", ctx.file_url(), ctx.rank, ctx.world, milliseconds(30000));
  const int rank = ctx.rank;
  auto parent = std::dynamic_pointer_cast<SplitBackend>(dist::get_default_group()->backend("cpu"));
  REQUIRE(parent);
  CHECK_FALSE(parent->from_split());

  auto even = dist::new_group({2, 0});
  REQUIRE(parent->calls().size() == 1);
  CHECK(parent->calls()[0].first == std::vector<int>{0, 2});
  CHECK(parent->calls()[0].second == (rank == 1 ? -1 : rank / 2));
  if (rank == 1) {
    CHECK(even == dist::ProcessGroup::non_member());
  } else {
    auto b = std::dynamic_pointer_cast<SplitBackend>(even->backend("cpu"));
    REQUIRE(b);
    CHECK(b->from_split());
    CHECK(b->rank() == rank / 2);
    CHECK(b->size() == 2);
    at::Tensor x = at::full({2}, static_cast<float>(rank + 1));
    dist::all_reduce(x, {.group = even});
    CHECK(identical(x, at::full({2}, 4.0f)));  // 1 + 3: the split group's members only
  }

  // A group of another backend is made as usual.
  auto other = dist::new_group({0, 1, 2}, {.backend = "storetest"});
  REQUIRE(other);
  CHECK(other->backend("cpu")->name() == "storetest");
  CHECK(parent->calls().size() == 1);

  // Members only (use_local_synchronization): nobody else takes part, so nothing is split.
  if (rank < 2) {
    auto local = dist::new_group({0, 1}, {.use_local_synchronization = true});
    REQUIRE(local);
    auto b = std::dynamic_pointer_cast<SplitBackend>(local->backend("cpu"));
    REQUIRE(b);
    CHECK_FALSE(b->from_split());
    at::Tensor x = at::full({1}, static_cast<float>(rank + 1));
    dist::all_reduce(x, {.group = local});
    CHECK(identical(x, at::full({1}, 3.0f)));
  }
  CHECK(parent->calls().size() == 1);

  // A backend name no process knows: members fail alike before any split, a non-member is not
  // in the group.
  if (rank == 1) {
    CHECK(dist::new_group({0, 2}, {.backend = "nosuch"}) == dist::ProcessGroup::non_member());
  } else {
    CHECK(error_text<std::invalid_argument>([] {
            dist::new_group({0, 2}, {.backend = "nosuch"});
          }) == "new_group: backend 'nosuch' is not registered (register_backend(name, creator))");
  }
  CHECK(parent->calls().size() == 1);

  // The whole world, split again: everyone is a member.
  auto all = dist::new_group();
  REQUIRE(parent->calls().size() == 2);
  CHECK(parent->calls()[1].second == rank);
  at::Tensor y = at::full({1}, 1.0f);
  dist::all_reduce(y, {.group = all});
  CHECK(identical(y, at::full({1}, 3.0f)));
  dist::barrier();
  dist::destroy_process_group();
}

// Objects over env://, then the exit without destroy_process_group: ranks 1 and 2 use the store
// after rank 0 has finished its body; rank 0's exit waits for them, so they still reach it.
DISTRPC_MP_TARGET("dist front target: objects, then exit without destroy") {
  register_test_backends();
  set_rank_env(ctx);
  dist::init_process_group("storetest", "env://", -1, -1, milliseconds(30000));

  std::vector<std::pair<int, std::string>> all;
  dist::all_gather_object(all, std::make_pair(ctx.rank * 10, "rank" + std::to_string(ctx.rank)));
  REQUIRE(all.size() == 3u);
  for (int r = 0; r < 3; ++r) {
    CHECK(all[static_cast<std::size_t>(r)].first == r * 10);
    CHECK(all[static_cast<std::size_t>(r)].second == "rank" + std::to_string(r));
  }
  // Values of different lengths, and tensors inside them.
  std::vector<std::vector<at::Tensor>> tensors;
  std::vector<at::Tensor> mine;
  for (int i = 0; i <= ctx.rank; ++i) mine.push_back(at::full({i + 1}, ctx.rank, at::kLong));
  dist::all_gather_object(tensors, mine);
  REQUIRE(tensors.size() == 3u);
  for (int r = 0; r < 3; ++r) {
    REQUIRE(tensors[static_cast<std::size_t>(r)].size() == static_cast<std::size_t>(r + 1));
    CHECK(identical(tensors[static_cast<std::size_t>(r)].back(), at::full({r + 1}, r, at::kLong)));
  }

  std::vector<std::string> objects;
  if (ctx.rank == 1) objects = {"foo", "", "bar baz"};
  dist::broadcast_object_list(objects, 1);
  CHECK(objects == std::vector<std::string>{"foo", "", "bar baz"});

  // all_reduce_coalesced: every tensor reduced (PyTorch's _test_allreduce_coalesced).
  std::vector<at::Tensor> many{at::ones({10, 10}), at::ones({3}) * (ctx.rank + 1)};
  dist::all_reduce_coalesced(many, {.op = dist::ReduceOp::SUM});
  CHECK(identical(many[0], at::ones({10, 10}) * 3));
  CHECK(identical(many[1], at::ones({3}) * 6));

  // Point to point around the ring, with tags kept apart, blocking and not.
  const int next = (ctx.rank + 1) % 3;
  const int prev = (ctx.rank + 2) % 3;
  at::Tensor a = at::full({2}, ctx.rank * 1.0f);
  at::Tensor b = at::full({2}, ctx.rank * 10.0f);
  dist::send(b, next, {.tag = 7});
  auto sent = dist::isend(a, next);
  REQUIRE(sent);
  CHECK(sent->wait());
  at::Tensor got_a = at::zeros({2});
  at::Tensor got_b = at::zeros({2});
  CHECK(dist::recv(got_a, prev) == prev);  // tag 0 first, though tag 7 was sent first
  auto pending = dist::irecv(got_b, prev, {.tag = 7});
  REQUIRE(pending);
  CHECK(pending->wait());
  CHECK(identical(got_a, at::full({2}, prev * 1.0f)));
  CHECK(identical(got_b, at::full({2}, prev * 10.0f)));
  // From any source: ranks 1 and 2 send to 0, which learns who sent what.
  if (ctx.rank == 0) {
    std::set<int> sources;
    for (int i = 0; i < 2; ++i) {
      at::Tensor t = at::zeros({1});
      const int src = dist::recv(t, std::nullopt, {.tag = 3});
      CHECK(t.item<float>() == static_cast<float>(src * 100));
      sources.insert(src);
    }
    CHECK(sources == std::set<int>{1, 2});
  } else {
    at::Tensor t = at::full({1}, ctx.rank * 100.0f);
    dist::send(t, 0, {.tag = 3});
  }

  if (ctx.rank != 0) {
    std::this_thread::sleep_for(milliseconds(500));
    auto store = dist::get_default_store();
    store->set("late" + std::to_string(ctx.rank), std::string_view("here"));
    CHECK(store->get_string("late" + std::to_string(ctx.rank)) == "here");
  }
  // No destroy_process_group: the process exits with its groups still up.
}

TEST_CASE("dist front: object collectives, and processes exit cleanly without destroy") {
  auto r = run_ranks("dist front target: objects, then exit without destroy", env_run(3, 60));
  INFO(r.report());
  CHECK(r.ok);
  for (const auto& rank : r.ranks) {
    CHECK(rank.exit_code == 0);
    CHECK(rank.output.find("not every rank checked out") == std::string::npos);
  }
}

// init, destroy, init again (another store and backend), destroy; and destroying one group.
DISTRPC_MP_TARGET("dist front target: init, destroy, init again") {
  register_test_backends();
  set_rank_env(ctx);
  dist::init_process_group("storetest", ctx.file_url() + "-first", ctx.rank, ctx.world,
                           milliseconds(30000));
  at::Tensor t = at::full({3}, static_cast<float>(ctx.rank + 1));
  dist::all_reduce(t, {.op = dist::ReduceOp::MAX});
  CHECK(identical(t, at::full({3}, 2.0f)));
  auto sub = dist::new_group();
  REQUIRE(sub);
  CHECK(sub->group_name() == "group1");
  dist::destroy_process_group(sub);
  CHECK(error_text<std::invalid_argument>([&] { dist::get_group_rank(sub, 0); }) ==
        "get_group_rank: Group group1 is not registered, please create group with "
        "distrpc::dist::new_group");
  CHECK(dist::is_initialized());
  dist::destroy_process_group();
  CHECK_FALSE(dist::is_initialized());
  CHECK(error_text<std::logic_error>([] { dist::get_world_size(); }) ==
        "Default process group has not been initialized, please make sure to call "
        "init_process_group.");

  dist::init_process_group({.backend = "dummy", .timeout = milliseconds(30000)});  // env://
  CHECK(dist::get_backend() == "dummy");
  CHECK(dist::get_world_size() == ctx.world);
  CHECK(dist::get_default_group()->sequence_number() == 0);
  auto again = dist::new_group();
  CHECK(again->group_name() == "group1");  // names start again with the new default group
  at::Tensor u = at::zeros({1});
  dist::all_reduce(u);
  CHECK(identical(u, at::full({1}, 2.0f)));
  dist::destroy_process_group();

  // A third time over tcp://host:port, rank and world size in the URL.
  const std::string port = std::getenv("DISTRPC_TEST_TCP_PORT");
  dist::init_process_group("storetest",
                           "tcp://127.0.0.1:" + port + "?rank=" + std::to_string(ctx.rank) +
                               "&world_size=" + std::to_string(ctx.world),
                           -1, -1, milliseconds(30000));
  CHECK(dist::get_rank() == ctx.rank);
  at::Tensor v = at::full({2}, static_cast<float>(ctx.rank + 1));
  dist::all_reduce(v, {.op = dist::ReduceOp::PRODUCT});
  CHECK(identical(v, at::full({2}, 2.0f)));
  dist::destroy_process_group();
}

TEST_CASE("dist front: init, destroy and init again in two processes") {
  RunOptions o = env_run(2, 60);
  o.env.push_back("DISTRPC_TEST_TCP_PORT=" +
                  std::to_string(distrpc::testing::free_loopback_port()));
  auto r = run_ranks("dist front target: init, destroy, init again", o);
  INFO(r.report());
  CHECK(r.ok);
}
