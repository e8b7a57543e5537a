// The distributed RNN of pytorch/examples (distributed/rpc/rnn) in C++: the embedding table and the
// decoder live on a parameter server (worker1) as RemoteModules, the LSTM on the trainer
// (worker0). Each iteration runs in a distributed-autograd context: the forward pass crosses
// workers twice, one backward() computes the gradients where the parameters live, and a
// DistributedOptimizer (SGD) updates them there. The trainer prints the loss of each iteration;
// it trains on one fixed batch, so the loss must fall.
//
//   build/examples/rnn [--iterations 40] [--lr 2.0]   (SGD with momentum 0.9)
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "distrpc/dist_autograd.hpp"
#include "distrpc/dist_optim.hpp"
#include "distrpc/distrpc.hpp"
#include "distrpc/nn/remote_module.hpp"
#include "distrpc/transport/tcp.hpp"
#include "spawn_self.hpp"

namespace {

constexpr int kTokens = 10;  // vocabulary
constexpr int kEmbed = 16;   // embedding width
constexpr int kHidden = 32;  // LSTM state
constexpr int kLayers = 2;   // LSTM layers
constexpr int kSeq = 5;      // sequence length
constexpr int kBatch = 4;    // sequences per batch

// What the trainer knows of the two remote parts: their forward, nothing else.
struct EmbeddingInterface {
  at::Tensor forward(at::Tensor tokens);
};
struct DecoderInterface {
  at::Tensor forward(at::Tensor hidden);
};

// Built on the parameter server.
struct EmbeddingTable : torch::nn::Module {
  EmbeddingTable(int tokens, int width)
      : emb(register_module("emb", torch::nn::Embedding(tokens, width))) {
    torch::nn::init::uniform_(emb->weight, -0.1, 0.1);
  }
  at::Tensor forward(const at::Tensor& tokens) { return emb->forward(tokens); }
  torch::nn::Embedding emb;
};
struct Decoder : torch::nn::Module {
  Decoder(int hidden, int tokens) : fc(register_module("fc", torch::nn::Linear(hidden, tokens))) {
    torch::nn::init::uniform_(fc->weight, -0.1, 0.1);
    torch::nn::init::zeros_(fc->bias);
  }
  at::Tensor forward(const at::Tensor& h) { return fc->forward(h); }
  torch::nn::Linear fc;
};

// The model on the trainer: remote embedding -> local LSTM -> remote decoder.
struct RnnModel {
  RnnModel(const std::string& ps)
      : embedding(distrpc::nn::RemoteModule<EmbeddingInterface>::create<EmbeddingTable>(
            ps + "/cpu", kTokens, kEmbed)),
        lstm(torch::nn::LSTMOptions(kEmbed, kHidden).num_layers(kLayers)),
        decoder(distrpc::nn::RemoteModule<DecoderInterface>::create<Decoder>(ps + "/cpu", kHidden,
                                                                             kTokens)) {}

  at::Tensor forward(const at::Tensor& tokens) {
    const at::Tensor emb = embedding.forward(tokens);  // [seq, batch, embed], over RPC
    auto [out, state] = lstm->forward(emb);            // local
    return decoder.forward(out);                       // [seq, batch, tokens], over RPC
  }

  // Every parameter as an RRef: the remote ones owned by the parameter server, the LSTM's by
  // the trainer itself.
  std::vector<distrpc::RRef<at::Tensor>> parameter_rrefs() {
    auto out = embedding.remote_parameters();
    for (auto& p : decoder.remote_parameters()) out.push_back(p);
    for (auto& p : lstm->parameters()) out.emplace_back(p);
    return out;
  }

  distrpc::nn::RemoteModule<EmbeddingInterface> embedding;
  torch::nn::LSTM lstm;
  distrpc::nn::RemoteModule<DecoderInterface> decoder;
};

struct Args {
  int rank = -1;
  std::string init;
  int iterations = 40;
  double lr = 2.0;
};

int run_worker(const Args& a) {
  distrpc::RpcBackendOptions opts;
  opts.init_method = a.init;
  const std::string me = a.rank == 0 ? "trainer" : "ps";
  distrpc::init_rpc<distrpc::transport::Tcp>(me, a.rank, 2, opts);
  int rc = 0;
  if (a.rank == 0) {
    torch::manual_seed(0);
    RnnModel model("ps");
    distrpc::optim::DistributedOptimizer<torch::optim::SGD> opt(
        model.parameter_rrefs(), torch::optim::SGDOptions(a.lr).momentum(0.9));
    // One fixed batch: the next token of each position is the target.
    const at::Tensor data = torch::randint(kTokens, {kSeq + 1, kBatch}, torch::kLong);
    const at::Tensor input = data.slice(0, 0, kSeq);
    const at::Tensor target = data.slice(0, 1, kSeq + 1);
    double first = 0;
    double last = 0;
    for (int it = 0; it < a.iterations; ++it) {
      distrpc::dist_autograd::Context ctx;
      const at::Tensor logits = model.forward(input);
      const at::Tensor loss =
          torch::nn::functional::cross_entropy(logits.reshape({-1, kTokens}), target.reshape(-1));
      distrpc::dist_autograd::backward(ctx.id(), {loss});
      opt.step(ctx.id());
      last = loss.item<double>();
      if (it == 0) first = last;
      std::printf("iteration %2d  loss %.4f\n", it, last);
    }
    const bool fell = last < 0.5 * first;
    std::printf("loss %.4f -> %.4f: %s\n", first, last, fell ? "falls" : "DID NOT FALL");
    rc = fell ? 0 : 1;
  }
  distrpc::shutdown();
  return rc;
}

int launch(const Args& a) {
  const bool ok = distrpc_examples::run_local_group(2, "rnn", [&](const std::string&) {
    return std::vector<std::string>{"--iterations", std::to_string(a.iterations), "--lr",
                                    std::to_string(a.lr)};
  });
  std::printf(ok ? "rnn: done, clean shutdown\n" : "rnn: FAILED\n");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Args a;
    for (int i = 1; i < argc; i += 2) {
      const std::string k = argv[i];
      if (i + 1 >= argc) throw std::invalid_argument("missing value after " + k);
      const std::string v = argv[i + 1];
      if (k == "--rank") {
        a.rank = std::stoi(distrpc_examples::rank_text(argv[i + 1]));
        if (a.rank < 0 || a.rank > 1) throw std::invalid_argument("--rank must be 0 or 1");
      } else if (k == "--init") {
        a.init = v;
      } else if (k == "--iterations") {
        a.iterations = std::stoi(v);
        if (a.iterations < 1 || a.iterations > 100000) {
          throw std::invalid_argument("--iterations must be within 1..100000, got '" + v + "'");
        }
      } else if (k == "--lr") {
        a.lr = std::stod(v);
        if (!(a.lr > 0 && a.lr < 10)) {
          throw std::invalid_argument("--lr must be within (0, 10), got '" + v + "'");
        }
      } else {
        throw std::invalid_argument("unknown argument '" + k +
                                    "' (expected --iterations N, --lr X)");
      }
    }
    return a.rank < 0 ? launch(a) : run_worker(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rnn: %s\n", e.what());
    return 1;
  }
}
