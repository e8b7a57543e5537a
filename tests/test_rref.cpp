// The RRef suite, from docs spec rpc.md groups C (remote mode), I, J, K and the RRef rows of the
// failure table; acceptance scenarios 3-9, 15, 18 and the RRef parts of 19-23.
//
// Same conventions as test_rpc.cpp: 4 fresh processes named worker{rank} per case, a file://
// rendezvous, a graceful shutdown at the end with the RRef leak check on (a leak fails the
// case), functions called remotely live in namespace rref_test.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include <ATen/ATen.h>
#include <doctest/doctest.h>
#include <torch/library.h>

#include <distrpc/net/handoff.hpp>  // DISTRPC_UNDER_TSAN
#include <distrpc/rpc.hpp>
#include <distrpc/rref.hpp>

#include "multiprocess.hpp"
#include "support/rpc_test_util.hpp"
#include "support/rpc_under_test.hpp"

using namespace distrpc::testing::rpc_names;

namespace {

using distrpc::testing::eventually;
using distrpc::testing::rref_counter;
using distrpc::testing::rref_flushed;

std::string counters_line() {
  auto i = distrpc::get_debug_info();
  return "num_owner_rrefs=" + i.at("num_owner_rrefs") + " num_forks=" + i.at("num_forks") +
         " num_pending_users=" + i.at("num_pending_users") +
         " num_pending_futures=" + i.at("num_pending_futures");
}

bool owners_and_forks(int owners, int forks) {
  return eventually([&] {
    return rref_counter("num_owner_rrefs") == owners && rref_counter("num_forks") == forks;
  });
}

}  // namespace

// ---- functions run remotely -------------------------------------------------------------------

namespace rref_test {

at::Tensor add(at::Tensor a, at::Tensor b) {
  return a + b;
}
at::Tensor add_scalar(at::Tensor a, double s) {
  return a + s;
}
int add_ints(int a, int b) {
  return a + b;
}
int sleep_ms(int ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return ms;
}
int raise_value_error() {
  throw std::invalid_argument("Expected error");
}

int add_rref_to_value(RRef<int> r, int v) {
  return r.to_here() + v;
}
at::Tensor rref_add_scalar(RRef<at::Tensor> r, double s) {
  return r.to_here() + s;
}
bool check_rref_confirmed(RRef<at::Tensor> r) {
  return r.confirmed_by_owner();
}
std::string owner_of(RRef<at::Tensor> r) {
  return r.owner_name();
}
bool is_owner_here(RRef<at::Tensor> r) {
  return r.is_owner();
}

// Worker-global RRef holders (each process has its own).
std::mutex g_mu;
std::optional<RRef<int>> g_int_rref;
std::optional<RRef<at::Tensor>> g_tensor_rref;
void set_global_rref(RRef<int> r) {
  std::lock_guard<std::mutex> lk(g_mu);
  g_int_rref = std::move(r);
}
void clear_global_rref() {
  std::lock_guard<std::mutex> lk(g_mu);
  g_int_rref.reset();
}
at::Tensor hold_tensor_rref(RRef<at::Tensor> r) {
  auto v = r.to_here();
  std::lock_guard<std::mutex> lk(g_mu);
  g_tensor_rref = std::move(r);
  return v;
}
void drop_tensor_rref() {
  std::lock_guard<std::mutex> lk(g_mu);
  g_tensor_rref.reset();
}

// A function returning a user RRef to a third worker's value.
RRef<at::Tensor> rpc_return_rref(std::string dst) {
  return distrpc::remote<&add>(dst, at::ones({2, 2}), at::ones({2, 2}));
}

// RRef of RRefs: the callee makes two RRefs on `dst` and returns them.
std::tuple<RRef<at::Tensor>, RRef<at::Tensor>> nested_rref(std::string dst) {
  return {distrpc::remote<&add_scalar>(dst, at::ones({2, 2}), 1.0),
          distrpc::remote<&add_scalar>(dst, at::ones({2, 2}), 2.0)};
}

// The forward chain of PyTorch's rref_forward_chain: a list of one RRef per hop, then the value.
struct Link {
  std::vector<RRef<Link>> next;
  at::Tensor value;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(next, value);
  }
};
Link forward_chain(int dst, int world, RRef<at::Tensor> rref, int ttl) {
  if (ttl > 0) {
    const int next = (dst + 1) % world;
    return Link{{distrpc::remote<&forward_chain>(dst, next, world, rref, ttl - 1)}, at::Tensor()};
  }
  return Link{{}, rref.to_here()};
}

// Objects behind RRefs, used through proxies. Calls on an owned object run on the owner's pool
// threads, concurrently when they overlap (a slow_get whose caller timed out still runs while the
// caller's next call arrives), as in PyTorch: the object guards its own state, here an atomic.
struct MyClass {
  explicit MyClass(int v = 0) : value(v) {}
  MyClass(const MyClass& other) : value(other.value.load()) {}
  MyClass& operator=(const MyClass& other) {
    value = other.value.load();
    return *this;
  }
  std::atomic<int> value;
  void increment_value(int by) { value += by; }
  int get_value() const { return value; }
  int slow_get(int ms) const {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    return value;
  }
  // Asynchronous by its type: answers after a nested call.
  Future<int> async_add(int to_dst, int x) {
    return distrpc::rpc_async<&add_ints>(to_dst, value, x);
  }
};
DISTRPC_REGISTER_METHOD(MyClass, increment_value);
DISTRPC_REGISTER_METHOD(MyClass, get_value);
DISTRPC_REGISTER_METHOD(MyClass, slow_get);

std::vector<RRef<MyClass>> get_rref_list(std::vector<int> values) {
  std::vector<RRef<MyClass>> out;
  for (int v : values) out.emplace_back(MyClass(v));
  return out;
}
int increment_on_owner(RRef<MyClass> r, int by) {
  r.local_value().increment_value(by);
  return r.local_value().get_value();
}

// Not serializable at all (a mutex inside): lives only behind an RRef.
struct Unshippable {
  std::mutex mu;
  int hits = 0;
  int hit() {
    std::lock_guard<std::mutex> lk(mu);
    return ++hits;
  }
};

// The parameter server of spec §V, dense gradients.
struct ParameterServer {
  explicit ParameterServer(int trainers) : trainers(trainers) {}
  std::mutex mu;
  int trainers;
  int iteration = -1;
  int updates = 0;
  std::vector<Future<at::Tensor>> waiting;
  at::Tensor total;
  at::Tensor gradient;

  // Holds every reply until all trainers of this iteration contributed.
  Future<at::Tensor> average(int it, at::Tensor grad) {
    Future<at::Tensor> fut;
    std::vector<Future<at::Tensor>> ready;
    at::Tensor avg;
    {
      std::lock_guard<std::mutex> lk(mu);
      if (it > iteration) {
        iteration = it;
        updates = 0;
        waiting.clear();
        total = at::Tensor();
      }
      waiting.push_back(fut);
      total = total.defined() ? total + grad : grad.clone();
      if (++updates == trainers) {
        gradient = total / static_cast<double>(trainers);
        avg = gradient;
        ready.swap(waiting);
      }
    }
    for (auto& f : ready) f.set_value(avg);  // outside the lock
    return fut;
  }
  at::Tensor get_gradient() {
    std::lock_guard<std::mutex> lk(mu);
    return gradient;
  }
};

