// DistributedDataParallel and its reducer, on 2 ranks (one fresh process each), on the distrpc
// backend and on gloo where it is built in. The oracle of most checks is a plain copy of the model
// on each rank: its local gradients, summed over the ranks with dist::all_reduce and divided by
// the world size, are what the wrapper must leave in `.grad`.
#include <ATen/ATen.h>
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <chrono>
#include <csignal>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <unistd.h>

#include "distrpc/ddp.hpp"
#include "distrpc/dist.hpp"
#include "distrpc/dist/distrpc_backend.hpp"
#include "distrpc/dist_autograd.hpp"
#include "distrpc/rpc.hpp"
#include "distrpc/transport/auto.hpp"
#include "distrpc/transport/shm.hpp"
#include "distrpc/transport/tcp.hpp"
#ifdef USE_C10D_GLOO
#include "distrpc/dist/gloo_backend.hpp"
#endif
#include "multiprocess.hpp"
#include "support/error_text.hpp"

namespace dist = distrpc::dist;
namespace ddp = distrpc::ddp;
using distrpc::nn::DDPOptions;
using distrpc::nn::DistributedDataParallel;
using distrpc::testing::RankContext;

namespace {

using Clock = std::chrono::steady_clock;

void init_group(const RankContext& ctx, const std::string& backend) {
  if (backend == "distrpc" && !dist::is_backend_available("distrpc")) {
    using distrpc::transport::Auto, distrpc::transport::Shm, distrpc::transport::Tcp;
    dist::register_distrpc_backend<Auto<Shm, Tcp>>();
  }
#ifdef USE_C10D_GLOO
  if (backend == "gloo" && !dist::is_backend_available("gloo")) dist::register_gloo_backend();
#endif
  dist::init_process_group(backend, ctx.file_url(), ctx.rank, ctx.world,
                           std::chrono::milliseconds(20000));
}

// The spec's Net: Linear 2->10, ReLU, Linear 10->50, ReLU, Linear 50->4, no bias, softmax.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(torch::nn::LinearOptions(2, 10).bias(false)));
    fc2 = register_module("fc2", torch::nn::Linear(torch::nn::LinearOptions(10, 50).bias(false)));
    fc3 = register_module("fc3", torch::nn::Linear(torch::nn::LinearOptions(50, 4).bias(false)));
  }
  at::Tensor forward(at::Tensor x) {
    x = torch::relu(fc1(x));
    x = torch::relu(fc2(x));
    return torch::softmax(fc3(x), 1);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Net);

// fc3 is used only when asked (find_unused_parameters), or only outside forward (double mark).
struct BranchNet : torch::nn::Module {
  BranchNet() {
    fc1 = register_module("fc1", torch::nn::Linear(torch::nn::LinearOptions(2, 10).bias(false)));
    fc2 = register_module("fc2", torch::nn::Linear(torch::nn::LinearOptions(10, 4).bias(false)));
    fc3 = register_module("fc3", torch::nn::Linear(torch::nn::LinearOptions(10, 4).bias(false)));
  }
  at::Tensor forward(at::Tensor x, bool use_fc3) {
    x = torch::relu(fc1(x));
    return use_fc3 ? fc3(x) : fc2(x);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};

// Three 1.4 MB layers applied in the reverse of their registration: the first buckets (built in
// reverse registration order) get their gradients last until the buckets are rebuilt.
struct ReversedNet : torch::nn::Module {
  ReversedNet() {
    a = register_module("a", torch::nn::Linear(torch::nn::LinearOptions(600, 600).bias(false)));
    b = register_module("b", torch::nn::Linear(torch::nn::LinearOptions(600, 600).bias(false)));
    c = register_module("c", torch::nn::Linear(torch::nn::LinearOptions(600, 600).bias(false)));
  }
  at::Tensor forward(at::Tensor x) { return a(torch::tanh(b(torch::tanh(c(x))))); }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
};

// A copy of `src`'s parameters in a fresh module of the same type.
template <class M>
std::shared_ptr<M> copy_of(const std::shared_ptr<M>& src) {
  auto m = std::make_shared<M>();
  torch::NoGradGuard no_grad;
  auto to = m->parameters();
  auto from = src->parameters();
  for (std::size_t i = 0; i < to.size(); ++i) to[i].copy_(from[i]);
  return m;
}

// The averaged gradients of `local` (its own .grad, computed by the caller), as DDP must give.
std::vector<at::Tensor> averaged_grads(torch::nn::Module& local, int world) {
  std::vector<at::Tensor> out;
  for (auto& p : local.parameters()) {
    at::Tensor g = p.grad().defined() ? p.grad().clone() : at::zeros_like(p);
    dist::all_reduce(g);
    out.push_back(g / world);
  }
  return out;
}

void check_grads(torch::nn::Module& m, const std::vector<at::Tensor>& expected) {
  auto ps = m.parameters();
  REQUIRE(ps.size() == expected.size());
  for (std::size_t i = 0; i < ps.size(); ++i) {
    REQUIRE(ps[i].grad().defined());
    CHECK_MESSAGE(at::allclose(ps[i].grad(), expected[i], 1.3e-6, 5e-5),
                  "parameter " << i << ": " << ps[i].grad() << " vs " << expected[i]);
  }
}

std::string what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no exception)";
}

