// The backend registry (spec rpc.md group A): transports chosen by name at run time, each name
// registered once with the exact text "RPC backend <name>: already registered".
#include <algorithm>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <doctest/doctest.h>

#include <distrpc/backends.hpp>
#include <distrpc/transport/tcp.hpp>

#include "multiprocess.hpp"

namespace backends_test {
at::Tensor twice(at::Tensor t) {
  return t * 2;
}
int plus(int a, int b) {
  return a + b;
}
}  // namespace backends_test

namespace {

using distrpc::BackendRegistry;
using distrpc::RpcBackendOptions;
using distrpc::transport::Tcp;

TEST_CASE("backends: a name is registered once, with the spec's text") {
  distrpc::register_rpc_backend<Tcp>("backends-test-once");
  CHECK(BackendRegistry::instance().contains("backends-test-once"));
  CHECK_THROWS_WITH_AS(distrpc::register_rpc_backend<Tcp>("backends-test-once"),
                       "RPC backend backends-test-once: already registered", distrpc::RpcError);
  // The first registration still stands.
  const auto names = BackendRegistry::instance().names();
  CHECK(std::count(names.begin(), names.end(), "backends-test-once") == 1);
}

TEST_CASE("backends: bad names and unknown backends are refused, naming what was wrong") {
  CHECK_THROWS_WITH_AS(distrpc::register_rpc_backend<Tcp>(""), "RPC backend name must be non-empty",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(BackendRegistry::instance().add("backends-test-null", nullptr),
                       "RPC backend backends-test-null: the init function is empty",
                       std::invalid_argument);
  CHECK_FALSE(BackendRegistry::instance().contains("backends-test-null"));
  RpcBackendOptions o;
  o.init_method = "file:///nonexistent/never-used";
  CHECK_THROWS_WITH_AS(distrpc::init_rpc("worker0", "no-such-transport", 0, 1, o),
                       doctest::Contains("RPC backend 'no-such-transport' is not registered"),
                       distrpc::RpcError);
  CHECK_FALSE(distrpc::is_initialized());
}

DISTRPC_MP_TEST("backends: init_rpc by backend name runs RPC on that transport", 2, 60) {
  distrpc::register_rpc_backend<Tcp>();  // as "tcp", its policy name
  CHECK_THROWS_WITH(distrpc::register_rpc_backend<Tcp>(),
                    doctest::Contains("RPC backend tcp: already registered"));
  RpcBackendOptions o;
  o.init_method = ctx.file_url();
  distrpc::init_rpc("worker" + std::to_string(ctx.rank), "tcp", ctx.rank, ctx.world, o);
  CHECK(distrpc::get_debug_info().at("agent.transport") == "tcp");
  const int peer = 1 - ctx.rank;
  CHECK(distrpc::rpc_sync<&backends_test::plus>(peer, 40, ctx.rank + 2) == 42 + ctx.rank);
  CHECK(at::equal(distrpc::rpc_async<&backends_test::twice>(peer, at::ones({3})).value(),
                  at::full({3}, 2.0)));
  // Initialized through the registry or not, a second init is refused the same way.
  CHECK_THROWS_WITH(distrpc::init_rpc("again", "tcp", ctx.rank, ctx.world, o),
                    doctest::Contains("is already initialized"));
  distrpc::shutdown();
  CHECK_FALSE(distrpc::is_initialized());
}

}  // namespace
