// A model split over two workers: worker0 runs the feature extractor itself and sends the
// features to the classifier head, a RemoteModule that lives on worker1. worker0 runs inference
// batches one at a time, then pipelined (forward_async: the next batch's local part runs while
// the previous batch is on worker1), prints the throughput of both, and checks the split model
// against a local copy of the head built from remote_parameters().
//
//   build/examples/remote_module [--batches 200] [--batch 32] [--inflight 4]
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "distrpc/distrpc.hpp"
#include "distrpc/nn/remote_module.hpp"
#include "distrpc/transport/tcp.hpp"
#include "spawn_self.hpp"

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kInputs = 32;
constexpr int kFeatures = 64;
constexpr int kHidden = 128;
constexpr int kClasses = 10;

// What worker0 knows of the head: its forward, nothing else.
struct HeadInterface {
  at::Tensor forward(at::Tensor features);
};

// The head, built on worker1. In eval() mode it records no autograd graph (inference).
struct Head : torch::nn::Module {
  Head(int features, int hidden, int classes)
      : fc1(register_module("fc1", torch::nn::Linear(features, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, classes))) {}
  at::Tensor forward(const at::Tensor& x) {
    std::optional<torch::NoGradGuard> inference;
    if (!is_training()) inference.emplace();
    return torch::log_softmax(fc2->forward(torch::relu(fc1->forward(x))), 1);
  }
  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
};

struct Args {
  int rank = -1;
  std::string init;
  int batches = 200;
  int batch = 32;
  int inflight = 4;
};

int run_worker(const Args& a) {
  distrpc::RpcBackendOptions opts;
  opts.init_method = a.init;
  distrpc::init_rpc<distrpc::transport::Tcp>("worker" + std::to_string(a.rank), a.rank, 2, opts);
  int rc = 0;
  if (a.rank == 0) {
    torch::NoGradGuard no_grad;
    torch::manual_seed(0);
    torch::nn::Sequential features(torch::nn::Linear(kInputs, kFeatures), torch::nn::ReLU());
    auto head = distrpc::nn::RemoteModule<HeadInterface>::create<Head>("worker1/cpu", kFeatures,
                                                                       kHidden, kClasses);
    head.eval();
    std::vector<at::Tensor> inputs;
    for (int i = 0; i < a.batches; ++i) inputs.push_back(torch::randn({a.batch, kInputs}));

    // One batch at a time: local part, then the remote part, then the next batch.
    std::vector<at::Tensor> outputs;
    std::vector<double> latency_us;
    auto t0 = Clock::now();
    for (const auto& x : inputs) {
      const auto b0 = Clock::now();
      outputs.push_back(head.forward(features->forward(x)));
      latency_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - b0).count());
    }
    const double sequential_s = std::chrono::duration<double>(Clock::now() - t0).count();
    std::sort(latency_us.begin(), latency_us.end());

    // Pipelined: up to `inflight` batches on worker1 while worker0 prepares the next ones.
    std::deque<distrpc::Future<at::Tensor>> pending;
    std::vector<at::Tensor> pipelined;
    t0 = Clock::now();
    for (const auto& x : inputs) {
      pending.push_back(head.forward_async(features->forward(x)));
      if (static_cast<int>(pending.size()) >= a.inflight) {
        pipelined.push_back(pending.front().value());
        pending.pop_front();
      }
    }
    for (auto& f : pending) pipelined.push_back(f.value());
    const double pipelined_s = std::chrono::duration<double>(Clock::now() - t0).count();

    // The same head computed here from its remote parameters (fc1.weight, fc1.bias, fc2.weight,
    // fc2.bias, in registration order) must give the same answers.
    std::vector<at::Tensor> p;
    for (auto& r : head.remote_parameters()) p.push_back(r.to_here());
    bool same = p.size() == 4;
    for (std::size_t i = 0; same && i < inputs.size(); ++i) {
      const at::Tensor f = features->forward(inputs[i]);
      const at::Tensor local = torch::log_softmax(
          torch::linear(torch::relu(torch::linear(f, p[0], p[1])), p[2], p[3]), 1);
      same =
          torch::allclose(outputs[i], local, 1e-5, 1e-6) && torch::equal(outputs[i], pipelined[i]);
    }
    const double samples = static_cast<double>(a.batches) * a.batch;
    std::printf("split model: %d -> %d local (worker0), %d -> %d -> %d remote (worker1)\n", kInputs,
                kFeatures, kFeatures, kHidden, kClasses);
    std::printf("  one at a time: %7.0f batches/s %9.0f samples/s  (median %.0f us per batch)\n",
                a.batches / sequential_s, samples / sequential_s,
                latency_us[latency_us.size() / 2]);
    std::printf("  %d in flight:   %7.0f batches/s %9.0f samples/s\n", a.inflight,
                a.batches / pipelined_s, samples / pipelined_s);
    std::printf("  outputs equal to a local copy of the head: %s\n", same ? "yes" : "NO");
    rc = same ? 0 : 1;
  }
  distrpc::shutdown();
  return rc;
}

int launch(const Args& a) {
  const int rc = distrpc_examples::run_local_group(2, "rm",
                                                   [&](const std::string&) {
                                                     return std::vector<std::string>{
                                                         "--batches",  std::to_string(a.batches),
                                                         "--batch",    std::to_string(a.batch),
                                                         "--inflight", std::to_string(a.inflight)};
                                                   })
                     ? 0
                     : 1;
  std::printf(rc == 0 ? "remote_module: done, clean shutdown\n" : "remote_module: FAILED\n");
  return rc;
}

int to_int(const std::string& key, const char* v, int lo, int hi) {
  const int n = std::atoi(v);
  if (n < lo || n > hi) {
    throw std::invalid_argument(key + " must be within " + std::to_string(lo) + ".." +
                                std::to_string(hi) + ", got '" + v + "'");
  }
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Args a;
    for (int i = 1; i < argc; i += 2) {
      const std::string k = argv[i];
      if (i + 1 >= argc) throw std::invalid_argument("missing value after " + k);
      if (k == "--rank") {
        a.rank = to_int(k, distrpc_examples::rank_text(argv[i + 1]).c_str(), 0, 1);
      } else if (k == "--init") {
        a.init = argv[i + 1];
      } else if (k == "--batches") {
        a.batches = to_int(k, argv[i + 1], 1, 1000000);
      } else if (k == "--batch") {
        a.batch = to_int(k, argv[i + 1], 1, 65536);
      } else if (k == "--inflight") {
        a.inflight = to_int(k, argv[i + 1], 1, 1024);
      } else {
        throw std::invalid_argument("unknown argument '" + k +
                                    "' (expected --batches N, --batch N, --inflight N)");
      }
    }
    return a.rank < 0 ? launch(a) : run_worker(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "remote_module: %s\n", e.what());
    return 1;
  }
}
