// Elastic (dynamic) membership: init_rpc without a world size joins a dynamic group through the
// store. Workers join one after another and all call each other; a late joiner reaches members
// that already called each other (and they reach it); a member that leaves drops out of every
// view and calls to it fail naming it; the error texts of a missing rank, of env:// without RANK
// and of a group mixing static and dynamic members; a worker killed with SIGKILL is replaced by a
// new process under its name (calls to the dead one fail naming it, its RRefs fail, never hang;
// afterwards calls reach the replacement). Runs on the transport under test
// (DISTRPC_TEST_TRANSPORT), like the other RPC suites.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <doctest/doctest.h>

#include <distrpc/agent/extension.hpp>
#include <distrpc/rpc.hpp>
#include <distrpc/rref.hpp>
#include <distrpc/store/file_store.hpp>

#include "multiprocess.hpp"
#include "support/rpc_test_util.hpp"
#include "support/rpc_under_test.hpp"

using namespace std::chrono_literals;
using distrpc::RpcBackendOptions;
using distrpc::WorkerInfo;
using distrpc::testing::contains;
using distrpc::testing::error_of;
using distrpc::testing::file_url;
using distrpc::testing::RankContext;
using distrpc::testing::wname;

namespace elastic_test {

// Which process answers: 1 for the first incarnation of a worker, 2 for its replacement.
int g_incarnation = 1;

int plus(int a, int b) {
  return a + b;
}
int incarnation() {
  return g_incarnation;
}
// Holds a request thread until the worker's main thread lets go (or 30 s pass).
std::atomic<int> g_holding{0};
std::atomic<bool> g_let_go{false};
int hold(int v) {
  ++g_holding;
  const auto t0 = std::chrono::steady_clock::now();
  while (!g_let_go.load() && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return v;
}
int make_value(int v) {
  return v;
}
// An RRef another worker shares with this one, kept until the test lets go of it.
std::optional<distrpc::RRef<int>> g_shared;
bool keep_shared(distrpc::RRef<int> r) {
  g_shared = std::move(r);
  return true;
}

// A layer whose handling of a lost peer takes 2.5 s, in the process that sets g_slow_loss only
// (the other agents of this binary make it too, and it does nothing there): it records whether a
// peer joined while that handling still ran.
std::atomic<bool> g_slow_loss{false};
std::atomic<bool> g_loss_started{false};
std::atomic<bool> g_loss_ended{false};
std::atomic<bool> g_joined_during_loss{false};
class SlowLossLayer : public distrpc::AgentExtension {
 public:
  static constexpr int kId = distrpc::AgentExtension::kMaxExtensions - 1;
  int id() const override { return kId; }
  distrpc::Future<distrpc::wire::Message> handle_control(int, int,
                                                         const distrpc::wire::Message&) override {
    throw std::runtime_error("the test layer has no control messages");
  }
  std::string control_name(int) const override { return "none"; }
  void on_peer_lost(int) override {
    if (!g_slow_loss.load()) return;
    g_loss_started = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    g_loss_ended = true;
  }
  void on_peer_joined(int) override {
    if (g_slow_loss.load() && g_loss_started.load() && !g_loss_ended.load()) {
      g_joined_during_loss = true;
    }
  }
};
const bool slow_loss_registered = distrpc::register_agent_extension(
    SlowLossLayer::kId, [](distrpc::AgentServices&) -> std::shared_ptr<distrpc::AgentExtension> {
      return std::make_shared<SlowLossLayer>();
    });

void join(const RankContext& ctx, const std::string& name, int rank,
          const std::string& tag = "elastic") {
  RpcBackendOptions o;
  o.init_method = file_url(ctx, tag);
  distrpc::testing::init_rpc_dynamic_under_test(name, rank, o);
}

std::set<std::string> member_names() {
  std::set<std::string> out;
  for (const auto& w : distrpc::get_worker_infos()) out.insert(w.name);
  return out;
}

// Each rank publishes `tag<rank>` and waits for every rank in `ranks` to have done so.
void meet(const RankContext& ctx, const std::string& tag, const std::vector<int>& ranks) {
  ctx.publish(tag + std::to_string(ctx.rank), "1");
  for (int r : ranks) (void)ctx.lookup(tag + std::to_string(r), 60s);
}

}  // namespace elastic_test

using namespace elastic_test;

// ---- joins -------------------------------------------------------------------------------------

DISTRPC_MP_TEST("elastic: three workers join one after another and all call each other", 3, 90) {
  if (ctx.rank > 0) (void)ctx.lookup("joined" + std::to_string(ctx.rank - 1), 60s);
  join(ctx, wname(ctx.rank), ctx.rank);
  // At its join, a worker sees itself and every earlier member.
  std::set<std::string> expected;
  for (int r = 0; r <= ctx.rank; ++r) expected.insert(wname(r));
  CHECK(member_names() == expected);
  CHECK(distrpc::get_worker_info().id == ctx.rank);
  ctx.publish("joined" + std::to_string(ctx.rank), "1");
  // Once the last init_rpc returned, every member has it: the members added it before answering.
  (void)ctx.lookup("joined2", 60s);
  CHECK((member_names() == std::set<std::string>{wname(0), wname(1), wname(2)}));
  for (int r = 0; r < 3; ++r) {
    CHECK(distrpc::get_worker_info(wname(r)).id == r);
    if (r == ctx.rank) continue;
    CHECK(distrpc::rpc_sync<&plus>(wname(r), ctx.rank * 10, r) == ctx.rank * 10 + r);
    CHECK(distrpc::rpc_sync<&plus>(r, ctx.rank, 100) == ctx.rank + 100);  // by rank
  }
  CHECK(distrpc::rpc_sync<&plus>(wname(ctx.rank), 1, 1) == 2);  // self
  meet(ctx, "called", {0, 1, 2});
  CHECK_NOTHROW(distrpc::shutdown());
  CHECK_FALSE(distrpc::is_initialized());
}

DISTRPC_MP_TEST("elastic: a late joiner after the others already called each other", 3, 90) {
  if (ctx.rank < 2) {
    join(ctx, wname(ctx.rank), ctx.rank);
    meet(ctx, "up", {0, 1});
    const int other = 1 - ctx.rank;
    CHECK(distrpc::rpc_sync<&plus>(wname(other), 20, 3) == 23);
    CHECK(distrpc::get_worker_infos().size() == 2);
    ctx.publish("early_calls" + std::to_string(ctx.rank), "1");
    (void)ctx.lookup("joined2", 60s);
    // The earlier members call the late one by name and by rank; it is in their views.
    CHECK((member_names() == std::set<std::string>{wname(0), wname(1), wname(2)}));
    CHECK(distrpc::rpc_sync<&plus>(wname(2), ctx.rank, 40) == ctx.rank + 40);
    CHECK(distrpc::rpc_sync<&plus>(2, ctx.rank, 50) == ctx.rank + 50);
    CHECK((distrpc::get_worker_info(wname(2)) == WorkerInfo{2, wname(2)}));
  } else {
    (void)ctx.lookup("early_calls0", 60s);
    (void)ctx.lookup("early_calls1", 60s);
    join(ctx, wname(2), 2);
    CHECK((member_names() == std::set<std::string>{wname(0), wname(1), wname(2)}));
    CHECK(distrpc::get_worker_infos().size() == 3);
    CHECK(distrpc::rpc_sync<&plus>(wname(0), 2, 5) == 7);
    CHECK(distrpc::rpc_sync<&plus>(wname(1), 2, 6) == 8);
    ctx.publish("joined2", "1");
  }
  meet(ctx, "called", {0, 1, 2});
  CHECK_NOTHROW(distrpc::shutdown());
}

// ---- leaves ------------------------------------------------------------------------------------

DISTRPC_MP_TEST("elastic: a member leaves; the others drop it and calls to it fail naming it", 3,
                90) {
  if (ctx.rank > 0) (void)ctx.lookup("joined" + std::to_string(ctx.rank - 1), 60s);
  join(ctx, wname(ctx.rank), ctx.rank);
  ctx.publish("joined" + std::to_string(ctx.rank), "1");
  (void)ctx.lookup("joined2", 60s);
  for (int r = 0; r < 3; ++r) {
    if (r != ctx.rank) CHECK(distrpc::rpc_sync<&plus>(r, 1, r) == 1 + r);
  }
  meet(ctx, "called", {0, 1, 2});
  if (ctx.rank == 2) {
    // No barrier with the others: they are not shutting down, and its shutdown returns anyway.
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_NOTHROW(distrpc::shutdown());
    MESSAGE("leaving took " << distrpc::testing::ms_since(t0) << " ms");
    CHECK(distrpc::testing::ms_since(t0) < 5000);
    ctx.publish("left2", "1");
    return;
  }
  (void)ctx.lookup("left2", 60s);
  CHECK((member_names() == std::set<std::string>{wname(0), wname(1)}));
  const std::string by_name = error_of([] { distrpc::rpc_sync<&plus>(wname(2), 1, 1); });
  CHECK_MESSAGE(contains(by_name, "'worker2' left the group"), by_name);
  const std::string by_rank = error_of([] { distrpc::rpc_sync<&plus>(2, 1, 1); });
  CHECK_MESSAGE(contains(by_rank, "worker 'worker2' left the group"), by_rank);
  const std::string by_info = error_of([] {
    distrpc::rpc_sync<&plus>(WorkerInfo{2, "worker2"}, 1, 1);
  });
  CHECK_MESSAGE(contains(by_info, "worker2"), by_info);
  CHECK_THROWS_WITH_AS(distrpc::get_worker_info(wname(2)), doctest::Contains("left the group"),
                       distrpc::RpcError);
  // The rest of the group works on.
  CHECK(distrpc::rpc_sync<&plus>(wname(1 - ctx.rank), 3, 4) == 7);
  meet(ctx, "checked", {0, 1});
  CHECK_NOTHROW(distrpc::shutdown());
}

// ---- error texts -------------------------------------------------------------------------------

DISTRPC_MP_TEST("elastic: a missing rank, and env:// without RANK, fail with PyTorch's texts", 1,
                60) {
  RpcBackendOptions o;
  o.init_method = file_url(ctx, "norank");
  const std::string file_text =
      error_of([&] { distrpc::testing::init_rpc_dynamic_under_test(wname(0), -1, o); });
  CHECK_MESSAGE(contains(file_text, "rank parameter missing"), file_text);
  o.init_method = "tcp://127.0.0.1:" + std::to_string(distrpc::testing::free_loopback_port());
  const std::string tcp_text =
      error_of([&] { distrpc::testing::init_rpc_dynamic_under_test(wname(0), -1, o); });
  CHECK_MESSAGE(contains(tcp_text, "rank parameter missing"), tcp_text);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", "29500", 1);
  for (const char* v : {"RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"}) ::unsetenv(v);
  o.init_method = "env://";
  const std::string env_text =
      error_of([&] { distrpc::testing::init_rpc_dynamic_under_test(wname(0), -1, o); });
  CHECK_MESSAGE(contains(env_text, "environment variable RANK expected"), env_text);
  CHECK_FALSE(distrpc::is_initialized());
  // A world size in the URL contradicts a dynamic group.
  o.init_method = file_url(ctx, "norank") + "?rank=0&world_size=2";
  const std::string world_text =
      error_of([&] { distrpc::testing::init_rpc_dynamic_under_test(wname(0), -1, o); });
  CHECK_MESSAGE(contains(world_text, "a dynamic group has no world size"), world_text);
  // The rank from the URL is enough.
  o.init_method = file_url(ctx, "urlrank") + "?rank=0";
  distrpc::testing::init_rpc_dynamic_under_test(wname(0), -1, o);
  CHECK((distrpc::get_worker_info() == WorkerInfo{0, wname(0)}));
  CHECK(distrpc::rpc_sync<&plus>(wname(0), 2, 2) == 4);
  CHECK_NOTHROW(distrpc::shutdown());
}

DISTRPC_MP_TEST("elastic: a group mixing static and dynamic members is refused", 3, 90) {
  const std::string mixed =
      "RPC group mixes statically and dynamically initialized members which is not supported.";
  RpcBackendOptions o;
  o.init_method = file_url(ctx, "mixed");
  if (ctx.rank < 2) {
    // A static group of two.
    distrpc::testing::init_rpc_under_test(wname(ctx.rank), ctx.rank, 2, o);
    ctx.publish("static_up" + std::to_string(ctx.rank), "1");
    (void)ctx.lookup("mix_tried", 60s);
    // Unaffected by the refused joiner.
    CHECK(distrpc::get_worker_infos().size() == 2);
    CHECK(distrpc::rpc_sync<&plus>(wname(1 - ctx.rank), 5, 5) == 10);
    CHECK_NOTHROW(distrpc::shutdown());
    return;
  }
  (void)ctx.lookup("static_up0", 60s);
  (void)ctx.lookup("static_up1", 60s);
  const std::string text =
      error_of([&] { distrpc::testing::init_rpc_dynamic_under_test(wname(2), 2, o); });
  CHECK_MESSAGE(text == mixed, text);
  CHECK_FALSE(distrpc::is_initialized());
  ctx.publish("mix_tried", "1");
  // The process lives on: a dynamic group of its own works; after it, a static member on that
  // group's store is refused with the same text.
  join(ctx, wname(2), 0, "own");
  CHECK(distrpc::rpc_sync<&plus>(wname(2), 1, 2) == 3);
  CHECK_NOTHROW(distrpc::shutdown());
  RpcBackendOptions s;
  s.init_method = file_url(ctx, "own");
  const std::string reverse =
      error_of([&] { distrpc::testing::init_rpc_under_test(wname(1), 1, 2, s); });
  CHECK_MESSAGE(reverse == mixed, reverse);
  CHECK_FALSE(distrpc::is_initialized());
}

DISTRPC_MP_TEST("elastic: a joiner under the name of a live member is refused and leaves no trace",
                2, 60) {
  if (ctx.rank == 0) {
    join(ctx, wname(0), 0);
    ctx.publish("up0", "1");
    (void)ctx.lookup("tried1", 60s);
    CHECK((member_names() == std::set<std::string>{wname(0)}));
    CHECK(distrpc::rpc_sync<&plus>(wname(0), 1, 1) == 2);
    CHECK_NOTHROW(distrpc::shutdown());
    return;
  }
  (void)ctx.lookup("up0", 60s);
  RpcBackendOptions o;
  o.init_method = file_url(ctx, "elastic");
  const std::string text =
      error_of([&] { distrpc::testing::init_rpc_dynamic_under_test(wname(0), 1, o); });
  CHECK_MESSAGE(contains(text, "Worker name 'worker0' is not unique"), text);
  CHECK_MESSAGE(contains(text, "WorkerInfo(id=0, name=worker0) is alive"), text);
  CHECK_FALSE(distrpc::is_initialized());
  ctx.publish("tried1", "1");
}

// A member whose request threads are all busy in user code still answers the membership's
// liveness check: a joiner under its name (at a free rank) is refused, the member keeps its place
// and its running calls complete (the check once waited for a request thread, timed out after
// 2 s and had the live member replaced, its calls failed).
DISTRPC_MP_TEST("elastic: a member whose request threads are all busy is not taken for dead", 3,
                90) {
  if (ctx.rank == 1) {
    RpcBackendOptions o;
    o.init_method = file_url(ctx, "elastic");
    o.num_worker_threads = 2;
    (void)ctx.lookup("up0", 60s);
    distrpc::testing::init_rpc_dynamic_under_test(wname(1), 1, o);
    ctx.publish("up1", "1");
    const auto t0 = std::chrono::steady_clock::now();
    while (g_holding.load() < 2 && std::chrono::steady_clock::now() - t0 < 30s) {
      std::this_thread::sleep_for(5ms);
    }
    REQUIRE(g_holding.load() >= 2);
    // Both request threads hold one; the transport's reading threads may run one each besides
    // (leader/follower), until one is left reading: the rest wait in the queue.
    std::this_thread::sleep_for(300ms);
    ctx.publish("busy", "1");
    (void)ctx.lookup("tried", 60s);
    g_let_go = true;
    meet(ctx, "done", {0, 1});
    CHECK_NOTHROW(distrpc::shutdown());
    return;
  }
  if (ctx.rank == 2) {
    (void)ctx.lookup("busy", 60s);
    RpcBackendOptions o;
    o.init_method = file_url(ctx, "elastic");
    const std::string text =
        error_of([&] { distrpc::testing::init_rpc_dynamic_under_test(wname(1), 2, o); });
    CHECK_MESSAGE(contains(text,
                           "Worker name 'worker1' is not unique: WorkerInfo(id=2, "
                           "name=worker1) cannot join the dynamic group while "
                           "WorkerInfo(id=1, name=worker1) is alive"),
                  text);
    CHECK_FALSE(distrpc::is_initialized());
    ctx.publish("tried", "1");
    return;
  }
  join(ctx, wname(0), 0);
  ctx.publish("up0", "1");
  (void)ctx.lookup("up1", 60s);
  std::vector<distrpc::Future<int>> busy;
  for (int i = 0; i < 8; ++i) busy.push_back(distrpc::rpc_async<&hold>(wname(1), 10 + i));
  (void)ctx.lookup("tried", 60s);
  for (int i = 0; i < 8; ++i) CHECK(busy[static_cast<std::size_t>(i)].value() == 10 + i);
  CHECK((member_names() == std::set<std::string>{wname(0), wname(1)}));
  CHECK(distrpc::rpc_sync<&incarnation>(wname(1)) == 1);
  meet(ctx, "done", {0, 1});
  CHECK_NOTHROW(distrpc::shutdown());
}

// A joiner that took its join number and died before publishing its entry (done here by hand on
// the store) holds up the next join for init_timeout once: that joiner marks the number
// abandoned and joins; a later one does not wait at all.
DISTRPC_MP_TEST("elastic: a joiner that died before publishing holds up one join, once", 3, 90) {
  using Clock = std::chrono::steady_clock;
  if (ctx.rank == 0) {
    join(ctx, wname(0), 0);
    distrpc::store::FileStore raw(ctx.dir + "/rendezvous-elastic", -1, 10s);
    CHECK(raw.add("distrpc/rpc/dyn/seq", 1) == 2);  // number 2, never published
    ctx.publish("took2", "1");
    meet(ctx, "done", {0, 1, 2});
    CHECK_NOTHROW(distrpc::shutdown());
    return;
  }
  if (ctx.rank == 2) (void)ctx.lookup("joined1", 60s);
  (void)ctx.lookup("took2", 60s);
  RpcBackendOptions o;
  o.init_method = file_url(ctx, "elastic");
  o.init_timeout = 2s;
  const auto t0 = Clock::now();
  distrpc::testing::init_rpc_dynamic_under_test(wname(ctx.rank), ctx.rank, o);
  const auto took = Clock::now() - t0;
  if (ctx.rank == 1) {
    CHECK(took >= 1900ms);  // waited for number 2 once
    ctx.publish("joined1", "1");
  } else {
    CHECK(took < 1500ms);  // number 2 is marked abandoned: no wait
  }
  meet(ctx, "up", {1, 2});
  for (int r = 0; r < 3; ++r) {
    if (r != ctx.rank) CHECK(distrpc::rpc_sync<&plus>(wname(r), r, 1) == r + 1);
  }
  meet(ctx, "called", {1, 2});
  meet(ctx, "done", {0, 1, 2});
  CHECK_NOTHROW(distrpc::shutdown());
}

// ---- a worker killed, then replaced ------------------------------------------------------------

// Ranks 0..2 join as worker0..2; worker1 creates an RRef owned by worker2; worker2 creates one
// owned by worker0 and shares it with worker1, then dies by SIGKILL; worker0's calls and worker1's
// to_here() fail naming it; process 3 joins as worker2 (rank 2) and both reach it; its own RRef
// on worker0 and the one its predecessor shared are two RRefs, each with its value. Worker0 is
// admitting the replacement while a layer there still handles the loss: the admission waits.
DISTRPC_MP_TARGET("elastic target: kill and replace") {
  using Clock = std::chrono::steady_clock;
  if (ctx.rank == 3) {
    (void)ctx.lookup("saw_dead0", 60s);
    (void)ctx.lookup("saw_dead1", 60s);
    g_incarnation = 2;
    join(ctx, wname(2), 2);
    CHECK((member_names() == std::set<std::string>{wname(0), wname(1), wname(2)}));
    CHECK(distrpc::rpc_sync<&plus>(wname(0), 2, 0) == 2);
    CHECK(distrpc::rpc_sync<&plus>(wname(1), 2, 1) == 3);
    {
      // The dead incarnation's first RRef lives on at worker0 (worker1 holds it); this one, made
      // the same way, is another RRef: its id is not the dead one's, so it gets its own value.
      auto again = distrpc::remote<&make_value>(wname(0), 30);
      CHECK(again.to_here() == 30);
    }
    ctx.publish("replaced", "1");
    meet(ctx, "done", {0, 1, 3});
    // The others' RRefs to values owned here are dropped; their deletes may still be in flight,
    // and a leaving worker's leak check does not wait for other workers.
    const auto t0 = Clock::now();
    while (distrpc::get_debug_info().at("num_owner_rrefs") != "0" && Clock::now() - t0 < 10s) {
      std::this_thread::sleep_for(10ms);
    }
    CHECK(distrpc::get_debug_info().at("num_owner_rrefs") == "0");
    CHECK_NOTHROW(distrpc::shutdown());
    return;
  }
  if (ctx.rank > 0) (void)ctx.lookup("joined" + std::to_string(ctx.rank - 1), 60s);
  if (ctx.rank == 0) g_slow_loss = true;
  join(ctx, wname(ctx.rank), ctx.rank);
  ctx.publish("joined" + std::to_string(ctx.rank), "1");
  (void)ctx.lookup("joined2", 60s);
  for (int r = 0; r < 3; ++r) {
    if (r != ctx.rank) CHECK(distrpc::rpc_sync<&plus>(r, 0, r) == r);
  }
  ctx.publish("called" + std::to_string(ctx.rank), "1");
  if (ctx.rank == 2) {
    // Not before worker0 and worker1 made their calls to it (worker1 may make its RRef first).
    (void)ctx.lookup("called0", 60s);
    (void)ctx.lookup("called1", 60s);
    (void)ctx.lookup("rref_made", 60s);
    // This process's first RRef, owned by worker0 and shared with worker1, outlives it there.
    auto first = distrpc::remote<&make_value>(wname(0), 20);
    CHECK(first.to_here() == 20);
    CHECK(distrpc::rpc_sync<&keep_shared>(wname(1), first));
    ctx.publish("killed2", "now");
    ::kill(::getpid(), SIGKILL);
    std::this_thread::sleep_for(60s);  // never reached
  }
  std::optional<distrpc::RRef<int>> rref;
  std::optional<distrpc::RRef<int>> kept;  // held across the replacement
  if (ctx.rank == 1) {
    rref = distrpc::remote<&make_value>(wname(2), 7);
    kept = distrpc::remote<&make_value>(wname(2), 8);
    CHECK(rref->to_here() == 7);
    CHECK(kept->to_here() == 8);
    ctx.publish("rref_made", "1");
  }
  (void)ctx.lookup("killed2", 60s);
  // Calls to the dead worker fail, naming it, soon (the connection breaks or is refused).
  std::string dead_text;
  const auto t0 = Clock::now();
  while (dead_text.empty() && Clock::now() - t0 < 20s) {
    dead_text = error_of([] { distrpc::rpc_sync<&incarnation>(wname(2)); });
    if (dead_text.empty()) std::this_thread::sleep_for(20ms);
  }
  CHECK_MESSAGE(contains(dead_text, "worker2"), dead_text);
  if (ctx.rank == 0) {
    // The replacement asks to join while a layer here still handles the loss (2.5 s).
    const auto t1 = Clock::now();
    while (!g_loss_started.load() && Clock::now() - t1 < 10s) std::this_thread::sleep_for(1ms);
    CHECK(g_loss_started.load());
  }
  if (rref) {
    // An RRef owned by the dead worker fails cleanly (the test's time limit catches a hang).
    const std::string rref_text = error_of([&] { (void)rref->to_here(); });
    CHECK_MESSAGE(contains(rref_text, "worker2"), rref_text);
    rref.reset();
  }
  ctx.publish("saw_dead" + std::to_string(ctx.rank), "1");
  (void)ctx.lookup("replaced", 60s);
  // The replacement is in the view under the same name and rank, and answers calls.
  CHECK((member_names() == std::set<std::string>{wname(0), wname(1), wname(2)}));
  CHECK(distrpc::get_worker_info(wname(2)).id == 2);
  CHECK(distrpc::rpc_sync<&incarnation>(wname(2)) == 2);
  CHECK(distrpc::rpc_sync<&incarnation>(2) == 2);
  if (ctx.rank == 0) {
    // Admitted once every layer here was done with its predecessor's loss, not during it.
    CHECK(g_loss_ended.load());
    CHECK_FALSE(g_joined_during_loss.load());
  }
  if (ctx.rank == 1) {
    // The RRef the dead incarnation shared is owned by worker0, which is alive: it keeps its
    // value, whatever its maker's replacement made since.
    REQUIRE(g_shared.has_value());
    CHECK(g_shared->to_here() == 20);
    g_shared.reset();
  }
  if (kept) {
    // A value the dead incarnation owned is not asked of the replacement (which never held it:
    // the fetch once waited there for its creation until the call's 60 s timeout): it fails at
    // once, naming the owner, as before the replacement.
    const auto t0 = Clock::now();
    const std::string text = error_of([&] { (void)kept->to_here(); });
    CHECK_MESSAGE(contains(text, "its owner WorkerInfo(id=2, name=worker2) was lost"), text);
    CHECK(Clock::now() - t0 < 2s);
    kept.reset();
  }
  {
    auto fresh = distrpc::remote<&make_value>(wname(2), 11);
    CHECK(fresh.to_here() == 11);
  }
  meet(ctx, "done", {0, 1, 3});
  if (ctx.rank == 0) {
    // Worker0 owned the RRef shared with worker1 and the replacement's: their deletes may still
    // be on their way, and a leaving worker's leak check does not wait for other workers.
    const auto t1 = Clock::now();
    while (distrpc::get_debug_info().at("num_owner_rrefs") != "0" && Clock::now() - t1 < 10s) {
      std::this_thread::sleep_for(10ms);
    }
    CHECK(distrpc::get_debug_info().at("num_owner_rrefs") == "0");
  }
  CHECK_NOTHROW(distrpc::shutdown());
}

namespace elastic_test {
// Runs `target` on `world` processes: `killed` ends by SIGKILL, every other one exits with 0.
void run_with_one_killed(const char* target, int world, int killed) {
  distrpc::testing::RunOptions o;
  o.world = world;
  o.limit = 90s;
  o.may_die = {killed};
  const auto r = distrpc::testing::run_ranks(target, o);
  CHECK_MESSAGE(r.ok, r.report());
  for (const auto& rank : r.ranks) {
    if (rank.rank == killed) {
      CHECK_MESSAGE(rank.signal == SIGKILL, r.report());
    } else {
      CHECK_MESSAGE(rank.exit_code == 0, r.report());
    }
  }
}
}  // namespace elastic_test

TEST_CASE("elastic: a worker killed with SIGKILL is replaced by a new process under its name") {
  run_with_one_killed("elastic target: kill and replace", 4, 2);
}

// ---- a worker frozen, then replaced ------------------------------------------------------------

namespace elastic_test {
// Whether every thread of `pid` is stopped within `limit`. kill(SIGSTOP) returns before the
// target's threads stop: each stops when it next enters the kernel, so under load a thread can
// still answer a call for a while after kill() returned.
bool wait_stopped(pid_t pid, std::chrono::milliseconds limit) {
  namespace fs = std::filesystem;
  const auto deadline = std::chrono::steady_clock::now() + limit;
  const fs::path tasks = fs::path("/proc") / std::to_string(pid) / "task";
  while (std::chrono::steady_clock::now() < deadline) {
    bool all = true;
    std::error_code ec;
    for (const auto& task : fs::directory_iterator(tasks, ec)) {
      // /proc/PID/task/TID/stat: "TID (comm) STATE ..."; comm may hold spaces and parentheses.
      std::ifstream in(task.path() / "stat");
      const std::string line((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
      const auto close = line.rfind(')');
      if (close == std::string::npos || close + 2 >= line.size() || line[close + 2] != 'T') {
        all = false;
        break;
      }
    }
    if (all && !ec) return true;
    std::this_thread::sleep_for(1ms);
  }
  return false;
}
}  // namespace elastic_test

// Worker1 is stopped (SIGSTOP: its connections stay up, it answers nothing) while worker0 has a
// call out to it; a replacement joins under its name and rank. Worker0 finds the frozen one
// silent, takes it for dead, and fails the call still out to it at once, naming it and the
// replacement, instead of leaving it to its 60 s timeout. Process 2 is the replacement.
DISTRPC_MP_TARGET("elastic target: freeze and replace") {
  if (ctx.rank == 1) {
    join(ctx, wname(1), 1);
    ctx.publish("pid1", std::to_string(::getpid()));
    (void)ctx.lookup("never", 90s);  // stopped, then killed by worker0
    return;
  }
  if (ctx.rank == 2) {
    (void)ctx.lookup("frozen", 60s);
    g_incarnation = 2;
    join(ctx, wname(1), 1);
    ctx.publish("replaced", "1");
    (void)ctx.lookup("done0", 60s);
    CHECK_NOTHROW(distrpc::shutdown());
    return;
  }
  join(ctx, wname(0), 0);
  const pid_t frozen = static_cast<pid_t>(std::stol(ctx.lookup("pid1", 60s)));
  CHECK(distrpc::rpc_sync<&incarnation>(wname(1)) == 1);
  REQUIRE(::kill(frozen, SIGSTOP) == 0);
  REQUIRE(elastic_test::wait_stopped(frozen, 5000ms));
  distrpc::Future<int> out = distrpc::rpc_async<&plus>(wname(1), distrpc::CallOptions{60s}, 1, 2);
  std::this_thread::sleep_for(200ms);
  CHECK_FALSE(out.done());
  ctx.publish("frozen", "1");
  (void)ctx.lookup("replaced", 60s);
  // Failed when the replacement was admitted, not at the call's timeout.
  CHECK(out.done());
  const std::string text = error_of([&] { (void)out.value(); });
  CHECK_MESSAGE(contains(text,
                         "to WorkerInfo(id=1, name=worker1) failed: it no longer answers; "
                         "replaced by WorkerInfo(id=1, name=worker1)"),
                text);
  CHECK(distrpc::rpc_sync<&incarnation>(wname(1)) == 2);
  // The frozen process dies now: its connections break, and that loss is the old incarnation's,
  // not the replacement's, which stays a member and answers.
  ::kill(frozen, SIGKILL);
  std::this_thread::sleep_for(500ms);
  CHECK((member_names() == std::set<std::string>{wname(0), wname(1)}));
  CHECK(distrpc::rpc_sync<&incarnation>(wname(1)) == 2);
  ctx.publish("done0", "1");
  CHECK_NOTHROW(distrpc::shutdown());
}

TEST_CASE("elastic: a frozen worker's pending calls fail when a replacement takes its place") {
  run_with_one_killed("elastic target: freeze and replace", 3, 1);
}

// ---- a member that left joins again ------------------------------------------------------------

// Worker1 leaves (graceful shutdown), and the same process joins again under its name and rank
// while a layer on worker0 still handles the end of its old connections (2.5 s). The admission
// waits for that handling, which, run later, would drop what the joiner holds under that rank.
DISTRPC_MP_TEST("elastic: a member that left joins again once the others handled its leave", 2,
                90) {
  using Clock = std::chrono::steady_clock;
  if (ctx.rank == 0) {
    g_slow_loss = true;
    join(ctx, wname(0), 0, "rejoin");
    ctx.publish("up0", "1");
    (void)ctx.lookup("left1", 60s);
    const auto t0 = Clock::now();
    while (!g_loss_started.load() && Clock::now() - t0 < 10s) std::this_thread::sleep_for(1ms);
    CHECK(g_loss_started.load());
    ctx.publish("loss_seen0", "1");
    (void)ctx.lookup("rejoined1", 60s);
    CHECK(g_loss_ended.load());
    CHECK_FALSE(g_joined_during_loss.load());
    CHECK((member_names() == std::set<std::string>{wname(0), wname(1)}));
    CHECK(distrpc::rpc_sync<&plus>(wname(1), 1, 2) == 3);
  } else {
    (void)ctx.lookup("up0", 60s);
    join(ctx, wname(1), 1, "rejoin");
    CHECK(distrpc::rpc_sync<&plus>(wname(0), 1, 1) == 2);
    CHECK_NOTHROW(distrpc::shutdown());
    ctx.publish("left1", "1");
    (void)ctx.lookup("loss_seen0", 60s);
    join(ctx, wname(1), 1, "rejoin");
    CHECK((member_names() == std::set<std::string>{wname(0), wname(1)}));
    CHECK(distrpc::rpc_sync<&plus>(wname(0), 2, 2) == 4);
    ctx.publish("rejoined1", "1");
  }
  meet(ctx, "done", {0, 1});
  CHECK_NOTHROW(distrpc::shutdown());
}
