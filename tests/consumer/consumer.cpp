// The smallest real user of distrpc, built two ways by tests/consumer/check.sh: as a Meson
// subproject, and against the installed headers through `pkg-config --cflags --libs distrpc`.
// It makes RPC calls between two processes: rank 0 starts rank 1 (this program again, before
// libtorch or any thread starts), both meet through a file:// rendezvous, rank 0 calls rank 1.
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "distrpc/distrpc.hpp"
#include "distrpc/transport/tcp.hpp"

extern char** environ;

at::Tensor add(at::Tensor a, at::Tensor b) {
  return a + b;
}

namespace {

distrpc::RpcBackendOptions options(const std::string& url) {
  distrpc::RpcBackendOptions o;
  o.init_method = url;
  o.init_timeout = std::chrono::seconds(60);
  o.rpc_timeout = std::chrono::seconds(30);
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--serve") {  // rank 1: serves add, then leaves
    distrpc::init_rpc<distrpc::transport::Tcp>("worker1", 1, 2, options(argv[2]));
    distrpc::shutdown();
    return 0;
  }
  char dir[] = "/tmp/distrpc-consumer-XXXXXX";
  if (::mkdtemp(dir) == nullptr) return 2;
  const std::string url = std::string("file://") + dir + "/rendezvous";
  std::string serve = "--serve";
  char* child_argv[] = {argv[0], serve.data(), const_cast<char*>(url.c_str()), nullptr};
  pid_t child = 0;
  if (::posix_spawn(&child, argv[0], nullptr, nullptr, child_argv, environ) != 0) return 3;

  distrpc::init_rpc<distrpc::transport::Tcp>("worker0", 0, 2, options(url));
  const at::Tensor t =
      distrpc::rpc_sync<&add>("worker1", torch::ones({2, 2}) * 40, torch::ones({2, 2}) * 2);
  distrpc::store::HashStore store;
  store.set("answer", std::to_string(t[0][0].item<int>()));
  distrpc::shutdown();
  int status = 0;
  ::waitpid(child, &status, 0);
  const double sum = t.sum().item<double>();
  std::printf("consumer: sum=%.0f keys=%lld rank1=%d\n", sum,
              static_cast<long long>(store.num_keys()),
              WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  return sum == 168.0 && WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
