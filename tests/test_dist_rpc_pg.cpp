// RPC and a process group in one program, as pytorch/examples' ddp_rpc runs them: the RPC agent
// and the "distrpc" backend each open their own listener (port 0), so they never clash, whether
// they meet through two stores or through one.
#include <ATen/ATen.h>
#include <doctest/doctest.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "distrpc/dist.hpp"
#include "distrpc/dist/distrpc_backend.hpp"
#include "distrpc/rpc.hpp"
#include "distrpc/rpc_store.hpp"
#include "distrpc/transport/tcp.hpp"
#include "multiprocess.hpp"

namespace dist = distrpc::dist;
using distrpc::testing::run_ranks;
using distrpc::testing::RunOptions;

namespace {

at::Tensor times_ten(at::Tensor t) {
  return t * 10;
}

void register_distrpc_once() {
  if (!dist::is_backend_available("distrpc")) {
    dist::register_distrpc_backend<distrpc::transport::Tcp>();
  }
}

// Both at work at once: an all-reduce of what an RPC to the other worker returned, an async
// all-reduce in flight while an RPC runs, and an RPC inside a group that spans both ranks.
void use_both(int rank) {
  const std::string peer = "trainer" + std::to_string(1 - rank);
  at::Tensor mine = at::full({8}, rank + 1.0);
  at::Tensor got = distrpc::rpc_sync<&times_ten>(peer, mine);
  CHECK(at::equal(got, at::full({8}, (rank + 1) * 10.0)));
  dist::all_reduce(got);
  CHECK(at::equal(got, at::full({8}, 30.0)));

  at::Tensor big = at::full({1 << 18}, static_cast<float>(rank));
  auto work = dist::all_reduce(big, {.async_op = true});
  auto reply = distrpc::rpc_async<&times_ten>(peer, at::ones({2}));
  CHECK(at::equal(reply.value(), at::full({2}, 10.0)));
  CHECK(work->wait(std::chrono::seconds(30)));
  CHECK(at::equal(big, at::full({1 << 18}, 1.0)));
  CHECK(dist::get_world_size() == 2);
  CHECK(dist::get_rank() == rank);
}

RunOptions run_options(int rpc_port) {
  RunOptions o;
  o.world = 2;
  o.limit = std::chrono::seconds(90);
  o.env = {"MASTER_ADDR=127.0.0.1",
           "MASTER_PORT=" + std::to_string(distrpc::testing::free_loopback_port()), "WORLD_SIZE=2",
           "DISTRPC_TEST_RPC_PORT=" + std::to_string(rpc_port)};
  return o;
}

}  // namespace

// ddp_rpc's layout: the process group on env:// (MASTER_ADDR/MASTER_PORT), RPC on its own tcp://.
DISTRPC_MP_TARGET("dist rpc+pg target: two stores") {
  register_distrpc_once();
  ::setenv("RANK", std::to_string(ctx.rank).c_str(), 1);
  dist::init_process_group("distrpc");
  distrpc::RpcBackendOptions opts;
  opts.init_method = std::string("tcp://127.0.0.1:") + std::getenv("DISTRPC_TEST_RPC_PORT");
  distrpc::init_rpc<distrpc::transport::Tcp>("trainer" + std::to_string(ctx.rank), ctx.rank, 2,
                                             opts);
  use_both(ctx.rank);
  dist::destroy_process_group();
  distrpc::shutdown();
}

// One rendezvous: the process group meets through the store RPC met through.
DISTRPC_MP_TARGET("dist rpc+pg target: one store") {
  register_distrpc_once();
  distrpc::RpcBackendOptions opts;
  opts.init_method = std::string("tcp://127.0.0.1:") + std::getenv("DISTRPC_TEST_RPC_PORT");
  distrpc::init_rpc<distrpc::transport::Tcp>("trainer" + std::to_string(ctx.rank), ctx.rank, 2,
                                             opts);
  dist::init_process_group("distrpc", distrpc::rpc_store(), ctx.rank, 2);
  use_both(ctx.rank);
  // Again on a subgroup of both ranks: its keys sit beside the default group's and the agent's.
  auto g = dist::new_group({0, 1});
  at::Tensor t = at::full({3}, ctx.rank * 2.0);
  dist::all_reduce(t, {.op = dist::ReduceOp::MAX, .group = g});
  CHECK(at::equal(t, at::full({3}, 2.0)));
  dist::destroy_process_group();
  distrpc::shutdown();
}

TEST_CASE("dist rpc+pg: RPC and a process group in one program, on two stores") {
  auto r = run_ranks("dist rpc+pg target: two stores",
                     run_options(distrpc::testing::free_loopback_port()));
  INFO(r.report());
  CHECK(r.ok);
}

TEST_CASE("dist rpc+pg: RPC and a process group in one program, through one store") {
  auto r = run_ranks("dist rpc+pg target: one store",
                     run_options(distrpc::testing::free_loopback_port()));
  INFO(r.report());
  CHECK(r.ok);
}

TEST_CASE("dist rpc+pg: rpc_store() without RPC names what is missing") {
  try {
    (void)distrpc::rpc_store();
    FAIL("rpc_store() returned without a running agent");
  } catch (const distrpc::RpcError& e) {
    CHECK(std::string(e.what()).find("Current RPC agent is not set!") != std::string::npos);
  }
}
