// The transport a multi-process RPC suite runs on, chosen at run time so one test binary covers
// every policy: tests/run.sh runs the RPC suites once per transport with DISTRPC_TEST_TRANSPORT
// set to "tcp", "shm" or "auto". The Agent<Transport> instantiations live in one translation unit
// (rpc_under_test.cpp) so the suites themselves stay transport-agnostic and compile once.
#pragma once

#include <string>
#include <vector>

#include <distrpc/options.hpp>

namespace distrpc::testing {

// DISTRPC_TEST_TRANSPORT, or "tcp" when unset. Throws naming the value when it is not one of
// compiled_transports(), so a typo cannot silently test the default.
std::string transport_under_test();

// The transport names this test build was compiled with (tcp always; shm/auto where built).
std::vector<std::string> compiled_transports();

// distrpc::init_rpc<T>(name, rank, world, opts) with T the transport under test (every builtin
// operator allowed when opts lists none).
void init_rpc_under_test(const std::string& name, int rank, int world, const RpcBackendOptions& o);

// distrpc::init_rpc<T>(name, rank, opts): joins a dynamic group (no world size).
void init_rpc_dynamic_under_test(const std::string& name, int rank, const RpcBackendOptions& o);

}  // namespace distrpc::testing
