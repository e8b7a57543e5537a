// Launched by torchrun (tests/interop/check.sh): `torchrun --no_python --nproc_per_node 2
// torchrun_rpc`. Each rank meets the other through env:// (under torchrun: the store torchrun's
// agent hosts, a PyTorch TCPStore), calls the other rank, and prints one checked line.
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "distrpc/distrpc.hpp"
#include "distrpc/store/rendezvous.hpp"
#include "distrpc/transport/tcp.hpp"

// Runs on the callee: its rank is in the answer, so the caller sees who answered.
at::Tensor scaled(at::Tensor t, std::int64_t by) {
  return t * by;
}

int main() {
  const char* rank_text = std::getenv("RANK");
  const char* world_text = std::getenv("WORLD_SIZE");
  if (!rank_text || !world_text) {
    std::fprintf(stderr, "torchrun_rpc: RANK and WORLD_SIZE must be set (run me under torchrun)\n");
    return 2;
  }
  const int rank = std::atoi(rank_text);
  const int world = std::atoi(world_text);
  if (world != 2) {
    std::fprintf(stderr, "torchrun_rpc: expects --nproc_per_node 2, got WORLD_SIZE=%d\n", world);
    return 2;
  }
  distrpc::RpcBackendOptions opts;
  opts.init_method = "env://";
  opts.init_timeout = std::chrono::seconds(60);
  opts.rpc_timeout = std::chrono::seconds(30);
  distrpc::init_rpc<distrpc::transport::Tcp>("worker" + std::to_string(rank), rank, world, opts);
  const int peer = 1 - rank;
  // rank 0 asks for 10 * 2 from worker1, rank 1 for 10 * 3 from worker0.
  const at::Tensor got = distrpc::rpc_sync<&scaled>("worker" + std::to_string(peer),
                                                    torch::full({2}, 10), std::int64_t(rank + 2));
  const long value = static_cast<long>(got.sum().item<double>());
  const long expected = 2 * 10 * (rank + 2);
  distrpc::shutdown();
  const bool agent_store = std::getenv("TORCHELASTIC_USE_AGENT_STORE") &&
                           std::string(std::getenv("TORCHELASTIC_USE_AGENT_STORE")) == "True";
  std::printf("torchrun_rpc rank %d: worker%d answered %ld (expected %ld), agent store %s\n", rank,
              peer, value, expected, agent_store ? "yes" : "no");
  return value == expected ? 0 : 1;
}
