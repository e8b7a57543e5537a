// The flagship example: N workers on loopback (N processes, re-executing this binary) meet through
// a TCP store, call each other around a ring in every mode, call a builtin operator, gather a value
// from everyone, and shut down gracefully.
//
//   build/examples/hello_rpc [--world 4]
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "distrpc/distrpc.hpp"
#include "distrpc/transport/tcp.hpp"
#include "spawn_self.hpp"

namespace {

at::Tensor add(at::Tensor a, at::Tensor b) {
  return a + b;
}

// Asynchronous by its type: the callee's thread is free while the nested call runs.
distrpc::Future<at::Tensor> add_via_next(at::Tensor a, int hops) {
  if (hops == 0) return distrpc::make_ready_future(a);
  const auto me = distrpc::get_worker_info();
  const int next = (me.id + 1) % static_cast<int>(distrpc::get_worker_infos().size());
  return distrpc::rpc_async<&add_via_next>(next, a + 1, hops - 1);
}

int worker(int rank, int world, const std::string& init) {
  distrpc::RpcBackendOptions opts;
  opts.init_method = init;
  opts.builtin_operators = {"aten::mul"};  // peers may run this ATen operator here by name
  const std::string me = "worker" + std::to_string(rank);
  distrpc::init_rpc<distrpc::transport::Tcp>(me, rank, world, opts);
  const int next = (rank + 1) % world;
  const int n = rank + 1;
  at::Tensor s = distrpc::rpc_sync<&add>(next, torch::ones({n, n}), torch::ones({n, n}));
  at::Tensor a = distrpc::rpc_async<&add>("worker" + std::to_string(next), s, s).value();
  c10::IValue b = distrpc::rpc_sync(next, "aten::mul.Tensor", {a, a});
  at::Tensor chain = distrpc::rpc_sync<&add_via_next>(next, torch::zeros({2}), 2 * world);
  auto names =
      distrpc::all_gather(me + " sum=" + std::to_string(b.toTensor().sum().item<double>()));
  if (rank == 0) {
    for (const auto& [who, what] : names) std::printf("  %s -> %s\n", who.c_str(), what.c_str());
    std::printf("  async chain of %d hops around the ring: %s\n", 2 * world,
                chain[0].item<double>() == 2 * world ? "ok" : "WRONG");
  }
  distrpc::shutdown();
  return 0;
}

int launch(int world) {
  const int rc = distrpc_examples::run_local_group(
                     world, "hello",
                     [&](const std::string&) {
                       return std::vector<std::string>{"--world", std::to_string(world)};
                     })
                     ? 0
                     : 1;
  std::printf(rc == 0 ? "hello_rpc: %d workers done, clean shutdown\n"
                      : "hello_rpc: a worker FAILED (%d workers)\n",
              world);
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    int rank = -1, world = 4;
    std::string init;
    for (int i = 1; i + 1 < argc; i += 2) {
      const std::string k = argv[i];
      if (k == "--rank") {
        rank = std::atoi(distrpc_examples::rank_text(argv[i + 1]).c_str());
      } else if (k == "--world") {
        world = std::atoi(argv[i + 1]);
      } else if (k == "--init") {
        init = argv[i + 1];
      } else {
        throw std::invalid_argument("unknown argument '" + k + "' (expected --world N)");
      }
    }
    if (world < 1 || world > 64) throw std::invalid_argument("--world must be within 1..64");
    return rank < 0 ? launch(world) : worker(rank, world, init);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hello_rpc: %s\n", e.what());
    return 1;
  }
}