using distrpc::testing::contains;

// ---- The scenarios, each run on one backend.

// Two iterations of SGD through DDP agree with one process training on the whole batch.
void agrees_with_single_process(const RankContext& ctx) {
  torch::manual_seed(100 + ctx.rank);  // different replicas: the wrapper broadcasts rank 0's
  auto model = std::make_shared<NetImpl>();
  DistributedDataParallel ddp_model(model, {.bucket_cap_mb = 0.001});
  torch::manual_seed(100);
  auto reference = std::make_shared<NetImpl>();  // rank 0's initial parameters
  for (std::size_t i = 0; i < model->parameters().size(); ++i) {
    CHECK(at::equal(model->parameters()[i], reference->parameters()[i]));
  }
  torch::optim::SGD opt(model->parameters(), 0.5);
  torch::optim::SGD ref_opt(reference->parameters(), 0.5);
  const int per_rank = 4;
  for (int it = 0; it < 2; ++it) {
    torch::manual_seed(1000 + it);  // the same global batch on every rank
    at::Tensor input = torch::randn({per_rank * ctx.world, 2});
    at::Tensor target = torch::randn({per_rank * ctx.world, 4});
    at::Tensor mine = input.narrow(0, ctx.rank * per_rank, per_rank);
    at::Tensor my_target = target.narrow(0, ctx.rank * per_rank, per_rank);

    opt.zero_grad();
    torch::mse_loss(ddp_model(mine), my_target).backward();
    opt.step();
    ref_opt.zero_grad();
    torch::mse_loss(reference->forward(input), target).backward();
    ref_opt.step();
    for (std::size_t i = 0; i < model->parameters().size(); ++i) {
      CHECK_MESSAGE(at::allclose(model->parameters()[i], reference->parameters()[i], 1.3e-6, 5e-5),
                    "iteration " << it << ", parameter " << i);
    }
  }
  const auto s = ddp_model.stats();
  CHECK(s.iterations == 2);
  // 80 + 2000 + 800 bytes: under the 1 MiB first bucket, so one bucket, in reverse order.
  CHECK(s.bucket_count == 1);
  CHECK(s.bucket_indices == std::vector<std::vector<std::size_t>>{{2, 1, 0}});
  CHECK(s.bucket_bytes == std::vector<std::size_t>{2880});
  CHECK(s.reductions_launched == 1);
  CHECK(s.buckets_rebuilt);  // rebuilt before the second forward (the same order here)
}

