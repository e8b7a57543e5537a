// Self-tests of the multi-process harness: a passing run, a failing rank, a hanging rank, a
// crashing rank, a rank allowed to die, and the shared directory between ranks.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>

#include <doctest/doctest.h>

#include "multiprocess.hpp"

using distrpc::testing::run_ranks;
using distrpc::testing::RunOptions;

DISTRPC_MP_TEST("harness: every rank runs in its own process", 3, 30) {
  CHECK(ctx.world == 3);
  CHECK(ctx.rank >= 0);
  CHECK(ctx.rank < 3);
  ctx.publish("pid" + std::to_string(ctx.rank), std::to_string(::getpid()));
  std::set<std::string> pids;
  for (int r = 0; r < ctx.world; ++r) pids.insert(ctx.lookup("pid" + std::to_string(r)));
  CHECK(pids.size() == 3);  // three distinct processes
}

DISTRPC_MP_TARGET("harness target: rank 1 fails") {
  std::printf("rank %d says hello\n", ctx.rank);
  std::fflush(stdout);
  if (ctx.rank == 1) CHECK_MESSAGE(1 + 1 == 3, "deliberate failure on rank 1");
}

DISTRPC_MP_TARGET("harness target: rank 0 hangs") {
  if (ctx.rank == 0) std::this_thread::sleep_for(std::chrono::seconds(120));
}

DISTRPC_MP_TARGET("harness target: rank 1 crashes") {
  if (ctx.rank == 1) std::abort();
  // The survivor waits for the crash to be noticed; the harness ends it after the grace period.
  std::this_thread::sleep_for(std::chrono::seconds(120));
}

DISTRPC_MP_TARGET("harness target: rank 1 is killed on purpose") {
  if (ctx.rank == 1) ::kill(::getpid(), SIGKILL);
}

DISTRPC_MP_TARGET("harness target: rank throws") {
  if (ctx.rank == 0) throw std::runtime_error("boom from rank 0");
}

DISTRPC_MP_TARGET("harness target: the case's environment") {
  const char* v = std::getenv("DISTRPC_HARNESS_PROBE");
  CHECK(v != nullptr);
  CHECK(std::string(v ? v : "") == (ctx.rank == 1 ? "rank 1's own" : "from the case"));
  CHECK(std::string(std::getenv("DISTRPC_HARNESS_KEPT") ? std::getenv("DISTRPC_HARNESS_KEPT")
                                                        : "") == "inherited");
}

TEST_CASE(
    "harness: RunOptions::env replaces an inherited variable of the same name, and rank_env "
    "replaces both for its rank") {
  struct Inherited {  // set for the run, unset on every way out
    Inherited() {
      ::setenv("DISTRPC_HARNESS_PROBE", "inherited", 1);
      ::setenv("DISTRPC_HARNESS_KEPT", "inherited", 1);
    }
    ~Inherited() {
      ::unsetenv("DISTRPC_HARNESS_PROBE");
      ::unsetenv("DISTRPC_HARNESS_KEPT");
    }
  } inherited;
  RunOptions o;
  o.world = 2;
  o.limit = std::chrono::seconds(30);
  o.env = {"DISTRPC_HARNESS_PROBE=from the case"};
  o.rank_env[1] = {"DISTRPC_HARNESS_PROBE=rank 1's own"};
  auto r = run_ranks("harness target: the case's environment", o);
  CHECK_MESSAGE(r.ok, r.report());
}

TEST_CASE("harness: a rank outside the world in rank_env or may_die is refused, naming it") {
  RunOptions o;
  o.world = 2;
  o.rank_env[2] = {"DISTRPC_HARNESS_PROBE=nobody's"};
  CHECK_THROWS_WITH_AS(run_ranks("harness target: the case's environment", o),
                       "multiprocess harness: RunOptions::rank_env names rank 2, outside a world "
                       "of 2",
                       std::invalid_argument);
  o.rank_env.clear();
  o.may_die = {-1};
  CHECK_THROWS_WITH_AS(run_ranks("harness target: the case's environment", o),
                       "multiprocess harness: RunOptions::may_die names rank -1, outside a world "
                       "of 2",
                       std::invalid_argument);
}

TEST_CASE("harness: a failing rank fails the run and its output is shown") {
  RunOptions o;
  o.world = 2;
  o.limit = std::chrono::seconds(30);
  auto r = run_ranks("harness target: rank 1 fails", o);
  REQUIRE(r.ranks.size() == 2);
  CHECK_FALSE(r.ok);
  CHECK_FALSE(r.timed_out);
  CHECK(r.ranks[0].exit_code == 0);
  CHECK(r.ranks[1].exit_code != 0);
  CHECK(r.ranks[1].output.find("deliberate failure on rank 1") != std::string::npos);
  const std::string rep = r.report();
  CHECK(rep.find("rank 0 says hello") != std::string::npos);  // every rank's output is shown
  CHECK(rep.find("rank 1 says hello") != std::string::npos);
}

TEST_CASE("harness: a hanging rank is killed at the wall-clock limit") {
  RunOptions o;
  o.world = 2;
  o.limit = std::chrono::milliseconds(1500);
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run_ranks("harness target: rank 0 hangs", o);
  const auto took = std::chrono::steady_clock::now() - t0;
  CHECK_FALSE(r.ok);
  CHECK(r.timed_out);
  CHECK(r.ranks[0].killed_by_harness);
  CHECK(r.ranks[1].exit_code == 0);
  CHECK(took < std::chrono::seconds(10));
  CHECK(r.report().find("wall-clock limit") != std::string::npos);
}

TEST_CASE("harness: a crashing rank is reported with its signal and the rest are stopped") {
  RunOptions o;
  o.world = 2;
  o.limit = std::chrono::seconds(60);
  o.grace_after_failure = std::chrono::milliseconds(500);
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run_ranks("harness target: rank 1 crashes", o);
  CHECK_FALSE(r.ok);
  CHECK_FALSE(r.timed_out);
  CHECK(r.ranks[1].signal == SIGABRT);
  CHECK(r.ranks[0].killed_by_harness);  // the survivor did not wait out the full limit
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));
  CHECK(r.report().find("signal 6") != std::string::npos);
}

TEST_CASE("harness: a rank listed in may_die may die by a signal") {
  RunOptions o;
  o.world = 2;
  o.limit = std::chrono::seconds(30);
  o.may_die = {1};
  auto r = run_ranks("harness target: rank 1 is killed on purpose", o);
  CHECK(r.ok);
  CHECK(r.ranks[1].signal == SIGKILL);
  o.may_die.clear();
  auto r2 = run_ranks("harness target: rank 1 is killed on purpose", o);
  CHECK_FALSE(r2.ok);
}

TEST_CASE("harness: an exception escaping a rank fails it with the message") {
  RunOptions o;
  o.world = 2;
  o.limit = std::chrono::seconds(30);
  auto r = run_ranks("harness target: rank throws", o);
  CHECK_FALSE(r.ok);
  CHECK(r.ranks[0].exit_code != 0);
  CHECK(r.ranks[0].output.find("boom from rank 0") != std::string::npos);
  CHECK(r.ranks[1].exit_code == 0);
}

TEST_CASE("harness: lookup of a key nobody publishes times out with its name") {
  distrpc::testing::RankContext c;
  c.dir = "/tmp";
  CHECK_THROWS_WITH(c.lookup("never-published-key", std::chrono::milliseconds(50)),
                    doctest::Contains("never-published-key"));
}
