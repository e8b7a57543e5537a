// The RPC core suite, from docs spec rpc.md (groups A-H, M, N, O, Q) and its acceptance scenarios
// 1, 2, 10-14, 16, 17, 19-23, 25. Their RRef / remote() parts are in test_rref.cpp.
//
// Every multi-process case runs its body in 4 fresh processes named worker{rank}, meeting through
// a file:// rendezvous, and ends with a graceful shutdown (a shutdown that hangs fails the case
// through its wall-clock limit). Functions called remotely are free functions (or static member
// functions) in namespace rpc_test: they run in the callee's process, so their globals change
// there only. Cases that expect a crash or must read a rank's output run a DISTRPC_MP_TARGET
// through run_ranks().
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <doctest/doctest.h>

#include <distrpc/rpc.hpp>
#include <distrpc/rref.hpp>
#include <distrpc/transport/tcp.hpp>

#include "multiprocess.hpp"
#include "support/rpc_test_util.hpp"
#include "support/rpc_under_test.hpp"
#include "support/tls_certs.hpp"

using namespace distrpc::testing::rpc_names;

namespace {

// doctest::Contains takes a doctest::String, built from a C string.
doctest::Contains has(const std::string& text) {
  return doctest::Contains(text.c_str());
}

// A fresh 2x3 sparse COO tensor: upstream's build_sparse_tensor(); `coalesce` as upstream.
at::Tensor build_sparse(bool coalesce) {
  auto i = at::tensor(std::vector<int64_t>{0, 1, 1, 2, 0, 2}, at::kLong).view({2, 3});
  auto v = at::tensor(std::vector<float>{3, 4, 5});
  auto t = at::sparse_coo_tensor(i, v, {2, 3});
  return coalesce ? t.coalesce() : t;
}

// Uncoalesced for sure: index (0, 1) appears twice.
at::Tensor build_uncoalesced_sparse() {
  auto i = at::tensor(std::vector<int64_t>{0, 0, 1, 1}, at::kLong).view({2, 2});
  auto v = at::tensor(std::vector<float>{1, 2});
  return at::sparse_coo_tensor(i, v, {2, 3});
}

}  // namespace

// ---- functions run remotely -------------------------------------------------------------------

namespace rpc_test {

at::Tensor add(at::Tensor a, at::Tensor b) {
  return a + b;
}
at::Tensor add_scalar(at::Tensor a, double s) {
  return a + s;
}
int echo_int(int x) {
  return x;
}
WorkerInfo echo_info(WorkerInfo w) {
  return w;
}
at::Tensor echo_tensor(at::Tensor t) {
  return t;
}

int registered_by_macro(int x) {
  return x + 1000;
}
DISTRPC_REGISTER(registered_by_macro);

// A global of the callee's process.
std::atomic<int> g_value{-1};
void set_value(int v) {
  g_value = v;
}
int get_value() {
  return g_value.load();
}

struct Calc {
  static at::Tensor mul(at::Tensor a, at::Tensor b) { return a * b; }
  static int twice(int x) { return 2 * x; }
};

int sleep_ms(int ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return ms;
}

// A handler that blocks until released (or 20 s pass, so a broken test cannot hang forever).
std::mutex g_hold_mu;
std::condition_variable g_hold_cv;
bool g_hold_open = false;
std::atomic<int> g_held{0};
int hold_until_released(int v) {
  ++g_held;
  std::unique_lock<std::mutex> lk(g_hold_mu);
  g_hold_cv.wait_for(lk, 20s, [] { return g_hold_open; });
  return v;
}
int release_held() {
  {
    std::lock_guard<std::mutex> lk(g_hold_mu);
    g_hold_open = true;
  }
  g_hold_cv.notify_all();
  return g_held.load();
}

// ---- exceptions ----
struct UnregisteredError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct MyError : std::runtime_error {
  explicit MyError(const std::string& m) : std::runtime_error(m) {}
};

int raise_kind(std::string kind, std::string msg) {
  if (kind == "runtime") throw std::runtime_error(msg);
  if (kind == "invalid_argument") throw std::invalid_argument(msg);
  if (kind == "out_of_range") throw std::out_of_range(msg);
  if (kind == "logic") throw std::logic_error(msg);
  if (kind == "c10") {
    TORCH_CHECK(false, msg);
  }
  if (kind == "value") {
    TORCH_CHECK_VALUE(false, msg);
  }
  if (kind == "type") {
    TORCH_CHECK_TYPE(false, msg);
  }
  if (kind == "index") {
    TORCH_CHECK_INDEX(false, msg);
  }
  if (kind == "unregistered") throw UnregisteredError(msg);
  // A c10::Error subclass distrpc does not name (as libtorch 2.x's c10::DistStoreError).
  if (kind == "c10_other") C10_THROW_ERROR(OutOfMemoryError, msg);
  if (kind == "mine") throw MyError(msg);
  if (kind == "size") return static_cast<int>((at::ones({2}) + at::ones({3})).numel());
  return 0;
}

// ---- containers and tensors ----
std::vector<at::Tensor> vec_double(std::vector<at::Tensor> v) {
  for (auto& t : v) t = t * 2;
  return v;
}
std::tuple<int, std::string, at::Tensor> tuple_step(std::tuple<int, std::string, at::Tensor> t) {
  return {std::get<0>(t) + 1, std::get<1>(t) + "!", std::get<2>(t) + 1};
}
std::map<std::string, std::vector<at::Tensor>> map_echo(
    std::map<std::string, std::vector<at::Tensor>> m) {
  return m;
}
std::optional<at::Tensor> opt_echo(std::optional<at::Tensor> t) {
  return t;
}
using Nested =
    std::vector<std::tuple<std::string, std::vector<at::Tensor>, std::map<int, std::string>>>;
Nested nested_echo(Nested n) {
  return n;
}
// User types with their own serializer, nesting other serialized values (re-entrant).
struct Point {
  int x = 0;
  std::vector<at::Tensor> ts;
  std::map<std::string, int> tags;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(x, ts, tags);
  }
};
struct Outer {
  Point p;
  std::vector<Point> more;
  std::optional<std::string> note;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(p, more, note);
  }
};
Outer outer_step(Outer o) {
  o.p.x += 1;
  for (auto& q : o.more) q.x *= 10;
  o.note = o.note.value_or("") + "+";
  return o;
}
std::tuple<at::Tensor, at::Tensor> same_twice(at::Tensor a, at::Tensor b) {
  return {a + b, a};
}
// What the callee sees of a tensor argument, and the argument itself sent back.
std::tuple<std::vector<int64_t>, bool, int64_t, at::Tensor> tensor_facts(at::Tensor t) {
  return {t.strides().vec(), t.is_contiguous(), static_cast<int64_t>(t.storage().nbytes()), t};
}
// A non-contiguous result made on the callee.
at::Tensor make_transposed(int64_t n) {
  return at::arange(n * n, at::kFloat).view({n, n}).t();
}
std::tuple<bool, bool, at::Tensor> sparse_facts(at::Tensor t) {
  return {t.is_sparse(), t.is_sparse() && t.is_coalesced(), t};
}

// ---- nested calls and callbacks inside functions ----
at::Tensor nested_back(std::string caller) {
  return distrpc::rpc_sync<&add_scalar>(caller, at::ones({2, 2}), 1.0);
}
// A sync function blocking on a value set by a then() callback of a nested call.
at::Tensor add_use_future_cb(std::string to, at::Tensor x, double y, double z) {
  Future<at::Tensor> out;
  auto child = distrpc::rpc_async<&add_scalar>(to, x, y).then(
      [out, z](Future<at::Tensor>& f) { out.set_value(f.value() + z); });
  (void)child;
  return out.value();
}
// As above, through add_done_callback.
at::Tensor add_use_future_set_result(std::string to, at::Tensor x, double y, double z) {
  Future<at::Tensor> out;
  distrpc::rpc_async<&add_scalar>(to, x, y).add_done_callback(
      [out, z](Future<at::Tensor>& f) { out.set_value(f.value() + z); });
  return out.value();
}
// The callback itself makes a nested call and completes `out` from that call's callback.
at::Tensor add_use_future_nested_cb(std::string to, at::Tensor x, double y, double z) {
  Future<at::Tensor> out;
  distrpc::rpc_async<&add_scalar>(to, x, y).add_done_callback([out, to, z](Future<at::Tensor>& f1) {
    distrpc::rpc_async<&add_scalar>(to, f1.value(), z)
        .add_done_callback([out](Future<at::Tensor>& f2) { out.set_value(f2.value()); });
  });
  return out.value();
}