int trainer(RRef<ParameterServer> ps, int seed) {
  at::manual_seed(seed);
  auto w = at::randn({10, 10}).set_requires_grad(true);
  int checked = 0;
  for (int i = 0; i < 10; ++i) {
    auto x = at::rand({10, 10});
    auto loss = (at::matmul(x, w) - at::rand({10, 10})).pow(2).mean();
    loss.backward();
    at::Tensor grad = w.grad().clone();
    w.mutable_grad().zero_();
    at::Tensor avg = ps.rpc_async<&ParameterServer::average>(i, grad).value();
    at::Tensor ps_grad = ps.rpc_sync<&ParameterServer::get_gradient>();
    if (at::equal(avg, ps_grad)) ++checked;
  }
  return checked;
}

// Functions returning nothing, for RRef<void>. Each worker keeps counts per key (the caller's
// rank), so concurrent callers never disturb each other's expected values.
std::map<int, int> g_counts;  // guarded by g_mu
void bump(int key, int by) {
  std::lock_guard<std::mutex> lk(g_mu);
  g_counts[key] += by;
}
void slow_bump(int key, int by, int ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  bump(key, by);
}
int count_of(int key) {
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_counts.find(key);
  return it == g_counts.end() ? 0 : it->second;
}
void raise_in_void(std::string text) {
  throw std::invalid_argument(text);
}
// Asynchronous and returning nothing: done once the nested call to `to` ran.
Future<void> async_bump(int to, int key, int by) {
  return distrpc::rpc_async<&slow_bump>(to, key, by, 100);
}
// Received as an argument: waits for the function behind it, then reads the owner's count.
std::string wait_void_rref(RRef<void> r, int key) {
  const bool confirmed = r.confirmed_by_owner();
  const bool owner = r.is_owner();
  r.to_here();
  return std::to_string(distrpc::rpc_sync<&count_of>(r.owner(), key)) +
         (confirmed ? " confirmed" : " unconfirmed") + (owner ? " owner" : " user");
}
// Returns a user RRef<void> whose owner is a third worker.
RRef<void> make_void_rref(int owner, int key) {
  return distrpc::remote<&bump>(owner, key, 1);
}

}  // namespace rref_test

using namespace rref_test;

// ---- I. core API ------------------------------------------------------------------------------

DISTRPC_MP_TEST("rref: ids, string forms, local RRefs, local_value on a user (scenario 9)", 4, 60) {
  init(ctx);
  const int next = (ctx.rank + 1) % ctx.world;
  RRef<int> local(ctx.rank);
  CHECK(local.str() ==
        "OwnerRRef(GloballyUniqueId(created_on=" + std::to_string(ctx.rank) + ", local_id=0))");
  CHECK(local.is_owner());
  CHECK(local.owner() == distrpc::get_worker_info());
  CHECK(local.owner_name() == wname(ctx.rank));
  CHECK(local.confirmed_by_owner());
  CHECK(local.local_value() == ctx.rank);
  CHECK(local.to_here() == ctx.rank);
  CHECK(local.get_future().done());
  // A local RRef is not in the bookkeeping until it is shared.
  CHECK(rref_counter("num_owner_rrefs") == 0);
  CHECK(rref_counter("num_pending_users") == 0);
  distrpc::barrier();  // nobody creates RRefs on a peer before every rank checked the above

  auto user = distrpc::remote<&add>(next, at::ones({2, 2}), at::ones({2, 2}));
  const std::string r = std::to_string(ctx.rank);
  CHECK(user.str() == "UserRRef(RRefId = GloballyUniqueId(created_on=" + r +
                          ", local_id=1), ForkId = GloballyUniqueId(created_on=" + r +
                          ", local_id=2))");
  CHECK_FALSE(user.is_owner());
  CHECK(user.owner() == distrpc::get_worker_infos()[static_cast<std::size_t>(next)]);
  CHECK(at::equal(user.to_here(), at::ones({2, 2}) * 2));
  user.get_future().wait();
  CHECK(user.confirmed_by_owner());

  // local_value() on a user: PyTorch's exact text, with a fresh RRef (ids 3 and 4).
  auto other = distrpc::remote<&add>(next, at::ones({1}), at::ones({1}));
  expect_exact<distrpc::RpcError>(
      [&] { other.local_value(); },
      "For UserRRef(rref_id=GloballyUniqueId(created_on=" + r +
          ", local_id=3), fork_id=GloballyUniqueId(created_on=" + r +
          ", local_id=4)), can't call localValue() on user WorkerInfo(id=" + r + ", name=" +
          wname(ctx.rank) + "). Call it on owner WorkerInfo(id=" + std::to_string(next) +
          ", name=" + wname(next) + ")",
      "local_value on a user");

  // Owner equality and remote() to self (an owner RRef made locally, local_value works).
  auto mine = distrpc::remote<&add_ints>(ctx.rank, 20, 22);
  CHECK(mine.is_owner());
  CHECK(mine.local_value() == 42);
  CHECK(mine.to_here() == 42);
  CHECK(local.owner() == mine.owner());
  CHECK_FALSE(local.owner() == user.owner());

  // An empty handle, and an RRef serialized outside RPC.
  RRef<int> empty;
  CHECK_FALSE(empty.valid());
  CHECK_THROWS_WITH(empty.to_here(), doctest::Contains("empty RRef"));
  distrpc::wire::Message m;
  CHECK_THROWS_WITH(distrpc::wire::encode(m, local),
                    doctest::Contains("can only be serialized inside an RPC call"));
  distrpc::shutdown();
}

DISTRPC_MP_TEST("rref: world size 1: remote to self in every mode, proxies to self", 1, 60) {
  init(ctx);
  auto r = distrpc::remote<&add>(0, at::ones({2}), at::ones({2}));
  CHECK(r.is_owner());
  CHECK(at::equal(r.local_value(), at::ones({2}) * 2));
  CHECK(distrpc::rpc_sync<&rref_add_scalar>(0, r, 1.0).equal(at::ones({2}) * 3));
  auto rr = distrpc::remote<&rref_add_scalar>("worker0", r, 2.0);
  CHECK(at::equal(rr.to_here(), at::ones({2}) * 4));
  RRef<MyClass> obj(MyClass(5));
  obj.rpc_sync<&MyClass::increment_value>(1);
  CHECK(obj.rpc_async<&MyClass::get_value>().value() == 6);
  CHECK(obj.remote<&MyClass::get_value>().to_here() == 6);
  CHECK(obj.local_value().value.load() == 6);
  CHECK(owners_and_forks(0, 0));
  distrpc::shutdown();
}

// ---- §C: remote() of a function returning nothing: RRef<void> -----------------------------------

