// Tests of distrpc::Future and its combinators (spec rpc.md group F, the future side of group H and
// scenarios 11-12). No RPC here: futures are completed by hand or by helper threads.
#include <doctest/doctest.h>

#include "distrpc/future.hpp"
#include "support/finishes_within.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <latch>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using distrpc::Future;
using distrpc::FutureBase;
using distrpc::Promise;
using distrpc::WaitAllScope;
using distrpc::testing::finishes_within;
using namespace std::chrono_literals;

namespace {

// One worker thread draining a queue: lets a test tell "ran on the executor" from "ran inline".
class SerialExecutor {
 public:
  SerialExecutor() : thread_([this] { loop(); }) {}
  ~SerialExecutor() {
    {
      std::lock_guard lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  SerialExecutor(const SerialExecutor&) = delete;
  SerialExecutor& operator=(const SerialExecutor&) = delete;

  void post(std::function<void()> fn) {
    {
      std::lock_guard lk(mu_);
      queue_.push_back(std::move(fn));
      ++posted_;
    }
    cv_.notify_one();
  }
  std::thread::id id() const { return thread_.get_id(); }
  int posted() const {
    std::lock_guard lk(mu_);
    return posted_;
  }

 private:
  void loop() {
    std::unique_lock lk(mu_);
    for (;;) {
      cv_.wait(lk, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ set and drained
      auto fn = std::move(queue_.front());
      queue_.pop_front();
      lk.unlock();
      fn();
      lk.lock();
    }
  }

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  int posted_ = 0;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

std::string error_text(const FutureBase& f) {
  if (!f.has_error()) return f.done() ? "<succeeded>" : "<pending>";
  try {
    std::rethrow_exception(f.exception_ptr());
  } catch (const std::exception& e) {
    return e.what();
  }
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST_CASE("Future: value, done, has_value, try_value") {
  Future<int> f;
  CHECK(f.valid());
  CHECK_FALSE(f.done());
  CHECK(f.try_value() == nullptr);
  CHECK(f.exception_ptr() == nullptr);
  CHECK_FALSE(f.wait_for(10ms));
  f.set_value(42);
  CHECK(f.done());
  CHECK(f.has_value());
  CHECK_FALSE(f.has_error());
  REQUIRE(f.try_value() != nullptr);
  CHECK(*f.try_value() == 42);
  CHECK(f.value() == 42);
  CHECK(f.wait_for(0ms));
  CHECK(f.wait_until(std::chrono::steady_clock::now()));
  Future<int> copy = f;  // a handle: both see the same state
  CHECK(&copy.value() == &f.value());
}

TEST_CASE("Future: PyTorch's names: wait() returns the value, set_result() completes") {
  Future<int> f;
  std::thread t([f] { f.set_result(41); });
  CHECK(f.wait() == 41);  // torch.futures.Future.wait() returns the result
  t.join();
  CHECK_THROWS_WITH(f.set_result(1), doctest::Contains("Future can only be marked completed once"));
  CHECK(f.wait() == 41);

  Future<std::string> failed;
  failed.set_exception(std::make_exception_ptr(std::runtime_error("no result")));
  CHECK_THROWS_WITH_AS(failed.wait(), "no result", std::runtime_error);

  Future<void> done;
  done.set_result();
  done.wait();
  CHECK(done.has_value());
  // Through the type-erased handle wait() still only waits (and rethrows).
  const FutureBase& base = failed;
  CHECK_THROWS_AS(base.wait(), std::runtime_error);
}

TEST_CASE("Future: wait_for wakes when another thread completes the future") {
  Future<std::string> f;
  std::thread t([f] {
    std::this_thread::sleep_for(20ms);
    f.set_value("late");
  });
  CHECK(f.wait_for(5s));
  CHECK(f.value() == "late");
  t.join();
  Future<int> never;
  auto t0 = std::chrono::steady_clock::now();
  CHECK_FALSE(never.wait_for(50ms));
  CHECK(seconds_since(t0) >= 0.045);
}

TEST_CASE("Future: a then-chain of 20 accumulates") {
  Future<int> head;
  Future<int> tail = head;
  for (int i = 0; i < 20; ++i) {
    tail = tail.then([](Future<int>& parent) { return parent.value() + 3; });
  }
  CHECK_FALSE(tail.done());
  head.set_value(1);
  CHECK(tail.done());
  CHECK(tail.value() == 1 + 20 * 3);
}

TEST_CASE("Future: 10 callbacks on one future each see the value") {
  Future<int> f;
  std::vector<Future<int>> children;
  for (int i = 0; i < 10; ++i) {
    children.push_back(f.then([i](Future<int>& parent) { return parent.value() + i; }));
  }
  f.set_value(100);
  for (int i = 0; i < 10; ++i) CHECK(children[i].value() == 100 + i);
}

TEST_CASE("Future: a throwing then-callback fails only its child") {
  Future<int> f;
  auto bad = f.then([](Future<int>&) -> int { throw std::invalid_argument("Expected error"); });
  auto good = f.then([](Future<int>& p) { return p.value() * 2; });
  auto after_bad = bad.then([](Future<int>& p) { return p.value(); });
  auto recovered = bad.then([](Future<int>& p) {
    try {
      return p.value();
    } catch (const std::invalid_argument&) {
      return -1;
    }
  });
  f.set_value(21);
  CHECK(f.has_value());
  CHECK(f.value() == 21);
  CHECK(good.value() == 42);
  CHECK(bad.has_error());
  CHECK_THROWS_AS_MESSAGE(bad.value(), std::invalid_argument, "the original type is kept");
  CHECK(error_text(bad) == "Expected error");
  CHECK(after_bad.has_error());  // errors travel down the chain
  CHECK(error_text(after_bad) == "Expected error");
  CHECK(recovered.value() == -1);
}

TEST_CASE("Future: completing twice fails with the PyTorch text") {
  const std::string text = "Future can only be marked completed once";
  Future<int> f;
  f.set_value(1);
  CHECK_THROWS_WITH_AS(f.set_value(2), text.c_str(), std::logic_error);
  CHECK_THROWS_WITH_AS(f.set_exception(std::runtime_error("x")), text.c_str(), std::logic_error);
  CHECK(f.value() == 1);  // the first completion stands
  CHECK_FALSE(f.try_set_value(3));
  CHECK_FALSE(f.try_set_exception(std::make_exception_ptr(std::runtime_error("y"))));
  CHECK(f.value() == 1);

  Future<int> e;
  e.set_exception(std::runtime_error("first"));
  CHECK_THROWS_WITH_AS(e.set_value(2), text.c_str(), std::logic_error);
  CHECK(error_text(e) == "first");

  Future<void> v;
  v.set_value();
  CHECK_THROWS_WITH_AS(v.set_value(), text.c_str(), std::logic_error);

  Promise<int> p;
  p.set_value(5);
  CHECK_THROWS_WITH_AS(p.set_value(6), text.c_str(), std::logic_error);
  CHECK(p.get_future().value() == 5);
}

TEST_CASE("Future: set_exception rejects a null exception_ptr") {
  Future<int> f;
  CHECK_THROWS_AS(f.set_exception(std::exception_ptr{}), std::invalid_argument);
  CHECK_FALSE(f.done());
}

TEST_CASE("Future: wait() rethrows the stored error every time; done() after an error") {
  Future<int> f;
  CHECK_FALSE(f.done());
  f.set_exception(std::runtime_error("Expected error"));
  CHECK(f.done());
  CHECK(f.has_error());
  CHECK_FALSE(f.has_value());
  CHECK(f.exception_ptr() != nullptr);
  CHECK(f.try_value() == nullptr);
  for (int i = 0; i < 2; ++i) {
    CHECK_THROWS_WITH_AS(f.wait(), "Expected error", std::runtime_error);
    CHECK_THROWS_WITH_AS(f.value(), "Expected error", std::runtime_error);
  }
  CHECK(f.wait_for(0ms));  // reports completion without throwing
}

TEST_CASE("Future: add_done_callback runs callbacks in registration order") {
  Future<int> f;
  std::vector<int> order;
  for (int i = 0; i < 8; ++i) {
    f.add_done_callback([&order, i](Future<int>& p) { order.push_back(i * 100 + p.value()); });
  }
  CHECK(order.empty());
  f.set_value(7);
  CHECK(order == std::vector<int>{7, 107, 207, 307, 407, 507, 607, 707});
}

TEST_CASE("Future: callbacks registered after completion run inline, on this thread") {
  Future<int> f;
  std::thread completer([f] { f.set_value(9); });
  completer.join();
  std::thread::id ran_on;
  int seen = 0;
  f.add_done_callback([&](const Future<int>& p) {
    ran_on = std::this_thread::get_id();
    seen = p.value();
  });
  CHECK(seen == 9);  // already ran when add_done_callback returned
  CHECK(ran_on == std::this_thread::get_id());
  auto child = f.then([](Future<int> p) { return p.value() + 1; });
  CHECK(child.done());
  CHECK(child.value() == 10);
}

TEST_CASE("Future: callbacks registered before completion run on the completing thread") {
  Future<int> f;
  std::thread::id ran_on;
  f.add_done_callback([&](Future<int>&) { ran_on = std::this_thread::get_id(); });
  std::thread::id completer_id;
  std::thread completer([f, &completer_id] {
    completer_id = std::this_thread::get_id();
    f.set_value(1);
  });
  completer.join();
  CHECK(ran_on == completer_id);
}

TEST_CASE(
    "Future: a throwing add_done_callback is dropped; the future and later callbacks are fine") {
  Future<int> f;
  int later = 0;
  f.add_done_callback(
      [](Future<int>&) { throw std::runtime_error("callback failure (expected)"); });
  f.add_done_callback([&](Future<int>& p) { later = p.value(); });
  auto child = f.then([](Future<int>& p) { return p.value() + 1; });
  CHECK_NOTHROW(f.set_value(5));
  CHECK(later == 5);
  CHECK(f.has_value());
  CHECK(f.value() == 5);
  CHECK(child.value() == 6);
  // Registered after completion (inline path): still contained.
  CHECK_NOTHROW(f.add_done_callback([](Future<int>&) { throw 17; }));
}

TEST_CASE("Future: then returning a Future flattens into the child") {
  Future<int> f;
  Future<std::string> inner;
  auto child = f.then([inner](Future<int>&) { return inner; });
  static_assert(std::is_same_v<decltype(child), Future<std::string>>);
  f.set_value(1);
  CHECK_FALSE(child.done());  // waits for the inner future, not for the callback
  inner.set_value("inner value");
  REQUIRE(child.done());
  CHECK(child.value() == "inner value");

  // Errors of the inner future reach the child too.
  Future<int> g;
  Future<int> failing;
  auto child2 = g.then([failing](Future<int>&) { return failing; });
  g.set_value(0);
  failing.set_exception(std::runtime_error("inner failed"));
  CHECK(error_text(child2) == "inner failed");

  // The asynchronous 20-step chain of spec H: each step returns a future completed later.
  Future<int> start;
  Future<int> chain = start;
  std::vector<Future<int>> steps(20);
  for (int i = 0; i < 20; ++i) {
    chain = chain.then([step = steps[i]](Future<int>& p) {
      return step.then([base = p.value()](Future<int>& s) { return base + s.value(); });
    });
  }
  start.set_value(0);
  for (auto& s : steps) {
    CHECK_FALSE(chain.done());
    s.set_value(3);
  }
  CHECK(chain.value() == 60);

  // An empty future returned by the callback fails the child instead of hanging it.
  Future<int> h;
  auto child3 = h.then([](Future<int>&) {
    Future<int> moved_from;
    Future<int> sink = std::move(moved_from);
    return moved_from;  // NOLINT(bugprone-use-after-move): deliberately empty
  });
  h.set_value(0);
  CHECK(child3.has_error());
}

TEST_CASE("Future: a callback may block on another future completed elsewhere (no lock held)") {
  Future<int> f;
  Future<int> other;
  auto child = f.then([other](Future<int>& p) { return p.value() + other.value(); });
  std::thread later([other] {
    std::this_thread::sleep_for(20ms);
    other.set_value(2);
  });
  CHECK(finishes_within([f] { f.set_value(1); }, 5s));
  later.join();
  CHECK(child.value() == 3);

  // Re-entrancy from inside a callback on the same future: register, chain, read.
  Future<int> g;
  auto nested_value = std::make_shared<std::atomic<int>>(0);
  auto nested_child = std::make_shared<Future<int>>();
  g.add_done_callback([nested_value, nested_child](Future<int>& p) {
    p.add_done_callback([nested_value](Future<int>& q) { nested_value->store(q.value()); });
    *nested_child = p.then([](Future<int>& q) { return q.value() * 10; });
    CHECK(p.done());
  });
  CHECK(finishes_within([g] { g.set_value(4); }, 5s));
  CHECK(nested_value->load() == 4);
  CHECK(nested_child->value() == 40);
}

TEST_CASE("Future: executor overloads run the callback via the executor") {
  SerialExecutor exec;
  const auto main_id = std::this_thread::get_id();

  SUBCASE("then(executor pointer, cb), registered before completion") {
    Future<int> f;
    std::thread::id ran_on;
    auto child = f.then(&exec, [&](Future<int>& p) {
      ran_on = std::this_thread::get_id();
      return p.value() + 1;
    });
    f.set_value(1);
    CHECK(child.value() == 2);
    CHECK(ran_on == exec.id());
    CHECK(ran_on != main_id);
    CHECK(exec.posted() == 1);
  }
  SUBCASE("then(std::ref(pool), cb) on an already-completed future still posts") {
    auto f = distrpc::make_ready_future(5);
    std::thread::id ran_on;
    auto child = f.then(std::ref(exec), [&](Future<int>& p) {
      ran_on = std::this_thread::get_id();
      return p.value() * 2;
    });
    CHECK(child.value() == 10);
    CHECK(ran_on == exec.id());
  }
  SUBCASE("add_done_callback(lambda executor, cb)") {
    Future<int> f;
    Future<std::thread::id> ran_on;
    auto post = [&exec](std::function<void()> fn) { exec.post(std::move(fn)); };
    f.add_done_callback(post, [ran_on](Future<int>&) {
      ran_on.set_value(std::this_thread::get_id());
      throw std::runtime_error("dropped (expected)");  // contained on the executor as well
    });
    f.set_value(1);
    CHECK(ran_on.value() == exec.id());
    CHECK(exec.posted() == 1);
  }
  SUBCASE("via(executor): inline callbacks of the result run on the executor") {
    Future<int> f;
    auto moved = f.via(&exec);
    Future<std::thread::id> ran_on;
    moved.add_done_callback(
        [ran_on](Future<int>&) { ran_on.set_value(std::this_thread::get_id()); });
    f.set_value(3);
    CHECK(moved.value() == 3);
    CHECK(ran_on.value() == exec.id());

    Future<int> e;
    auto moved_error = e.via(&exec);
    e.set_exception(std::runtime_error("carried"));
    CHECK_THROWS_WITH(moved_error.value(), "carried");
  }
  SUBCASE("an executor that refuses the task fails then()'s child with its error") {
    auto refusing = [](std::function<void()>) { throw std::runtime_error("pool is shut down"); };
    Future<int> f;
    auto child = f.then(refusing, [](Future<int>& p) { return p.value(); });
    auto moved = f.via(refusing);
    int later = 0;
    f.add_done_callback(refusing, [](Future<int>&) {});
    f.add_done_callback([&](Future<int>& p) { later = p.value(); });
    CHECK_NOTHROW(f.set_value(1));
    CHECK(error_text(child) == "pool is shut down");
    CHECK(error_text(moved) == "pool is shut down");
    CHECK(later == 1);
  }
}

// What an RPC agent does for the futures it hands out (detail::set_wait_driver): a thread about
// to sleep in wait() first lets the driver poll, here one that completes the future itself.
namespace {
struct CompletingDriver : distrpc::detail::WaitDriver {
  std::function<void()> complete;  // what "reading the reply" does
  std::atomic<int> calls{0};
  std::chrono::steady_clock::time_point last_until{};
  void drive_wait(const std::function<bool()>& done,
                  std::chrono::steady_clock::time_point until) override {
    ++calls;
    last_until = until;
    if (!done() && complete) complete();
  }
};
}  // namespace

TEST_CASE("Future: a wait driver runs on the waiting thread before it sleeps") {
  SUBCASE("wait() returns once the driver completed the future, on the same thread") {
    Future<int> f;
    auto d = std::make_shared<CompletingDriver>();
    std::thread::id completed_on;
    d->complete = [f, &completed_on] {
      completed_on = std::this_thread::get_id();
      f.set_value(7);
    };
    distrpc::detail::set_wait_driver(f, d);
    CHECK(f.value() == 7);
    CHECK(d->calls == 1);
    CHECK(completed_on == std::this_thread::get_id());
    f.wait();  // done: not asked again
    CHECK(d->calls == 1);
  }
  SUBCASE("wait_for() passes its deadline; a driver that cannot help leaves the wait to time out") {
    Future<int> f;
    auto d = std::make_shared<CompletingDriver>();
    distrpc::detail::set_wait_driver(f, d);
    const auto before = std::chrono::steady_clock::now();
    CHECK_FALSE(f.wait_for(20ms));
    CHECK(d->calls == 1);
    CHECK(d->last_until >= before + 20ms);
    CHECK(d->last_until <= std::chrono::steady_clock::now());
  }
  SUBCASE("a driver that is gone (its agent destroyed) is not called; completion still wakes") {
    Future<int> f;
    auto d = std::make_shared<CompletingDriver>();
    distrpc::detail::set_wait_driver(f, d);
    std::weak_ptr<CompletingDriver> w = d;
    d.reset();
    CHECK(w.expired());
    std::thread t([f] {
      std::this_thread::sleep_for(10ms);
      f.set_value(3);
    });
    CHECK(f.value() == 3);
    t.join();
  }
  SUBCASE("a future without a driver waits as before") {
    Future<int> f;
    std::thread t([f] { f.set_value(4); });
    CHECK(f.value() == 4);
    t.join();
  }
}

TEST_CASE("Future: a callback executor keeps user callbacks off the completing (I/O) thread") {
  SerialExecutor pool;
  SerialExecutor other;
  const auto main_id = std::this_thread::get_id();
  auto record = [](Future<std::thread::id> where) {
    return [where](auto&) { where.set_value(std::this_thread::get_id()); };
  };

  SUBCASE("plain callbacks and their descendants run on the pool") {
    Future<int> reply;
    distrpc::detail::set_callback_executor(reply, &pool);
    Future<std::thread::id> by_then, by_done, by_grandchild, by_explicit;
    auto child = reply.then([by_then](Future<int>& p) {
      by_then.set_value(std::this_thread::get_id());
      return p.value() + 1;
    });
    reply.add_done_callback(record(by_done));
    child.add_done_callback(record(by_grandchild));
    reply.add_done_callback(&other, record(by_explicit));  // an explicit executor wins
    std::thread::id io_id;
    std::thread io([reply, &io_id] {
      io_id = std::this_thread::get_id();
      reply.set_value(1);
    });
    io.join();
    CHECK(child.value() == 2);
    CHECK(by_then.value() == pool.id());
    CHECK(by_done.value() == pool.id());
    CHECK(by_grandchild.value() == pool.id());
    CHECK(by_explicit.value() == other.id());
    CHECK(pool.posted() == 1);  // one task per completion: that is what keeps the order
    // Registered after completion: inline, on the registering (user) thread.
    Future<std::thread::id> late;
    reply.add_done_callback(record(late));
    CHECK(late.value() == main_id);
    CHECK(io_id != pool.id());
  }
  SUBCASE("futures completed as a consequence on the I/O thread post to the pool too") {
    Future<int> reply;
    distrpc::detail::set_callback_executor(reply, &pool);
    Future<int> plain;
    auto flattened = plain.then([reply](Future<int>&) { return reply; });
    auto collected = distrpc::collect_all(std::vector<Future<int>>{reply});
    Future<std::thread::id> by_flattened, by_collected;
    flattened.add_done_callback(record(by_flattened));
    collected.add_done_callback(record(by_collected));
    plain.set_value(0);  // on this thread, no executor involved: the forwarder is registered
    std::thread io([reply] { reply.set_value(7); });
    io.join();
    CHECK(flattened.value() == 7);
    CHECK(by_flattened.value() == pool.id());
    CHECK(by_collected.value() == pool.id());
  }
  SUBCASE("library-internal bookkeeping never waits for the executor") {
    auto refusing = [](std::function<void()>) { throw std::runtime_error("callback dropped"); };
    Future<int> reply;
    distrpc::detail::set_callback_executor(reply, refusing);
    auto child = reply.then([](Future<int>& p) { return p.value(); });
    std::thread io([reply] { reply.set_value(3); });
    io.join();
    CHECK(distrpc::wait_all(std::vector<Future<int>>{reply}) == std::vector<int>{3});
    CHECK(error_text(child) == "callback dropped");  // refused: the child fails, no hang
  }
}

TEST_CASE("Future: move-only callbacks and move-only values are accepted") {
  Future<int> f;
  auto owned = std::make_unique<int>(40);
  auto child = f.then([o = std::move(owned)](Future<int>& p) { return *o + p.value(); });
  f.set_value(2);
  CHECK(child.value() == 42);

  Future<std::unique_ptr<int>> u;
  auto read = u.then([](Future<std::unique_ptr<int>>& p) { return *p.value() + 1; });
  u.set_value(std::make_unique<int>(6));
  REQUIRE(u.value() != nullptr);
  CHECK(*u.value() == 6);
  CHECK(read.value() == 7);
}

TEST_CASE("Future<void>: completion, then, errors") {
  Future<void> v;
  int calls = 0;
  v.add_done_callback([&](Future<void>& p) {
    p.value();  // returns void; would throw on error
    ++calls;
  });
  auto child = v.then([](Future<void>& p) {
    p.wait();
    return 5;
  });
  auto void_child = child.then([](Future<int>&) {});
  static_assert(std::is_same_v<decltype(void_child), Future<void>>);
  static_assert(std::is_void_v<decltype(v.value())>);
  CHECK_FALSE(void_child.done());
  v.set_value();
  CHECK(calls == 1);
  CHECK(child.value() == 5);
  CHECK(void_child.done());
  CHECK(void_child.has_value());

  Future<void> e;
  auto e_child = e.then([](Future<void>& p) { p.wait(); });
  e.set_exception(std::runtime_error("void failed"));
  CHECK_THROWS_WITH(e.value(), "void failed");
  CHECK(error_text(e_child) == "void failed");
}

TEST_CASE("Future: Promise: the writer side of a future") {
  Promise<std::vector<int>> p;
  auto f = p.get_future();
  CHECK_FALSE(p.done());
  p.set_value({1, 2, 3});  // braced list reaches T's constructor
  CHECK(p.done());
  CHECK(f.value() == std::vector<int>{1, 2, 3});
  CHECK_FALSE(p.try_set_value(std::vector<int>{}));

  Promise<void> pv;
  auto fv = pv.get_future();
  CHECK(pv.try_set_value());
  CHECK(fv.has_value());

  Promise<int> pe;
  pe.set_exception(std::out_of_range("nope"));
  CHECK_THROWS_AS(pe.get_future().value(), std::out_of_range);
}

TEST_CASE("Future: make_ready_future, make_exceptional_future, make_future") {
  auto r = distrpc::make_ready_future(std::string("ready"));
  static_assert(std::is_same_v<decltype(r), Future<std::string>>);
  CHECK(r.value() == "ready");
  auto rv = distrpc::make_ready_future();
  CHECK(rv.has_value());
  auto e = distrpc::make_exceptional_future<int>(
      std::make_exception_ptr(std::runtime_error("made failed")));
  CHECK(error_text(e) == "made failed");
  auto e2 = distrpc::make_exceptional_future<double>(std::domain_error("typed"));
  CHECK_THROWS_AS(e2.value(), std::domain_error);
  auto fresh = distrpc::make_future<int>();
  CHECK_FALSE(fresh.done());
}

TEST_CASE("Future: FutureBase: type-erased completion and an empty handle") {
  Future<std::string> f;
  FutureBase erased = f;
  CHECK(erased.try_set_exception(std::runtime_error("RPC ran for more than 0.1 seconds")));
  CHECK(f.has_error());
  CHECK_THROWS_WITH(f.value(), "RPC ran for more than 0.1 seconds");
  CHECK_FALSE(erased.try_set_exception(std::runtime_error("late")));

  FutureBase empty;
  CHECK_FALSE(empty.valid());
  CHECK_FALSE(empty.done());
  CHECK_THROWS_AS(empty.wait(), std::logic_error);

  Future<int> a;
  Future<int> b = std::move(a);
  CHECK_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): checking the moved-from state
  CHECK_THROWS_AS(a.then([](Future<int>&) {}), std::logic_error);
  CHECK(b.valid());
}

TEST_CASE("Future traits: is_future_v, future_value_t, unwrap_future_t") {
  static_assert(distrpc::is_future_v<Future<int>>);
  static_assert(distrpc::is_future_v<const Future<int>&>);
  static_assert(!distrpc::is_future_v<int>);
  static_assert(!distrpc::is_future_v<FutureBase>);
  static_assert(std::is_same_v<distrpc::future_value_t<Future<std::string>>, std::string>);
  static_assert(std::is_same_v<distrpc::future_value_t<Future<void>&&>, void>);
  static_assert(std::is_same_v<distrpc::unwrap_future_t<Future<int>>, int>);
  static_assert(std::is_same_v<distrpc::unwrap_future_t<double>, double>);
  static_assert(distrpc::Executor<SerialExecutor*>);
  static_assert(distrpc::Executor<std::reference_wrapper<SerialExecutor>>);
  static_assert(distrpc::Executor<std::shared_ptr<SerialExecutor>>);
  static_assert(!distrpc::Executor<SerialExecutor>);  // not copyable: pass a pointer or std::ref
  static_assert(!distrpc::Executor<int>);
  CHECK(distrpc::is_future_v<Future<int>>);
  CHECK_FALSE(distrpc::is_future_v<std::vector<int>>);
}

TEST_CASE("Future: wait_all returns the values in order") {
  std::vector<Future<int>> futs(5);
  std::thread t([futs] {
    for (int i = 4; i >= 0; --i) {  // completed out of order
      futs[i].set_value(i * i);
      std::this_thread::sleep_for(2ms);
    }
  });
  CHECK(distrpc::wait_all(futs) == std::vector<int>{0, 1, 4, 9, 16});
  t.join();
  CHECK(distrpc::wait_all(std::vector<Future<int>>{}).empty());

  std::vector<Future<void>> voids(3);
  for (auto& v : voids) v.set_value();
  CHECK_NOTHROW(distrpc::wait_all(voids));
}

TEST_CASE(
    "Future: wait_all fails fast: the first error is raised while other futures stay pending") {
  std::vector<Future<int>> futs(6);
  const auto t0 = std::chrono::steady_clock::now();
  std::thread failer([f = futs[3]] {
    std::this_thread::sleep_for(50ms);
    f.set_exception(std::invalid_argument("Expected error"));
  });

  auto outcome = std::make_shared<std::promise<std::string>>();
  auto got = outcome->get_future();
  std::thread waiter([futs, outcome] {
    try {
      distrpc::wait_all(futs);
      outcome->set_value("no error");
    } catch (const std::invalid_argument& e) {
      outcome->set_value(e.what());
    } catch (...) {
      outcome->set_value("wrong exception type");
    }
  });
  // An in-order implementation blocks on futs[0] forever: give it 1 s, then unblock it below.
  const bool prompt = got.wait_for(1s) == std::future_status::ready;
  const double elapsed = seconds_since(t0);
  for (std::size_t i = 0; i < futs.size(); ++i) {
    if (i != 3) futs[i].set_value(static_cast<int>(i));  // cleanup: the pending ones complete now
  }
  failer.join();
  CHECK(prompt);
  CHECK(elapsed < 1.0);
  // An implementation that loses the error would block even now: fail instead of hanging.
  if (got.wait_for(5s) != std::future_status::ready) {
    waiter.detach();
    FAIL("wait_all never returned although every future has completed");
  }
  waiter.join();
  CHECK(got.get() == "Expected error");

  // With two failures the one that happens first wins, whatever its position...
  std::vector<Future<int>> two(3);
  auto gate = distrpc::when_all_succeed(two);  // registers now, like a blocked wait_all
  two[2].set_exception(std::runtime_error("first to fail"));
  two[0].set_exception(std::runtime_error("second to fail"));
  CHECK(error_text(gate) == "first to fail");
  // ...and among inputs that had already failed, the earliest in input order.
  CHECK_THROWS_WITH(distrpc::wait_all(two), "second to fail");
  two[1].set_value(0);
}

TEST_CASE("Future: collect_all completes after every input, errors included") {
  std::vector<Future<int>> futs(3);
  auto all = distrpc::collect_all(futs);
  futs[1].set_exception(std::runtime_error("middle failed"));
  CHECK_FALSE(all.done());  // not fail-fast
  futs[0].set_value(10);
  CHECK_FALSE(all.done());
  futs[2].set_value(30);
  REQUIRE(all.done());
  REQUIRE(all.has_value());
  const auto& got = all.value();
  REQUIRE(got.size() == 3);
  CHECK(got[0].value() == 10);
  CHECK(got[1].has_error());
  CHECK(got[2].value() == 30);

  auto none = distrpc::collect_all(std::vector<Future<void>>{});
  CHECK(none.done());
  CHECK(none.value().empty());
}

TEST_CASE("Future: when_all_succeed: values in order, or the first error without waiting") {
  std::vector<Future<int>> futs(3);
  auto all = distrpc::when_all_succeed(futs);
  futs[2].set_value(3);
  futs[0].set_value(1);
  CHECK_FALSE(all.done());
  futs[1].set_value(2);
  CHECK(all.value() == std::vector<int>{1, 2, 3});

  std::vector<Future<void>> pending(3);
  auto failed = distrpc::when_all_succeed(pending);
  static_assert(std::is_same_v<decltype(failed), Future<void>>);
  pending[1].set_exception(std::runtime_error("fan-out leg failed"));
  CHECK(failed.done());  // the others are still pending
  CHECK(error_text(failed) == "fan-out leg failed");
  pending[0].set_value();
  pending[2].set_value();
}

TEST_CASE(
    "Future: WaitAllScope collects only futures registered inside it and rethrows the first "
    "error") {
  Future<int> before;
  CHECK_FALSE(distrpc::detail::register_in_scope(before));  // no scope yet
  Future<int> a, b, c;
  std::thread completer;
  std::string caught;
  try {
    WaitAllScope scope;
    CHECK(distrpc::detail::register_in_scope(a));
    CHECK(distrpc::detail::register_in_scope(b));
    CHECK(distrpc::detail::register_in_scope(c));
    CHECK(scope.size() == 3);
    // c fails before b in time, but b was registered first: its error is the one raised.
    completer = std::thread([a, b, c] {
      std::this_thread::sleep_for(30ms);
      c.set_exception(std::runtime_error("c failed"));
      std::this_thread::sleep_for(10ms);
      b.set_exception(std::runtime_error("b failed"));
      std::this_thread::sleep_for(10ms);
      a.set_value(1);
    });
  } catch (const std::runtime_error& e) {
    caught = e.what();
    // Leaving the scope waited for everything collected in it.
    CHECK(a.done());
    CHECK(b.done());
    CHECK(c.done());
  }
  completer.join();
  CHECK(caught == "b failed");
  CHECK_FALSE(before.done());                               // never collected, so never waited for
  CHECK_FALSE(distrpc::detail::register_in_scope(before));  // the scope is gone
  before.set_value(0);
}

TEST_CASE("Future: WaitAllScope: nested scopes, the innermost collects") {
  Future<int> x, y, z;
  x.set_value(1);
  y.set_value(2);
  z.set_value(3);
  WaitAllScope outer;
  CHECK(distrpc::detail::register_in_scope(x));
  {
    WaitAllScope inner;
    CHECK(distrpc::detail::register_in_scope(y));
    CHECK(inner.size() == 1);
    CHECK(outer.size() == 1);
  }
  CHECK(distrpc::detail::register_in_scope(z));
  CHECK(outer.size() == 2);
  CHECK_NOTHROW(outer.wait());
  CHECK(outer.size() == 0);
}

TEST_CASE("Future: WaitAllScope: wait() observes errors; unwinding keeps the exception in flight") {
  auto failed = distrpc::make_exceptional_future<int>(std::runtime_error("async failure"));

  auto explicit_wait = [&] {
    WaitAllScope scope;
    distrpc::detail::register_in_scope(failed);
    CHECK_THROWS_WITH(scope.wait(), "async failure");
    CHECK(scope.size() == 0);
  };  // the error was observed: the destructor has nothing left to throw
  CHECK_NOTHROW(explicit_wait());

  std::string caught;
  try {
    WaitAllScope scope;
    distrpc::detail::register_in_scope(failed);
    throw std::logic_error("body failed");
  } catch (const std::exception& e) {
    caught = e.what();
  }
  CHECK(caught == "body failed");

  // A scope on another thread does not see this thread's futures and vice versa.
  WaitAllScope here;
  std::thread other([] { CHECK_FALSE(distrpc::detail::register_in_scope(Future<int>{})); });
  other.join();
  CHECK(here.size() == 0);
}

TEST_CASE("Future stress: 8 threads, 10,000 futures, callbacks racing completion") {
  constexpr int kFutures = 10000;
  constexpr int kCompleters = 4;
  constexpr int kRegistrars = 4;
  std::vector<Future<int>> futs(kFutures);
  std::vector<std::atomic<int>> hits(kFutures);
  std::atomic<int> wrong_value{0};
  std::vector<std::vector<Future<long>>> children(kRegistrars);
  std::latch go(kCompleters + kRegistrars);
  std::vector<std::thread> threads;
  for (int c = 0; c < kCompleters; ++c) {
    threads.emplace_back([&, c] {
      go.arrive_and_wait();
      for (int i = c; i < kFutures; i += kCompleters) futs[i].set_value(i);
    });
  }
  for (int r = 0; r < kRegistrars; ++r) {
    threads.emplace_back([&, r] {
      auto& mine = children[r];
      mine.reserve(kFutures);
      go.arrive_and_wait();
      for (int n = 0; n < kFutures; ++n) {
        const int i = (r % 2 == 0) ? n : kFutures - 1 - n;  // half walk backwards: more races
        futs[i].add_done_callback([&, i](Future<int>& f) {
          if (f.value() != i) wrong_value.fetch_add(1);
          hits[i].fetch_add(1);
        });
        mine.push_back(
            futs[i].then([](Future<int>& f) { return static_cast<long>(f.value()) * 2; }));
      }
    });
  }
  for (auto& t : threads) t.join();

  int total = 0;
  int bad_count = 0;
  for (int i = 0; i < kFutures; ++i) {
    total += hits[i].load();
    if (hits[i].load() != kRegistrars) ++bad_count;
  }
  CHECK(wrong_value.load() == 0);
  CHECK(bad_count == 0);
  CHECK(total == kFutures * kRegistrars);
  int bad_children = 0;
  for (int r = 0; r < kRegistrars; ++r) {
    REQUIRE(children[r].size() == kFutures);
    for (int n = 0; n < kFutures; ++n) {
      const int i = (r % 2 == 0) ? n : kFutures - 1 - n;
      const long* v = children[r][n].try_value();
      if (v == nullptr || *v != 2L * i) ++bad_children;
    }
  }
  CHECK(bad_children == 0);
}