// ---- async functions (return a Future) ----
Future<at::Tensor> async_add(std::string to, at::Tensor x, at::Tensor y) {
  return distrpc::rpc_async<&add>(to, x, y);
}
Future<at::Tensor> async_add_chained_multi(std::string to, at::Tensor x, int num, double step) {
  auto fut = distrpc::rpc_async<&add_scalar>(to, x, 0.0);
  for (int i = 0; i < num; ++i) {
    fut = fut.then([step](Future<at::Tensor>& f) { return f.value() + step; });
  }
  return fut;
}
Future<at::Tensor> async_add_multi_fanout(std::string to, at::Tensor x, int num, double step) {
  struct State {
    std::mutex mu;
    int cnt = 0;
    at::Tensor ret;
  };
  auto st = std::make_shared<State>();
  st->ret = at::zeros_like(x);
  Future<at::Tensor> ret_future;
  for (int i = 0; i < num; ++i) {
    auto f = distrpc::rpc_async<&add_scalar>(to, i == 0 ? x : at::zeros_like(x), step);
    auto child = f.then([st, num, ret_future](Future<at::Tensor>& done) {
      std::lock_guard<std::mutex> lk(st->mu);
      st->cnt += 1;
      st->ret += done.value();
      if (st->cnt >= num) ret_future.set_value(st->ret.clone());
    });
    (void)child;
  }
  return ret_future;
}
Future<at::Tensor> async_add_with_future_ctor(std::string to, at::Tensor x, at::Tensor y,
                                              double z) {
  Future<at::Tensor> out;
  distrpc::rpc_async<&add>(to, x, y).add_done_callback(
      [out, z](Future<at::Tensor>& f) { out.set_value(f.value() + z); });
  return out;
}
Future<at::Tensor> async_add_nested(std::string to, at::Tensor x, at::Tensor y, double z) {
  return distrpc::rpc_async<&async_add>(to, to, x, y).then([z](Future<at::Tensor>& f) {
    return f.value() + z;
  });
}
Future<int> async_raise() {
  throw std::runtime_error("Expected error");
}
Future<int> async_raise_later(std::string to) {
  return distrpc::rpc_async<&echo_int>(to, 1).then(
      [](Future<int>&) -> int { throw std::runtime_error("Expected error"); });
}
Future<void> async_void(std::string to, int v) {
  return distrpc::rpc_async<&set_value>(to, v);
}
struct AsyncCalc {
  static Future<at::Tensor> add(std::string to, at::Tensor x, at::Tensor y) {
    return distrpc::rpc_async<&rpc_test::add>(to, x, y);
  }
};
// Parameter-server style: every request is held until `n` have arrived, then all complete.
std::mutex g_ps_mu;
std::vector<Future<int>> g_ps_waiting;
Future<int> held_until_n(int n) {
  Future<int> mine;
  std::vector<Future<int>> ready;
  {
    std::lock_guard<std::mutex> lk(g_ps_mu);
    g_ps_waiting.push_back(mine);
    if (static_cast<int>(g_ps_waiting.size()) == n) ready.swap(g_ps_waiting);
  }
  for (auto& f : ready) f.set_value(n);
  return mine;
}

// ---- barrier counters (on the leader) ----
std::atomic<int> g_barrier_count{0};
void reset_count() {
  g_barrier_count = 0;
}
void increment_count() {
  ++g_barrier_count;
}

// ---- shutdown ----
int heavy_rpc(at::Tensor t) {
  for (int i = 1; i < 100; ++i) {
    t *= i;
    t /= i + 1;
  }
  return 0;
}
std::atomic<int> g_ring_hits{0};
int ring_hop(int ttl) {
  ++g_ring_hits;
  if (ttl > 0) {
    const auto self = distrpc::get_worker_info();
    const int world = static_cast<int>(distrpc::get_worker_infos().size());
    // Fire and forget: nobody waits for this future.
    (void)distrpc::rpc_async<&ring_hop>((self.id + 1) % world, ttl - 1);
  }
  return 0;
}

}  // namespace rpc_test

using namespace rpc_test;

// ---- A. initialization -------------------------------------------------------------------------

DISTRPC_MP_TEST("rpc: ring add in sync, async and builtin modes", 4, 60) {
  init(ctx);
  const int n = ctx.rank + 1;
  const int dst = (ctx.rank + 1) % ctx.world;
  const auto x = at::ones({n, n});

  // Scenario 1: worker i calls worker i+1: add(ones(n,n), ones(n,n)) = 2*ones.
  CHECK(at::equal(distrpc::rpc_sync<&add>(wname(dst), x, x), x * 2));
  auto f = distrpc::rpc_async<&add>(wname(dst), x, x);
  CHECK(at::equal(f.value(), x * 2));
  auto b = distrpc::rpc_sync(wname(dst), "aten::add.Tensor", std::vector<c10::IValue>{x, x});
  REQUIRE(b.isTensor());
  CHECK(at::equal(b.toTensor(), x * 2));
  auto bf = distrpc::rpc_async(wname(dst), "aten::add.Tensor", std::vector<c10::IValue>{x, x});
  CHECK(at::equal(bf.value().toTensor(), x * 2));
  CHECK(at::equal(distrpc::rpc_sync<&add_scalar>(wname(dst), x, 1.0), x + 1));

  // Concurrent calls: each result goes to its own future.
  std::vector<Future<int>> futs;
  for (int i = 0; i < 20; ++i) futs.push_back(distrpc::rpc_async<&echo_int>(wname(dst), i));
  for (int i = 0; i < 20; ++i) CHECK(futs[static_cast<std::size_t>(i)].value() == i);

  // Registered with DISTRPC_REGISTER.
  CHECK(distrpc::rpc_sync<&registered_by_macro>(wname(dst), 1) == 1001);

  // The function runs in the callee's process: its global changes there only.
  distrpc::rpc_sync<&set_value>(wname(dst), 100 * ctx.rank + 7);
  distrpc::barrier();
  const int pred = (ctx.rank + ctx.world - 1) % ctx.world;
  CHECK(g_value.load() == 100 * pred + 7);

  // Defaults: 60 s timeout, 16 worker threads.
  CHECK(distrpc::get_rpc_timeout() == 60s);
  CHECK(distrpc::get_debug_info().at("thread_pool_size") == "16");

  distrpc::shutdown();
}

DISTRPC_MP_TEST("rpc: destinations by name, WorkerInfo and rank; self calls; bad destinations", 4,
                60) {
  init(ctx);
  const int dst = (ctx.rank + 1) % ctx.world;

  // Self and peers.
  const WorkerInfo me = distrpc::get_worker_info();
  CHECK(me.id == ctx.rank);
  CHECK(me.name == wname(ctx.rank));
  const WorkerInfo peer = distrpc::get_worker_info(wname(dst));
  CHECK(peer.id == dst);
  CHECK(peer.name == wname(dst));

  // All workers: names worker0..3, ids 0..3.
  const auto infos = distrpc::get_worker_infos();
  REQUIRE(infos.size() == 4);
  std::set<int> ids;
  std::set<std::string> names;
  for (const auto& w : infos) {
    ids.insert(w.id);
    names.insert(w.name);
    CHECK(w.name == wname(w.id));
  }
  CHECK(ids == std::set<int>{0, 1, 2, 3});
  CHECK(names == std::set<std::string>{"worker0", "worker1", "worker2", "worker3"});

  // A peer by name, WorkerInfo and rank, in sync and async.
  CHECK(distrpc::rpc_sync<&Calc::twice>(wname(dst), 3) == 6);
  CHECK(distrpc::rpc_sync<&Calc::twice>(peer, 4) == 8);
  CHECK(distrpc::rpc_sync<&Calc::twice>(dst, 5) == 10);
  CHECK(distrpc::rpc_async<&Calc::twice>(wname(dst), 6).value() == 12);
  CHECK(distrpc::rpc_async<&Calc::twice>(peer, 7).value() == 14);
  CHECK(distrpc::rpc_async<&Calc::twice>(dst, 8).value() == 16);

  // Self calls, all three ways, and builtins to self.
  const auto x = at::ones({2, 2});
  CHECK(at::equal(distrpc::rpc_sync<&add>(wname(ctx.rank), x, x), x * 2));
  CHECK(at::equal(distrpc::rpc_sync<&add>(me, x, x), x * 2));
  CHECK(at::equal(distrpc::rpc_async<&add>(ctx.rank, x, x).value(), x * 2));
  CHECK(at::equal(
      distrpc::rpc_sync(ctx.rank, "aten::add.Tensor", std::vector<c10::IValue>{x, x}).toTensor(),
      x * 2));
  // A self call keeps value semantics: the callee's in-place change does not reach the caller.
  auto keep = at::ones({100, 100});
  CHECK(distrpc::rpc_sync<&heavy_rpc>(ctx.rank, keep) == 0);
  CHECK(at::equal(keep, at::ones({100, 100})));

  // WorkerInfo travels as a value.
  CHECK(distrpc::rpc_sync<&echo_info>(wname(dst), me) == me);

  // Unknown name: "could not find destination", for queries, sync and async.
  CHECK_THROWS_WITH_AS(distrpc::get_worker_info("nope"),
                       doctest::Contains("could not find destination"), distrpc::RpcError);
  CHECK_THROWS_WITH(distrpc::rpc_sync<&echo_int>("nope", 1),
                    doctest::Contains("could not find destination"));
  CHECK_THROWS_WITH(distrpc::rpc_async<&echo_int>("nope", 1).value(),
                    doctest::Contains("could not find destination"));
  CHECK_THROWS_WITH(distrpc::rpc_sync("nope", "aten::add.Tensor", std::vector<c10::IValue>{x, x}),
                    doctest::Contains("could not find destination"));

  // Bad ranks (world+1, -1): an error in every mode (raised at the call or through the future).
  for (int bad : {ctx.world + 1, -1}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(distrpc::rpc_sync<&echo_int>(bad, 1), distrpc::RpcError);
    CHECK_THROWS_AS(distrpc::rpc_async<&echo_int>(bad, 1).value(), distrpc::RpcError);
    CHECK_THROWS_AS(distrpc::rpc_sync(bad, "aten::add.Tensor", std::vector<c10::IValue>{x, x}),
                    distrpc::RpcError);
    CHECK_THROWS_AS(
        distrpc::rpc_async(bad, "aten::add.Tensor", std::vector<c10::IValue>{x, x}).value(),
        distrpc::RpcError);
  }
  // A WorkerInfo that names no worker of the group.
  CHECK_THROWS_AS(distrpc::rpc_sync<&echo_int>(WorkerInfo{dst, "impostor"}, 1), distrpc::RpcError);
  // The agent is fine afterwards.
  CHECK(distrpc::rpc_sync<&echo_int>(dst, 9) == 9);

  distrpc::shutdown();
}