DISTRPC_MP_TEST("rref: remote() of a void function gives RRef<void>: peer, self, errors, sharing",
                4, 60) {
  init(ctx);
  const int next = (ctx.rank + 1) % ctx.world;
  const int third = (ctx.rank + 2) % ctx.world;
  const int key = ctx.rank;
  const std::string r = std::to_string(ctx.rank);

  // To a peer: to_here() returns only after the function ran there (it sleeps first).
  auto peer = distrpc::remote<&slow_bump>(next, key, 1, 200);
  static_assert(std::is_same_v<decltype(peer), RRef<void>>);
  CHECK(peer.str() == "UserRRef(RRefId = GloballyUniqueId(created_on=" + r +
                          ", local_id=0), ForkId = GloballyUniqueId(created_on=" + r +
                          ", local_id=1))");
  CHECK_FALSE(peer.is_owner());
  CHECK(peer.owner() == distrpc::get_worker_infos()[static_cast<std::size_t>(next)]);
  CHECK(peer.owner_name() == wname(next));
  peer.to_here();
  CHECK(distrpc::rpc_sync<&count_of>(next, key) == 1);
  peer.get_future().wait();  // the creation future (may complete just after the fetch)
  CHECK(peer.confirmed_by_owner());
  CHECK(peer.type_name() == "void");
  expect_exact<distrpc::RpcError>([&] { peer.local_value(); },
                                  "can't call localValue() on user WorkerInfo(id=" + r,
                                  "local_value of a user RRef<void>");

  // To self: an owner RRef<void>; the function has run once to_here()/local_value() return.
  auto self = distrpc::remote<&slow_bump>(ctx.rank, key, 10, 100);
  CHECK(self.is_owner());
  CHECK(self.str() == "OwnerRRef(GloballyUniqueId(created_on=" + r + ", local_id=2))");
  self.to_here();
  CHECK(count_of(key) == 10);
  self.local_value();
  CHECK(self.type_name() == "void");
  self.get_future().wait();

  // A function returning Future<void>: done once its nested call to the third worker ran.
  auto async = distrpc::remote<&async_bump>(next, third, key, 100);
  static_assert(std::is_same_v<decltype(async), RRef<void>>);
  async.to_here(5s);
  CHECK(distrpc::rpc_sync<&count_of>(third, key) == 100);

  // The function's exception comes back from to_here() with its type and text; the creation
  // itself succeeded.
  auto bad = distrpc::remote<&raise_in_void>(next, std::string("void fn failed on purpose"));
  bad.get_future().wait();
  expect_exact<std::invalid_argument>([&] { bad.to_here(); }, "void fn failed on purpose",
                                      "to_here of a throwing void function on a peer");
  expect_exact<std::invalid_argument>([&] { bad.type_name(); }, "void fn failed on purpose",
                                      "type query of a throwing void function");
  auto bad_self = distrpc::remote<&raise_in_void>(ctx.rank, std::string("on self"));
  expect_exact<std::invalid_argument>([&] { bad_self.to_here(); }, "on self", "to_here on self");
  expect_exact<std::invalid_argument>([&] { bad_self.local_value(); }, "on self",
                                      "local_value on self");

  // Passed as an argument to a third worker, which waits on it (the function is still sleeping
  // when the call starts), and to the owner itself.
  auto shared = distrpc::remote<&slow_bump>(next, key, 1000, 300);
  CHECK(distrpc::rpc_sync<&wait_void_rref>(third, shared, key) == "1001 confirmed user");
  CHECK(distrpc::rpc_sync<&wait_void_rref>(next, shared, key) == "1001 confirmed owner");
  CHECK(distrpc::remote<&wait_void_rref>(third, shared, key).to_here() == "1001 confirmed user");
  // Returned by a function: a user RRef<void> owned by a third worker.
  RRef<void> returned = distrpc::rpc_sync<&make_void_rref>(next, third, key);
  CHECK(returned.owner_name() == wname(third));
  returned.to_here();
  CHECK(distrpc::rpc_sync<&count_of>(third, key) == 101);

  // Every worker owns, for its predecessor: peer, async, bad and shared (forks held by it), and
  // for the worker two before it the returned one (its fork moved there): 5 cells, 5 forks.
  CHECK(rref_flushed());
  distrpc::barrier();
  CHECK_MESSAGE(owners_and_forks(5, 5), counters_line());
  distrpc::barrier();
  peer = RRef<void>();
  self = RRef<void>();
  async = RRef<void>();
  bad = RRef<void>();
  bad_self = RRef<void>();
  shared = RRef<void>();
  returned = RRef<void>();
  CHECK(rref_flushed());
  distrpc::barrier();
  CHECK_MESSAGE(owners_and_forks(0, 0), counters_line());
  CHECK(rref_counter("num_pending_children") == 0);
  CHECK_NOTHROW(distrpc::shutdown());  // graceful, with the leak check on
}

DISTRPC_MP_TEST("rref: RRef<void> from proxies of methods returning void, typed and by name", 2,
                60) {
  init(ctx);
  const int dst = (ctx.rank + 1) % ctx.world;
  auto list = distrpc::remote<&get_rref_list>(dst, std::vector<int>{0});
  auto obj = list.to_here()[0];  // a user RRef<MyClass> owned by dst
  auto done = obj.remote<&MyClass::increment_value>(2);
  static_assert(std::is_same_v<decltype(done), RRef<void>>);
  CHECK(done.owner_name() == wname(dst));
  done.to_here();
  CHECK(obj.rpc_sync<&MyClass::get_value>() == 2);
  RRef<void> by_name = obj.remote_by_name<void>("increment_value", 3);
  by_name.to_here();
  CHECK(obj.rpc_sync<&MyClass::get_value>() == 5);
  // Owner is self.
  RRef<MyClass> local(MyClass(1));
  auto local_done = local.remote<&MyClass::increment_value>(4);
  CHECK(local_done.is_owner());
  local_done.to_here();
  CHECK(local.local_value().value.load() == 5);
  CHECK_NOTHROW(distrpc::shutdown());
}

// ---- scenario 3: three parties, with the owner's counter trace --------------------------------

DISTRPC_MP_TARGET("rref target: three-party RRef (scenario 3)") {
  init(ctx);
  std::optional<RRef<at::Tensor>> rref;
  if (ctx.rank == 0) {
    rref = distrpc::remote<&add>("worker1", at::ones({3}), at::ones({3}));
    std::printf("[trace] worker0 (user) right after remote(): %s\n", counters_line().c_str());
    rref->get_future().wait();
    CHECK(rref_flushed());
    std::printf("[trace] worker0 (user) once the owner confirmed: %s\n", counters_line().c_str());
    // worker2 fetches it and keeps it.
    CHECK(at::equal(distrpc::rpc_sync<&hold_tensor_rref>("worker2", *rref), at::ones({3}) * 2));
  }
  CHECK(rref_flushed());
  distrpc::barrier();
  if (ctx.rank == 1) {
    CHECK(owners_and_forks(1, 2));  // w0's fork and w2's fork
    std::printf("[trace] worker1 (owner) after w0 shared with w2: %s\n", counters_line().c_str());
  }
  distrpc::barrier();
  if (ctx.rank == 0) {
    rref.reset();
    distrpc::rpc_sync<&drop_tensor_rref>("worker2");
  }
  if (ctx.rank == 1) {
    CHECK(owners_and_forks(0, 0));
    std::printf("[trace] worker1 (owner) after w0 and w2 dropped theirs: %s\n",
                counters_line().c_str());
  }
  if (ctx.rank == 0 || ctx.rank == 2) {
    CHECK(rref_flushed());
    std::printf("[trace] %s (user) at the end: %s\n", wname(ctx.rank).c_str(),
                counters_line().c_str());
  }
  distrpc::shutdown();
}

