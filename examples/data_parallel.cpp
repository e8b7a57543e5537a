// Data-parallel training by hand with process groups: N local processes (re-executing this binary)
// each hold a replica of a small model and a shard of the data; after every backward pass they
// average their gradients with one all_reduce_coalesced (AVG), so the replicas stay equal, which
// a broadcast at the start and a check at the end (all_gather_object of a checksum) show.
//
//   build/examples/data_parallel [--world 4] [--steps 30] [--transport shm|tcp|auto]
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "distrpc/dist.hpp"
#include "distrpc/dist/distrpc_backend.hpp"
#include "distrpc/transport/auto.hpp"
#include "distrpc/transport/shm.hpp"
#include "distrpc/transport/tcp.hpp"
#include "spawn_self.hpp"

namespace {

namespace dist = distrpc::dist;
using distrpc::transport::Auto, distrpc::transport::Shm, distrpc::transport::Tcp;

void register_backend(const std::string& transport) {
  if (transport == "shm") {
    dist::register_distrpc_backend<Shm>();
  } else if (transport == "tcp") {
    dist::register_distrpc_backend<Tcp>();
  } else if (transport == "auto") {
    dist::register_distrpc_backend<Auto<Shm, Tcp>>();
  } else {
    throw std::invalid_argument("unknown transport '" + transport + "' (expected shm, tcp, auto)");
  }
}

int worker(int rank, int world, int steps, const std::string& init, const std::string& transport) {
  register_backend(transport);
  dist::init_process_group("distrpc", init, rank, world);

  // The task: y = 3x1 - 2x2 + 1 + noise; every rank sees its own shard of 256 samples.
  torch::manual_seed(1000 + rank);
  const at::Tensor x = torch::randn({256, 2});
  const at::Tensor y =
      x.matmul(torch::tensor({3.0f, -2.0f})).unsqueeze(1) + 1.0 + 0.01 * torch::randn({256, 1});

  torch::manual_seed(rank);  // replicas start different on purpose: the broadcast aligns them
  torch::nn::Sequential model(torch::nn::Linear(2, 16), torch::nn::Tanh(),
                              torch::nn::Linear(16, 1));
  std::vector<at::Tensor> params = model->parameters();
  for (const at::Tensor& p : params) {
    at::Tensor data = p.detach();  // the same memory, outside autograd
    dist::broadcast(data, /*src=*/0);
  }
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.1));

  for (int step = 0; step < steps; ++step) {
    opt.zero_grad();
    at::Tensor loss = torch::mse_loss(model->forward(x), y);
    loss.backward();
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : params) grads.push_back(p.grad());
    dist::all_reduce_coalesced(grads, {.op = dist::ReduceOp::AVG});
    opt.step();
    at::Tensor mean_loss = loss.detach().clone();
    dist::all_reduce(mean_loss, {.op = dist::ReduceOp::AVG});
    if (rank == 0 && (step % 5 == 0 || step == steps - 1)) {
      std::printf("  step %2d  loss %.5f\n", step, mean_loss.item<double>());
    }
  }

  // Every replica must hold the same parameters.
  double checksum = 0;
  for (const at::Tensor& p : params) checksum += p.sum().item<double>();
  std::vector<double> sums;
  dist::all_gather_object(sums, checksum);
  bool equal = true;
  for (double s : sums) equal = equal && s == sums[0];
  if (rank == 0) {
    std::printf("  replicas after %d steps: %s\n", steps,
                equal ? "identical on every rank" : "DIFFERENT");
  }
  dist::destroy_process_group();
  return equal ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    int rank = -1, world = 4, steps = 30;
    std::string init, transport = "auto";
    for (int i = 1; i + 1 < argc; i += 2) {
      const std::string k = argv[i];
      if (k == "--rank") {
        rank = std::atoi(distrpc_examples::rank_text(argv[i + 1]).c_str());
      } else if (k == "--world") {
        world = std::atoi(argv[i + 1]);
      } else if (k == "--steps") {
        steps = std::atoi(argv[i + 1]);
      } else if (k == "--init") {
        init = argv[i + 1];
      } else if (k == "--transport") {
        transport = argv[i + 1];
      } else {
        throw std::invalid_argument("unknown argument '" + k +
                                    "' (expected --world N, --steps N, --transport shm|tcp|auto)");
      }
    }
    if (world < 1 || world > 64) throw std::invalid_argument("--world must be within 1..64");
    if (steps < 1) throw std::invalid_argument("--steps must be at least 1");
    if (rank >= 0) return worker(rank, world, steps, init, transport);
    const bool ok =
        distrpc_examples::run_local_group(world, "data_parallel", [&](const std::string&) {
          return std::vector<std::string>{"--world",     std::to_string(world),
                                          "--steps",     std::to_string(steps),
                                          "--transport", transport};
        });
    std::printf(ok ? "data_parallel: %d ranks done\n" : "data_parallel: a rank FAILED (%d ranks)\n",
                world);
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "data_parallel: %s\n", e.what());
    return 1;
  }
}
