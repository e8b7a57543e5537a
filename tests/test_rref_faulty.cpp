// The RRef protocol on a faulty network (PyTorch's "faulty agent" suites): on Faulty<Tcp>, the
// first 3 sends of fork requests, child accepts, user deletes and type queries fail on every
// worker, and the calls are delivered 1.5 s late. The fire-and-forget messages are retried
// (host_control_call_retrying), so an RRef created, forked to a third worker, used and deleted
// still gives the right values, is freed on its owner, and graceful shutdown reports no leak; a
// type query is not retried (its caller sees the error). Runs on the tcp pass of test_rpc only:
// the transport is Faulty<Tcp> whatever DISTRPC_TEST_TRANSPORT says.
#include <ATen/ATen.h>

#include <chrono>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>

#include <doctest/doctest.h>

#include <distrpc/rpc.hpp>
#include <distrpc/rref.hpp>
#include <distrpc/transport/faulty.hpp>
#include <distrpc/transport/tcp.hpp>

#include "multiprocess.hpp"
#include "support/rpc_test_util.hpp"
#include "support/rpc_under_test.hpp"

using namespace distrpc::testing::rpc_names;

namespace rref_faulty_test {

at::Tensor add(at::Tensor a, at::Tensor b) {
  return a + b;
}
// Runs on the third worker: the RRef argument is a fork it must have confirmed by the owner.
at::Tensor plus_fetched(RRef<at::Tensor> r, double s) {
  return r.to_here() + s;
}

}  // namespace rref_faulty_test

namespace {

using distrpc::rref_message_type;
using distrpc::RRefControl;
using distrpc::transport::Faulty;
using distrpc::transport::FaultyOptions;
using distrpc::transport::FaultyStats;
using distrpc::transport::Tcp;
using distrpc::wire::MessageType;

// PyTorch's faulty agent settings: 3 failed sends of the RRef control messages on every worker,
// calls 1.5 s late. Only worker0 makes calls here; the other workers' requests are the library's
// own group operations (the graceful shutdown's joins), which would only add seconds to the case.
struct RRefFaults {
  static FaultyOptions options(const distrpc::transport::TransportOptions& t) {
    FaultyOptions o{.fail_sends = {.kinds = {rref_message_type(RRefControl::ForkRequest),
                                             rref_message_type(RRefControl::ChildAccept),
                                             rref_message_type(RRefControl::UserDelete),
                                             rref_message_type(RRefControl::TypeQuery)},
                                   .count = 3}};
    if (t.self_id == 0) o.delay = {.kinds = {MessageType::Request}, .by = 1500ms};
    return o;
  }
};
using FaultyTcp = Faulty<Tcp, RRefFaults>;

FaultyStats stats() {
  auto agent =
      std::dynamic_pointer_cast<distrpc::Agent<FaultyTcp>>(distrpc::detail::current_agent());
  REQUIRE(agent);
  return agent->context().stats();
}
std::uint64_t failed(RRefControl k) {
  const auto s = stats();
  const auto it = s.failed.find(rref_message_type(k));
  return it == s.failed.end() ? 0 : it->second;
}

using distrpc::testing::eventually;
using distrpc::testing::rref_counter;
using distrpc::testing::rref_flushed;

}  // namespace