// The agent routes its own calls off the request pool by reading only the header's first fields:
// the peek agrees with the full decode, whatever the name's and signature text's lengths, and a
// header cut short anywhere reads as a user call (the full decode then reports it).
TEST_CASE("rpc: a request header's internal flag is read without decoding the rest") {
  for (const bool internal : {false, true}) {
    for (const std::string& name : {std::string(), std::string("f"), std::string(300, 'n')}) {
      distrpc::RequestHeader h;
      h.name = name;
      h.signature = 0x0101010101010101ULL;  // a byte that would read as `true` if misaligned
      h.internal = internal;
      h.mode = 3;
      h.mode_data = "mode";
      h.signature_text = std::string(name.size() % 7, 's');
      distrpc::wire::Message m;
      m.type = distrpc::wire::MessageType::Request;
      distrpc::wire::encode(m, h, 42);
      CHECK(distrpc::RequestHeader::peek_internal(m) == internal);
      distrpc::RequestHeader back;
      distrpc::wire::InputArchive ar(m);
      ar(back);
      CHECK(back.internal == internal);
      for (std::size_t cut = 0; cut < m.payload.size(); ++cut) {
        distrpc::wire::Message shorter = m;
        shorter.payload.resize(cut);
        const bool whole_flag = cut > 8 + name.size() + 8 + 8 + h.signature_text.size();
        CHECK(distrpc::RequestHeader::peek_internal(shorter) == (internal && whole_flag));
      }
    }
  }
}

TEST_CASE("rpc: WorkerInfo string form, equality and hashing") {
  const WorkerInfo a{1, "worker1"};
  const WorkerInfo b{1, "worker1"};
  const WorkerInfo c{2, "worker2"};
  CHECK(a.str() == "WorkerInfo(id=1, name=worker1)");
  std::ostringstream s;
  s << c;
  CHECK(s.str() == "WorkerInfo(id=2, name=worker2)");
  CHECK(a == b);
  CHECK_FALSE(a == c);
  CHECK(a != c);
  CHECK(std::hash<WorkerInfo>{}(a) == std::hash<WorkerInfo>{}(b));
  std::unordered_map<WorkerInfo, int> m;
  m[a] = 1;
  m[b] = 2;  // the same key
  m[c] = 3;
  CHECK(m.size() == 2);
  CHECK(m.at(WorkerInfo{1, "worker1"}) == 2);
  std::unordered_set<WorkerInfo> set{a, b, c};
  CHECK(set.size() == 2);
}

DISTRPC_MP_TEST("rpc: world_size 1, invalid names, init then immediate non-graceful shutdown", 1,
                60) {
  using distrpc::transport::Tcp;
  // Name validation happens before anything starts.
  RpcBackendOptions o;
  o.init_method = file_url(ctx, "names");
  CHECK_THROWS_WITH(distrpc::init_rpc<Tcp>("abc*", 0, 1, o),
                    doctest::Contains("Worker name must match"));
  CHECK_THROWS_WITH(distrpc::init_rpc<Tcp>(" ", 0, 1, o),
                    doctest::Contains("Worker name must match"));
  CHECK_THROWS_WITH(distrpc::init_rpc<Tcp>("", 0, 1, o), doctest::Contains("must be non-empty"));
  CHECK_THROWS_WITH(distrpc::init_rpc<Tcp>(std::string(500, 'a'), 0, 1, o),
                    doctest::Contains("shorter than 128"));
  {
    RpcBackendOptions bad = o;
    bad.sync_wait_spin = std::chrono::microseconds(-1);
    CHECK_THROWS_WITH_AS(
        distrpc::init_rpc<Tcp>("worker0", 0, 1, bad),
        doctest::Contains("sync_wait_spin must be >= 0 us (0: never poll), got -1"),
        std::invalid_argument);
  }
  CHECK_FALSE(distrpc::is_initialized());

  // world_size 1: sync, async and builtins to self.
  init(ctx);
  CHECK(distrpc::get_worker_infos().size() == 1);
  CHECK(distrpc::get_worker_info() == WorkerInfo{0, "worker0"});
  const auto x = at::ones({3, 3});
  CHECK(at::equal(distrpc::rpc_sync<&add>("worker0", x, x), x * 2));
  CHECK(at::equal(distrpc::rpc_async<&add>(0, x, x).value(), x * 2));
  CHECK(at::equal(distrpc::rpc_sync(distrpc::get_worker_info(), "aten::add.Tensor",
                                    std::vector<c10::IValue>{x, x})
                      .toTensor(),
                  x * 2));
  distrpc::barrier();
  distrpc::shutdown();

  // Polling disabled (sync_wait_spin 0): blocking calls sleep at once and still get their value.
  {
    RpcBackendOptions no_poll = o;
    no_poll.init_method = file_url(ctx, "no-poll");
    no_poll.sync_wait_spin = std::chrono::microseconds(0);
    distrpc::init_rpc<Tcp>("worker0", 0, 1, no_poll);
    CHECK(at::equal(distrpc::rpc_sync<&add>("worker0", x, x), x * 2));
    distrpc::shutdown();
  }

  // The secret guards the rendezvous store as well as the connections: without it nobody reads or
  // rewrites the workers' addresses there.
  {
    namespace st = distrpc::store;
    st::TCPStoreOptions probe_opts;
    probe_opts.is_master = true;
    auto probe = std::make_unique<st::TCPStore>(probe_opts);
    const int port = probe->port();
    probe.reset();  // frees the port for the agent's store
    RpcBackendOptions guarded = o;
    guarded.init_method = "tcp://127.0.0.1:" + std::to_string(port);
    guarded.auth_token = "rendezvous secret";
    distrpc::init_rpc<Tcp>("worker0", 0, 1, guarded);
    CHECK(at::equal(distrpc::rpc_sync<&add>("worker0", x, x), x * 2));
    st::TCPStoreOptions client;
    client.port = port;
    client.timeout = std::chrono::seconds(5);
    CHECK_THROWS_WITH_AS(
        st::TCPStore{client},
        doctest::Contains("a server with a shared secret refuses a client without one"),
        distrpc::DistNetworkError);
    client.auth_secret = "rendezvous secret";
    st::TCPStore member(client);
    member.set("probe", "1");
    CHECK(member.get_string("probe") == "1");
    distrpc::shutdown();

    // TLS likewise: RpcBackendOptions::tls reaches the rendezvous store.
    probe = std::make_unique<st::TCPStore>(probe_opts);
    const int tls_port = probe->port();
    probe.reset();
    const auto& certs = distrpc::testing::tls_files();
    RpcBackendOptions encrypted = o;
    encrypted.init_method = "tcp://127.0.0.1:" + std::to_string(tls_port);
    encrypted.tls = certs.server;
    distrpc::init_rpc<Tcp>("worker0", 0, 1, encrypted);
    st::TCPStoreOptions plain;
    plain.port = tls_port;
    plain.timeout = std::chrono::seconds(5);
    CHECK_THROWS_WITH_AS(st::TCPStore{plain},
                         doctest::Contains("a server with TLS a client without TLS"),
                         distrpc::DistNetworkError);
    plain.tls = certs.client;
    st::TCPStore tls_member(plain);
    tls_member.set("probe", "1");
    CHECK(tls_member.get_string("probe") == "1");
    distrpc::shutdown();
  }

  // Every allowed character, then an immediate non-graceful shutdown.
  o.init_method = file_url(ctx, "second");
  distrpc::init_rpc<Tcp>("Ab-9_:z", 0, 1, o);
  CHECK(distrpc::get_worker_info().name == "Ab-9_:z");
  distrpc::shutdown(/*graceful=*/false);
  CHECK_FALSE(distrpc::is_initialized());
}

DISTRPC_MP_TEST("rpc: API before init, double init, API after shutdown, re-init", 4, 60) {
  const std::string not_set = "Current RPC agent is not set! Did you initialize the RPC framework";
  CHECK_THROWS_WITH(distrpc::get_worker_info(), has(not_set));
  CHECK_THROWS_WITH(distrpc::get_worker_infos(), has(not_set));
  CHECK_THROWS_WITH(distrpc::rpc_sync<&echo_int>("worker0", 1), has(not_set));
  CHECK_THROWS_WITH(distrpc::rpc_async<&echo_int>("worker0", 1), has(not_set));
  CHECK_THROWS_WITH(distrpc::get_rpc_timeout(), has(not_set));
  CHECK_THROWS_WITH(distrpc::barrier(), has(not_set));
  CHECK_FALSE(distrpc::is_initialized());

  init(ctx);
  CHECK(distrpc::is_initialized());
  // Initialized twice: refused, and the running agent is untouched.
  RpcBackendOptions o;
  o.init_method = file_url(ctx, "twice");
  CHECK_THROWS_WITH(distrpc::testing::init_rpc_under_test(wname(ctx.rank), ctx.rank, ctx.world, o),
                    doctest::Contains("is already initialized"));
  const int dst = (ctx.rank + 1) % ctx.world;
  CHECK(distrpc::rpc_sync<&echo_int>(dst, 3) == 3);
  distrpc::shutdown();

  // After shutdown: "RPC has not been initialized".
  const std::string gone = "RPC has not been initialized";
  CHECK_FALSE(distrpc::is_initialized());
  CHECK_THROWS_WITH(distrpc::rpc_sync<&echo_int>(dst, 1), has(gone));
  CHECK_THROWS_WITH(distrpc::rpc_async<&echo_int>(dst, 1).value(), has(gone));
  CHECK_THROWS_WITH(distrpc::get_worker_info(), has(gone));
  CHECK_THROWS_WITH(distrpc::rpc_sync(dst, "aten::add.Tensor",
                                      std::vector<c10::IValue>{at::ones({1}), at::ones({1})}),
                    has(gone));
  CHECK_THROWS_WITH(distrpc::shutdown(), has(gone));

  // Re-init in the same processes with a fresh init method.
  o.init_method = file_url(ctx, "again");
  distrpc::testing::init_rpc_under_test(wname(ctx.rank), ctx.rank, ctx.world, o);
  const auto x = at::ones({2, 2});
  CHECK(at::equal(distrpc::rpc_sync<&add>(dst, x, x), x * 2));
  distrpc::shutdown();
}

