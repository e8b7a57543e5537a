// Multi-process test harness on doctest.
//
// DISTRPC_MP_TEST("name", world, limit_seconds) { ... body using `ctx` ... }
//
// The test case, when run normally, re-executes this very binary once per rank (posix_spawn of
// /proc/self/exe: never fork() after libtorch or threads have started), selecting the same case
// and passing the rank through the environment. Each rank runs the body in a fresh process, with
// `ctx.rank`, `ctx.world` and `ctx.dir` (a fresh directory shared by the ranks of this run, for
// file:// rendezvous or exchanging a port). The parent waits with a hard wall-clock limit: a rank
// that hangs is killed (its whole process group) and the test fails instead of stalling CI. When
// any rank fails, the output of every rank is shown.
#pragma once

#include <chrono>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <doctest/doctest.h>

namespace distrpc::testing {

struct RankContext {
  int rank = 0;
  int world = 1;
  std::string dir;  // shared by all ranks of this run; removed afterwards

  // "file://<dir>/rendezvous": a fresh FileStore path for this run.
  std::string file_url() const;

  // Tiny file-based exchange between ranks of one run, independent of the code under test:
  // publish() writes atomically, lookup() polls until the key exists or the timeout passes
  // (throws).
  void publish(const std::string& key, const std::string& value) const;
  std::string lookup(const std::string& key,
                     std::chrono::milliseconds timeout = std::chrono::seconds(30)) const;
};

struct RankOutcome {
  int rank = 0;
  int exit_code = -1;  // valid when signal == 0 and !killed_by_harness
  int signal = 0;      // the signal that ended the process, 0 if it exited
  bool killed_by_harness = false;
  std::string output;  // stdout and stderr, interleaved
};

struct RunOptions {
  int world = 2;
  std::chrono::milliseconds limit{std::chrono::seconds(60)};
  // Ranks allowed to die by a signal (e.g. a peer the test kills with SIGKILL on purpose).
  std::set<int> may_die;
  // Once one rank has failed, how long the others get to finish before they are killed.
  std::chrono::milliseconds grace_after_failure{std::chrono::seconds(5)};
  // Extra environment variables for every rank, "NAME=value".
  std::vector<std::string> env;
  // And for one rank (by rank), over those of `env`.
  std::map<int, std::vector<std::string>> rank_env;
};

struct RunResult {
  bool ok = false;
  bool timed_out = false;
  std::chrono::milliseconds elapsed{0};
  std::vector<RankOutcome> ranks;
  std::string report() const;  // one paragraph per rank with its status and output
};

// Runs the test case named `case_name` (registered with DISTRPC_MP_TEST or DISTRPC_MP_TARGET) on
// `opts.world` fresh processes and collects their outcomes.
RunResult run_ranks(const std::string& case_name, const RunOptions& opts);

// A loopback TCP port that was free a moment ago (bound to port 0, then released): for tests
// that need a port where nothing listens, or a port before the server exists.
int free_loopback_port();

// In a child started by run_ranks: the context of this rank. Null in the parent.
const RankContext* current_rank();

namespace detail {
// True in a process started by run_ranks for the case `name`.
bool is_rank_of(const char* name);
void run_multiprocess_case(const char* name, int world, int limit_seconds);
}  // namespace detail

}  // namespace distrpc::testing

#define DISTRPC_MP_CAT2(a, b) a##b
#define DISTRPC_MP_CAT(a, b) DISTRPC_MP_CAT2(a, b)

// A multi-process test: `world` ranks, the whole run killed and failed after `limit_seconds`.
#define DISTRPC_MP_TEST(name, world, limit_seconds) \
  DISTRPC_MP_TEST_IMPL(name, world, limit_seconds, DISTRPC_MP_CAT(distrpc_mp_body_, __COUNTER__))
#define DISTRPC_MP_TEST_IMPL(name, world, limit_seconds, body)                       \
  static void body(const ::distrpc::testing::RankContext& ctx);                      \
  TEST_CASE(name) {                                                                  \
    if (::distrpc::testing::detail::is_rank_of(name)) {                              \
      body(*::distrpc::testing::current_rank());                                     \
    } else {                                                                         \
      ::distrpc::testing::detail::run_multiprocess_case(name, world, limit_seconds); \
    }                                                                                \
  }                                                                                  \
  static void body([[maybe_unused]] const ::distrpc::testing::RankContext& ctx)

// A body that runs only as a rank started explicitly by run_ranks() (skipped in a normal run):
// for tests that expect a run to fail, hang or crash and assert on the RunResult.
#define DISTRPC_MP_TARGET(name) \
  DISTRPC_MP_TARGET_IMPL(name, DISTRPC_MP_CAT(distrpc_mp_target_, __COUNTER__))
#define DISTRPC_MP_TARGET_IMPL(name, body)                      \
  static void body(const ::distrpc::testing::RankContext& ctx); \
  TEST_CASE(name* doctest::skip()) {                            \
    if (::distrpc::testing::detail::is_rank_of(name)) {         \
      body(*::distrpc::testing::current_rank());                \
    }                                                           \
  }                                                             \
  static void body([[maybe_unused]] const ::distrpc::testing::RankContext& ctx)