TEST_CASE("rref: three-party RRef: counts go 1 -> 0 on the owner (scenario 3)") {
  RunOptions o;
  o.world = 4;
  o.limit = 60s;
  auto r = run_ranks("rref target: three-party RRef (scenario 3)", o);
  CHECK_MESSAGE(r.ok, r.report());
  // The counter trace, in rank order (shown with -s).
  std::string trace;
  for (const auto& rank : r.ranks) {
    std::size_t at = 0;
    while ((at = rank.output.find("[trace]", at)) != std::string::npos) {
      const auto end = rank.output.find('\n', at);
      trace += rank.output.substr(at, end - at) + "\n";
      at = end;
    }
  }
  CHECK(contains(trace, "worker1 (owner) after w0 and w2 dropped theirs: num_owner_rrefs=0"));
  MESSAGE("three-party counter trace:\n" << trace);
}

// ---- scenario 4: a local RRef shared -----------------------------------------------------------

DISTRPC_MP_TEST("rref: local RRef(40) shared: 90 in all modes while the owner blocks (scenario 4)",
                4, 60) {
  init(ctx);
  const int dst = (ctx.rank + 1) % ctx.world;
  RRef<int> rref(40);
  CHECK(distrpc::rpc_sync<&add_rref_to_value>(dst, rref, 50) == 90);
  CHECK(distrpc::rpc_async<&add_rref_to_value>(dst, rref, 50).value() == 90);
  CHECK(distrpc::remote<&add_rref_to_value>(dst, rref, 50).to_here() == 90);
  // To self as well.
  CHECK(distrpc::rpc_sync<&add_rref_to_value>(ctx.rank, rref, 1) == 41);
  distrpc::shutdown();
}

// ---- scenario 5 / §I: fork confirmed before the function runs ---------------------------------

DISTRPC_MP_TEST("rref: a forked user RRef is confirmed inside the callee (scenario 5)", 4, 60) {
  init(ctx);
  const int dst = (ctx.rank + 1) % ctx.world;
  const int owner = (ctx.rank + 2) % ctx.world;
  auto rref = distrpc::remote<&add>(owner, at::zeros({2, 2}), at::ones({2, 2}));
  CHECK(distrpc::rpc_sync<&check_rref_confirmed>(dst, rref));
  CHECK(distrpc::remote<&check_rref_confirmed>(dst, rref).to_here());
  CHECK(distrpc::rpc_async<&check_rref_confirmed>(dst, rref).value());
  // The owner receiving its own RRef gets the owner RRef.
  CHECK(distrpc::rpc_sync<&is_owner_here>(owner, rref));
  CHECK(distrpc::rpc_sync<&owner_of>(dst, rref) == wname(owner));
  distrpc::shutdown();
}

// ---- RRefs as arguments and results in every combination ---------------------------------------

DISTRPC_MP_TEST("rref: RRef arguments and results: self-owned, user-shared, returned, third party",
                4, 60) {
  init(ctx);
  const int n = ctx.rank + 1;
  const int dst1 = n % ctx.world;
  const int dst2 = (n + 1) % ctx.world;
  const auto x = at::ones({2, 2});
  // Self-owned (remote to self) as an argument of rpc_sync / remote to a peer and to self.
  auto self_rref = distrpc::remote<&add_scalar>(ctx.rank, x, 1.0);
  CHECK(at::equal(distrpc::rpc_sync<&rref_add_scalar>(dst1, self_rref, 3.0), x + 4));
  CHECK(at::equal(distrpc::remote<&rref_add_scalar>(dst1, self_rref, 3.0).to_here(), x + 4));
  CHECK(at::equal(distrpc::rpc_sync<&rref_add_scalar>(ctx.rank, self_rref, 3.0), x + 4));
  CHECK(at::equal(distrpc::remote<&rref_add_scalar>(ctx.rank, self_rref, 3.0).to_here(), x + 4));
  // Owned by dst1, passed by this worker (a user) to dst2 (py_rref_args_user_share).
  auto a = distrpc::remote<&add_scalar>(dst1, x, 1.0);
  auto b = distrpc::remote<&add_scalar>(dst1, x, 2.0);
  CHECK(at::equal(distrpc::rpc_sync<&add>(dst2, a.to_here(), b.to_here()), x * 2 + 3));
  CHECK(at::equal(distrpc::rpc_sync<&rref_add_scalar>(dst2, a, 10.0), x + 11));
  CHECK(at::equal(distrpc::remote<&rref_add_scalar>(dst2, b, 10.0).to_here(), x + 12));
  // A user passing to itself.
  CHECK(at::equal(distrpc::rpc_sync<&rref_add_scalar>(ctx.rank, a, 1.0), x + 2));
  // Returned fresh local RRefs (the caller gets user RRefs), used through the owner.
  auto list = distrpc::rpc_sync<&get_rref_list>(dst1, std::vector<int>{1, 2, 3});
  REQUIRE(list.size() == 3);
  for (auto& r : list) {
    CHECK_FALSE(r.is_owner());
    CHECK(r.owner_name() == wname(dst1));
    distrpc::rpc_sync<&increment_on_owner>(r.owner(), r, 10);
  }
  std::vector<int> rets;
  for (auto& r : list) rets.push_back(r.rpc_sync<&MyClass::get_value>());
  CHECK(rets == std::vector<int>{11, 12, 13});
  // A function returning a user RRef to a third worker's value.
  auto third = distrpc::rpc_sync<&rpc_return_rref>(dst1, wname(dst2));
  CHECK(third.owner_name() == wname(dst2));
  CHECK(at::equal(third.to_here(), x * 2));
  distrpc::shutdown();
}

// ---- scenario 6: RRef of RRefs, 20 at once -----------------------------------------------------

DISTRPC_MP_TEST("rref: RRefs of RRefs, 20 concurrent nested creations (scenario 6)", 4, 90) {
  init(ctx);
  const int n = ctx.rank + 1;
  const int dst1 = n % ctx.world;
  const int dst2 = (n + 1) % ctx.world;
  std::vector<RRef<std::tuple<RRef<at::Tensor>, RRef<at::Tensor>>>> all;
  for (int i = 0; i < 20; ++i) all.push_back(distrpc::remote<&nested_rref>(dst1, wname(dst2)));
  int good = 0;
  for (auto& r : all) {
    auto [r1, r2] = r.to_here();
    CHECK(r1.owner_name() == wname(dst2));
    good += at::equal(r1.to_here(), at::ones({2, 2}) + 1) &&
            at::equal(r2.to_here(), at::ones({2, 2}) + 2);
  }
  CHECK(good == 20);
  distrpc::shutdown();
}