DISTRPC_MP_TEST("rpc: duplicate worker names fail on every rank", 4, 60) {
  RpcBackendOptions o;
  // Every rank the same name.
  o.init_method = file_url(ctx, "dup-all");
  CHECK_THROWS_WITH(distrpc::testing::init_rpc_under_test("duplicate_name", ctx.rank, ctx.world, o),
                    doctest::Contains("is not unique"));
  CHECK_FALSE(distrpc::is_initialized());
  // Only ranks 0 and 3 clash (worker_name(rank % (world - 1))): every rank still fails.
  o.init_method = file_url(ctx, "dup-one");
  CHECK_THROWS_WITH(distrpc::testing::init_rpc_under_test(wname(ctx.rank % (ctx.world - 1)),
                                                          ctx.rank, ctx.world, o),
                    doctest::Contains("is not unique"));
  CHECK_FALSE(distrpc::is_initialized());
  if (distrpc::is_initialized()) distrpc::shutdown(false);  // keep a broken library from hanging
  // Init is all-or-nothing: a correct init afterwards works.
  init(ctx);
  CHECK(distrpc::rpc_sync<&echo_int>((ctx.rank + 1) % ctx.world, 5) == 5);
  distrpc::shutdown();
}

// ---- C. kinds of callables, builtins
// --------------------------------------------------------------

DISTRPC_MP_TEST("rpc: void functions, static member functions, builtin operators", 4, 60) {
  init(ctx);
  const int dst = (ctx.rank + 1) % ctx.world;
  const auto x = at::ones({2, 2});

  // void: sync returns nothing, async gives Future<void>.
  distrpc::rpc_sync<&set_value>(dst, 11);
  CHECK(distrpc::rpc_sync<&get_value>(dst) == 11);
  Future<void> fv = distrpc::rpc_async<&set_value>(dst, 12);
  fv.value();
  CHECK(fv.done());
  CHECK_FALSE(fv.has_error());
  CHECK(distrpc::rpc_sync<&get_value>(dst) == 12);

  // Static member functions.
  CHECK(at::equal(distrpc::rpc_sync<&Calc::mul>(dst, x * 3, x * 2), x * 6));
  CHECK(distrpc::rpc_async<&Calc::twice>(dst, 21).value() == 42);

  // Builtin operators by schema name.
  auto y = at::arange(4, at::kFloat).view({2, 2});
  CHECK(at::equal(
      distrpc::rpc_sync(dst, "aten::mul.Tensor", std::vector<c10::IValue>{x * 3, y}).toTensor(),
      y * 3));
  CHECK(at::equal(
      distrpc::rpc_sync(dst, "aten::add.Scalar", std::vector<c10::IValue>{x, 1.5}).toTensor(),
      x + 1.5));
  auto nz = at::tensor(std::vector<float>{0, 1, 0, 2});
  CHECK(at::equal(
      distrpc::rpc_async(dst, "aten::nonzero", std::vector<c10::IValue>{nz}).value().toTensor(),
      at::nonzero(nz)));
  // alpha given explicitly (keyword-only in the schema, positional here).
  CHECK(at::equal(
      distrpc::rpc_sync(dst, "aten::add.Tensor", std::vector<c10::IValue>{x, x, 3}).toTensor(),
      x * 4));

  // Bad arguments: an error naming the schema.
  CHECK_THROWS_WITH(distrpc::rpc_sync(dst, "aten::add.Tensor",
                                      std::vector<c10::IValue>{x, std::string("not a tensor")}),
                    doctest::Contains("aten::add"));
  CHECK_THROWS_WITH(distrpc::rpc_async(dst, "aten::add.Tensor",
                                       std::vector<c10::IValue>{x, std::string("not a tensor")})
                        .value(),
                    doctest::Contains("schema"));
  CHECK_THROWS_WITH(
      distrpc::rpc_sync(dst, "aten::add.Tensor", std::vector<c10::IValue>{x, x, 1, 2, 3}),
      doctest::Contains("schema"));
  CHECK_THROWS_WITH(distrpc::rpc_sync(dst, "aten::no_such_op", std::vector<c10::IValue>{x}),
                    doctest::Contains("aten::no_such_op"));
  // Op errors keep their text.
  CHECK_THROWS_WITH(distrpc::rpc_sync(dst, "aten::add.Tensor",
                                      std::vector<c10::IValue>{at::ones({2}), at::ones({3})}),
                    doctest::Contains("size of tensor"));

  // A function unknown on the callee, and a signature that does not match: clear errors naming
  // the function (through the agent directly: an SPMD binary registers everything it calls).
  {
    auto agent = distrpc::detail::current_agent();
    distrpc::wire::Message m;
    distrpc::wire::encode(m, distrpc::RequestHeader{"rpc_test::not_registered_anywhere", 1, false},
                          std::tuple<>{});
    auto f = agent->call(agent->worker(dst), std::move(m), 10s, false, "raw call");
    CHECK_THROWS_WITH(f.value(), doctest::Contains("rpc_test::not_registered_anywhere"));

    distrpc::wire::Message m2;
    distrpc::wire::encode(
        m2,
        distrpc::RequestHeader{std::string(distrpc::detail::function_name<&echo_int>()), 12345,
                               false},
        std::tuple<int>{1});
    auto f2 = agent->call(agent->worker(dst), std::move(m2), 10s, false, "raw call");
    CHECK_THROWS_WITH(f2.value(), doctest::Contains("echo_int"));

    // A user function marked as one of the library's own calls (which run off the request pool)
    // is refused.
    distrpc::wire::Message m3;
    distrpc::RequestHeader h3{std::string(distrpc::detail::function_name<&echo_int>()), 12345,
                              true};
    distrpc::wire::encode(m3, h3, std::tuple<int>{1});
    auto f3 = agent->call(agent->worker(dst), std::move(m3), 10s, false, "raw call");
    CHECK_THROWS_WITH(f3.value(),
                      doctest::Contains("was called as one of the library's own calls, which it "
                                        "is not"));
  }
  CHECK(distrpc::rpc_sync<&echo_int>(dst, 2) == 2);

  distrpc::shutdown();
}

// ---- D. serialization ---------------------------------------------------------------------------

DISTRPC_MP_TEST("rpc: containers, non-contiguous views and sparse tensors round-trip", 4, 60) {
  init(ctx);
  const int dst = (ctx.rank + 1) % ctx.world;
  const auto t = at::arange(6, at::kFloat).view({2, 3});

  // Vectors, with the same tensor several times.
  auto v = distrpc::rpc_sync<&vec_double>(dst, std::vector<at::Tensor>{t, t, t + 1, t});
  REQUIRE(v.size() == 4);
  CHECK(at::equal(v[0], t * 2));
  CHECK(at::equal(v[1], t * 2));
  CHECK(at::equal(v[2], (t + 1) * 2));
  CHECK(at::equal(v[3], t * 2));
  // The same tensor as two arguments.
  auto [sum, first] = distrpc::rpc_sync<&same_twice>(dst, t, t);
  CHECK(at::equal(sum, t * 2));
  CHECK(at::equal(first, t));
  // Tuples, strings, maps, optionals, nested.
  auto tup =
      distrpc::rpc_async<&tuple_step>(dst, std::tuple<int, std::string, at::Tensor>{1, "a", t})
          .value();
  CHECK(std::get<0>(tup) == 2);
  CHECK(std::get<1>(tup) == "a!");
  CHECK(at::equal(std::get<2>(tup), t + 1));
  std::map<std::string, std::vector<at::Tensor>> m{{"x", {t}}, {"y", {t, t * 3}}, {"empty", {}}};
  auto m2 = distrpc::rpc_sync<&map_echo>(dst, m);
  REQUIRE(m2.size() == 3);
  CHECK(at::equal(m2.at("x")[0], t));
  REQUIRE(m2.at("y").size() == 2);
  CHECK(at::equal(m2.at("y")[1], t * 3));
  CHECK(m2.at("empty").empty());
  auto some = distrpc::rpc_sync<&opt_echo>(dst, std::optional<at::Tensor>(t));
  REQUIRE(some.has_value());
  CHECK(at::equal(*some, t));
  CHECK_FALSE(distrpc::rpc_sync<&opt_echo>(dst, std::optional<at::Tensor>()).has_value());
  Nested nested{{"one", {t, t}, {{1, "a"}, {2, "b"}}}, {"two", {}, {}}};
  auto n2 = distrpc::rpc_sync<&nested_echo>(dst, nested);
  REQUIRE(n2.size() == 2);
  CHECK(std::get<0>(n2[0]) == "one");
  REQUIRE(std::get<1>(n2[0]).size() == 2);
  CHECK(at::equal(std::get<1>(n2[0])[1], t));
  CHECK(std::get<2>(n2[0]) == std::map<int, std::string>{{1, "a"}, {2, "b"}});
  CHECK(std::get<1>(n2[1]).empty());
  // User types with nested serializers.
  Outer o{
      Point{1, {t}, {{"a", 1}}}, {Point{2, {t, t}, {}}, Point{3, {}, {{"b", 2}}}}, std::nullopt};
  auto o2 = distrpc::rpc_sync<&outer_step>(dst, o);
  CHECK(o2.p.x == 2);
  REQUIRE(o2.p.ts.size() == 1);
  CHECK(at::equal(o2.p.ts[0], t));
  CHECK(o2.p.tags == std::map<std::string, int>{{"a", 1}});
  REQUIRE(o2.more.size() == 2);
  CHECK(o2.more[0].x == 20);
  REQUIRE(o2.more[0].ts.size() == 2);
  CHECK(at::equal(o2.more[0].ts[1], t));
  CHECK(o2.more[1].x == 30);
  CHECK(o2.more[1].tags.at("b") == 2);
  CHECK(o2.note == std::optional<std::string>("+"));
  // Scalar types other than float.
  auto li = at::arange(5, at::kLong);
  CHECK(at::equal(distrpc::rpc_sync<&echo_tensor>(dst, li), li));
  auto empty = at::ones({0, 0});
  CHECK(distrpc::rpc_sync<&echo_tensor>(dst, empty).sizes() == empty.sizes());

  // Non-contiguous tensors keep their strides both ways.
  auto base = at::arange(24, at::kFloat).view({4, 6});
  auto tr = base.t();
  REQUIRE_FALSE(tr.is_contiguous());
  auto [strides, contiguous, nbytes, back] = distrpc::rpc_sync<&tensor_facts>(dst, tr);
  (void)nbytes;
  CHECK(strides == tr.strides().vec());
  CHECK_FALSE(contiguous);
  CHECK(at::equal(back, tr));
  CHECK(back.strides() == tr.strides());
  CHECK_FALSE(back.is_contiguous());
  auto every_other = base.select(1, 1);  // stride 6
  auto [s2, c2, nb2, back2] = distrpc::rpc_sync<&tensor_facts>(dst, every_other);
  (void)nb2;
  CHECK(s2 == every_other.strides().vec());
  CHECK_FALSE(c2);
  CHECK(at::equal(back2, every_other));
  auto made = distrpc::rpc_sync<&make_transposed>(dst, int64_t{5});
  CHECK_FALSE(made.is_contiguous());
  CHECK(made.strides() == at::IntArrayRef({1, 5}));
  CHECK(at::equal(made, at::arange(25, at::kFloat).view({5, 5}).t()));
  // A view of a big tensor sends the view, not the whole storage.
  auto big = at::zeros({1000, 1000});
  auto slice = big.narrow(0, 500, 2);
  auto [s3, c3, nb3, back3] = distrpc::rpc_sync<&tensor_facts>(dst, slice);
  CHECK(s3 == slice.strides().vec());
  CHECK(c3);
  CHECK(nb3 <= static_cast<int64_t>(2 * 1000 * sizeof(float)));
  CHECK(at::equal(back3, slice));

  // Sparse COO tensors, coalesced and not, in sync, async and builtin calls.
  for (bool coalesce : {true, false}) {
    CAPTURE(coalesce);
    auto sp = build_sparse(coalesce);
    auto r = distrpc::rpc_sync<&add>(dst, sp, sp);
    CHECK(r.is_sparse());
    CHECK(at::equal(r.to_dense(), sp.to_dense() * 2));
    auto ra = distrpc::rpc_async<&add>(dst, sp, sp).value();
    CHECK(ra.is_sparse());
    CHECK(at::equal(ra.to_dense(), sp.to_dense() * 2));
    auto rb =
        distrpc::rpc_sync(dst, "aten::add.Tensor", std::vector<c10::IValue>{sp, sp}).toTensor();
    CHECK(rb.is_sparse());
    CHECK(at::equal(rb.to_dense(), sp.to_dense() * 2));
    auto vs = distrpc::rpc_sync<&vec_double>(dst, std::vector<at::Tensor>{sp, sp});
    REQUIRE(vs.size() == 2);
    CHECK(at::equal(vs[1].to_dense(), sp.to_dense() * 2));
  }
  auto unc = build_uncoalesced_sparse();
  REQUIRE_FALSE(unc.is_coalesced());
  auto [is_sparse, coalesced, unc_back] = distrpc::rpc_sync<&sparse_facts>(dst, unc);
  CHECK(is_sparse);
  CHECK_FALSE(coalesced);
  CHECK(unc_back.is_sparse());
  CHECK_FALSE(unc_back.is_coalesced());
  CHECK(at::equal(unc_back.to_dense(), unc.to_dense()));
  auto co = build_sparse(true);
  auto [is_sparse2, coalesced2, co_back] = distrpc::rpc_sync<&sparse_facts>(dst, co);
  CHECK(is_sparse2);
  CHECK(coalesced2);
  CHECK(co_back.is_coalesced());
  CHECK(at::equal(co_back.to_dense(), co.to_dense()));

  distrpc::shutdown();
}

