// A parameter server over RRefs: worker0 owns the model; 3 trainers (worker1..3) each fit the same
// linear model on their own data shard. Every iteration a trainer pushes its gradient through the
// RRef's proxy to ParameterServer::average, an asynchronous method (it returns a Future): the
// server holds the replies until all 3 gradients of that iteration arrived, applies their mean,
// and answers everyone with the new weights. No server thread is blocked while replies are held.
//
//   build/examples/parameter_server [--iterations 20]
//
// Prints the mean training loss per iteration; it decreases.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "distrpc/distrpc.hpp"
#include "distrpc/transport/tcp.hpp"
#include "spawn_self.hpp"

namespace {

constexpr int kTrainers = 3;
constexpr int kFeatures = 8;

class ParameterServer {
 public:
  ParameterServer() : weights_(torch::zeros({kFeatures, 1})) {}

  at::Tensor weights() {
    std::lock_guard<std::mutex> lk(mu_);
    return weights_.clone();
  }

  // Holds each trainer's reply until all kTrainers gradients of `iteration` arrived, then steps
  // the model with their mean and answers every trainer with the new weights.
  distrpc::Future<at::Tensor> average(int iteration, at::Tensor grad, double loss) {
    distrpc::Future<at::Tensor> reply;
    std::vector<distrpc::Future<at::Tensor>> ready;
    at::Tensor updated;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (iteration != iteration_) {
        throw std::invalid_argument("gradient for iteration " + std::to_string(iteration) +
                                    " while the server is at iteration " +
                                    std::to_string(iteration_));
      }
      waiting_.push_back(reply);
      sum_ = sum_.defined() ? sum_ + grad : grad.clone();
      loss_sum_ += loss;
      if (static_cast<int>(waiting_.size()) == kTrainers) {
        weights_ -= 0.1 * sum_ / kTrainers;
        losses_.push_back(loss_sum_ / kTrainers);
        std::printf("iteration %2d  mean loss %.5f\n", iteration_, losses_.back());
        std::fflush(stdout);
        updated = weights_.clone();
        ready.swap(waiting_);
        sum_ = at::Tensor();
        loss_sum_ = 0;
        ++iteration_;
      }
    }
    for (auto& f : ready) f.set_value(updated);  // the held replies go out, outside the lock
    return reply;
  }

  std::vector<double> losses() {
    std::lock_guard<std::mutex> lk(mu_);
    return losses_;
  }

 private:
  std::mutex mu_;
  at::Tensor weights_;
  at::Tensor sum_;
  double loss_sum_ = 0;
  int iteration_ = 0;
  std::vector<distrpc::Future<at::Tensor>> waiting_;
  std::vector<double> losses_;
};

// Runs on a trainer (called by worker0 with the server's RRef): its shard of y = X w* + noise.
int train(distrpc::RRef<ParameterServer> ps, int iterations) {
  const int rank = distrpc::get_worker_info().id;
  torch::manual_seed(1234);  // every trainer agrees on w*
  const at::Tensor w_true = torch::randn({kFeatures, 1});
  torch::manual_seed(rank);
  const at::Tensor x = torch::randn({64, kFeatures});
  const at::Tensor y = x.mm(w_true) + 0.01 * torch::randn({64, 1});
  at::Tensor w = ps.rpc_sync<&ParameterServer::weights>();
  for (int it = 0; it < iterations; ++it) {
    const at::Tensor err = x.mm(w) - y;
    const double loss = err.pow(2).mean().item<double>();
    const at::Tensor grad = 2.0 * x.t().mm(err) / x.size(0);
    w = ps.rpc_async<&ParameterServer::average>(it, grad, loss).value();
  }
  return iterations;
}

int worker(int rank, int world, int iterations, const std::string& init) {
  distrpc::RpcBackendOptions opts;
  opts.init_method = init;
  distrpc::init_rpc<distrpc::transport::Tcp>("worker" + std::to_string(rank), rank, world, opts);
  int rc = 0;
  if (rank == 0) {
    auto ps = distrpc::RRef<ParameterServer>::make();
    std::vector<distrpc::Future<int>> trainers;
    for (int t = 1; t < world; ++t) {
      trainers.push_back(distrpc::rpc_async<&train>(t, ps, iterations));
    }
    distrpc::wait_all(trainers);
    const auto losses = ps.local_value().losses();
    const bool decreased =
        losses.size() == static_cast<std::size_t>(iterations) && losses.back() < losses.front();
    std::printf("loss %.5f -> %.5f over %d iterations: %s\n", losses.front(), losses.back(),
                iterations, decreased ? "decreasing" : "NOT DECREASING");
    auto info = distrpc::get_debug_info();
    std::printf("server RRef bookkeeping: num_owner_rrefs=%s num_forks=%s\n",
                info.at("num_owner_rrefs").c_str(), info.at("num_forks").c_str());
    rc = decreased ? 0 : 1;
  }
  distrpc::shutdown();
  return rc;
}

int launch(int iterations) {
  const int world = kTrainers + 1;
  const int rc = distrpc_examples::run_local_group(
                     world, "ps",
                     [&](const std::string&) {
                       return std::vector<std::string>{"--world", std::to_string(world),
                                                       "--iterations", std::to_string(iterations)};
                     })
                     ? 0
                     : 1;
  std::printf(rc == 0 ? "parameter_server: 1 server and %d trainers done, clean shutdown\n"
                      : "parameter_server: FAILED (%d trainers)\n",
              kTrainers);
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    int rank = -1, world = kTrainers + 1, iterations = 20;
    std::string init;
    for (int i = 1; i + 1 < argc; i += 2) {
      const std::string k = argv[i];
      if (k == "--rank") {
        rank = std::atoi(distrpc_examples::rank_text(argv[i + 1]).c_str());
      } else if (k == "--world") {
        world = std::atoi(argv[i + 1]);
      } else if (k == "--iterations") {
        iterations = std::atoi(argv[i + 1]);
      } else if (k == "--init") {
        init = argv[i + 1];
      } else {
        throw std::invalid_argument("unknown argument '" + k + "' (expected --iterations N)");
      }
    }
    if (iterations < 2 || iterations > 10000) {
      throw std::invalid_argument("--iterations must be within 2..10000");
    }
    return rank < 0 ? launch(iterations) : worker(rank, world, iterations, init);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "parameter_server: %s\n", e.what());
    return 1;
  }
}