// ---- scenario 7: forward chain ------------------------------------------------------------------

DISTRPC_MP_TEST("rref: a forward chain of 8 remote hops unwraps to the value (scenario 7)", 4, 90) {
  init(ctx);
  const int ttl = 8;
  const int n = ctx.rank + 1;
  const int dst = n % ctx.world;
  auto rref = distrpc::remote<&add_scalar>(dst, at::ones({n, n}), 1.0);
  Link link = forward_chain(dst, ctx.world, rref, ttl);
  for (int i = 0; i < ttl; ++i) {
    REQUIRE(link.next.size() == 1);
    link = link.next[0].to_here();
  }
  CHECK(link.next.empty());
  CHECK(at::equal(link.value, at::ones({n, n}) + 1));
  distrpc::shutdown();
}

// ---- scenario 8 / §K: proxies -------------------------------------------------------------------

DISTRPC_MP_TEST(
    "rref: proxies mutate state, reuse, self, async methods, timeouts, by name "
    "(scenario 8)",
    4, 90) {
  init(ctx);
  const int dst = (ctx.rank + 1) % ctx.world;
  auto rref = distrpc::remote<&get_rref_list>(dst, std::vector<int>{0});
  auto obj = rref.to_here()[0];  // a user RRef<MyClass> owned by dst
  for (int i = 0; i < 4; ++i) obj.rpc_sync<&MyClass::increment_value>(1);
  obj.rpc_async<&MyClass::increment_value>(3).value();
  obj.rpc_sync<&MyClass::increment_value>(distrpc::with_timeout(5s), 3);
  CHECK(obj.rpc_sync<&MyClass::get_value>() == 10);
  auto value_rref = obj.remote<&MyClass::get_value>();
  CHECK(value_rref.owner_name() == wname(dst));
  CHECK(value_rref.to_here() == 10);
  // Owner is self.
  RRef<MyClass> local(MyClass(1));
  local.rpc_sync<&MyClass::increment_value>(2);
  CHECK(local.rpc_async<&MyClass::get_value>().value() == 3);
  CHECK(local.remote<&MyClass::get_value>().to_here() == 3);
  // Asynchronous methods through proxies, all three modes.
  CHECK(obj.rpc_sync<&MyClass::async_add>(ctx.rank, 5) == 15);
  CHECK(obj.rpc_async<&MyClass::async_add>(ctx.rank, 6).value() == 16);
  CHECK(obj.remote<&MyClass::async_add>(ctx.rank, 7).to_here() == 17);
  // Timeouts on proxies.
  expect_exact<distrpc::RpcTimeoutError>(
      [&] { obj.rpc_sync<&MyClass::slow_get>(distrpc::with_timeout(100ms), 1000); },
      "RPC ran for more than", "rpc_sync proxy timeout");
  expect_exact<distrpc::RpcTimeoutError>(
      [&] { obj.rpc_async<&MyClass::slow_get>(distrpc::with_timeout(100ms), 1000).value(); },
      "RPC ran for more than", "rpc_async proxy timeout");
  expect_exact<distrpc::RpcTimeoutError>(
      [&] {
        obj.remote<&MyClass::slow_get>(distrpc::with_timeout(100ms), 1000).get_future().wait();
      },
      "RPC ran for more than", "remote proxy timeout");
  CHECK(obj.rpc_sync<&MyClass::slow_get>(distrpc::with_timeout(5s), 10) == 10);
  // By name.
  obj.rpc_sync_by_name<void>("increment_value", 5);
  CHECK(obj.rpc_sync_by_name<int>("get_value") == 15);
  CHECK(obj.rpc_async_by_name<int>("get_value").value() == 15);
  CHECK(obj.remote_by_name<int>("get_value").to_here() == 15);
  expect_exact<distrpc::AttributeError>([&] { obj.rpc_sync_by_name<int>("non_exist"); },
                                        "has no attribute 'non_exist'", "rpc_sync by name");
  expect_exact<distrpc::AttributeError>([&] { obj.rpc_async_by_name<int>("non_exist").value(); },
                                        "has no attribute 'non_exist'", "rpc_async by name");
  expect_exact<distrpc::AttributeError>([&] { obj.remote_by_name<int>("non_exist"); },
                                        "has no attribute 'non_exist'", "remote by name");
  expect_exact<std::invalid_argument>([&] { obj.rpc_sync_by_name<double>("get_value"); },
                                      "is 'int()'", "wrong result type by name");
  // An object that cannot be serialized lives behind an RRef and is used through proxies.
  auto unshippable = RRef<Unshippable>::make();
  CHECK(distrpc::rpc_sync<&add_ints>(dst, 1, 1) == 2);
  CHECK(unshippable.rpc_sync<&Unshippable::hit>() == 1);
  CHECK(unshippable.rpc_sync<&Unshippable::hit>() == 2);
  distrpc::shutdown();
}

// ---- CallOptions first on the by-name proxies and on builtin calls -----------------------------
// As rpc_sync<&f>(to, opts, ...) and rref.rpc_sync<&T::m>(opts, ...) take them. A builtin call
// by schema name reaches any operator the dispatcher knows: distrpc_rref_test::sleep_ms is one
// that sleeps, registered here.

namespace {
int64_t sleep_op(int64_t ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return ms;
}
}  // namespace

TORCH_LIBRARY(distrpc_rref_test, m) {
  m.def("sleep_ms(int ms) -> int", sleep_op);
}