// ---- E. remote exceptions -----------------------------------------------------------------------

DISTRPC_MP_TARGET("rpc target: remote exceptions") {
  distrpc::register_exception<MyError>("rpc_test::MyError");
  init(ctx);
  const int dst = (ctx.rank + 1) % ctx.world;
  auto call = [&](const char* kind, const std::string& msg) {
    return [=] { distrpc::rpc_sync<&raise_kind>(dst, std::string(kind), msg); };
  };
  const std::string tag = " from rank " + std::to_string(ctx.rank);
  expect_exact<std::runtime_error>(call("runtime", "runtime" + tag), "runtime" + tag, "runtime");
  expect_exact<std::invalid_argument>(call("invalid_argument", "bad arg" + tag), "bad arg" + tag,
                                      "invalid_argument");
  expect_exact<std::out_of_range>(call("out_of_range", "oor" + tag), "oor" + tag, "out_of_range");
  expect_exact<std::logic_error>(call("logic", "logic" + tag), "logic" + tag, "logic_error");
  expect_exact<c10::Error>(call("c10", "c10 error" + tag), "c10 error" + tag, "c10::Error");
  expect_exact<c10::ValueError>(call("value", "Expected error" + tag), "Expected error" + tag,
                                "c10::ValueError");
  expect_exact<c10::TypeError>(call("type", "type error" + tag), "type error" + tag,
                               "c10::TypeError");
  expect_exact<c10::IndexError>(call("index", "index error" + tag), "index error" + tag,
                                "c10::IndexError");
  // An op error from libtorch itself.
  expect_exact<c10::Error>(call("size", ""), "size of tensor", "op error");
  // Another c10::Error subclass arrives as c10::Error, its message kept.
  expect_exact<c10::Error>(call("c10_other", "oom" + tag), "oom" + tag, "c10 subclass");
  // Multi-line messages keep real newlines.
  expect_exact<std::runtime_error>(call("runtime", "line one\nline two\nline three"),
                                   "line one\nline two\nline three", "multi-line");
  // A user-registered type is rebuilt as itself.
  expect_exact<MyError>(call("mine", "mine" + tag), "mine" + tag, "registered user type");
  // A type the caller cannot rebuild.
  try {
    distrpc::rpc_sync<&raise_kind>(dst, std::string("unregistered"), "logged-marker" + tag);
    FAIL_CHECK("no exception");
  } catch (const distrpc::RemoteError& e) {
    CHECK(contains(e.what(), "Original exception on remote side was"));
    CHECK(contains(e.what(), "UnregisteredError"));
    CHECK(contains(e.what(), "logged-marker" + tag));
  } catch (const std::exception& e) {
    FAIL_CHECK("expected distrpc::RemoteError, got " << distrpc::demangle(typeid(e).name()) << ": "
                                                     << e.what());
  }

  // Through a future: every wait() rethrows; done() and has_error() hold.
  auto f =
      distrpc::rpc_async<&raise_kind>(dst, std::string("value"), std::string("Expected error"));
  CHECK_THROWS_AS(f.wait(), c10::ValueError);
  CHECK_THROWS_AS(f.wait(), c10::ValueError);
  CHECK_THROWS_WITH(f.value(), doctest::Contains("Expected error"));
  CHECK(f.done());
  CHECK(f.has_error());
  CHECK_FALSE(f.has_value());
  // The agent is fine afterwards.
  CHECK(distrpc::rpc_sync<&echo_int>(dst, 1) == 1);
  distrpc::shutdown();
}

TEST_CASE("rpc: remote exceptions keep type and message; the callee logs them") {
  RunOptions o;
  o.world = 4;
  o.limit = 60s;
  auto r = run_ranks("rpc target: remote exceptions", o);
  REQUIRE_MESSAGE(r.ok, r.report());
  for (const auto& rank : r.ranks) {
    // Rank r is called by rank r-1: it logs the text of the exception it raised.
    const int caller = (rank.rank + 3) % 4;
    CAPTURE(rank.rank);
    CHECK_MESSAGE(contains(rank.output, "logged-marker from rank " + std::to_string(caller)),
                  rank.output);
  }
}

// ---- F. futures ---------------------------------------------------------------------------------

DISTRPC_MP_TEST("rpc: fail-fast wait_all, collect_all, WaitAllScope", 4, 60) {
  init(ctx);
  const int dst = (ctx.rank + 1) % ctx.world;

  // Values in order.
  std::vector<Future<int>> ok;
  for (int i = 0; i < 5; ++i) ok.push_back(distrpc::rpc_async<&echo_int>(dst, i));
  CHECK(distrpc::wait_all(ok) == std::vector<int>{0, 1, 2, 3, 4});

  // Fail fast: a held call and a failing one; wait_all throws without waiting for the held one.
  std::vector<Future<int>> futs;
  futs.push_back(distrpc::rpc_async<&hold_until_released>(dst, 7));
  futs.push_back(
      distrpc::rpc_async<&raise_kind>(dst, std::string("value"), std::string("Expected error")));
  const auto t0 = Clock::now();
  CHECK_THROWS_WITH_AS(distrpc::wait_all(futs), doctest::Contains("Expected error"),
                       c10::ValueError);
  CHECK(ms_since(t0) < 5000);
  CHECK_FALSE(futs[0].done());
  // The held handler is released afterwards and the system is healthy.
  distrpc::rpc_sync<&release_held>(dst);
  CHECK(futs[0].value() == 7);
  CHECK(distrpc::rpc_sync<&echo_int>(dst, 8) == 8);

  // collect_all: completes when all did, whatever the outcome.
  std::vector<Future<int>> mixed{
      distrpc::rpc_async<&echo_int>(dst, 1),
      distrpc::rpc_async<&raise_kind>(dst, std::string("runtime"), std::string("boom")),
      distrpc::rpc_async<&sleep_ms>(dst, 50)};
  auto all = distrpc::collect_all(mixed).value();
  REQUIRE(all.size() == 3);
  CHECK(all[0].value() == 1);
  CHECK(all[1].has_error());
  CHECK_THROWS_WITH_AS(all[1].value(), doctest::Contains("boom"), std::runtime_error);
  CHECK(all[2].value() == 50);

  // WaitAllScope: collects the async futures made inside, waits, raises the first error.
  {
    distrpc::WaitAllScope scope;
    auto a = distrpc::rpc_async<&sleep_ms>(dst, 100);
    auto b =
        distrpc::rpc_async<&raise_kind>(dst, std::string("runtime"), std::string("scoped error"));
    auto c = distrpc::rpc_async<&echo_int>(dst, 3);
    (void)b;
    CHECK(scope.size() == 3);
    CHECK_THROWS_WITH_AS(scope.wait(), doctest::Contains("scoped error"), std::runtime_error);
    CHECK(a.done());  // the scope waited for all of them
    CHECK(c.done());
    CHECK(scope.size() == 0);
  }
  {
    std::vector<Future<int>> made;
    {
      distrpc::WaitAllScope scope;
      for (int i = 0; i < 4; ++i) made.push_back(distrpc::rpc_async<&sleep_ms>(dst, 20 * i));
      CHECK(scope.size() == 4);
    }  // leaves without error, after all of them completed
    for (const auto& m : made) CHECK(m.done());
  }
  distrpc::shutdown();
}

