// DistributedDataParallel together with RPC, after pytorch/examples distributed/rpc/ddp_rpc, on the
// CPU. Four local processes (re-executing this binary):
//   ps        (rank 3) holds the sparse part: an EmbeddingBag (100 x 16, mode sum), built there
//             as a RemoteModule by the master
//   master    (rank 2) creates that RemoteModule, hands it to both trainers, waits for them
//   trainer0, trainer1 (ranks 0, 1) each hold the dense part, a Linear(16, 8) replicated with
//             DistributedDataParallel over a process group of the two trainers, and train the
//             hybrid model: embedding lookup over RPC on ps, the Linear locally
// Every step runs in a distributed-autograd context: dist_autograd::backward sends the embedding's
// gradient to ps while DDP averages the Linear's gradients between the trainers, and a
// DistributedOptimizer (SGD, lr 0.05) over the remote embedding parameters and the local DDP
// parameters updates both. trainer0 prints the loss of each epoch (the mean over both trainers);
// at the end the trainers' Linear weights must be identical and the loss must have fallen.
//
//   build/examples/ddp_rpc [--epochs 20] [--timeout 300]
//
// Where it differs from the Python example: PyTorch's master runs each trainer's whole training
// inside its rpc_async (an RPC handler on the trainer); here the master's RPC only delivers the
// RemoteModule and each trainer trains on its main thread, which is where DistributedDataParallel
// must run (a backward driven from an RPC handler is not supported by it), and which keeps the
// trainers' RPC threads free to serve the distributed backward. Each trainer's 10 batches of
// random bags and labels are drawn once and reused every epoch (PyTorch draws new ones each
// epoch), so the loss has something to learn and must fall.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "distrpc/ddp.hpp"
#include "distrpc/dist.hpp"
#include "distrpc/dist/distrpc_backend.hpp"
#include "distrpc/dist_autograd.hpp"
#include "distrpc/dist_optim.hpp"
#include "distrpc/distrpc.hpp"
#include "distrpc/nn/remote_module.hpp"
#include "distrpc/transport/tcp.hpp"
#include "spawn_self.hpp"

namespace {

namespace dist = distrpc::dist;

constexpr int kNumEmbeddings = 100;
constexpr int kEmbeddingDim = 16;
constexpr int kClasses = 8;
constexpr int kBatchesPerEpoch = 10;
constexpr int kWorld = 4;  // 2 trainers, the master, the parameter server
constexpr int kMaster = 2;
constexpr int kPs = 3;

// What the trainers know of the sparse part: its forward.
struct EmbeddingBagInterface {
  at::Tensor forward(at::Tensor indices, at::Tensor offsets);
};

// Built on the parameter server: PyTorch's nn.EmbeddingBag(NUM_EMBEDDINGS, EMBEDDING_DIM,
// mode="sum").
struct EmbeddingBagTable : torch::nn::Module {
  EmbeddingBagTable(int num, int dim)
      : bag(register_module(
            "bag",
            torch::nn::EmbeddingBag(torch::nn::EmbeddingBagOptions(num, dim).mode(torch::kSum)))) {}
  at::Tensor forward(const at::Tensor& indices, const at::Tensor& offsets) {
    return bag->forward(indices, offsets);
  }
  torch::nn::EmbeddingBag bag;
};

using RemoteEmbedding = distrpc::nn::RemoteModule<EmbeddingBagInterface>;

// ---- What the RPC handlers hand to the main threads (they only store and notify, so no RPC
// thread is held for longer than that).

struct Mailbox {
  std::mutex mu;
  std::condition_variable cv;
  std::optional<RemoteEmbedding> embedding;  // on a trainer: from the master
  std::vector<std::string> reports;          // on the master: one per trainer
  int failed = 0;                            // on the master: trainers that failed
};

Mailbox& mailbox() {
  static Mailbox m;
  return m;
}

// Runs on a trainer, called by the master.
void receive_embedding(RemoteEmbedding emb) {
  Mailbox& m = mailbox();
  {
    std::lock_guard<std::mutex> lk(m.mu);
    m.embedding = std::move(emb);
  }
  m.cv.notify_all();
}

// Runs on the master, called by each trainer when it is done.
void report_done(int trainer, double first_loss, double last_loss, bool ok) {
  char line[160];
  std::snprintf(line, sizeof line, "trainer%d done: loss %.4f -> %.4f, %s", trainer, first_loss,
                last_loss, ok ? "ok" : "FAILED");
  Mailbox& m = mailbox();
  {
    std::lock_guard<std::mutex> lk(m.mu);
    m.reports.emplace_back(line);
    if (!ok) ++m.failed;
  }
  m.cv.notify_all();
}

// ---- The trainer.

// PyTorch's HybridModel: the sparse part remote, the dense part replicated with DDP.
struct HybridModel {
  explicit HybridModel(RemoteEmbedding emb)
      : remote_emb_module(std::move(emb)), fc(torch::nn::Linear(kEmbeddingDim, kClasses)) {}

