// The start-up conflict check (with conflict_b.cpp): two translation units each define a function
// `twice` in an anonymous namespace and call it in the SPMD form, so both register under the
// compiler's name "{anonymous}::twice"; and each exposes its own implementation of "math.scale".
// Neither can be refused while the program starts: init_rpc must fail naming both origins.
//   two_binaries_conflict <init_method>   prints the error and exits 0 if init_rpc refused
#include <chrono>
#include <cstdio>
#include <exception>
#include <string>

#include "distrpc/distrpc.hpp"
#include "distrpc/transport/tcp.hpp"

DISTRPC_REMOTE(scale, "math.scale", double(double));

namespace {

int twice(int x) {
  return 2 * x;
}

double scale_a(double x) {
  return 2 * x;
}

}  // namespace

DISTRPC_EXPOSE(scale, &scale_a);

int call_twice_a() {
  return distrpc::rpc_sync<&twice>("alone", 1);
}

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  try {
    distrpc::RpcBackendOptions o;
    o.init_method = argv[1];
    o.init_timeout = std::chrono::seconds(10);
    distrpc::init_rpc<distrpc::transport::Tcp>("alone", 0, 1, o);
  } catch (const std::exception& e) {
    std::printf("refused: %s\n", e.what());
    return 0;
  }
  std::printf("init_rpc did not refuse the conflicts\n");
  distrpc::shutdown();
  return 1;
}
