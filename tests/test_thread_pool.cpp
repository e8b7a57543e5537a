// Tests of the agent's executors (thread_pool.hpp) and the bounded join they and the transports
// use (bounded_thread.hpp): a task that never returns must not make a shutdown hang, and the
// thread left behind must be able to return later without touching freed memory.
#include <doctest/doctest.h>

#include "distrpc/bounded_thread.hpp"
#include "distrpc/thread_pool.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

using distrpc::BoundedThread;
using distrpc::ThreadPool;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

long long ms_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
}

// What a stuck task waits on. Tests allocate it with `new` and never free it: a thread abandoned
// by a shutdown may still wait on it when the test (or the process) ends.
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  std::atomic<int> entered{0};
  std::atomic<int> left{0};

  void pass() {
    ++entered;
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return open; });
    lk.unlock();
    ++left;
  }
  void release() {
    {
      std::lock_guard<std::mutex> lk(mu);
      open = true;
    }
    cv.notify_all();
  }
};

bool wait_until(const std::function<bool()>& pred, std::chrono::milliseconds limit) {
  const auto deadline = Clock::now() + limit;
  while (!pred()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

}  // namespace

TEST_CASE("thread pool: a bounded shutdown abandons a task that never returns") {
  auto* gate = new Gate;  // deliberately leaked (see Gate)
  auto queued_ran = std::make_shared<std::atomic<int>>(0);
  std::size_t abandoned = 0;
  long long took = -1;
  {
    ThreadPool pool("test-pool", 1, 1);
    REQUIRE(pool.post([gate] { gate->pass(); }));
    REQUIRE(wait_until([&] { return gate->entered.load() == 1; }, 5s));
    // Queued behind the stuck task: never started, so discarded once the thread is abandoned.
    for (int i = 0; i < 3; ++i) REQUIRE(pool.post([queued_ran] { ++*queued_ran; }));
    CHECK(pool.queued() == 3);

    const auto t0 = Clock::now();
    abandoned = pool.shutdown(Clock::now() + 100ms);
    took = ms_since(t0);
    CHECK(pool.queued() == 0);
    CHECK_FALSE(pool.post([] {}));
    CHECK(pool.shutdown(Clock::now() + 100ms) == 0);  // idempotent: nothing left to abandon
  }  // the destructor returns at once: already shut down
  CHECK(abandoned == 1);
  CHECK_MESSAGE(took >= 95, "shutdown returned after " << took << " ms, before its bound");
  CHECK_MESSAGE(took < 1000, "shutdown took " << took << " ms");

  // The abandoned thread returns from its task long after the pool object is gone: it goes back
  // to the pool's shared state (not freed; a sanitizer build would see it otherwise), finds it
  // stopped and exits without running the discarded tasks.
  gate->release();
  CHECK(wait_until([&] { return gate->left.load() == 1; }, 5s));
  std::this_thread::sleep_for(50ms);
  CHECK(queued_ran->load() == 0);
}

TEST_CASE("thread pool: shutdown runs queued tasks, or drops them, within the bound") {
  SUBCASE("queued tasks run before the join") {
    std::atomic<int> ran{0};
    ThreadPool pool("test-pool", 1, 1);
    for (int i = 0; i < 5; ++i) {
      pool.post([&] {
        std::this_thread::sleep_for(5ms);
        ++ran;
      });
    }
    CHECK(pool.shutdown(Clock::now() + 5s) == 0);
    CHECK(ran.load() == 5);
  }
  SUBCASE("drop_queued discards what has not started; the running task finishes") {
    std::atomic<int> started{0};
    std::atomic<int> finished{0};
    ThreadPool pool("test-pool", 1, 1);
    for (int i = 0; i < 5; ++i) {
      pool.post([&] {
        ++started;
        std::this_thread::sleep_for(100ms);
        ++finished;
      });
    }
    REQUIRE(wait_until([&] { return started.load() == 1; }, 5s));
    const auto t0 = Clock::now();
    CHECK(pool.shutdown(Clock::now() + 5s, /*drop_queued=*/true) == 0);
    CHECK(ms_since(t0) < 1000);
    CHECK(started.load() == 1);
    CHECK(finished.load() == 1);  // joined, not abandoned: it had finished by then
  }
  SUBCASE("a zero bound: the stuck thread is abandoned at once, the idle ones are joined") {
    auto* gate = new Gate;  // deliberately leaked
    ThreadPool pool("test-pool", 4, 4);
    pool.post([gate] { gate->pass(); });
    REQUIRE(wait_until([&] { return gate->entered.load() == 1; }, 5s));
    const auto t0 = Clock::now();
    CHECK(pool.shutdown(Clock::now()) == 1);  // exactly the one inside a task
    CHECK(ms_since(t0) < 1000);
    gate->release();
    CHECK(wait_until([&] { return gate->left.load() == 1; }, 5s));
  }
  SUBCASE("an elastic pool: every stuck thread is counted") {
    auto* gate = new Gate;  // deliberately leaked
    ThreadPool pool("test-pool", 1, 8);
    for (int i = 0; i < 3; ++i) pool.post([gate] { gate->pass(); });
    REQUIRE(wait_until([&] { return gate->entered.load() == 3; }, 5s));
    const auto t0 = Clock::now();
    CHECK(pool.shutdown(Clock::now() + 50ms) == 3);
    CHECK(ms_since(t0) < 1000);
    gate->release();
    CHECK(wait_until([&] { return gate->left.load() == 3; }, 5s));
  }
}

TEST_CASE("thread pool: the destructor is bounded by the default grace") {
  auto* gate = new Gate;  // deliberately leaked
  const auto t0 = Clock::now();
  {
    ThreadPool pool("test-pool", 2, 2);
    pool.post([gate] { gate->pass(); });
    REQUIRE(wait_until([&] { return gate->entered.load() == 1; }, 5s));
  }
  const long long took = ms_since(t0);
  CHECK(took >= distrpc::kDefaultShutdownGrace.count() - 5);
  CHECK(took < distrpc::kDefaultShutdownGrace.count() + 1500);
  gate->release();
  CHECK(wait_until([&] { return gate->left.load() == 1; }, 5s));
}

TEST_CASE("bounded thread: joins a thread that finished, detaches one stuck in user code") {
  std::atomic<bool> ran{false};
  BoundedThread quick([&] { ran = true; });
  CHECK(quick.join_until(Clock::now() + 5s));
  CHECK(ran.load());
  CHECK_FALSE(quick.joinable());

  // Past the deadline outside user code: joined anyway, and kept from entering user code.
  std::atomic<int> entered_late{-1};
  BoundedThread late([&] {
    std::this_thread::sleep_for(100ms);
    BoundedThread::UserCodeScope user;
    entered_late = user.entered() ? 1 : 0;
  });
  auto t0 = Clock::now();
  CHECK(late.join_until(Clock::now() + 10ms));
  CHECK(ms_since(t0) >= 95);
  CHECK(entered_late.load() == 0);

  auto* gate = new Gate;  // deliberately leaked
  BoundedThread stuck([gate] {
    BoundedThread::UserCodeScope user;
    CHECK(user.entered());
    gate->pass();
  });
  REQUIRE(wait_until([&] { return gate->entered.load() == 1; }, 5s));
  CHECK_FALSE(stuck.finished());
  t0 = Clock::now();
  CHECK_FALSE(stuck.join_until(Clock::now() + 50ms));
  const long long took = ms_since(t0);
  CHECK(took >= 45);
  CHECK(took < 1000);
  CHECK_FALSE(stuck.joinable());  // detached
  gate->release();
  CHECK(wait_until([&] { return gate->left.load() == 1; }, 5s));

  BoundedThread none;
  CHECK(none.join_until(Clock::now()));  // nothing to join

  // Outside any BoundedThread a scope marks nothing and is always entered.
  BoundedThread::UserCodeScope here;
  CHECK(here.entered());
}