// PyTorch's simple hook: every gradient becomes exactly 2; registering twice is refused; a hook
// whose future fails fails backward with that error; mismatched replicas are named.
void comm_hooks_and_mismatch(const RankContext& ctx) {
  {
    // Rank 1's fc1 takes 3 inputs: every rank fails construction with the same text.
    struct Odd : torch::nn::Module {
      explicit Odd(int in) {
        fc1 =
            register_module("fc1", torch::nn::Linear(torch::nn::LinearOptions(in, 10).bias(false)));
      }
      at::Tensor forward(at::Tensor x) { return fc1(x); }
      torch::nn::Linear fc1{nullptr};
    };
    auto odd = std::make_shared<Odd>(ctx.rank == 0 ? 2 : 3);
    CHECK(what_of([&] { DistributedDataParallel d(odd); }) ==
          "DistributedDataParallel: parameter 'fc1.weight' has shape [10, 2] on rank 0 but "
          "[10, 3] on rank 1");
  }
  {
    // Rank 0 freezes fc1, rank 1 fc2, both [10, 10]: the buckets would hold one parameter each
    // and average fc2's gradient with fc1's. Every rank fails construction instead.
    struct Two : torch::nn::Module {
      Two() {
        fc1 = register_module("fc1", torch::nn::Linear(10, 10));
        fc2 = register_module("fc2", torch::nn::Linear(10, 10));
      }
      at::Tensor forward(at::Tensor x) { return fc2(fc1(x)); }
      torch::nn::Linear fc1{nullptr}, fc2{nullptr};
    };
    auto two = std::make_shared<Two>();
    for (auto& p : (ctx.rank == 0 ? two->fc1 : two->fc2)->parameters()) p.requires_grad_(false);
    CHECK(what_of([&] { DistributedDataParallel d(two); }) ==
          "DistributedDataParallel: parameter 'fc1.weight' does not require grad on rank 0 but "
          "requires grad on rank 1 (every rank must train the same parameters)");
  }
  auto model = std::make_shared<NetImpl>();
  DistributedDataParallel d(model, {.bucket_cap_mb = 0.001});
  d.register_comm_hook(0, [](int&, ddp::GradBucket& bucket) -> distrpc::Future<at::Tensor> {
    at::Tensor r = at::ones_like(bucket.buffer());
    r += 1;
    return distrpc::make_ready_future(r);
  });
  CHECK(what_of([&] {
          d.register_comm_hook(
              0, [](int&, ddp::GradBucket& b) { return distrpc::make_ready_future(b.buffer()); });
        }) == "register_comm_hook or register_builtin_comm_hook can only be called once.");
  for (int it = 0; it < 2; ++it) {
    for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
    d(torch::randn({4, 2})).sum().backward();
    for (auto& p : model->parameters()) CHECK(at::equal(p.grad(), at::full_like(p, 2.0)));
  }

  // A hook that sees the buckets (index, is_last, parameters) and then fails.
  auto other = std::make_shared<NetImpl>();
  DistributedDataParallel failing(other, {.bucket_cap_mb = 0.001});
  struct Seen {
    std::vector<std::size_t> indices;
  };
  auto seen = std::make_shared<Seen>();
  failing.register_comm_hook(seen, [](std::shared_ptr<Seen>& s, ddp::GradBucket& b) {
    s->indices.push_back(b.index());
    CHECK(b.is_last());
    CHECK(b.parameters().size() == 3);
    return distrpc::make_exceptional_future<at::Tensor>(
        std::runtime_error("compression failed on purpose"));
  });
  CHECK(what_of([&] {
          failing(torch::randn({4, 2})).sum().backward();
        }) == "compression failed on purpose");
  CHECK(seen->indices == std::vector<std::size_t>{0});
}