  at::Tensor forward(const at::Tensor& indices, const at::Tensor& offsets) {
    const at::Tensor emb_lookup = remote_emb_module.forward(indices, offsets);  // over RPC
    return fc(emb_lookup);                                                      // local, DDP
  }

  RemoteEmbedding remote_emb_module;
  distrpc::nn::DistributedDataParallel<torch::nn::LinearImpl> fc;
};

struct Batch {
  at::Tensor indices;
  at::Tensor offsets;
  at::Tensor target;
};

// PyTorch's get_next_batch: bags of 1..10 indices, 20..50 indices in all, a random label per bag.
std::vector<Batch> make_batches(int rank) {
  std::mt19937 rng(static_cast<unsigned>(100 + rank));
  torch::manual_seed(100 + rank);
  std::vector<Batch> out;
  for (int i = 0; i < kBatchesPerEpoch; ++i) {
    const std::int64_t num_indices = std::uniform_int_distribution<std::int64_t>(20, 50)(rng);
    at::Tensor indices = torch::randint(0, kNumEmbeddings, {num_indices}, torch::kLong);
    std::vector<std::int64_t> offsets;
    for (std::int64_t start = 0; start < num_indices;
         start += std::uniform_int_distribution<std::int64_t>(1, 10)(rng)) {
      offsets.push_back(start);
    }
    at::Tensor offsets_tensor = torch::tensor(offsets, torch::kLong);
    at::Tensor target =
        torch::randint(0, kClasses, {static_cast<std::int64_t>(offsets.size())}, torch::kLong);
    out.push_back({indices, offsets_tensor, target});
  }
  return out;
}

RemoteEmbedding wait_for_embedding(std::chrono::seconds limit) {
  Mailbox& m = mailbox();
  std::unique_lock<std::mutex> lk(m.mu);
  if (!m.cv.wait_for(lk, limit, [&] { return m.embedding.has_value(); })) {
    throw std::runtime_error("no RemoteModule from the master within " +
                             std::to_string(limit.count()) + " s");
  }
  RemoteEmbedding emb = std::move(*m.embedding);
  m.embedding.reset();
  return emb;
}

double checksum(const torch::nn::Module& m) {
  double s = 0;
  for (const at::Tensor& p : m.parameters()) {
    const at::Tensor d = p.detach().to(at::kDouble);
    s += d.sum().item<double>() + d.pow(2).sum().item<double>();
  }
  return s;
}

int run_trainer(int rank, int epochs, std::chrono::seconds limit) {
  double first = 0;
  double last = 0;
  bool equal = false;
  {
    torch::manual_seed(rank);  // different starts: DDP's construction copies trainer0's Linear
    HybridModel model(wait_for_embedding(limit));

    // The embedding table's parameters as RRefs owned by ps, the Linear's as local RRefs.
    std::vector<distrpc::RRef<at::Tensor>> params = model.remote_emb_module.remote_parameters();
    for (const at::Tensor& p : model.fc.module()->parameters()) params.emplace_back(p);
    distrpc::optim::DistributedOptimizer<torch::optim::SGD> opt(params,
                                                                torch::optim::SGDOptions(0.05));

    const std::vector<Batch> batches = make_batches(rank);
    for (int epoch = 0; epoch < epochs; ++epoch) {
      double loss_sum = 0;
      for (const Batch& b : batches) {
        // Gradients live in the context: nothing to zero between steps.
        distrpc::dist_autograd::Context ctx;
        const at::Tensor output = model.forward(b.indices, b.offsets);
        const at::Tensor loss = torch::nn::functional::cross_entropy(output, b.target);
        distrpc::dist_autograd::backward(ctx.id(), {loss});
        opt.step(ctx.id());
        loss_sum += loss.item<double>();
      }
      at::Tensor mean = torch::tensor({loss_sum / kBatchesPerEpoch}, at::kDouble);
      dist::all_reduce(mean, {.op = dist::ReduceOp::AVG});  // over the two trainers
      last = mean.item<double>();
      if (epoch == 0) first = last;
      if (rank == 0) std::printf("epoch %3d  loss %.4f\n", epoch, last);
    }

    std::vector<double> sums;
    dist::all_gather_object(sums, checksum(*model.fc.module()));
    equal = sums.size() == 2 && sums[0] == sums[1];
    if (rank == 0) {
      std::printf("DDP Linear on the trainers: %s (checksums %.17g, %.17g)\n",
                  equal ? "identical" : "DIFFERENT", sums.at(0), sums.at(1));
    }
  }
  const bool ok = equal && last < first;
  distrpc::rpc_sync<&report_done>("master", rank, first, last, ok);
  return ok ? 0 : 1;
}

int run_master(std::chrono::seconds limit) {
  Mailbox& m = mailbox();
  {
    const RemoteEmbedding emb =
        RemoteEmbedding::create<EmbeddingBagTable>("ps/cpu", kNumEmbeddings, kEmbeddingDim);
    for (int t = 0; t < 2; ++t) {
      distrpc::rpc_sync<&receive_embedding>("trainer" + std::to_string(t), emb);
    }
    std::unique_lock<std::mutex> lk(m.mu);
    if (!m.cv.wait_for(lk, limit, [&] { return m.reports.size() == 2; })) {
      throw std::runtime_error("the trainers did not finish within " +
                               std::to_string(limit.count()) + " s");
    }
  }
  for (const std::string& r : m.reports) std::printf("%s\n", r.c_str());
  return m.failed == 0 ? 0 : 1;
}

struct Args {
  int epochs = 20;
  int timeout_s = 300;
  int rank = -1;  // -1: the launcher
  std::string init;
  std::string pg_init;
};

int run_worker(const Args& a) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // epochs appear as they finish
  at::set_num_threads(1);
  const std::chrono::seconds limit(a.timeout_s);
  const bool trainer = a.rank < kMaster;
  if (trainer) {
    // The trainers' own process group, for DDP (PyTorch's example uses gloo here).
    dist::register_distrpc_backend<distrpc::transport::Tcp>();
    dist::init_process_group("distrpc", a.pg_init, a.rank, 2);
  }
  const std::string name = trainer             ? "trainer" + std::to_string(a.rank)
                           : a.rank == kMaster ? std::string("master")
                                               : std::string("ps");
  distrpc::RpcBackendOptions opts;
  opts.init_method = a.init;
  distrpc::init_rpc<distrpc::transport::Tcp>(name, a.rank, kWorld, opts);
  int rc = 0;
  if (trainer) {
    rc = run_trainer(a.rank, a.epochs, limit);
  } else if (a.rank == kMaster) {
    rc = run_master(limit);
  }
  // The parameter server only serves; the graceful shutdown waits for everyone's calls.
  distrpc::shutdown();
  if (trainer) dist::destroy_process_group();
  return rc;
}

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
    if (k == "--epochs") {
      a.epochs = int_arg(k, next());
    } else if (k == "--timeout") {
      a.timeout_s = int_arg(k, next());
    } else if (k == "--rank") {
      a.rank = int_arg(k, distrpc_examples::rank_text(next()));
    } else if (k == "--init") {
      a.init = next();
    } else if (k == "--pg-init") {
      a.pg_init = next();
    } else {
      throw std::invalid_argument("unknown argument '" + k +
                                  "' (expected --epochs N, --timeout SECONDS)");
    }
  }
  if (a.epochs < 2 || a.epochs > 10000) {
    throw std::invalid_argument(
        "--epochs must be 2..10000 (the loss must fall between the "
        "first and the last), got " +
        std::to_string(a.epochs));
  }
  if (a.timeout_s < 1) {
    throw std::invalid_argument("--timeout must be at least 1 second, got " +
                                std::to_string(a.timeout_s));
  }
  if (a.rank >= kWorld) {
    throw std::invalid_argument("--rank must be 0..3, got " + std::to_string(a.rank));
  }
  return a;
}

int launch(const Args& a) {
  const bool ok = distrpc_examples::run_local_group(
      kWorld, "ddp_rpc",
      [&](const std::string& dir) {
        return std::vector<std::string>{"--epochs",  std::to_string(a.epochs),
                                        "--timeout", std::to_string(a.timeout_s),
                                        "--pg-init", "file://" + dir + "/trainers"};
      },
      {}, std::chrono::seconds(a.timeout_s));
  std::printf(ok ? "ddp_rpc: done, clean shutdown\n" : "ddp_rpc: FAILED\n");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse(argc, argv);
    return a.rank < 0 ? launch(a) : run_worker(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_rpc: %s\n", e.what());
    return 2;
  }
}