DISTRPC_MP_TEST(
    "rref: CallOptions first on the by-name proxies and on builtin calls by schema name; the "
    "timeout is honoured",
    2, 60) {
  init(ctx);
  if (ctx.rank == 0) {
    const std::string text100 =
        "RPC ran for more than set timeout (100 ms) and will now be marked with an error";
    auto obj = distrpc::rpc_sync<&get_rref_list>("worker1", std::vector<int>{5})[0];
    auto t0 = Clock::now();
    expect_exact<distrpc::RpcTimeoutError>(
        [&] { obj.rpc_sync_by_name<int>(distrpc::with_timeout(100ms), "slow_get", 1000); }, text100,
        "rpc_sync_by_name");
    CHECK(ms_since(t0) < 900);
    t0 = Clock::now();
    expect_exact<distrpc::RpcTimeoutError>(
        [&] { obj.rpc_async_by_name<int>(distrpc::with_timeout(100ms), "slow_get", 1000).value(); },
        text100, "rpc_async_by_name");
    CHECK(ms_since(t0) < 900);
    t0 = Clock::now();
    expect_exact<distrpc::RpcTimeoutError>(
        [&] {
          obj.remote_by_name<int>(distrpc::with_timeout(100ms), "slow_get", 1000)
              .get_future()
              .wait();
        },
        text100, "remote_by_name");
    CHECK(ms_since(t0) < 900);
    // Within the timeout.
    CHECK(obj.rpc_sync_by_name<int>(distrpc::with_timeout(20s), "slow_get", 10) == 5);
    obj.rpc_sync_by_name<void>(distrpc::with_timeout(20s), "increment_value", 2);
    CHECK(obj.rpc_async_by_name<int>(distrpc::with_timeout(20s), "get_value").value() == 7);
    CHECK(obj.remote_by_name<int>(distrpc::with_timeout(20s), "get_value").to_here() == 7);
    expect_exact<distrpc::AttributeError>(
        [&] { obj.rpc_sync_by_name<int>(distrpc::with_timeout(20s), "non_exist"); },
        "has no attribute 'non_exist'", "unknown name with options");

    // Builtins by schema name: CallOptions first, as every other call form.
    const at::Tensor x = at::ones({2});
    using IValues = std::vector<c10::IValue>;
    const std::string op = "distrpc_rref_test::sleep_ms";
    t0 = Clock::now();
    expect_exact<distrpc::RpcTimeoutError>(
        [&] { distrpc::rpc_sync("worker1", distrpc::with_timeout(100ms), op, IValues{1000}); },
        text100, "builtin rpc_sync");
    CHECK(ms_since(t0) < 900);
    t0 = Clock::now();
    expect_exact<distrpc::RpcTimeoutError>(
        [&] {
          distrpc::rpc_async("worker1", distrpc::with_timeout(100ms), op, IValues{1000}).value();
        },
        text100, "builtin rpc_async");
    CHECK(ms_since(t0) < 900);
    t0 = Clock::now();
    expect_exact<distrpc::RpcTimeoutError>(
        [&] {
          distrpc::remote("worker1", distrpc::with_timeout(100ms), op, IValues{1000})
              .get_future()
              .wait();
        },
        text100, "builtin remote");
    CHECK(ms_since(t0) < 900);
    t0 = Clock::now();
    expect_exact<distrpc::RpcTimeoutError>(
        [&] { distrpc::rpc_sync("worker1", op, IValues{1000}, distrpc::with_timeout(100ms)); },
        text100, "builtin rpc_sync, options last");
    CHECK(ms_since(t0) < 900);
    CHECK(distrpc::rpc_sync("worker1", distrpc::with_timeout(20s), op, IValues{10}).toInt() == 10);
    CHECK(distrpc::rpc_async("worker1", distrpc::with_timeout(20s), op, IValues{20})
              .value()
              .toInt() == 20);
    CHECK(
        distrpc::remote("worker1", distrpc::with_timeout(20s), op, IValues{30}).to_here().toInt() ==
        30);
    CHECK(at::equal(
        distrpc::rpc_sync("worker1", distrpc::with_timeout(20s), "aten::add.Tensor", IValues{x, x})
            .toTensor(),
        x * 2));
    // The options after the arguments are still accepted.
    CHECK(at::equal(
        distrpc::rpc_sync("worker1", "aten::add.Tensor", IValues{x, x}, distrpc::with_timeout(20s))
            .toTensor(),
        x * 2));
  }
  distrpc::shutdown();
}

// ---- scenario 15: parameter server --------------------------------------------------------------

DISTRPC_MP_TEST("rref: parameter server with async average through proxies (scenario 15)", 4, 120) {
  init(ctx);
  auto ps = RRef<ParameterServer>::make(ctx.world - 1);
  std::vector<Future<int>> futs;
  for (int i = 1; i < ctx.world; ++i) {
    futs.push_back(distrpc::rpc_async<&trainer>((ctx.rank + i) % ctx.world, ps, ctx.rank * 10 + i));
  }
  for (int checked : distrpc::wait_all(futs)) CHECK(checked == 10);
  CHECK(ps.local_value().iteration == 9);
  distrpc::shutdown();
}

// ---- scenario 18: creation timeout --------------------------------------------------------------

DISTRPC_MP_TEST("rref: remote() creation timeout; the owner still creates (scenario 18)", 4, 60) {
  init(ctx);
  std::optional<RRef<int>> rref;
  if (ctx.rank == 0) {
    rref = distrpc::remote<&sleep_ms>("worker1", distrpc::with_timeout(10ms), 1500);
    expect_exact<distrpc::RpcTimeoutError>([&] { rref->get_future().wait(); },
                                           "RPC ran for more than", "creation future");
    CHECK(rref_flushed());
    expect_exact<distrpc::RpcTimeoutError>([&] { rref->to_here(); }, "RRef creation",
                                           "to_here after a creation timeout");
    CHECK_FALSE(rref->confirmed_by_owner());
  }
  distrpc::barrier();
  if (ctx.rank == 1) {
    CHECK(owners_and_forks(1, 1));
    std::printf("[trace] worker1 after the timed-out creation: %s\n", counters_line().c_str());
  }
  distrpc::barrier();
  rref.reset();
  if (ctx.rank == 1) CHECK(owners_and_forks(0, 0));
  distrpc::shutdown();
}

// ---- §J: debug info -----------------------------------------------------------------------------

DISTRPC_MP_TEST("rref: context debug info (test_rref_context_debug_info)", 4, 60) {
  init(ctx);
  const int dst = (ctx.rank + 1) % ctx.world;
  RRef<int> rref1(ctx.rank);
  auto info = distrpc::get_debug_info();
  for (auto k : {"num_owner_rrefs", "num_pending_users", "num_pending_futures", "num_forks"}) {
    CHECK(info.count(k) == 1);
  }
  CHECK(info.at("num_owner_rrefs") == "0");
  CHECK(info.at("num_pending_users") == "0");
  distrpc::barrier();
  // Shared with a peer: one owner RRef, no pending user once the fork completed.
  distrpc::rpc_sync<&set_global_rref>(dst, rref1);
  CHECK(rref_flushed());
  distrpc::barrier();
  CHECK(rref_counter("num_owner_rrefs") == 1);
  CHECK(rref_counter("num_forks") == 1);
  CHECK(rref_counter("num_pending_users") == 0);
  distrpc::barrier();
  distrpc::rpc_sync<&clear_global_rref>(dst);
  CHECK(owners_and_forks(0, 0));
  distrpc::barrier();
  // Two remote() calls to a peer: it owns two.
  auto rref2 = distrpc::remote<&add>(dst, at::ones({2, 2}), at::ones({2, 2}));
  auto rref3 = distrpc::remote<&add>(dst, at::ones({2, 2}), at::ones({2, 2}));
  rref2.to_here();
  rref3.to_here();
  CHECK(rref_flushed());
  distrpc::barrier();
  CHECK(rref_counter("num_owner_rrefs") == 2);
  CHECK(rref_counter("num_pending_users") == 0);
  distrpc::barrier();
  distrpc::shutdown();
}

// ---- §J: leaks, shutdown purge, use after shutdown ----------------------------------------------