// A branch not taken: its parameter keeps no gradient where no rank used it, and gets the
// average (its gradient counting as zero where unused) where one rank used it. Then PyTorch's
// double mark: a parameter used outside forward is marked unused, then its hook fires.
void unused_parameters(const RankContext& ctx) {
  torch::manual_seed(7);
  auto model = std::make_shared<BranchNet>();
  DistributedDataParallel d(model, {.find_unused_parameters = true});
  auto local = copy_of(model);
  torch::manual_seed(50 + ctx.rank);
  at::Tensor x = torch::randn({3, 2});

  d(x, false).sum().backward();
  CHECK(!model->fc3->weight.grad().defined());  // no rank used it: untouched
  CHECK(d.stats().unused_parameters == std::vector<std::size_t>{2});
  local->forward(x, false).sum().backward();
  auto expected = averaged_grads(*local, ctx.world);
  CHECK(at::allclose(model->fc1->weight.grad(), expected[0], 1.3e-6, 5e-5));
  CHECK(at::allclose(model->fc2->weight.grad(), expected[1], 1.3e-6, 5e-5));

  // Rank 0 takes fc3, rank 1 fc2.
  model->zero_grad();
  local->zero_grad();
  for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
  for (auto& p : local->parameters()) p.mutable_grad() = at::Tensor();
  d(x, ctx.rank == 0).sum().backward();
  local->forward(x, ctx.rank == 0).sum().backward();
  check_grads(*model, averaged_grads(*local, ctx.world));

  // Under no_sync rank 0 takes fc3, then the synchronized pass takes fc2 on every rank: fc3's
  // accumulated gradient is averaged too (rank 1's counting as zero), the same on both ranks.
  for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
  for (auto& p : local->parameters()) p.mutable_grad() = at::Tensor();
  {
    auto guard = d.no_sync();
    d(x, ctx.rank == 0).sum().backward();
  }
  d(x, false).sum().backward();
  local->forward(x, ctx.rank == 0).sum().backward();
  local->forward(x, false).sum().backward();
  check_grads(*model, averaged_grads(*local, ctx.world));

  // fc3 applied by the caller after forward: found unused, then its hook fires.
  struct Outside : torch::nn::Module {
    Outside() {
      fc1 = register_module("fc1", torch::nn::Linear(torch::nn::LinearOptions(2, 10).bias(false)));
      fc2 = register_module("fc2", torch::nn::Linear(torch::nn::LinearOptions(10, 10).bias(false)));
      fc3 = register_module("fc3", torch::nn::Linear(torch::nn::LinearOptions(10, 4).bias(false)));
    }
    at::Tensor forward(at::Tensor in) { return fc2(torch::relu(fc1(in))); }
    torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
  };
  auto outside = std::make_shared<Outside>();
  DistributedDataParallel t(outside, {.find_unused_parameters = true});
  const std::string err = what_of([&] { outside->fc3(t(x)).sum().backward(); });
  CHECK(err.rfind("Expected to mark a variable ready only once.", 0) == 0);
  CHECK(contains(err, "Parameter at index 2 with name fc3.weight has been marked as ready twice."));
  // The failed pass is not finished: the next iteration says why, not that parameters were unused.
  const std::string next = what_of([&] { (void)t(x); });
  CHECK(next.rfind("DistributedDataParallel cannot run another iteration: a gradient hook of its "
                   "last backward pass failed (Expected to mark a variable ready only once.",
                   0) == 0);

  // The search sees into the values of a map; a result it cannot see into is named at forward
  // (searched from nothing, every parameter would count as unused).
  struct Mapped : torch::nn::Module {
    Mapped() { net = register_module("net", std::make_shared<BranchNet>()); }
    std::map<std::string, at::Tensor> forward(at::Tensor in) {
      return {{"y", net->forward(in, false)}};
    }
    std::shared_ptr<BranchNet> net;
  };
  auto mapped = std::make_shared<Mapped>();
  DistributedDataParallel m(mapped, {.find_unused_parameters = true});
  m(x).at("y").sum().backward();
  CHECK(mapped->net->fc2->weight.grad().defined());
  CHECK(!mapped->net->fc3->weight.grad().defined());
  CHECK(m.stats().unused_parameters == std::vector<std::size_t>{2});
  struct Result {
    at::Tensor y;
  };
  struct Opaque : torch::nn::Module {
    Opaque() { fc = register_module("fc", torch::nn::Linear(2, 2)); }
    Result forward(at::Tensor in) { return {fc(in)}; }
    torch::nn::Linear fc{nullptr};
  };
  DistributedDataParallel o(std::make_shared<Opaque>(), {.find_unused_parameters = true});
  const std::string opaque = what_of([&] { (void)o(x); });
  CHECK(opaque.rfind("DistributedDataParallel: find_unused_parameters searches the graph from the "
                     "tensors of forward's result, and its result (",
                     0) == 0);
  CHECK(contains(opaque,
                 "Result) holds none that it can see: return a tensor, or tensors in a "
                 "std::vector, std::array, std::tuple, std::pair, std::optional or the "
                 "values of a std::map or std::unordered_map"));

  // A dense parameter whose gradient is sparse (Embedding with sparse(true)) fails the backward
  // pass naming it.
  struct Sparse : torch::nn::Module {
    Sparse() {
      emb = register_module("emb",
                            torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 3).sparse(true)));
    }
    at::Tensor forward(at::Tensor in) { return emb(in); }
    torch::nn::Embedding emb{nullptr};
  };
  auto sparse = std::make_shared<Sparse>();
  DistributedDataParallel s(sparse);
  CHECK(what_of([&] {
          s(torch::tensor({1, 2}, at::kLong)).sum().backward();
        }) ==
        "DistributedDataParallel: parameter 'emb.weight' got a sparse gradient, which is not "
        "supported; make its module produce dense gradients (e.g. Embedding without sparse)");
}