DISTRPC_MP_TARGET("rref faulty target: create, fork to a third worker, use, delete") {
  RpcBackendOptions o;
  o.init_method = ctx.file_url();
  o.num_worker_threads = 8;
  distrpc::init_rpc<FaultyTcp>(wname(ctx.rank), ctx.rank, ctx.world, o);
  const at::Tensor ones = at::ones({2});
  if (ctx.rank == 0) {
    const auto t0 = Clock::now();
    std::optional<RRef<at::Tensor>> rref =
        distrpc::remote<&rref_faulty_test::add>("worker1", ones, ones);
    // Forked to worker2: its fork request to the owner and its child accept to us each fail 3
    // times before they go.
    CHECK(at::equal(distrpc::rpc_sync<&rref_faulty_test::plus_fetched>("worker2", *rref, 1.0),
                    ones * 3));
    CHECK(ms_since(t0) >= 1500);  // the call was held 1.5 s on its way
    CHECK(at::equal(rref->to_here(), ones * 2));
    CHECK(rref->confirmed_by_owner());

    auto& services = static_cast<distrpc::AgentServices&>(*distrpc::detail::current_agent());
    const auto query = rref_message_type(RRefControl::TypeQuery);
    // Bad input fails the future, naming what is wrong.
    expect_exact<std::invalid_argument>(
        [&] { services.host_control_call_retrying(1, query, {}, 5s, "probe", 0, 10ms).value(); },
        "host_control_call_retrying(probe to WorkerInfo(id=1, name=worker1)): attempts must be >= "
        "1, got 0",
        "attempts 0");
    expect_exact<std::invalid_argument>(
        [&] { services.host_control_call_retrying(1, query, {}, 5s, "probe", 2, -1ms).value(); },
        "first_backoff must be >= 0 ms, got -1 ms", "negative backoff");
    // Two attempts allowed, both refused: the error names the worker, the message and the cause.
    const auto t1 = Clock::now();
    expect_exact<distrpc::DistNetworkError>(
        [&] { services.host_control_call_retrying(1, query, {}, 5s, "probe", 2, 100ms).value(); },
        "probe to WorkerInfo(id=1, name=worker1) failed after 2 attempt(s), the most allowed; "
        "last error: distrpc faulty(tcp): cannot send to worker 1 ('worker1'): injected failure 2 "
        "of 3 for Control+4 messages (FaultyOptions::fail_sends)",
        "attempts exhausted");
    CHECK(ms_since(t1) >= 100);  // it backed off before the second attempt
    // A type query is not retried: the user's call fails with the send's error.
    expect_exact<distrpc::DistNetworkError>(
        [&] { (void)rref->type_name(); },
        "distrpc faulty(tcp): cannot send to worker 1 ('worker1'): injected failure 3 of 3 for "
        "Control+4 messages",
        "type query");
    // Its user delete fails 3 times before it goes. It leaves once worker2's child accept came
    // (the fork given to worker2 keeps ours alive until then), which is retried too.
    rref.reset();
    CHECK(eventually([] { return failed(RRefControl::UserDelete) == 3; }, 20s));
    CHECK(rref_flushed());
    CHECK(rref_counter("num_pending_children") == 0);
    CHECK(failed(RRefControl::UserDelete) == 3);
    CHECK(failed(RRefControl::TypeQuery) == 3);
    CHECK(failed(RRefControl::ForkRequest) == 0);  // worker0 created it: nothing to request
    CHECK(stats().delayed.at(MessageType::Request) >= 2);
  }
  if (ctx.rank == 1) {
    // The owner holds the value, then frees it once both users' deletes came through.
    CHECK(eventually([] { return rref_counter("num_owner_rrefs") == 1; }, 20s));
    CHECK(eventually(
        [] { return rref_counter("num_owner_rrefs") == 0 && rref_counter("num_forks") == 0; },
        20s));
  }
  if (ctx.rank == 2) {
    CHECK(eventually([] { return failed(RRefControl::UserDelete) == 3; }, 20s));
    CHECK(rref_flushed());
    CHECK(failed(RRefControl::ForkRequest) == 3);
    CHECK(failed(RRefControl::ChildAccept) == 3);
  }
  const auto t2 = Clock::now();
  CHECK_NOTHROW(distrpc::shutdown());  // graceful: no leak reported, and it completes
  std::printf("[faulty] worker%d: graceful shutdown took %lld ms\n", ctx.rank, ms_since(t2));
}

TEST_CASE("rref faulty: 3 failed sends of each control message and 1.5 s late requests") {
  if (distrpc::testing::transport_under_test() != "tcp") return;  // runs once, on Faulty<Tcp>
  RunOptions o;
  o.world = 3;
  o.limit = 60s;
  auto r = run_ranks("rref faulty target: create, fork to a third worker, use, delete", o);
  CHECK_MESSAGE(r.ok, r.report());
  MESSAGE("rref faulty: " << r.elapsed.count() << " ms");
}
