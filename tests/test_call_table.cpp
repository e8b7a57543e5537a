// The agent's call table in one process: deadlines fail calls with the RPC timeout text naming
// the call and the worker, replies take a call once (and only from the worker it went to), the
// join's counters follow every path, and timed tasks go to the executor, never run on the timer.
#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <doctest/doctest.h>

#include <distrpc/agent/call_table.hpp>

using namespace std::chrono_literals;
using distrpc::Future;
using distrpc::WorkCounters;
using distrpc::WorkerInfo;
using Table = distrpc::detail::CallTable<int>;

namespace {

// An executor that runs what it is given on a thread of its own and counts it.
struct Executor {
  std::atomic<int> ran{0};
  std::atomic<bool> accept{true};
  std::vector<std::thread> threads;
  Table::Post post() {
    return [this](std::function<void()> fn) {
      if (!accept.load()) return false;
      threads.emplace_back([this, fn = std::move(fn)] {
        fn();
        ++ran;
      });
      return true;
    };
  }
  ~Executor() {
    for (auto& t : threads) t.join();
  }
};

bool wait_until(const std::function<bool()>& cond, std::chrono::milliseconds limit = 5s) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!cond()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

}  // namespace

TEST_CASE("call table: a call past its deadline fails with the RPC timeout text") {
  Executor ex;
  Table t(ex.post());
  Future<int> f;
  const auto id = t.add(WorkerInfo{1, "worker1"}, f, 50ms, false, "call to 'add'");
  CHECK(t.size() == 1);
  REQUIRE(f.wait_for(5s));
  CHECK_THROWS_AS(f.value(), distrpc::RpcTimeoutError);
  CHECK_THROWS_WITH(f.value(),
                    "RPC ran for more than set timeout (50 ms) and will now be marked with an "
                    "error (call to 'add' on WorkerInfo(id=1, name=worker1))");
  CHECK(t.size() == 0);
  // Gone: a late reply finds nothing, a late failure changes nothing.
  CHECK_FALSE(t.take(id).call.has_value());
  CHECK_FALSE(t.fail(id, std::make_exception_ptr(std::runtime_error("late"))));
  REQUIRE(wait_until([&] { return t.counters().protocol_pending == 0; }));
  CHECK(t.counters() == WorkCounters{1, 1, 0, 0});
}

TEST_CASE("call table: a reply takes its call once, only from the worker it went to") {
  Executor ex;
  Table t(ex.post());
  Future<int> f;
  const auto id = t.add(WorkerInfo{2, "worker2"}, f, 0ms, false, "call to 'f'");
  auto wrong = t.take(id, 3);
  CHECK_FALSE(wrong.call.has_value());
  REQUIRE(wrong.other_peer.has_value());
  CHECK(wrong.other_peer->name == "worker2");
  CHECK(t.size() == 1);
  // Taken: counted done, but not settled until its future's callbacks ran.
  auto taken = t.take(id, 2);
  REQUIRE(taken.call.has_value());
  CHECK(taken.call->what == "call to 'f'");
  CHECK(t.counters() == WorkCounters{1, 1, 0, 1});
  taken.call->future.set_value(7);
  t.settled(taken.call->internal);
  CHECK(f.value() == 7);
  CHECK(t.counters() == WorkCounters{1, 1, 0, 0});
  CHECK_FALSE(t.take(id, 2).call.has_value());
}

TEST_CASE("call table: internal calls are not counted; calls_to() lists a worker's calls") {
  Executor ex;
  Table t(ex.post());
  Future<int> a, b, c;
  const auto ia = t.add(WorkerInfo{1, "w1"}, a, 0ms, true, "gather");
  const auto ib = t.add(WorkerInfo{2, "w2"}, b, 0ms, false, "call to 'g'");
  t.add(WorkerInfo{2, "w2"}, c, 0ms, false, "call to 'h'");
  CHECK(t.counters().client_sent == 2);
  CHECK(ia != ib);
  CHECK(t.calls_to(2).size() == 2);
  CHECK(t.calls_to(1).size() == 1);
  CHECK(t.calls_to(-1).size() == 3);
  for (const auto& [id, what] : t.calls_to(2)) {
    CHECK(t.fail(id, std::make_exception_ptr(distrpc::DistNetworkError("lost " + what))));
  }
  CHECK_THROWS_WITH(b.value(), "lost call to 'g'");
  CHECK(t.fail(ia, std::make_exception_ptr(std::runtime_error("x"))));
  CHECK(t.counters() == WorkCounters{2, 2, 0, 0});
  t.server_begin();
  t.protocol_begin(3);
  CHECK(t.counters() == WorkCounters{2, 2, 1, 3});
  t.server_end();
  t.protocol_end(3);
  CHECK(t.counters() == WorkCounters{2, 2, 0, 0});
}

TEST_CASE("call table: timed tasks run on the executor, in order; stop drops the rest") {
  Executor ex;
  std::vector<int> order;
  std::mutex mu;
  {
    Table t(ex.post());
    const auto record = [&](int v) {
      return [&, v] {
        std::lock_guard<std::mutex> lk(mu);
        order.push_back(v);
      };
    };
    CHECK(t.after(60ms, record(2)));
    CHECK(t.after(20ms, record(1)));
    CHECK(t.after(10s, record(99)));  // never due: dropped by stop()
    REQUIRE(wait_until([&] { return ex.ran.load() == 2; }));
    t.stop();
    CHECK_FALSE(t.after(1ms, record(3)));
  }
  std::this_thread::sleep_for(20ms);
  CHECK(ex.ran.load() == 2);
  CHECK(order == std::vector<int>{1, 2});
}

TEST_CASE("call table: an earlier deadline added later is still met (the timer is woken)") {
  Executor ex;
  Table t(ex.post());
  Future<int> slow, fast;
  t.add(WorkerInfo{1, "w1"}, slow, 10s, false, "slow");
  const auto t0 = std::chrono::steady_clock::now();
  t.add(WorkerInfo{1, "w1"}, fast, 30ms, false, "fast");
  REQUIRE(fast.wait_for(5s));
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);
  CHECK_FALSE(slow.done());
}