// Gradients accumulated under no_sync, then one synchronized backward: the average of the sums.
void no_sync_accumulates(const RankContext& ctx) {
  torch::manual_seed(3);
  auto model = std::make_shared<NetImpl>();
  DistributedDataParallel d(model, {.bucket_cap_mb = 0.001});
  auto local = copy_of(model);
  torch::manual_seed(60 + ctx.rank);
  at::Tensor a = torch::randn({5, 2});
  at::Tensor b = torch::randn({5, 2});
  {
    auto guard = d.no_sync();
    d(a).pow(2).sum().backward();
  }
  local->forward(a).pow(2).sum().backward();
  // Nothing was communicated: the gradients are this rank's own.
  auto ps = model->parameters();
  auto ls = local->parameters();
  for (std::size_t i = 0; i < ps.size(); ++i) CHECK(at::equal(ps[i].grad(), ls[i].grad()));
  CHECK(d.stats().iterations == 0);
  d(b).pow(2).sum().backward();
  local->forward(b).pow(2).sum().backward();
  check_grads(*model, averaged_grads(*local, ctx.world));
  CHECK(d.stats().iterations == 1);
}

// gradient_as_bucket_view: each gradient is a view of its bucket's buffer (same storage, at its
// offset), the values the average, across a zero_grad and a second iteration.
void grads_are_bucket_views(const RankContext& ctx) {
  torch::manual_seed(4);
  auto model = std::make_shared<NetImpl>();
  DistributedDataParallel d(model, {.bucket_cap_mb = 0.001, .gradient_as_bucket_view = true});
  auto local = copy_of(model);
  for (int it = 0; it < 2; ++it) {
    torch::manual_seed(70 + 10 * it + ctx.rank);
    at::Tensor x = torch::randn({6, 2});
    for (auto& p : model->parameters()) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
    local->zero_grad();
    d(x).pow(2).sum().backward();
    local->forward(x).pow(2).sum().backward();
    check_grads(*model, averaged_grads(*local, ctx.world));
    const auto buffers = d.reducer()->bucket_buffers();
    const auto s = d.stats();
    const auto ps = model->parameters();
    for (std::size_t bk = 0; bk < s.bucket_indices.size(); ++bk) {
      std::int64_t offset = 0;
      for (std::size_t i : s.bucket_indices[bk]) {
        CHECK(ps[i].grad().is_alias_of(buffers[bk]));
        CHECK(ps[i].grad().data_ptr<float>() == buffers[bk].data_ptr<float>() + offset);
        offset += ps[i].numel();
      }
    }
  }
}

