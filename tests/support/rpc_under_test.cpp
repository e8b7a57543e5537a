#include "rpc_under_test.hpp"

#include <cstdlib>
#include <stdexcept>

#include <distrpc/rpc.hpp>
#include <distrpc/transport/tcp.hpp>
#if __has_include(<distrpc/transport/shm.hpp>)
#include <distrpc/transport/auto.hpp>
#include <distrpc/transport/shm.hpp>
#define DISTRPC_TEST_HAVE_SHM 1
#endif

namespace distrpc::testing {

std::vector<std::string> compiled_transports() {
#ifdef DISTRPC_TEST_HAVE_SHM
  return {"tcp", "shm", "auto"};
#else
  return {"tcp"};
#endif
}

std::string transport_under_test() {
  const char* v = std::getenv("DISTRPC_TEST_TRANSPORT");
  const std::string t = (v && *v) ? v : "tcp";
  for (const auto& known : compiled_transports()) {
    if (t == known) return t;
  }
  std::string list;
  for (const auto& known : compiled_transports()) list += (list.empty() ? "" : ", ") + known;
  throw std::invalid_argument("DISTRPC_TEST_TRANSPORT='" + t +
                              "' is not a transport of this test build (built: " + list + ")");
}

void init_rpc_under_test(const std::string& name, int rank, int world,
                         const RpcBackendOptions& given) {
  // The suites are SPMD programs that test the builtin path itself: every operator is allowed
  // unless a case names its own list (a real worker allows none by default).
  RpcBackendOptions o = given;
  if (o.builtin_operators.empty()) o.builtin_operators = {"*"};
  const std::string t = transport_under_test();
  if (t == "tcp") {
    distrpc::init_rpc<distrpc::transport::Tcp>(name, rank, world, o);
    return;
  }
#ifdef DISTRPC_TEST_HAVE_SHM
  if (t == "shm") {
    distrpc::init_rpc<distrpc::transport::Shm>(name, rank, world, o);
    return;
  }
  if (t == "auto") {
    // Shared memory with peers of this host, TCP otherwise (all of them, unless
    // DISTRPC_TRANSPORT_DOMAIN_OVERRIDE_SHM makes workers look like separate hosts).
    distrpc::init_rpc<distrpc::transport::Auto<distrpc::transport::Shm, distrpc::transport::Tcp>>(
        name, rank, world, o);
    return;
  }
#endif
  throw std::logic_error("transport '" + t + "' listed as compiled but not dispatched");
}

void init_rpc_dynamic_under_test(const std::string& name, int rank,
                                 const RpcBackendOptions& given) {
  RpcBackendOptions o = given;
  if (o.builtin_operators.empty()) o.builtin_operators = {"*"};
  const std::string t = transport_under_test();
  if (t == "tcp") {
    distrpc::init_rpc<distrpc::transport::Tcp>(name, rank, o);
    return;
  }
#ifdef DISTRPC_TEST_HAVE_SHM
  if (t == "shm") {
    distrpc::init_rpc<distrpc::transport::Shm>(name, rank, o);
    return;
  }
  if (t == "auto") {
    distrpc::init_rpc<distrpc::transport::Auto<distrpc::transport::Shm, distrpc::transport::Tcp>>(
        name, rank, o);
    return;
  }
#endif
  throw std::logic_error("transport '" + t + "' listed as compiled but not dispatched");
}

}  // namespace distrpc::testing