DISTRPC_MP_TEST("rref: leak check: 'Leaking RRef' without the purge, silent when ignored", 4, 60) {
  // Without the purge the predecessor's fork stays on every owner.
  distrpc::detail::rref_purge_enabled() = false;
  RpcBackendOptions o;
  o.init_method = file_url(ctx, "leak");
  distrpc::testing::init_rpc_under_test(wname(ctx.rank), ctx.rank, ctx.world, o);
  auto rref = distrpc::remote<&add>((ctx.rank + 1) % ctx.world, at::ones({2, 2}), at::ones({2, 2}));
  rref.to_here();
  CHECK(rref_flushed());
  expect_exact<distrpc::RpcError>([] { distrpc::shutdown(); }, "Leaking RRef", "leak check");
  CHECK_FALSE(distrpc::is_initialized());
  // Again, with the leak check off.
  distrpc::set_ignore_rref_leak(true);
  o.init_method = file_url(ctx, "ignored");
  distrpc::testing::init_rpc_under_test(wname(ctx.rank), ctx.rank, ctx.world, o);
  auto rref2 =
      distrpc::remote<&add>((ctx.rank + 1) % ctx.world, at::ones({2, 2}), at::ones({2, 2}));
  rref2.to_here();
  CHECK_NOTHROW(distrpc::shutdown());
  distrpc::set_ignore_rref_leak(false);
  distrpc::detail::rref_purge_enabled() = true;
}

struct CycleNode {
  std::shared_ptr<CycleNode> other;
  std::optional<RRef<at::Tensor>> rref;
};

DISTRPC_MP_TEST("rref: shutdown purges user RRefs held in reference cycles; dead RRefs after", 4,
                60) {
  init(ctx);
  const int dst = (ctx.rank + 1) % ctx.world;
  // A user RRef kept alive by a local cycle (never destroyed): the purge still releases it.
  auto a = std::make_shared<CycleNode>();
  auto b = std::make_shared<CycleNode>();
  a->other = b;
  b->other = a;
  a->rref = distrpc::remote<&add>(dst, at::ones({2, 2}), at::ones({2, 2}));
  a->rref->to_here();
  auto keep = distrpc::remote<&add>(dst, at::ones({1}), at::ones({1}));
  keep.to_here();
  distrpc::shutdown();  // would raise "Leaking RRef" if the cycle's fork were left on the owner
  expect_exact<distrpc::RpcError>([&] { keep.to_here(); },
                                  "Cannot call to_here() on it after deletion.", "to_here after");
  // Forking a dead user RRef (in a new session) is refused.
  RpcBackendOptions o;
  o.init_method = file_url(ctx, "again");
  distrpc::testing::init_rpc_under_test(wname(ctx.rank), ctx.rank, ctx.world, o);
  expect_exact<distrpc::RpcError>([&] { distrpc::rpc_sync<&rref_add_scalar>(dst, keep, 1.0); },
                                  "Cannot call fork an UserRRef after deletion.", "fork after");
  distrpc::shutdown();
  a->other.reset();  // let the test process free the cycle
}

DISTRPC_MP_TEST("rref: API after shutdown and before init", 2, 60) {
  CHECK_THROWS_WITH(RRef<int>(1), doctest::Contains("Current RPC agent is not set"));
  init(ctx);
  distrpc::shutdown();
  CHECK_THROWS_WITH(RRef<int>(1), doctest::Contains("RPC has not been initialized"));
  CHECK_THROWS_WITH(distrpc::remote<&add_ints>(0, 1, 2),
                    doctest::Contains("RPC has not been initialized"));
}

// ---- errors, type queries -----------------------------------------------------------------------

DISTRPC_MP_TEST("rref: remote exceptions through to_here and type queries; bad destinations", 4,
                60) {
  init(ctx);
  const int dst = (ctx.rank + 1) % ctx.world;
  auto bad = distrpc::remote<&raise_value_error>(dst);
  bad.get_future().wait();  // the creation itself succeeded
  expect_exact<std::invalid_argument>([&] { bad.to_here(); }, "Expected error", "to_here");
  expect_exact<std::invalid_argument>([&] { bad.type_name(); }, "Expected error", "type query");
  auto bad_self = distrpc::remote<&raise_value_error>(ctx.rank);
  expect_exact<std::invalid_argument>([&] { bad_self.to_here(); }, "Expected error", "self");
  // Type queries: one RPC then cached (the same future); owners answer locally.
  auto t = distrpc::remote<&add>(dst, at::ones({2}), at::ones({2}));
  auto f1 = t.type_name_async();
  auto f2 = t.type_name_async();
  CHECK(f1.value() == "at::Tensor");
  CHECK(f2.value() == "at::Tensor");
  CHECK(distrpc::detail::FutureAccess::state(f1) == distrpc::detail::FutureAccess::state(f2));
  RRef<MyClass> mine(MyClass(1));
  CHECK(mine.type_name() == "rref_test::MyClass");
  auto slow = distrpc::remote<&sleep_ms>(dst, 500);
  CHECK(slow.type_name() == "int");
  // Bad destinations fail in remote() like in the other modes.
  CHECK_THROWS_WITH(distrpc::remote<&add_ints>(ctx.world + 1, 1, 2),
                    doctest::Contains("could not find destination"));
  CHECK_THROWS_WITH(distrpc::remote<&add_ints>("nobody", 1, 2),
                    doctest::Contains("could not find destination"));
  CHECK_THROWS_WITH(distrpc::remote<&add_ints>(-1, 1, 2),
                    doctest::Contains("could not find destination"));
  CHECK(owners_and_forks(rref_counter("num_owner_rrefs"), rref_counter("num_forks")));
  distrpc::shutdown();
}

// to_here() right after remote() sends its fetch along, before the owner confirmed the creation
// (one round trip). When the owner refuses the call before running it (here a signature
// mismatch, through the raw path: an SPMD binary registers everything it calls), the fetch must
// fail with the creation, at once and not at its timeout, and the owner must keep nothing for
// it, whether the fetch reached the owner before the refusal or after.
DISTRPC_MP_TEST("rref: to_here() right after a remote() the owner refuses fails with the creation",
                2, 60) {
  init(ctx);
  if (ctx.rank == 0) {
    auto agent = distrpc::detail::current_agent();
    for (int i = 0; i < 20; ++i) {
      distrpc::RequestHeader h;
      h.name = std::string(distrpc::detail::function_name<&add_ints>());
      h.signature = 12345;  // not add_ints's
      const std::tuple<int, int> packed{1, 2};
      auto r = distrpc::detail::remote_packed<int>(agent, agent->worker(1), {}, h, packed,
                                                   "raw remote()");
      const auto t0 = Clock::now();
      std::string text;
      try {
        (void)r.to_here(10s);
      } catch (const distrpc::RpcError& e) {
        text = e.what();
      }
      CHECK(contains(text, "Error occurred during RRef creation"));
      CHECK(contains(text, "signature mismatch"));
      CHECK(Clock::now() - t0 < 5s);  // not the fetch's own 10 s timeout
      CHECK_FALSE(r.confirmed_by_owner());
    }
    // The type query of one goes the same way.
    distrpc::RequestHeader h;
    h.name = std::string(distrpc::detail::function_name<&add_ints>());
    h.signature = 12345;
    auto r = distrpc::detail::remote_packed<int>(agent, agent->worker(1), {}, h,
                                                 std::tuple<int, int>{1, 2}, "raw remote()");
    CHECK_THROWS_WITH(r.type_name(), doctest::Contains("signature mismatch"));
    // A good one right after still works, in one round trip or two.
    CHECK(distrpc::remote<&add_ints>("worker1", 2, 3).to_here() == 5);
  }
  distrpc::barrier();
  // The owner holds no cell for the refused calls (nor for the good one, released).
  if (ctx.rank == 1) CHECK(owners_and_forks(0, 0));
  CHECK(rref_flushed());
  distrpc::shutdown();
}