// The buckets are rebuilt after the first iteration in the order gradients arrived: first
// ({c}, {b}, {a}: c's gradient comes last, so nothing is launched before the last gradient),
// then ({a}, {b}, {c}: two reductions overlap the rest of the backward pass).
void buckets_rebuilt(const RankContext& ctx) {
  torch::manual_seed(5);
  auto model = std::make_shared<ReversedNet>();
  DistributedDataParallel d(model, {.bucket_cap_mb = 1});
  auto local = copy_of(model);
  using Indices = std::vector<std::vector<std::size_t>>;
  CHECK(d.stats().bucket_indices == Indices{{2}, {1}, {0}});
  for (int it = 0; it < 2; ++it) {
    torch::manual_seed(80 + 10 * it + ctx.rank);
    at::Tensor x = torch::randn({2, 600});
    model->zero_grad();
    local->zero_grad();
    d(x).sum().backward();
    local->forward(x).sum().backward();
    check_grads(*model, averaged_grads(*local, ctx.world));
    const auto s = d.stats();
    CHECK(s.reductions_launched == 3);
    if (it == 0) {
      CHECK(!s.buckets_rebuilt);
      CHECK(s.bucket_indices == Indices{{2}, {1}, {0}});
      CHECK(s.reductions_before_last_gradient == 0);
    } else {
      CHECK(s.buckets_rebuilt);
      CHECK(s.bucket_indices == Indices{{0}, {1}, {2}});
      CHECK(s.reductions_before_last_gradient == 2);
    }
    CHECK(s.bucket_bytes == std::vector<std::size_t>{1440000, 1440000, 1440000});
  }
}

// static_graph: the first iteration learns the graph (everything reduced at the end), later
// ones reduce as gradients come, an unused parameter is handled from what the first learnt, and
// the buckets are rebuilt after the second iteration.
void static_graph(const RankContext& ctx) {
  torch::manual_seed(6);
  auto model = std::make_shared<BranchNet>();
  DistributedDataParallel d(model, {.static_graph = true});
  auto local = copy_of(model);
  for (int it = 0; it < 3; ++it) {
    torch::manual_seed(90 + 10 * it + ctx.rank);
    at::Tensor x = torch::randn({3, 2});
    for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
    for (auto& p : local->parameters()) p.mutable_grad() = at::Tensor();
    d(x, false).sum().backward();
    local->forward(x, false).sum().backward();
    auto expected = averaged_grads(*local, ctx.world);
    CHECK(at::allclose(model->fc1->weight.grad(), expected[0], 1.3e-6, 5e-5));
    CHECK(at::allclose(model->fc2->weight.grad(), expected[1], 1.3e-6, 5e-5));
    CHECK(!model->fc3->weight.grad().defined());
    const auto s = d.stats();
    CHECK(s.iterations == static_cast<std::size_t>(it + 1));
    CHECK(s.buckets_rebuilt == (it == 2));
    CHECK(s.unused_parameters == std::vector<std::size_t>{2});
  }
}

