// Data-parallel training with distrpc::nn::DistributedDataParallel: --world local processes
// (re-executing this binary) each hold a replica of a small classifier and train it on their own
// shard of a synthetic data set (every world-th sample, as PyTorch's DistributedSampler deals
// them). DDP averages the gradients during each backward pass, so the replicas take the same
// steps; rank 0 prints the loss of each epoch (the mean over every rank's batches), and at the end
// every rank's checksum of its weights is gathered (all_gather_object): the run fails unless they
// are all the same.
//
//   build/examples/ddp_train [--world 2] [--epochs 5] [--backend distrpc|gloo]
//                            [--transport shm|tcp|auto] [--timeout 300]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "distrpc/ddp.hpp"
#include "distrpc/dist.hpp"
#include "distrpc/dist/distrpc_backend.hpp"
#include "distrpc/transport/tcp.hpp"
#if __has_include("distrpc/transport/shm.hpp")
#include "distrpc/transport/auto.hpp"
#include "distrpc/transport/shm.hpp"
#define DDP_TRAIN_HAVE_SHM 1
#endif
#ifdef USE_C10D_GLOO
#include "distrpc/dist/gloo_backend.hpp"
#endif
#include "spawn_self.hpp"

namespace {

namespace dist = distrpc::dist;

constexpr int kSamples = 2048;  // the whole data set, dealt over the ranks
constexpr int kFeatures = 8;
constexpr int kClasses = 4;
constexpr int kBatch = 32;  // per rank

struct Args {
  int world = 2;
  int epochs = 5;
  std::string backend = "distrpc";
  std::string transport = "auto";
  int timeout_s = 300;
  int rank = -1;  // -1: the launcher
  std::string init;
};

int int_arg(const std::string& flag, const std::string& v) {
  std::size_t used = 0;
  int n = 0;
  try {
    n = std::stoi(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != v.size() || v.empty()) {
    throw std::invalid_argument(flag + " needs a whole number, got '" + v + "'");
  }
  return n;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument("missing value after " + k);
      return argv[++i];
    };
    if (k == "--world") {
      a.world = int_arg(k, next());
    } else if (k == "--epochs") {
      a.epochs = int_arg(k, next());
    } else if (k == "--backend") {
      a.backend = next();
    } else if (k == "--transport") {
      a.transport = next();
    } else if (k == "--timeout") {
      a.timeout_s = int_arg(k, next());
    } else if (k == "--rank") {
      a.rank = int_arg(k, distrpc_examples::rank_text(next()));
    } else if (k == "--init") {
      a.init = next();
    } else {
      throw std::invalid_argument("unknown argument '" + k +
                                  "' (expected --world 2..4, --epochs N, --backend distrpc|gloo, "
                                  "--transport shm|tcp|auto, --timeout SECONDS)");
    }
  }
  if (a.world < 2 || a.world > 4) {
    throw std::invalid_argument("--world must be 2..4, got " + std::to_string(a.world));
  }
  if (a.epochs < 1 || a.epochs > 10000) {
    throw std::invalid_argument("--epochs must be 1..10000, got " + std::to_string(a.epochs));
  }
  if (a.timeout_s < 1) {
    throw std::invalid_argument("--timeout must be at least 1 second, got " +
                                std::to_string(a.timeout_s));
  }
#ifdef USE_C10D_GLOO
  const bool backend_ok = a.backend == "distrpc" || a.backend == "gloo";
  const char* backends = "distrpc, gloo";
#else
  const bool backend_ok = a.backend == "distrpc";
  const char* backends = "distrpc";
#endif
  if (!backend_ok) {
    throw std::invalid_argument("unknown backend '" + a.backend + "': this build has: " + backends);
  }
#ifdef DDP_TRAIN_HAVE_SHM
  const bool transport_ok = a.transport == "shm" || a.transport == "tcp" || a.transport == "auto";
  const char* transports = "shm, tcp, auto";
#else
  const bool transport_ok = a.transport == "tcp";
  const char* transports = "tcp";
#endif
  if (!transport_ok) {
    throw std::invalid_argument("unknown transport '" + a.transport +
                                "': this build has: " + transports);
  }
  return a;
}

void register_backends(const Args& a) {
  using namespace distrpc::transport;
#ifdef DDP_TRAIN_HAVE_SHM
  if (a.transport == "shm") {
    dist::register_distrpc_backend<Shm>();
  } else if (a.transport == "auto") {
    dist::register_distrpc_backend<Auto<Shm, Tcp>>();
  } else
#endif
  {
    dist::register_distrpc_backend<Tcp>();
  }
#ifdef USE_C10D_GLOO
  dist::register_gloo_backend();
#endif
}

// The task: 4 Gaussian clusters in 8 dimensions, one per class, with overlap. Every rank draws
// the same data set (same seed) and keeps its share.
struct Shard {
  at::Tensor x;  // [n, kFeatures]
  at::Tensor y;  // [n]
};