DISTRPC_MP_TEST("rref: deletes of dropped user RRefs go in batches, and soon", 2, 60) {
  init(ctx);
  if (ctx.rank == 0) {
    std::vector<RRef<int>> users;
    for (int i = 0; i < 300; ++i) users.push_back(distrpc::remote<&add_ints>("worker1", i, 1));
    for (int i = 0; i < 300; ++i) CHECK(users[static_cast<std::size_t>(i)].to_here() == i + 1);
    CHECK(rref_flushed());
    const int sent0 = rref_counter("num_user_deletes_sent");
    const int messages0 = rref_counter("num_user_delete_messages");
    ctx.publish("made", "1");
    (void)ctx.lookup("counted");
    users.clear();
    // 300 deletes: one full batch of 256 at once, the rest when the short delay ends.
    CHECK(rref_flushed());
    CHECK(rref_counter("num_queued_deletes") == 0);
    CHECK(rref_counter("num_user_deletes_sent") - sent0 == 300);
    const int messages = rref_counter("num_user_delete_messages") - messages0;
    CHECK(messages >= 2);
#ifdef DISTRPC_UNDER_TSAN  // net/handoff.hpp
    // Under ThreadSanitizer clear() itself outlasts the delay, as many times as the machine's load
    // makes it: the last 44 leave in more messages, still batched (measured: 7, then 16 on a
    // loaded machine). At least 10 deletes a message on average.
    CHECK(messages <= 30);
#else
    CHECK(messages <= 4);
#endif
    ctx.publish("dropped", "1");
    (void)ctx.lookup("freed");
    // A lone dropped RRef is not kept waiting for company: its owner frees it within the delay.
    auto one = distrpc::remote<&add_ints>("worker1", 2, 2);
    CHECK(one.to_here() == 4);
    ctx.publish("one", "1");
    (void)ctx.lookup("one_counted");
    one = RRef<int>();
    ctx.publish("one_dropped", std::to_string(std::chrono::duration_cast<std::chrono::microseconds>(
                                                  Clock::now().time_since_epoch())
                                                  .count()));
  } else {
    (void)ctx.lookup("made");
    CHECK(owners_and_forks(300, 300));
    ctx.publish("counted", "1");
    (void)ctx.lookup("dropped");
    CHECK(owners_and_forks(0, 0));
    ctx.publish("freed", "1");
    (void)ctx.lookup("one");
    CHECK(owners_and_forks(1, 1));
    ctx.publish("one_counted", "1");
    const auto dropped_at =
        Clock::time_point(std::chrono::microseconds(std::stoll(ctx.lookup("one_dropped"))));
    CHECK(owners_and_forks(0, 0));
    // Steady clocks agree across processes of one host.
    CHECK(Clock::now() - dropped_at < 1s);
  }
  distrpc::barrier();
  distrpc::shutdown();
}

// ---- scenarios 19-21 with RRefs: barriers, all-gather and shutdown under RRef traffic --------

DISTRPC_MP_TEST("rref: graceful shutdown with RRef traffic in flight everywhere", 4, 60) {
  init(ctx);
  std::vector<RRef<at::Tensor>> keep;
  for (int i = 0; i < 10; ++i) {
    keep.push_back(distrpc::remote<&add_scalar>((ctx.rank + i) % ctx.world, at::ones({4}), i));
  }
  // Pass them around without waiting: forks, confirmations and deletes race with shutdown.
  for (int i = 0; i < 10; ++i) {
    (void)distrpc::rpc_async<&rref_add_scalar>((ctx.rank + 2 * i + 1) % ctx.world,
                                               keep[static_cast<std::size_t>(i)], 1.0);
  }
  distrpc::barrier({wname(ctx.rank)});
  auto names = distrpc::all_gather(ctx.rank);
  CHECK(names.size() == static_cast<std::size_t>(ctx.world));
  distrpc::shutdown();
}

// ---- a peer owning RRefs killed ----------------------------------------------------------------

DISTRPC_MP_TARGET("rref target: the owner is killed") {
  init(ctx);
  constexpr int kVictim = 3;
  if (ctx.rank == kVictim) {
    for (int r = 0; r < kVictim; ++r) (void)ctx.lookup("created" + std::to_string(r));
    ctx.publish("killed", "now");
    ::kill(::getpid(), SIGKILL);
    std::this_thread::sleep_for(60s);
  }
  auto rref = distrpc::remote<&add>(wname(kVictim), at::ones({2}), at::ones({2}));
  CHECK(at::equal(rref.to_here(), at::ones({2}) * 2));
  ctx.publish("created" + std::to_string(ctx.rank), "yes");
  (void)ctx.lookup("killed");
  std::this_thread::sleep_for(100ms);
  const auto t0 = Clock::now();
  try {
    rref.to_here();
    FAIL_CHECK("to_here() of an RRef whose owner died succeeded");
  } catch (const std::exception& e) {
    CHECK_MESSAGE(contains(e.what(), wname(kVictim)), e.what());
  }
  CHECK(ms_since(t0) < 2000);
  // The survivors still work, with RRefs among themselves.
  auto ok = distrpc::remote<&add>((ctx.rank + 1) % 3, at::ones({2}), at::ones({2}));
  CHECK(at::equal(ok.to_here(), at::ones({2}) * 2));
  distrpc::barrier({"worker0", "worker1", "worker2"});
  const auto t1 = Clock::now();
  CHECK_THROWS(distrpc::shutdown(/*graceful=*/true, 2s));
  CHECK(ms_since(t1) < 10000);
  CHECK_FALSE(distrpc::is_initialized());
}

TEST_CASE("rref: an owner killed with SIGKILL: to_here fails naming it, shutdown does not hang") {
  RunOptions o;
  o.world = 4;
  o.limit = 60s;
  o.may_die = {3};
  auto r = run_ranks("rref target: the owner is killed", o);
  CHECK_MESSAGE(r.ok, r.report());
  REQUIRE(r.ranks.size() == 4);
  CHECK_MESSAGE(r.ranks[3].signal == SIGKILL, r.report());
  for (int i = 0; i < 3; ++i) {
    CHECK_MESSAGE(r.ranks[static_cast<std::size_t>(i)].exit_code == 0, r.report());
  }
}
