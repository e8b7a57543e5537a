// Non-graceful shutdown never hangs (spec rpc.md group O; docs/threading.md, "Bounded shutdown"):
// handlers that never return, on worker1's request pool and on one of its transport reading
// threads (leader/follower), are abandoned after the grace; shutdown(false) returns within its
// bound, the callers' futures fail naming the lost worker, and RPC can start again in the same
// process. Runs on the transport under test (DISTRPC_TEST_TRANSPORT), like the other RPC suites.
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <doctest/doctest.h>

#include <distrpc/rpc.hpp>

#include "multiprocess.hpp"
#include "support/rpc_test_util.hpp"
#include "support/rpc_under_test.hpp"

using namespace distrpc::testing::rpc_names;

namespace rpc_shutdown_test {

// What the stuck handlers wait on: nobody ever signals it. Allocated once and never freed, so the
// process exit does not destroy it under the abandoned threads.
struct Never {
  std::mutex mu;
  std::condition_variable cv;
};
Never& never() {
  static Never* n = new Never;
  return *n;
}

std::atomic<int> g_started{0};
std::mutex g_names_mu;
std::vector<std::string> g_thread_names;  // the threads the handlers of this round run on

// Records the thread it runs on, then blocks forever.
int block_forever(int v) {
  char name[16] = {};
  ::pthread_getname_np(::pthread_self(), name, sizeof name);
  {
    std::lock_guard<std::mutex> lk(g_names_mu);
    g_thread_names.emplace_back(name);
  }
  ++g_started;
  std::unique_lock<std::mutex> lk(never().mu);
  never().cv.wait(lk, [] { return false; });
  return v;
}

int echo(int x) {
  return x;
}

}  // namespace rpc_shutdown_test

using namespace rpc_shutdown_test;