DISTRPC_MP_TEST("rpc: future callbacks: fan-out, chains, errors, ordering, double completion", 4,
                60) {
  init(ctx);
  const int n = ctx.rank + 1;
  const int dst = (ctx.rank + 1) % ctx.world;
  const auto ones = at::ones({n, n});

  // 10 callbacks on one future each see the value.
  auto f = distrpc::rpc_async<&add_scalar>(dst, ones, 1.0);
  std::vector<Future<at::Tensor>> children;
  for (int i = 0; i < 10; ++i) {
    children.push_back(f.then([i](Future<at::Tensor>& p) { return p.value() + i; }));
  }
  for (int i = 0; i < 10; ++i) {
    CHECK(at::equal(children[static_cast<std::size_t>(i)].value(), ones + 1 + i));
  }

  // A chain of 20.
  auto chain = distrpc::rpc_async<&add_scalar>(dst, ones, 1.0);
  for (int i = 0; i < 20; ++i) {
    chain = chain.then([](Future<at::Tensor>& p) { return p.value() + 1; });
  }
  CHECK(at::equal(chain.value(), ones + 1 + 20));

  // A failing callback fails only its child.
  auto parent = distrpc::rpc_async<&add_scalar>(dst, ones, 1.0);
  auto bad = parent.then(
      [](Future<at::Tensor>&) -> at::Tensor { throw std::invalid_argument("callback failed"); });
  auto good = parent.then([](Future<at::Tensor>& p) { return p.value() * 2; });
  CHECK_THROWS_WITH_AS(bad.value(), doctest::Contains("callback failed"), std::invalid_argument);
  CHECK(at::equal(good.value(), (ones + 1) * 2));
  CHECK(at::equal(parent.value(), ones + 1));
  CHECK_FALSE(parent.has_error());

  // A callback on a failed future sees the error through value().
  auto err =
      distrpc::rpc_async<&raise_kind>(dst, std::string("value"), std::string("Expected error"))
          .then([](Future<int>& p) { return p.value() + 1; });
  CHECK_THROWS_AS(err.value(), c10::ValueError);

  // A callback may start a new RPC and block on it.
  auto with_ret =
      distrpc::rpc_async<&add_scalar>(dst, ones, 1.0).then([dst](Future<at::Tensor>& p) {
        return distrpc::rpc_async<&add_scalar>(dst, p.value(), 1.0)
            .then([](Future<at::Tensor>& q) { return q.value() + 1; })
            .value();
      });
  CHECK(at::equal(with_ret.value(), ones + 3));

  // add_done_callback: callbacks registered before completion run in registration order (spec F),
  // also on RPC futures, whose callbacks the agent moves off its I/O threads. Earlier callbacks
  // work a little longer: run one after another they still finish in order; run concurrently,
  // the later ones would overtake them.
  {
    constexpr int kCallbacks = 10;
    auto slow = distrpc::rpc_async<&sleep_ms>(dst, 200);
    auto order = std::make_shared<std::vector<int>>();
    auto mu = std::make_shared<std::mutex>();
    Future<void> all_ran;
    for (int i = 0; i < kCallbacks; ++i) {
      slow.add_done_callback([order, mu, i, all_ran](Future<int>& p) {
        (void)p.value();
        std::this_thread::sleep_for(std::chrono::milliseconds(3 * (kCallbacks - i)));
        std::lock_guard<std::mutex> lk(*mu);
        order->push_back(i);
        if (static_cast<int>(order->size()) == kCallbacks) all_ran.set_value();
      });
    }
    CHECK(slow.value() == 200);
    REQUIRE(all_ran.wait_for(10s));
    std::vector<int> expected(kCallbacks);
    for (int i = 0; i < kCallbacks; ++i) expected[static_cast<std::size_t>(i)] = i;
    std::lock_guard<std::mutex> lk(*mu);
    CHECK(*order == expected);
  }

  // Upstream's test_add_done_callback: a then() registered after a done-callback completes only
  // after that callback ran (the callback works a little to make an overtaking visible).
  {
    auto set_by_cb = std::make_shared<std::atomic<bool>>(false);
    auto fut = distrpc::rpc_async<&add>(dst, ones, ones);
    fut.add_done_callback([set_by_cb](Future<at::Tensor>& p) {
      (void)p.value();
      std::this_thread::sleep_for(50ms);
      *set_by_cb = true;
    });
    auto fut_then = fut.then([](Future<at::Tensor>&) { return true; });
    CHECK(at::equal(fut.value(), ones * 2));
    CHECK(fut_then.value());
    CHECK(set_by_cb->load());
  }

  // Completing a completed future.
  Future<int> mine;
  mine.set_value(1);
  CHECK_THROWS_WITH(mine.set_value(2),
                    doctest::Contains("Future can only be marked completed once"));
  CHECK_THROWS_WITH(mine.set_exception(std::runtime_error("late")),
                    doctest::Contains("Future can only be marked completed once"));
  CHECK(mine.value() == 1);
  auto done_rpc = distrpc::rpc_async<&echo_int>(dst, 5);
  CHECK(done_rpc.value() == 5);
  CHECK(done_rpc.value() == 5);  // wait is repeatable
  CHECK(done_rpc.done());

  distrpc::shutdown();
}

// ---- G. nested RPC ------------------------------------------------------------------------------

DISTRPC_MP_TEST("rpc: nested calls, back to the caller and from callbacks inside functions", 4,
                60) {
  init(ctx);
  const std::string dst1 = wname((ctx.rank + 1) % ctx.world);
  const std::string dst2 = wname((ctx.rank + 2) % ctx.world);
  const auto ones = at::ones({2, 2});

  // The callee calls back to the caller, whose main thread is blocked in rpc_sync.
  CHECK(at::equal(distrpc::rpc_sync<&nested_back>(dst1, wname(ctx.rank)), ones + 1));
  CHECK(at::equal(distrpc::rpc_async<&nested_back>(dst1, wname(ctx.rank)).value(), ones + 1));
  // A nested call to self, from a function running on self.
  CHECK(at::equal(distrpc::rpc_sync<&nested_back>(ctx.rank, wname(ctx.rank)), ones + 1));

  // Scenario 13: a function blocks on a value set by a callback of its nested call.
  CHECK(at::equal(distrpc::rpc_sync<&add_use_future_cb>(dst1, dst2, ones, 1.0, 2.0), ones + 1 + 2));
  CHECK(at::equal(distrpc::rpc_sync<&add_use_future_set_result>(dst1, dst2, ones, 1.0, 2.0),
                  ones + 1 + 2));
  CHECK(at::equal(distrpc::rpc_sync<&add_use_future_nested_cb>(dst1, dst2, ones, 1.0, 2.0),
                  ones + 1 + 2));
  // Several at once: handlers blocked on nested calls must not starve the threads that process
  // responses and callbacks. (8 per rank: more blocking handlers than request threads, in a
  // ring where every pool waits on the next, would deadlock any fixed-size pool, PyTorch's too.)
  std::vector<Future<at::Tensor>> many;
  for (int i = 0; i < 8; ++i) {
    many.push_back(distrpc::rpc_async<&add_use_future_nested_cb>(dst1, dst2, ones, 1.0, 2.0));
  }
  for (auto& m : many) CHECK(at::equal(m.value(), ones + 3));

  distrpc::shutdown();
}

// ---- H. async functions -------------------------------------------------------------------------

DISTRPC_MP_TEST("rpc: async functions: chains, fan-out, nesting, errors, held replies", 4, 60) {
  init(ctx);
  const std::string dst1 = wname((ctx.rank + 1) % ctx.world);
  const std::string dst2 = wname((ctx.rank + 2) % ctx.world);
  const auto ones = at::ones({2, 2});

  CHECK(at::equal(distrpc::rpc_sync<&async_add>(dst1, dst2, ones, ones), ones * 2));
  // 20-step chain over an RPC: ones + 20 * 3.
  CHECK(
      at::equal(distrpc::rpc_sync<&async_add_chained_multi>(dst1, dst2, ones, 20, 3.0), ones + 60));
  CHECK(at::equal(distrpc::rpc_async<&async_add_chained_multi>(dst1, dst2, ones, 20, 3.0).value(),
                  ones + 60));
  // 20-way fan-out joined under a lock: ones + 20 * step.
  CHECK(
      at::equal(distrpc::rpc_sync<&async_add_multi_fanout>(dst1, dst2, ones, 20, 3.0), ones + 60));
  CHECK(at::equal(distrpc::rpc_async<&async_add_multi_fanout>(dst1, dst2, ones, 20, 3.0).value(),
                  ones + 60));
  // A hand-built future completed from a callback.
  CHECK(at::equal(distrpc::rpc_sync<&async_add_with_future_ctor>(dst1, dst2, ones, ones, 1.0),
                  ones * 2 + 1));
  // Nested async functions.
  CHECK(at::equal(distrpc::rpc_sync<&async_add_nested>(dst1, dst2, ones, ones, 1.0), ones * 2 + 1));
  CHECK(at::equal(distrpc::rpc_async<&async_add_nested>(dst1, dst2, ones, ones, 1.0).value(),
                  ones * 2 + 1));
  // Static member function.
  CHECK(at::equal(distrpc::rpc_sync<&AsyncCalc::add>(dst1, dst2, ones, ones), ones * 2));
  // Future<void>.
  distrpc::rpc_sync<&async_void>(dst1, dst2, 77);
  CHECK(distrpc::rpc_sync<&get_value>(dst2) == 77);
  // Errors, raised before returning the future or through it.
  CHECK_THROWS_WITH_AS(distrpc::rpc_sync<&async_raise>(dst1), doctest::Contains("Expected error"),
                       std::runtime_error);
  CHECK_THROWS_WITH_AS(distrpc::rpc_async<&async_raise>(dst1).value(),
                       doctest::Contains("Expected error"), std::runtime_error);
  CHECK_THROWS_WITH_AS(distrpc::rpc_sync<&async_raise_later>(dst1, dst2),
                       doctest::Contains("Expected error"), std::runtime_error);

  // Held replies do not use up worker threads: 24 requests (> 16 threads) all held until the
  // 24th arrives.
  std::vector<Future<int>> held;
  for (int i = 0; i < 24; ++i) held.push_back(distrpc::rpc_async<&held_until_n>(dst1, 24));
  for (auto& h : held) CHECK(h.value() == 24);

  distrpc::shutdown();
}