// A ModuleHolder wraps as its Impl; buffers follow rank 0's before a forward that follows a
// synchronized one.
void holders_and_buffers(const RankContext& ctx) {
  torch::manual_seed(20 + ctx.rank);
  torch::nn::Linear lin(torch::nn::LinearOptions(2, 3));
  DistributedDataParallel holder(lin);
  static_assert(std::is_same_v<decltype(holder), DistributedDataParallel<torch::nn::LinearImpl>>);
  torch::manual_seed(20);
  torch::nn::Linear rank0(torch::nn::LinearOptions(2, 3));
  CHECK(at::equal(lin->weight, rank0->weight));
  CHECK(at::equal(lin->bias, rank0->bias));
  holder(at::full({1, 2}, 1.0 + ctx.rank)).sum().backward();
  CHECK(at::equal(lin->weight.grad(), at::full({3, 2}, 1.5)));  // (1 + 2) / 2
  CHECK(at::equal(lin->bias.grad(), at::ones({3})));

  struct Counting : torch::nn::Module {
    Counting() {
      fc = register_module("fc", torch::nn::Linear(2, 2));
      seen = register_buffer("seen", at::zeros({1}));
    }
    at::Tensor forward(at::Tensor x) {
      seen += 1;
      return fc(x);
    }
    torch::nn::Linear fc{nullptr};
    at::Tensor seen;
  };
  auto counting = std::make_shared<Counting>();
  DistributedDataParallel d(counting);
  if (ctx.rank == 1) counting->seen.fill_(7);  // overwritten by rank 0's before the forward
  d(at::ones({1, 2})).sum().backward();
  CHECK(counting->seen.item<float>() == 1);
  // As in PyTorch, a forward broadcasts the buffers only when the one before it was
  // synchronized: the first no_sync (or no-grad) forward does, later ones keep local buffers
  // (no collective each micro-step), and so does the synchronized forward right after them.
  const auto seen_after = [&](bool sync, float rank1_before) {
    if (ctx.rank == 1) counting->seen.fill_(rank1_before);
    if (sync) {
      d(at::ones({1, 2})).sum().backward();
    } else {
      auto guard = d.no_sync();
      d(at::ones({1, 2})).sum().backward();
    }
    return counting->seen.item<float>();
  };
  CHECK(seen_after(false, 7) == 2);                        // rank 0's 1, then + 1
  CHECK(seen_after(false, 7) == (ctx.rank == 1 ? 8 : 3));  // kept
  CHECK(seen_after(true, 7) == (ctx.rank == 1 ? 8 : 4));   // kept: the forward before was local
  CHECK(seen_after(true, 7) == 5);                         // rank 0's 4, then + 1
  {
    torch::NoGradGuard no_grad;
    if (ctx.rank == 1) counting->seen.fill_(7);
    (void)d(at::ones({1, 2}));
    CHECK(counting->seen.item<float>() == 6);
    if (ctx.rank == 1) counting->seen.fill_(7);
    (void)d(at::ones({1, 2}));
    CHECK(counting->seen.item<float>() == (ctx.rank == 1 ? 8 : 7));
  }
  DistributedDataParallel keep(std::make_shared<Counting>(), {.broadcast_buffers = false});
  if (ctx.rank == 1) keep.module()->seen.fill_(7);
  keep(at::ones({1, 2})).sum().backward();
  CHECK(keep.module()->seen.item<float>() == (ctx.rank == 1 ? 8 : 1));
}

}  // namespace

// The scenarios above once per backend; each case is one launch of 2 fresh processes.
#define DDP_CASE(backend, tag, title, fn)                                           \
  DISTRPC_MP_TEST_IMPL("ddp [" backend "]: " title, 2, 90, ddp_body_##tag##_##fn) { \
    init_group(ctx, backend);                                                       \
    fn(ctx);                                                                        \
    dist::destroy_process_group();                                                  \
  }

#define DDP_CASES(backend, tag)                                                                  \
  DDP_CASE(backend, tag, "training agrees with one process on the whole batch",                  \
           agrees_with_single_process)                                                           \
  DDP_CASE(backend, tag, "comm hooks, a failing hook, mismatched replicas",                      \
           comm_hooks_and_mismatch)                                                              \
  DDP_CASE(backend, tag, "find_unused_parameters and the double mark", unused_parameters)        \
  DDP_CASE(backend, tag, "no_sync accumulates, then one synchronized step", no_sync_accumulates) \
  DDP_CASE(backend, tag, "gradient_as_bucket_view", grads_are_bucket_views)                      \
  DDP_CASE(backend, tag, "buckets rebuilt in arrival order", buckets_rebuilt)                    \
  DDP_CASE(backend, tag, "static_graph", static_graph)                                           \
  DDP_CASE(backend, tag, "module holders, buffers", holders_and_buffers)

DDP_CASES("distrpc", distrpc)
#ifdef USE_C10D_GLOO
DDP_CASES("gloo", gloo)
#endif