namespace {

// worker1: waits until `n` blocking handlers started here.
bool wait_started(int n) {
  const auto deadline = Clock::now() + 20s;
  while (g_started.load() < n) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

// The bounds of one round: shutdown(false, timeout) with timeout 0 waits the default grace (2 s,
// RpcBackendOptions::shutdown_grace).
struct Round {
  std::chrono::milliseconds timeout;
  long long min_ms, max_ms;
};
constexpr Round kRounds[] = {{0ms, 1900, 5000}, {200ms, 190, 2000}};

}  // namespace

// Two rounds in the same processes (the second one after a re-init): worker0 calls worker1's
// block_forever once alone (worker1 runs it on the reading thread that read it: leader/follower),
// then twice more while that thread is busy (those go to the request pool). worker1 then shuts
// down non-gracefully: its three handlers never return. The ranks coordinate through the
// harness's files, not RPC, so nothing else travels with the first call (a burst of frames would
// send it to the pool).
DISTRPC_MP_TARGET("rpc target: shutdown(false) while handlers never return") {
  RpcBackendOptions bad;
  bad.init_method = file_url(ctx, "bad");
  bad.shutdown_grace = -1ms;
  CHECK_THROWS_WITH_AS(
      distrpc::testing::init_rpc_under_test(wname(ctx.rank), ctx.rank, ctx.world, bad),
      doctest::Contains("shutdown_grace must be >= 0 ms (0: abandon at once), got -1 ms"),
      std::invalid_argument);

  for (int round = 0; round < 2; ++round) {
    const Round& r = kRounds[round];
    const std::string tag = std::to_string(round);
    INFO("round " << round << " (shutdown timeout " << r.timeout.count() << " ms)");
    RpcBackendOptions o;
    o.init_method = file_url(ctx, "round" + tag);
    distrpc::testing::init_rpc_under_test(wname(ctx.rank), ctx.rank, ctx.world, o);
    const int before = 3 * round;  // handlers started by earlier rounds (still blocked)

    if (ctx.rank == 0) {
      std::vector<Future<int>> futs;
      futs.push_back(distrpc::rpc_async<&block_forever>("worker1", 1));
      (void)ctx.lookup("first" + tag);
      futs.push_back(distrpc::rpc_async<&block_forever>("worker1", 2));
      futs.push_back(distrpc::rpc_async<&block_forever>("worker1", 3));

      // worker1's shutdown closes its connections first: the futures fail at once, naming it.
      (void)ctx.lookup("stopping" + tag);
      const auto t0 = Clock::now();
      for (auto& f : futs) CHECK_MESSAGE(f.wait_for(10s), "a call to the stopped worker hangs");
      const long long failed_after = ms_since(t0);
      CHECK_MESSAGE(failed_after < 3000, "the futures failed " << failed_after << " ms after");
      for (auto& f : futs) {
        if (!f.done()) continue;
        CHECK_THROWS_WITH(f.value(), doctest::Contains("worker1"));
      }
      // Nothing of this worker is stuck: its own non-graceful stop is quick.
      const auto t1 = Clock::now();
      distrpc::shutdown(/*graceful=*/false, r.timeout);
      CHECK(ms_since(t1) < 1000);
    } else {
      REQUIRE(wait_started(before + 1));
      ctx.publish("first" + tag, "yes");
      REQUIRE(wait_started(before + 3));
      CHECK(g_started.load() == before + 3);
      int on_reader = 0, on_pool = 0;
      std::string names;
      {
        std::lock_guard<std::mutex> lk(g_names_mu);
        for (const auto& n : g_thread_names) {
          names += n + " ";
          on_reader += n.rfind("distrpc-", 0) == 0;  // distrpc-tcp-rd, distrpc-shm-io
          on_pool += n == "rpc-request";
        }
        g_thread_names.clear();
      }
      CHECK_MESSAGE(on_reader == 1, "handler threads: " << names);
      CHECK_MESSAGE(on_pool == 2, "handler threads: " << names);

      ctx.publish("stopping" + tag, "yes");
      const auto t0 = Clock::now();
      distrpc::shutdown(/*graceful=*/false, r.timeout);
      const long long took = ms_since(t0);
      CHECK_MESSAGE(took >= r.min_ms, "shutdown(false) returned after " << took << " ms");
      CHECK_MESSAGE(took < r.max_ms, "shutdown(false) took " << took << " ms");
      CHECK_FALSE(distrpc::is_initialized());
      CHECK_THROWS_WITH(distrpc::rpc_sync<&echo>("worker0", 1),
                        doctest::Contains("RPC has not been initialized"));
      CHECK_THROWS_WITH(distrpc::get_worker_info(),
                        doctest::Contains("RPC has not been initialized"));
    }
  }

  // RPC starts again in this process (alone, on a fresh rendezvous), abandoned threads and all.
  RpcBackendOptions solo;
  solo.init_method = file_url(ctx, "solo" + std::to_string(ctx.rank));
  distrpc::testing::init_rpc_under_test(wname(ctx.rank), 0, 1, solo);
  CHECK(distrpc::rpc_sync<&echo>(wname(ctx.rank), 7) == 7);
  distrpc::shutdown();
}

TEST_CASE("rpc: shutdown(false) returns within its bound while handlers never return") {
  RunOptions o;
  o.world = 2;
  o.limit = 60s;
  auto r = run_ranks("rpc target: shutdown(false) while handlers never return", o);
  CHECK_MESSAGE(r.ok, r.report());
  REQUIRE(r.ranks.size() == 2);
  for (const auto& rank : r.ranks) CHECK_MESSAGE(rank.exit_code == 0, r.report());
  // One line per stop that abandoned threads, naming the worker, the count and where they run.
  const std::string& w1 = r.ranks[1].output;
  const std::string where =
      " (2 request handler(s) on the request pool, 1 on transport reading threads, 0 callback(s))";
  CHECK_MESSAGE(contains(w1,
                         "[distrpc] worker1: shutdown abandoned 3 thread(s) still running user "
                         "code after 2000 ms" +
                             where),
                r.report());
  CHECK_MESSAGE(contains(w1,
                         "[distrpc] worker1: shutdown abandoned 3 thread(s) still running user "
                         "code after 200 ms" +
                             where),
                r.report());
  CHECK_MESSAGE(!contains(r.ranks[0].output, "abandoned"), r.report());
  // The abandoned handlers never returned, so no reply was attempted after the stop.
  CHECK_MESSAGE(!contains(w1, "could not send a reply"), r.report());
}