Shard make_shard(int rank, int world) {
  torch::manual_seed(1234);
  const at::Tensor centers = 2.0 * torch::randn({kClasses, kFeatures});
  const at::Tensor y = torch::randint(0, kClasses, {kSamples}, torch::kLong);
  const at::Tensor x = centers.index_select(0, y) + torch::randn({kSamples, kFeatures});
  const at::Tensor mine = torch::arange(rank, kSamples, world, torch::kLong);
  return {x.index_select(0, mine), y.index_select(0, mine)};
}

// Every parameter's sum and sum of squares: a replica that took one different step differs here.
double checksum(const torch::nn::Module& m) {
  double s = 0;
  for (const at::Tensor& p : m.parameters()) {
    const at::Tensor d = p.detach().to(at::kDouble);
    s += d.sum().item<double>() + d.pow(2).sum().item<double>();
  }
  return s;
}

int run_worker(const Args& a) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // epochs appear as they finish
  at::set_num_threads(1);
  register_backends(a);
  dist::init_process_group(a.backend, a.init, a.rank, a.world);
  const Shard data = make_shard(a.rank, a.world);

  // The replicas start different on purpose: DDP's construction copies rank 0's weights.
  torch::manual_seed(a.rank);
  torch::nn::Sequential model(torch::nn::Linear(kFeatures, 64), torch::nn::ReLU(),
                              torch::nn::Linear(64, 64), torch::nn::ReLU(),
                              torch::nn::Linear(64, kClasses));
  distrpc::nn::DistributedDataParallel ddp(model);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  if (a.rank == 0) {
    const auto st = ddp.stats();
    std::printf("%d ranks, %lld samples each, %zu gradient bucket(s)\n", a.world,
                static_cast<long long>(data.x.size(0)), st.bucket_count);
  }

  // Every rank runs the same number of batches, counted from the smallest shard: DDP needs the
  // same backward passes on every rank.
  const std::int64_t batches = (kSamples / a.world) / kBatch;
  double first = 0;
  double last = 0;
  for (int epoch = 0; epoch < a.epochs; ++epoch) {
    torch::manual_seed(10000 * epoch + a.rank);  // each rank shuffles its own shard
    const at::Tensor order = torch::randperm(data.x.size(0), torch::kLong);
    double loss_sum = 0;
    std::int64_t correct = 0;
    for (std::int64_t b = 0; b < batches; ++b) {
      const at::Tensor idx = order.slice(0, b * kBatch, (b + 1) * kBatch);
      const at::Tensor xb = data.x.index_select(0, idx);
      const at::Tensor yb = data.y.index_select(0, idx);
      opt.zero_grad();
      const at::Tensor logits = ddp(xb);
      const at::Tensor loss = torch::nn::functional::cross_entropy(logits, yb);
      loss.backward();  // the gradients are averaged over the ranks here
      opt.step();
      loss_sum += loss.item<double>();
      correct += logits.argmax(1).eq(yb).sum().item<std::int64_t>();
    }
    // The epoch's figures over every rank: one all-reduce of [loss sum, correct].
    at::Tensor totals = torch::tensor({loss_sum, static_cast<double>(correct)}, at::kDouble);
    dist::all_reduce(totals);
    const double mean_loss = totals[0].item<double>() / static_cast<double>(batches * a.world);
    const double accuracy =
        totals[1].item<double>() / static_cast<double>(batches * kBatch * a.world);
    if (epoch == 0) first = mean_loss;
    last = mean_loss;
    if (a.rank == 0) {
      std::printf("epoch %3d  loss %.4f  accuracy %.3f\n", epoch, mean_loss, accuracy);
    }
  }

  // Every replica must hold the same weights.
  std::vector<double> sums;
  dist::all_gather_object(sums, checksum(*model));
  const bool equal = std::all_of(sums.begin(), sums.end(), [&](double s) { return s == sums[0]; });
  if (a.rank == 0) {
    std::printf("loss %.4f -> %.4f over %d epoch(s)\n", first, last, a.epochs);
    for (std::size_t r = 0; r < sums.size(); ++r) {
      std::printf("rank %zu weights checksum %.17g\n", r, sums[r]);
    }
    std::printf("replicas: %s\n", equal ? "identical on every rank" : "DIFFERENT");
  }
  dist::destroy_process_group();
  return equal ? 0 : 1;
}

int launch(const Args& a) {
  const bool ok = distrpc_examples::run_local_group(
      a.world, "ddp_train",
      [&](const std::string&) {
        return std::vector<std::string>{"--world",     std::to_string(a.world),
                                        "--epochs",    std::to_string(a.epochs),
                                        "--backend",   a.backend,
                                        "--transport", a.transport,
                                        "--timeout",   std::to_string(a.timeout_s)};
      },
      {}, std::chrono::seconds(a.timeout_s));
  std::printf(ok ? "ddp_train: %d ranks done\n" : "ddp_train: FAILED (%d ranks)\n", a.world);
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse(argc, argv);
    return a.rank < 0 ? launch(a) : run_worker(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_train: %s\n", e.what());
    return 2;
  }
}