// ---- M. timeouts --------------------------------------------------------------------------------

DISTRPC_MP_TEST("rpc: per-call and default timeouts; the default is read at call time", 4, 90) {
  init(ctx);
  const int dst = (ctx.rank + 1) % ctx.world;
  CHECK(distrpc::get_rpc_timeout() == 60s);

  // Scenario 16: 100 ms against a 1 s function: the exact text, long before the function ends.
  const std::string text100 =
      "RPC ran for more than set timeout (100 ms) and will now be marked with an error";
  auto t0 = Clock::now();
  auto f100 = distrpc::rpc_async<&sleep_ms>(dst, distrpc::with_timeout(100ms), 1000);
  CHECK_THROWS_WITH_AS(f100.value(), has(text100), distrpc::RpcTimeoutError);
  CHECK(ms_since(t0) < 900);
  CHECK_THROWS_WITH_AS(distrpc::rpc_sync<&sleep_ms>(dst, distrpc::with_timeout(100ms), 1000),
                       has(text100), distrpc::RpcTimeoutError);

  // No timeout given: the default (60 s) lets it finish; 0 means no limit; 5 s is enough.
  auto fdefault = distrpc::rpc_async<&sleep_ms>(dst, 1000);
  auto fzero = distrpc::rpc_async<&sleep_ms>(dst, distrpc::with_timeout(0ms), 1000);
  auto f5s = distrpc::rpc_async<&sleep_ms>(dst, distrpc::with_timeout(5s), 1000);

  // Default 1 ms: used when no timeout is passed; 1 ms and 10 ms fire reliably (20 times each).
  distrpc::set_rpc_timeout(1ms);
  CHECK(distrpc::get_rpc_timeout() == 1ms);
  std::vector<Future<int>> f1ms, f10ms;
  for (int i = 0; i < 20; ++i) {
    f1ms.push_back(distrpc::rpc_async<&sleep_ms>(dst, 100));
    f10ms.push_back(distrpc::rpc_async<&sleep_ms>(dst, distrpc::with_timeout(10ms), 100));
  }
  for (auto& f : f1ms) {
    CHECK_THROWS_WITH_AS(f.value(), doctest::Contains("RPC ran for more than set timeout (1 ms)"),
                         distrpc::RpcTimeoutError);
  }
  for (auto& f : f10ms) {
    CHECK_THROWS_WITH_AS(f.value(), doctest::Contains("RPC ran for more than set timeout (10 ms)"),
                         distrpc::RpcTimeoutError);
  }
  CHECK_THROWS_WITH_AS(distrpc::rpc_sync<&sleep_ms>(dst, 1000),
                       doctest::Contains("RPC ran for more than"), distrpc::RpcTimeoutError);
  // A builtin call's error names the operator it ran (not the library's runner).
  const auto big = at::ones({600, 600});
  CHECK_THROWS_WITH_AS(
      distrpc::rpc_sync(dst, "aten::mm", std::vector<c10::IValue>{big, big}),
      has("RPC ran for more than set timeout (1 ms) and will now be marked with an error (call "
          "to 'aten::mm' on WorkerInfo(id=" +
          std::to_string(dst)),
      distrpc::RpcTimeoutError);
  // Per-call overrides beat the 1 ms default (sync and async).
  auto over5s = distrpc::rpc_async<&sleep_ms>(dst, distrpc::with_timeout(5s), 1000);
  auto over0 = distrpc::rpc_async<&sleep_ms>(dst, distrpc::with_timeout(0ms), 1000);
  CHECK(distrpc::rpc_sync<&sleep_ms>(dst, distrpc::with_timeout(5s), 1000) == 1000);
  CHECK(over5s.value() == 1000);
  CHECK(over0.value() == 1000);
  // Default 0: no limit.
  distrpc::set_rpc_timeout(0ms);
  CHECK(distrpc::get_rpc_timeout() == 0ms);
  CHECK(distrpc::rpc_sync<&sleep_ms>(dst, 100) == 100);

  // Scenario 17: the default is captured when the call is made (200 s, then 1 ms).
  distrpc::set_rpc_timeout(200s);
  auto snap200 = distrpc::rpc_async<&sleep_ms>(dst, 500);
  distrpc::set_rpc_timeout(1ms);
  auto snap1 = distrpc::rpc_async<&sleep_ms>(dst, 500);
  CHECK_THROWS_WITH_AS(snap1.value(), doctest::Contains("RPC ran for more than set timeout (1 ms)"),
                       distrpc::RpcTimeoutError);
  CHECK(snap200.value() == 500);
  distrpc::set_rpc_timeout(60s);

  CHECK(fdefault.value() == 1000);
  CHECK(fzero.value() == 1000);
  CHECK(f5s.value() == 1000);
  // Timeouts harmed nothing: the agent works and counts no call as still active.
  CHECK(distrpc::rpc_sync<&echo_int>(dst, 4) == 4);
  CHECK(distrpc::get_debug_info().at("num_active_client_calls") == "0");
  distrpc::shutdown();
}

// ---- N. barrier, all_gather, wait_all_workers ---------------------------------------------------

namespace {

// Upstream's _test_barrier_helper: the leader counts the increments made between two barriers.
void barrier_helper(const std::vector<std::string>& unsorted, bool multi_threaded) {
  auto names = unsorted;
  std::sort(names.begin(), names.end());
  const std::string& leader = names.front();
  const bool i_lead = distrpc::get_worker_info().name == leader;
  distrpc::rpc_sync<&reset_count>(leader);
  if (!multi_threaded && i_lead) CHECK(g_barrier_count.load() == 0);
  distrpc::barrier(names);
  distrpc::rpc_sync<&increment_count>(leader);
  distrpc::barrier(names);
  if (!multi_threaded && i_lead) CHECK(g_barrier_count.load() == static_cast<int>(names.size()));
}

}  // namespace

DISTRPC_MP_TEST("rpc: barriers: all, subsets, singleton, several threads; idle shutdown is fast", 4,
                60) {
  init(ctx);
  std::vector<std::string> all;
  for (const auto& w : distrpc::get_worker_infos()) all.push_back(w.name);

  barrier_helper(all, false);
  distrpc::barrier();

  // Disjoint subsets: odd and even ranks.
  std::vector<std::string> same_parity;
  for (int r = 0; r < ctx.world; ++r) {
    if (r % 2 == ctx.rank % 2) same_parity.push_back(wname(r));
  }
  barrier_helper(same_parity, false);
  distrpc::barrier();

  // Partial: odd ranks together, even ranks each alone (a singleton returns at once).
  if (ctx.rank % 2) {
    barrier_helper(same_parity, false);
  } else {
    const auto t0 = Clock::now();
    distrpc::barrier({wname(ctx.rank)});
    CHECK(ms_since(t0) < 500);
    barrier_helper({wname(ctx.rank)}, false);
  }
  distrpc::barrier();

  // 3 threads of each process at once, without hanging.
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(3);
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&, i] {
      try {
        barrier_helper(all, true);
      } catch (...) {
        errors[static_cast<std::size_t>(i)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) {
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& ex) {
        FAIL_CHECK("barrier thread failed: " << ex.what());
      }
    }
  }
  // Graceful shutdown of an idle group (all-gather + join + exit) takes well under a second.
  distrpc::barrier();
  const auto t0 = Clock::now();
  distrpc::shutdown();
  const auto took = ms_since(t0);
  CHECK_MESSAGE(took < 1000, "idle graceful shutdown took " << took << " ms");
}