TEST_CASE("ddp: bad options are named before any communication") {
  CHECK(what_of([] { DistributedDataParallel d(std::shared_ptr<NetImpl>{}); }) ==
        "DistributedDataParallel: the module is null");
  CHECK(what_of([] {
          DistributedDataParallel d(std::make_shared<NetImpl>(), {.bucket_cap_mb = -1});
        }) == "DistributedDataParallel: bucket_cap_mb must be >= 0, got -1.000000");
}

// A peer killed between forward and backward fails the survivor's backward within 2 s, naming
// the lost rank (the distrpc backend sees the connection break; gloo's error names no rank).
DISTRPC_MP_TARGET("ddp target: peer killed mid-backward") {
  init_group(ctx, "distrpc");
  torch::manual_seed(8);
  auto model = std::make_shared<NetImpl>();
  DistributedDataParallel d(model, {.bucket_cap_mb = 0.001});
  d(torch::randn({4, 2})).sum().backward();  // one good iteration
  at::Tensor loss = d(torch::randn({4, 2})).sum();
  if (ctx.rank == 1) ::kill(::getpid(), SIGKILL);
  const auto t0 = Clock::now();
  const std::string err = what_of([&] { loss.backward(); });
  const auto took =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
  MESSAGE("rank 0: " << err << " after " << took << " ms");
  const bool named = contains(err, "connection to rank 1 lost");
  CHECK(named);
  CHECK(took < 2000);
  // Exit now: the store's server in this process would wait for rank 1 to check out.
  std::_Exit(named && took < 2000 ? 0 : 1);
}

TEST_CASE("ddp [distrpc]: a peer killed mid-backward fails the other rank's backward in 2 s") {
  distrpc::testing::RunOptions o;
  o.world = 2;
  o.limit = std::chrono::seconds(60);
  o.may_die = {1};
  const auto r = distrpc::testing::run_ranks("ddp target: peer killed mid-backward", o);
  CHECK_MESSAGE(r.ok, r.report());
  REQUIRE(r.ranks.size() == 2);
  CHECK_MESSAGE(r.ranks[1].signal == SIGKILL, r.report());
  CHECK_MESSAGE(r.ranks[0].exit_code == 0, r.report());
}

// Inside a distributed-autograd context the averaged gradients go into the context, not .grad.
// (A backward that reaches the wrapped module through an RPC to the other rank is not covered:
// it hung in 2 of 7 runs and is a known limit.)
DISTRPC_MP_TEST("ddp [distrpc]: inside a distributed-autograd context", 2, 90) {
  distrpc::RpcBackendOptions o;
  o.init_method = ctx.file_url() + "-rpc";
  distrpc::init_rpc<distrpc::transport::Tcp>("trainer" + std::to_string(ctx.rank), ctx.rank,
                                             ctx.world, o);
  init_group(ctx, "distrpc");
  torch::manual_seed(9);
  auto model = std::make_shared<NetImpl>();
  DistributedDataParallel d(model, {.bucket_cap_mb = 0.001});
  auto local = copy_of(model);
  torch::manual_seed(110 + ctx.rank);
  at::Tensor x = torch::randn({4, 2});
  std::vector<at::Tensor> direct;
  {
    distrpc::dist_autograd::Context c;
    at::Tensor loss = d(x).pow(2).sum();
    distrpc::dist_autograd::backward(c.id(), {loss});
    auto grads = distrpc::dist_autograd::get_gradients(c.id());
    for (auto& p : model->parameters()) {
      CHECK(!p.grad().defined());
      direct.push_back(grads.at(p));
    }
  }
  CHECK(d.stats().iterations == 1);
  local->forward(x).pow(2).sum().backward();
  auto expected = averaged_grads(*local, ctx.world);
  for (std::size_t i = 0; i < expected.size(); ++i) {
    CHECK(at::allclose(direct[i], expected[i], 1.3e-6, 5e-5));
  }
  dist::destroy_process_group();
  distrpc::shutdown();
}