DISTRPC_MP_TEST("rpc: all_gather values and timeouts, wait_all_workers", 4, 60) {
  init(ctx);
  // {name: value} from everyone.
  std::map<std::string, int> expected;
  for (const auto& w : distrpc::get_worker_infos()) expected[w.name] = w.id;
  CHECK(distrpc::all_gather(distrpc::get_worker_info().id) == expected);
  // Repeated calls match up.
  for (int round = 0; round < 5; ++round) {
    auto got = distrpc::all_gather(std::string("r") + std::to_string(round) + "-" +
                                   std::to_string(ctx.rank));
    REQUIRE(got.size() == 4);
    for (int r = 0; r < ctx.world; ++r) {
      CHECK(got.at(wname(r)) == "r" + std::to_string(round) + "-" + std::to_string(r));
    }
  }
  // Subsets.
  std::vector<std::string> same_parity;
  for (int r = 0; r < ctx.world; ++r) {
    if (r % 2 == ctx.rank % 2) same_parity.push_back(wname(r));
  }
  auto sub = distrpc::all_gather(std::vector<int>{ctx.rank, ctx.rank * 10}, same_parity);
  REQUIRE(sub.size() == 2);
  for (const auto& n : same_parity) {
    const int r = n.back() - '0';
    CHECK(sub.at(n) == std::vector<int>{r, r * 10});
  }
  // wait_all_workers, twice in a row.
  distrpc::wait_all_workers();
  distrpc::wait_all_workers();

  // Timeouts (default 0.1 s). Round 1: the leader (worker0) does not come for longer than the
  // members' own wait (the timeout plus the 1 s they leave for the leader's verdict): their calls
  // time out with the plain RPC timeout.
  distrpc::set_rpc_timeout(100ms);
  if (ctx.rank == 0) {
    std::this_thread::sleep_for(1500ms);
    try {
      (void)distrpc::all_gather(0);
    } catch (const std::exception&) {
      // Either outcome is acceptable for the late leader.
    }
    ctx.publish("round1", "done");
  } else {
    CHECK_THROWS_WITH_AS(distrpc::all_gather(ctx.rank), doctest::Contains("RPC ran for more than"),
                         distrpc::RpcTimeoutError);
    (void)ctx.lookup("round1");
  }
  // Round 2: the followers come late: the leader gives up after 0.10 s, naming them.
  if (ctx.rank == 0) {
    try {
      (void)distrpc::all_gather(0);
      FAIL_CHECK("the leader's all_gather did not time out");
    } catch (const std::exception& e) {
      const std::string what = e.what();
      CHECK_MESSAGE(contains(what, "timed out in _all_gather after 0.10 seconds"), what);
      CHECK_MESSAGE(contains(what, "worker1"), what);
      CHECK_MESSAGE(contains(what, "worker3"), what);
    }
    ctx.publish("round2", "done");
  } else {
    (void)ctx.lookup("round2");
    std::this_thread::sleep_for(200ms);
    CHECK_THROWS_AS(distrpc::all_gather(ctx.rank), distrpc::RpcError);
  }
  // Round 3: worker3 does not come; the leader's verdict reaches every member that did, the same
  // text everywhere (the members' own wait is longer than the leader's).
  if (ctx.rank == 3) {
    (void)ctx.lookup("round3-0");
    (void)ctx.lookup("round3-1");
    (void)ctx.lookup("round3-2");
    std::this_thread::sleep_for(100ms);
    CHECK_THROWS_AS(distrpc::all_gather(ctx.rank), distrpc::RpcError);  // the gather is closed
  } else {
    std::string text;
    try {
      (void)distrpc::all_gather(ctx.rank);
      FAIL_CHECK("all_gather did not time out although worker3 never came");
    } catch (const distrpc::RpcTimeoutError& e) {
      text = e.what();
    }
    CHECK_MESSAGE(contains(text,
                           "timed out in _all_gather after 0.10 seconds. The following workers did "
                           "not respond: "),
                  text);
    CHECK_MESSAGE(contains(text, "worker3"), text);
    ctx.publish("round3-" + std::to_string(ctx.rank), text);
    for (int r = 0; r < 3; ++r) CHECK(ctx.lookup("round3-" + std::to_string(r)) == text);
  }
  // Healthy afterwards.
  distrpc::set_rpc_timeout(60s);
  std::map<std::string, int> expected2;
  for (int r = 0; r < ctx.world; ++r) expected2[wname(r)] = r + 100;
  CHECK(distrpc::all_gather(ctx.rank + 100) == expected2);
  distrpc::shutdown();
}

// ---- O. shutdown --------------------------------------------------------------------------------

DISTRPC_MP_TEST("rpc: graceful shutdown with uneven load and a fire-and-forget ring", 4, 60) {
  init(ctx);
  if (ctx.rank == 0) {
    // A 20-hop ring nobody waits for: ranks 1, 2, 3, 0, 1, ... each run 5 hops.
    (void)distrpc::rpc_async<&ring_hop>(1, 19);
    const auto x = at::ones({100, 100});
    // Phase 1: only worker1 has work.
    std::vector<Future<int>> futs;
    for (int i = 0; i < 30; ++i) futs.push_back(distrpc::rpc_async<&heavy_rpc>("worker1", x));
    auto collected = distrpc::collect_all(futs);  // keep the future alive: value() is a reference
    for (const auto& f : collected.value()) CHECK(f.value() == 0);
    // Phase 2: only worker2, which is in shutdown by now and must not have left.
    futs.clear();
    for (int i = 0; i < 30; ++i) futs.push_back(distrpc::rpc_async<&heavy_rpc>("worker2", x));
    for (int v : distrpc::wait_all(futs)) CHECK(v == 0);
  }
  distrpc::shutdown();
  // The ring completed before anyone left.
  CHECK(g_ring_hits.load() == 5);
}

// ---- Q. debug info ------------------------------------------------------------------------------

DISTRPC_MP_TEST("rpc: debug info", 4, 60) {
  RpcBackendOptions o;
  o.num_worker_threads = 27;
  init(ctx, o);
  const int dst = (ctx.rank + 1) % ctx.world;
  auto info = distrpc::get_debug_info();
  CHECK(info.at("thread_pool_size") == "27");
  auto has_key_with = [&](const std::string& part) {
    return std::any_of(info.begin(), info.end(),
                       [&](const auto& kv) { return contains(kv.first, part); });
  };
  CHECK(info.count("num_active_client_calls") == 1);
  CHECK(has_key_with("pending_requests"));
  CHECK(has_key_with("idle_threads"));
  CHECK(has_key_with("server_calls"));
  // Active client calls, as seen during and after a call; all the calls made, before and after.
  const auto made = std::stoull(distrpc::get_debug_info().at("num_client_calls"));
  auto f = distrpc::rpc_async<&sleep_ms>(dst, 300);
  CHECK(distrpc::get_debug_info().at("num_active_client_calls") == "1");
  CHECK(f.value() == 300);
  CHECK(distrpc::get_debug_info().at("num_active_client_calls") == "0");
  CHECK(std::stoull(distrpc::get_debug_info().at("num_client_calls")) == made + 1);
  distrpc::shutdown();
}

// ---- stress -------------------------------------------------------------------------------------

DISTRPC_MP_TEST("rpc: stress: 1000 concurrent async calls per worker, 100 tensor sizes", 4, 90) {
  init(ctx);
  std::vector<Future<int>> futs;
  futs.reserve(1000);
  for (int i = 0; i < 1000; ++i) futs.push_back(distrpc::rpc_async<&echo_int>(i % ctx.world, i));
  auto values = distrpc::wait_all(futs);
  REQUIRE(values.size() == 1000);
  int wrong = 0;
  for (int i = 0; i < 1000; ++i) wrong += values[static_cast<std::size_t>(i)] != i;
  CHECK(wrong == 0);

  // 100 concurrent calls with tensors 0x0 .. 99x99.
  const int dst = (ctx.rank + 1) % ctx.world;
  std::vector<Future<at::Tensor>> tf;
  for (int i = 0; i < 100; ++i) {
    auto t = at::ones({i, i});
    tf.push_back(distrpc::rpc_async<&add>(dst, t, t));
  }
  int bad = 0;
  for (int i = 0; i < 100; ++i)
    bad += !at::equal(tf[static_cast<std::size_t>(i)].value(), at::ones({i, i}) * 2);
  CHECK(bad == 0);
  distrpc::shutdown();
}

// ---- node failure -------------------------------------------------------------------------------

DISTRPC_MP_TARGET("rpc target: a peer killed mid-call") {
  init(ctx);
  constexpr int kVictim = 3;
  constexpr int kPerCaller = 5;
  if (ctx.rank == kVictim) {
    // Wait until every survivor's calls are running here, then die without a word.
    const auto deadline = Clock::now() + 30s;
    while (g_held.load() < kPerCaller * (ctx.world - 1) && Clock::now() < deadline) {
      std::this_thread::sleep_for(2ms);
    }
    ctx.publish("killed", "now");
    ::kill(::getpid(), SIGKILL);
    std::this_thread::sleep_for(60s);
  }
  std::vector<Future<int>> pending;
  for (int i = 0; i < kPerCaller; ++i) {
    pending.push_back(distrpc::rpc_async<&hold_until_released>(wname(kVictim), i));
  }
  (void)ctx.lookup("killed");
  const auto t0 = Clock::now();
  for (auto& f : pending) {
    const auto left =
        2000ms - std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
    CHECK_MESSAGE(f.wait_for(std::max(left, 0ms)), "a future for the dead peer is still pending");
  }
  CHECK(ms_since(t0) < 2000);
  for (auto& f : pending) {
    if (!f.done()) continue;
    CHECK_THROWS_AS(f.value(), distrpc::DistNetworkError);
    CHECK_THROWS_WITH(f.value(), doctest::Contains("worker3"));
  }
  // Calls among the survivors keep working; a call to the dead peer fails without a crash.
  const int dst = (ctx.rank + 1) % 3;
  CHECK(distrpc::rpc_sync<&echo_int>(dst, 42) == 42);
  CHECK(at::equal(distrpc::rpc_sync<&add>(dst, at::ones({2}), at::ones({2})), at::ones({2}) * 2));
  CHECK_THROWS(distrpc::rpc_sync<&echo_int>(wname(kVictim), distrpc::with_timeout(5s), 1));
  distrpc::barrier({"worker0", "worker1", "worker2"});
  // A graceful shutdown cannot reach the dead peer: its error reaches the caller and the local
  // stop still runs.
  CHECK_THROWS(distrpc::shutdown(/*graceful=*/true, 2s));
  CHECK_FALSE(distrpc::is_initialized());
}

TEST_CASE("rpc: a peer killed mid-call fails its pending futures promptly; the rest works") {
  RunOptions o;
  o.world = 4;
  o.limit = 60s;
  o.may_die = {3};
  auto r = run_ranks("rpc target: a peer killed mid-call", o);
  CHECK_MESSAGE(r.ok, r.report());
  REQUIRE(r.ranks.size() == 4);
  CHECK_MESSAGE(r.ranks[3].signal == SIGKILL, r.report());
  for (int i = 0; i < 3; ++i)
    CHECK_MESSAGE(r.ranks[static_cast<std::size_t>(i)].exit_code == 0, r.report());
}
