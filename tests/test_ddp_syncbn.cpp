// SyncBatchNorm and convert_sync_batchnorm (distrpc/ddp/sync_batch_norm.hpp).
//  - in-process: options and their defaults, bad options and bad input (exact texts), the local
//    fallback without a process group, convert_sync_batchnorm on containers and custom modules;
//  - 2 ranks on each backend (distrpc over tcp, and gloo where built): outputs, input gradients,
//    summed weight/bias gradients and running statistics equal those of torch::nn::BatchNorm on
//    the concatenated batch (uneven slices, 2D to 5D, two steps); a rank with an empty batch
//    (no NaN anywhere; the others get a local BatchNorm's results); eval mode makes no collective;
//  - a group of one is a local BatchNorm.
#include <chrono>
#include <cstdint>
#include <memory>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <doctest/doctest.h>
#include <torch/torch.h>

#include <distrpc/ddp/sync_batch_norm.hpp>
#include <distrpc/dist.hpp>
#include <distrpc/dist/distrpc_backend.hpp>
#include <distrpc/transport/tcp.hpp>
#ifdef USE_C10D_GLOO
#include <distrpc/dist/gloo_backend.hpp>
#endif

#include "multiprocess.hpp"
#include "support/error_text.hpp"

namespace dist = distrpc::dist;
using distrpc::nn::SyncBatchNorm;
using distrpc::nn::SyncBatchNormImpl;
using distrpc::nn::SyncBatchNormOptions;
using distrpc::testing::error_text;
using distrpc::testing::RankContext;

namespace {

constexpr std::chrono::milliseconds kTimeout{30000};

void register_backend(const std::string& name) {
  if (name == "distrpc" && !dist::is_backend_available("distrpc")) {
    dist::register_distrpc_backend<distrpc::transport::Tcp>();
  }
#ifdef USE_C10D_GLOO
  if (name == "gloo") dist::register_gloo_backend();
#endif
  REQUIRE(dist::is_backend_available(name));
}

void init(const RankContext& ctx, const std::string& backend,
          std::chrono::milliseconds timeout = kTimeout) {
  register_backend(backend);
  dist::init_process_group(backend, ctx.file_url(), ctx.rank, ctx.world, timeout);
}

// Equal within 1e-5 relative (1e-6 absolute, for values near zero), with the largest difference
// shown when not. The reference computes in float too: batches of at least 4 values per channel
// keep its own rounding (against a double-precision run) well inside that; with 3 values the input
// gradient is ill-conditioned and float BatchNorm itself is off by ~1e-5.
void check_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  INFO(what);
  REQUIRE(got.defined());
  REQUIRE(want.defined());
  REQUIRE(got.sizes() == want.sizes());
  const double diff = got.numel() == 0 ? 0.0 : (got - want).abs().max().item<double>();
  const double rel =
      got.numel() == 0 ? 0.0 : ((got - want).abs() / (want.abs() + 1e-12)).max().item<double>();
  INFO("largest difference " << diff << ", largest relative " << rel << ", got "
                             << got.flatten().slice(0, 0, 6) << " want "
                             << want.flatten().slice(0, 0, 6));
  CHECK(at::allclose(got, want, 1e-5, 1e-6));
}

void check_no_nan(const at::Tensor& t, const std::string& what) {
  INFO(what);
  REQUIRE(t.defined());
  CHECK_FALSE(at::isnan(t).any().item<bool>());
}

// Known, different per-channel weight and bias (not the ones/zeros a fresh layer has).
void set_affine(at::Tensor& weight, at::Tensor& bias) {
  torch::NoGradGuard no_grad;
  const int64_t c = weight.size(0);
  weight.copy_(at::linspace(0.5, 1.75, c));
  bias.copy_(at::linspace(-0.25, 0.5, c));
}

// Runs `steps` training steps of the reference `ref` (a torch::nn::BatchNorm on the whole batch)
// and of `sync` (this rank's rows of it), with loss sum(out * g), and compares everything. `rows`:
// how many rows of dimension 0 each rank holds, in rank order (0 for an empty batch).
template <class RefHolder>
void check_against_batch_norm(const std::string& what, RefHolder ref, SyncBatchNorm sync,
                              std::vector<int64_t> shape, const std::vector<int64_t>& rows,
                              int rank, const std::shared_ptr<dist::ProcessGroup>& group,
                              int steps = 2) {
  INFO(what);
  const bool affine = sync->options.affine();
  if (affine) {
    set_affine(ref->weight, ref->bias);
    set_affine(sync->weight, sync->bias);
  }
  shape[0] = std::accumulate(rows.begin(), rows.end(), int64_t{0});
  const int64_t lo = std::accumulate(rows.begin(), rows.begin() + rank, int64_t{0});
  const int64_t n = rows[static_cast<std::size_t>(rank)];
  for (int step = 0; step < steps; ++step) {
    INFO("step " << step);
    torch::manual_seed(1000 + step);
    // Off-centre data: a combination of moments that cancelled would show here.
    const at::Tensor x = at::randn(shape) * 2 + 3;
    const at::Tensor g = at::randn(shape);

    at::Tensor xr = x.clone().requires_grad_(true);
    at::Tensor yr = ref->forward(xr);
    (yr * g).sum().backward();

    at::Tensor xs = x.narrow(0, lo, n).clone().requires_grad_(true);
    at::Tensor ys = sync->forward(xs);
    (ys * g.narrow(0, lo, n)).sum().backward();

    CHECK(ys.sizes() == xs.sizes());
    check_close(ys, yr.narrow(0, lo, n), "output");
    check_no_nan(ys, "output");
    REQUIRE(xs.grad().defined());
    CHECK(xs.grad().sizes() == xs.sizes());
    check_close(xs.grad(), xr.grad().narrow(0, lo, n), "input gradient");
    check_no_nan(xs.grad(), "input gradient");
    if (affine) {
      // Each rank holds its share; their sum (what data-parallel training reduces) is the whole.
      check_no_nan(sync->weight.grad(), "weight gradient");
      check_no_nan(sync->bias.grad(), "bias gradient");
      at::Tensor wg = sync->weight.grad().clone();
      at::Tensor bg = sync->bias.grad().clone();
      dist::all_reduce(wg, {.group = group});
      dist::all_reduce(bg, {.group = group});
      check_close(wg, ref->weight.grad(), "summed weight gradient");
      check_close(bg, ref->bias.grad(), "summed bias gradient");
    }
    if (sync->options.track_running_stats()) {
      check_close(sync->running_mean, ref->running_mean, "running_mean");
      check_close(sync->running_var, ref->running_var, "running_var");
      check_no_nan(sync->running_mean, "running_mean");
      check_no_nan(sync->running_var, "running_var");
      CHECK(sync->num_batches_tracked.item<int64_t>() == step + 1);
    }
    ref->zero_grad();
    sync->zero_grad();
  }
}

// Every shape the module takes, each split unevenly between the two ranks (or with rank 1 empty).
void run_value_cases(int rank, const std::vector<int64_t>& rows_4d,
                     const std::vector<int64_t>& rows_2d, const std::vector<int64_t>& rows_3d,
                     const std::vector<int64_t>& rows_5d) {
  auto world = dist::get_default_group();
  const std::uint64_t seq_before = world->sequence_number();

  check_against_batch_norm("N x C x H x W", torch::nn::BatchNorm2d(3), SyncBatchNorm(3),
                           {0, 3, 4, 5}, rows_4d, rank, world);
  CHECK(world->sequence_number() > seq_before);  // it did synchronize

  // N x C through convert_sync_batchnorm, on a group of its own, with a cumulative average.
  auto group = dist::new_group({0, 1});
  auto bn1 = torch::nn::BatchNorm1d(torch::nn::BatchNorm1dOptions(4).momentum(c10::nullopt));
  auto converted = std::dynamic_pointer_cast<SyncBatchNormImpl>(distrpc::nn::convert_sync_batchnorm(
      torch::nn::BatchNorm1d(torch::nn::BatchNorm1dOptions(4).momentum(c10::nullopt)), group));
  REQUIRE(converted != nullptr);
  CHECK(converted->options.process_group() == group);
  CHECK_FALSE(converted->options.momentum().has_value());
  check_against_batch_norm("N x C, converted, own group, cumulative average", bn1,
                           SyncBatchNorm(converted), {0, 4}, rows_2d, rank, group, 3);

  check_against_batch_norm("N x C x L, no affine",
                           torch::nn::BatchNorm1d(torch::nn::BatchNorm1dOptions(2).affine(false)),
                           SyncBatchNorm(SyncBatchNormOptions(2).affine(false)), {0, 2, 4}, rows_3d,
                           rank, world);
  check_against_batch_norm(
      "N x C x D x H x W, no running stats",
      torch::nn::BatchNorm3d(torch::nn::BatchNorm3dOptions(2).track_running_stats(false)),
      SyncBatchNorm(SyncBatchNormOptions(2).track_running_stats(false)), {0, 2, 2, 3, 2}, rows_5d,
      rank, world);
}

// Rank 1's input needs no gradient (only the parameters do): its backward still joins rank 0's
// all-reduce, so rank 0 gets the whole batch's input gradient and neither waits.
void input_without_grad_on_one_rank(int rank) {
  torch::nn::BatchNorm2d ref(3);
  SyncBatchNorm sync(3);
  set_affine(ref->weight, ref->bias);
  set_affine(sync->weight, sync->bias);
  torch::manual_seed(21);
  const at::Tensor x = at::randn({6, 3, 2, 2}) * 2 + 3;
  const at::Tensor g = at::randn({6, 3, 2, 2});
  at::Tensor xr = x.clone().requires_grad_(true);
  (ref->forward(xr) * g).sum().backward();
  const int64_t lo = rank == 0 ? 0 : 4, n = rank == 0 ? 4 : 2;
  at::Tensor xs = x.narrow(0, lo, n).clone().requires_grad_(rank == 0);
  (sync->forward(xs) * g.narrow(0, lo, n)).sum().backward();
  if (rank == 0) {
    check_close(xs.grad(), xr.grad().narrow(0, lo, n), "input gradient");
  } else {
    CHECK_FALSE(xs.grad().defined());
  }
  at::Tensor wg = sync->weight.grad().clone();
  dist::all_reduce(wg);
  check_close(wg, ref->weight.grad(), "summed weight gradient");
}

void values_scenario(const RankContext& ctx, const std::string& backend) {
  init(ctx, backend);
  run_value_cases(ctx.rank, {4, 2}, {3, 2}, {1, 2}, {1, 2});
  input_without_grad_on_one_rank(ctx.rank);
  dist::destroy_process_group();
}

// Rank 1's batch is empty in every case: rank 0's results are a local BatchNorm's on its rows.
void empty_batch_scenario(const RankContext& ctx, const std::string& backend) {
  init(ctx, backend);
  run_value_cases(ctx.rank, {4, 0}, {5, 0}, {2, 0}, {1, 0});

  // One value per channel over the whole group: every rank refuses, none waits for another.
  SyncBatchNorm bn(4);
  const at::Tensor x = ctx.rank == 0 ? at::randn({1, 4}) : at::randn({0, 4});
  CHECK(error_text<std::invalid_argument>([&] { bn->forward(x); }) ==
        "SyncBatchNorm: expected more than 1 value per channel when training, got 1 over the "
        "whole group of 2 (this member's input size " +
            std::string(ctx.rank == 0 ? "[1, 4]" : "[0, 4]") + ")");
  // The group is still in step afterwards.
  at::Tensor t = at::full({2}, static_cast<float>(ctx.rank + 1));
  dist::all_reduce(t);
  CHECK(at::equal(t, at::full({2}, 3.0f)));
  dist::destroy_process_group();
}

}  // namespace

// ---- In-process.

TEST_CASE("SyncBatchNorm: options, defaults, parameters and buffers") {
  SyncBatchNorm bn(3);
  CHECK(bn->options.num_features() == 3);
  CHECK(bn->options.eps() == 1e-5);
  CHECK(bn->options.momentum() == 0.1);
  CHECK(bn->options.affine());
  CHECK(bn->options.track_running_stats());
  CHECK(bn->options.process_group() == nullptr);
  CHECK(at::equal(bn->weight, at::ones({3})));
  CHECK(at::equal(bn->bias, at::zeros({3})));
  CHECK(bn->weight.requires_grad());
  CHECK(at::equal(bn->running_mean, at::zeros({3})));
  CHECK(at::equal(bn->running_var, at::ones({3})));
  CHECK(bn->num_batches_tracked.item<int64_t>() == 0);
  CHECK((bn->num_batches_tracked.scalar_type() == at::kLong));
  CHECK(bn->named_parameters().keys() == std::vector<std::string>{"weight", "bias"});
  CHECK(bn->named_buffers().keys() ==
        std::vector<std::string>{"running_mean", "running_var", "num_batches_tracked"});

  SyncBatchNorm bare(
      SyncBatchNormOptions(2).affine(false).track_running_stats(false).momentum(std::nullopt));
  CHECK_FALSE(bare->weight.defined());
  CHECK_FALSE(bare->running_mean.defined());
  CHECK(bare->parameters().empty());
  CHECK(bare->buffers().empty());

  std::ostringstream printed;
  printed << *bn;
  CHECK(printed.str() ==
        "distrpc::nn::SyncBatchNorm(3, eps=1e-05, momentum=0.1, affine=true, "
        "track_running_stats=true)");
  std::ostringstream printed_bare;
  printed_bare << *bare;
  CHECK(printed_bare.str() ==
        "distrpc::nn::SyncBatchNorm(2, eps=1e-05, momentum=None, affine=false, "
        "track_running_stats=false)");

  // reset_parameters brings back ones, zeros and fresh statistics.
  {
    torch::NoGradGuard no_grad;
    bn->weight.fill_(2);
    bn->running_var.fill_(7);
    bn->num_batches_tracked.fill_(4);
  }
  bn->reset_parameters();
  CHECK(at::equal(bn->weight, at::ones({3})));
  CHECK(at::equal(bn->running_var, at::ones({3})));
  CHECK(bn->num_batches_tracked.item<int64_t>() == 0);

  // A clone has its own tensors with the same values.
  {
    torch::NoGradGuard no_grad;
    bn->weight.fill_(3);
  }
  auto copy = std::dynamic_pointer_cast<SyncBatchNormImpl>(bn->clone());
  REQUIRE(copy != nullptr);
  CHECK(at::equal(copy->weight, bn->weight));
  CHECK_FALSE(copy->weight.is_same(bn->weight));
}

TEST_CASE("SyncBatchNorm: bad options and bad input name what was wrong") {
  using E = std::invalid_argument;
  CHECK(error_text<E>([] { SyncBatchNorm(SyncBatchNormOptions(0)); }) ==
        "SyncBatchNorm: num_features must be positive, got 0");
  CHECK(error_text<E>([] { SyncBatchNorm(SyncBatchNormOptions(2).eps(-1)); }) ==
        "SyncBatchNorm: eps must be finite and non-negative, got -1");
  CHECK(error_text<E>([] { SyncBatchNorm(SyncBatchNormOptions(2).momentum(1.5)); }) ==
        "SyncBatchNorm: momentum must lie in [0, 1], got 1.5");
  CHECK(error_text<E>([] {
          SyncBatchNorm(SyncBatchNormOptions(2).process_group(dist::ProcessGroup::non_member()));
        }) ==
        "SyncBatchNorm: this process is not a member of the process group given "
        "(ProcessGroup::non_member())");

  SyncBatchNorm bn(3);
  CHECK(error_text<E>([&] { bn->forward(at::randn({3})); }) ==
        "SyncBatchNorm: expected a 2D to 5D input (N, C, ...), got a 1D input of size [3]");
  CHECK(error_text<E>([&] {
          bn->forward(at::randn({1, 3, 1, 1, 1, 2}));
        }) ==
        "SyncBatchNorm: expected a 2D to 5D input (N, C, ...), got a 6D input of size "
        "[1, 3, 1, 1, 1, 2]");
  CHECK(error_text<E>([&] {
          bn->forward(at::randn({2, 4, 5, 5}));
        }) ==
        "SyncBatchNorm: expected 3 channels (num_features) in dimension 1 of the input, got 4 "
        "(input size [2, 4, 5, 5])");
  CHECK(error_text<E>([&] {
          bn->forward(at::ones({2, 3}, at::kLong));
        }) == "SyncBatchNorm: expected a floating-point input, got Long");
  CHECK(error_text<E>([&] { bn->forward(at::Tensor()); }) ==
        "SyncBatchNorm: the input is undefined");
  // Nothing was counted for the refused calls.
  CHECK(bn->num_batches_tracked.item<int64_t>() == 0);
}

TEST_CASE("SyncBatchNorm without a process group is torch::nn::BatchNorm, in training and eval") {
  REQUIRE_FALSE(dist::is_initialized());
  torch::nn::BatchNorm2d ref(3);
  SyncBatchNorm sync(3);
  set_affine(ref->weight, ref->bias);
  set_affine(sync->weight, sync->bias);
  torch::manual_seed(7);
  const at::Tensor x = at::randn({4, 3, 2, 2}) + 1;
  const at::Tensor g = at::randn({4, 3, 2, 2});
  at::Tensor xr = x.clone().requires_grad_(true);
  at::Tensor xs = x.clone().requires_grad_(true);
  at::Tensor yr = ref->forward(xr);
  at::Tensor ys = sync->forward(xs);
  (yr * g).sum().backward();
  (ys * g).sum().backward();
  check_close(ys, yr, "output");
  check_close(xs.grad(), xr.grad(), "input gradient");
  check_close(sync->weight.grad(), ref->weight.grad(), "weight gradient");
  check_close(sync->bias.grad(), ref->bias.grad(), "bias gradient");
  check_close(sync->running_mean, ref->running_mean, "running_mean");
  check_close(sync->running_var, ref->running_var, "running_var");
  CHECK(sync->num_batches_tracked.item<int64_t>() == 1);

  ref->eval();
  sync->eval();
  check_close(sync->forward(x), ref->forward(x), "eval output");
}

TEST_CASE("convert_sync_batchnorm: a Sequential's BatchNorm2d and BatchNorm1d") {
  torch::nn::Sequential seq(torch::nn::BatchNorm2d(torch::nn::BatchNorm2dOptions(3).eps(1e-3)),
                            torch::nn::Flatten(), torch::nn::Linear(3 * 2 * 2, 5),
                            torch::nn::BatchNorm1d(torch::nn::BatchNorm1dOptions(5).momentum(0.3)));
  // Non-default parameters and statistics: one training step, and weights set by hand.
  auto bn2 = std::dynamic_pointer_cast<torch::nn::BatchNorm2dImpl>(seq->ptr(0));
  auto bn1 = std::dynamic_pointer_cast<torch::nn::BatchNorm1dImpl>(seq->ptr(3));
  REQUIRE(bn2 != nullptr);
  REQUIRE(bn1 != nullptr);
  set_affine(bn2->weight, bn2->bias);
  set_affine(bn1->weight, bn1->bias);
  torch::manual_seed(3);
  const at::Tensor x = at::randn({6, 3, 2, 2});
  seq->forward(x);
  seq->eval();
  const at::Tensor expected = seq->forward(x);
  seq->train();
  const auto params_before = seq->parameters();
  const at::Tensor bn2_weight = bn2->weight, bn2_mean = bn2->running_mean,
                   bn2_var = bn2->running_var, bn1_var = bn1->running_var;
  const at::Tensor bn2_mean_values = bn2_mean.clone();

  auto out = distrpc::nn::convert_sync_batchnorm(seq);
  CHECK(out == seq.ptr());  // converted in place

  auto s2 = std::dynamic_pointer_cast<SyncBatchNormImpl>(seq->ptr(0));
  auto s1 = std::dynamic_pointer_cast<SyncBatchNormImpl>(seq->ptr(3));
  REQUIRE(s2 != nullptr);
  REQUIRE(s1 != nullptr);
  // The registered children are the new layers too (named_modules, state dicts, to(), ...).
  CHECK(seq->named_children()["0"] == std::static_pointer_cast<torch::nn::Module>(s2));
  CHECK(seq->named_children()["3"] == std::static_pointer_cast<torch::nn::Module>(s1));
  CHECK(std::dynamic_pointer_cast<torch::nn::LinearImpl>(seq->ptr(2)) != nullptr);

  CHECK(s2->options.num_features() == 3);
  CHECK(s2->options.eps() == 1e-3);
  CHECK(s2->options.momentum() == 0.1);
  CHECK(s1->options.num_features() == 5);
  CHECK(s1->options.momentum() == 0.3);
  CHECK(s1->options.affine());
  CHECK(s1->options.track_running_stats());
  CHECK(s2->options.process_group() == nullptr);
  // The very same tensors: optimizers built on the old parameters keep working.
  CHECK(s2->weight.is_same(bn2_weight));
  CHECK(s2->running_mean.is_same(bn2_mean));
  CHECK(s2->running_var.is_same(bn2_var));
  CHECK(s1->running_var.is_same(bn1_var));
  CHECK(at::equal(s2->running_mean, bn2_mean_values));
  CHECK(s2->num_batches_tracked.item<int64_t>() == 1);
  const auto params_after = seq->parameters();
  REQUIRE(params_after.size() == params_before.size());
  for (std::size_t i = 0; i < params_after.size(); ++i) {
    CHECK(params_after[i].is_same(params_before[i]));
  }
  CHECK(seq->named_buffers().size() == 6);

  // The Sequential calls the new layers: same results in eval mode, and SyncBatchNorm's checks.
  seq->eval();
  CHECK(at::equal(seq->forward(x), expected));
  CHECK(error_text<std::invalid_argument>([&] {
          seq->forward(at::randn({2, 4, 2, 2}));
        }) ==
        "SyncBatchNorm: expected 3 channels (num_features) in dimension 1 of the input, got 4 "
        "(input size [2, 4, 2, 2])");
  CHECK_FALSE(s2->is_training());  // eval() reached the new layers
}

namespace {
struct NestedBnNet : torch::nn::Module {
  NestedBnNet() {
    bn = register_module("bn", torch::nn::BatchNorm2d(torch::nn::BatchNorm2dOptions(2)));
    list = register_module(
        "list", torch::nn::ModuleList(torch::nn::BatchNorm1d(4), torch::nn::Linear(4, 4)));
    dict = register_module(
        "dict",
        torch::nn::ModuleDict(torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>{
            {"norm", torch::nn::BatchNorm3d(6).ptr()}}));
    inner = register_module("inner", torch::nn::Sequential(torch::nn::BatchNorm1d(7)));
  }
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::ModuleList list{nullptr};
  torch::nn::ModuleDict dict{nullptr};
  torch::nn::Sequential inner{nullptr};
};
}  // namespace

TEST_CASE("convert_sync_batchnorm: nested modules, containers, a lone layer and bad input") {
  auto net = std::make_shared<NestedBnNet>();
  net->train(false);
  auto out = distrpc::nn::convert_sync_batchnorm(net);
  CHECK(out == net);
  const auto children = net->named_children();
  auto bn = std::dynamic_pointer_cast<SyncBatchNormImpl>(children["bn"]);
  REQUIRE(bn != nullptr);
  CHECK(bn->options.num_features() == 2);
  CHECK_FALSE(bn->is_training());  // the mode of the layer it replaced
  // Containers hold the new layers in their own lists as well.
  CHECK(std::dynamic_pointer_cast<SyncBatchNormImpl>(net->list[0]) != nullptr);
  CHECK(std::dynamic_pointer_cast<torch::nn::LinearImpl>(net->list[1]) != nullptr);
  CHECK(std::dynamic_pointer_cast<SyncBatchNormImpl>(net->list->named_children()["0"]) != nullptr);
  CHECK(std::dynamic_pointer_cast<SyncBatchNormImpl>(net->dict["norm"]) != nullptr);
  CHECK(std::dynamic_pointer_cast<SyncBatchNormImpl>(net->dict->named_children()["norm"]) !=
        nullptr);
  CHECK(std::dynamic_pointer_cast<SyncBatchNormImpl>(net->inner->ptr(0)) != nullptr);
  // Every batch norm of the tree was replaced.
  int sync_count = 0;
  for (const auto& m : net->modules()) {
    CHECK(std::dynamic_pointer_cast<torch::nn::BatchNorm1dImpl>(m) == nullptr);
    CHECK(std::dynamic_pointer_cast<torch::nn::BatchNorm2dImpl>(m) == nullptr);
    CHECK(std::dynamic_pointer_cast<torch::nn::BatchNorm3dImpl>(m) == nullptr);
    if (std::dynamic_pointer_cast<SyncBatchNormImpl>(m)) ++sync_count;
  }
  CHECK(sync_count == 4);

  // A lone batch norm comes back as a new SyncBatchNorm with its options.
  torch::nn::BatchNorm3d lone(torch::nn::BatchNorm3dOptions(5)
                                  .eps(1e-2)
                                  .momentum(c10::nullopt)
                                  .affine(false)
                                  .track_running_stats(false));
  auto converted =
      std::dynamic_pointer_cast<SyncBatchNormImpl>(distrpc::nn::convert_sync_batchnorm(lone));
  REQUIRE(converted != nullptr);
  CHECK(converted->options.num_features() == 5);
  CHECK(converted->options.eps() == 1e-2);
  CHECK_FALSE(converted->options.momentum().has_value());
  CHECK_FALSE(converted->options.affine());
  CHECK_FALSE(converted->options.track_running_stats());
  CHECK_FALSE(converted->weight.defined());
  CHECK_FALSE(converted->running_mean.defined());
  // A module with no batch norm is returned as it is.
  torch::nn::Linear linear(2, 2);
  CHECK(distrpc::nn::convert_sync_batchnorm(linear) ==
        std::static_pointer_cast<torch::nn::Module>(linear.ptr()));

  using E = std::invalid_argument;
  CHECK(error_text<E>([] {
          distrpc::nn::convert_sync_batchnorm(std::shared_ptr<torch::nn::Module>());
        }) == "convert_sync_batchnorm: the module is null");
  CHECK(error_text<E>([] {
          distrpc::nn::convert_sync_batchnorm(torch::nn::BatchNorm1d(nullptr));
        }) == "convert_sync_batchnorm: the module is null");
  CHECK(error_text<E>([] {
          distrpc::nn::convert_sync_batchnorm(torch::nn::BatchNorm1d(2),
                                              dist::ProcessGroup::non_member());
        }) ==
        "convert_sync_batchnorm: this process is not a member of the process group given "
        "(ProcessGroup::non_member())");
}

// ---- Two ranks.

DISTRPC_MP_TEST("SyncBatchNorm [distrpc]: 2 ranks match BatchNorm on the concatenated batch", 2,
                120) {
  values_scenario(ctx, "distrpc");
}

DISTRPC_MP_TEST("SyncBatchNorm [distrpc]: an empty batch on rank 1 makes no NaN", 2, 120) {
  empty_batch_scenario(ctx, "distrpc");
}

#ifdef USE_C10D_GLOO
DISTRPC_MP_TEST("SyncBatchNorm [gloo]: 2 ranks match BatchNorm on the concatenated batch", 2, 120) {
  values_scenario(ctx, "gloo");
}

DISTRPC_MP_TEST("SyncBatchNorm [gloo]: an empty batch on rank 1 makes no NaN", 2, 120) {
  empty_batch_scenario(ctx, "gloo");
}
#endif

// Rank 1 joins the group and then does nothing: rank 0's eval-mode passes must not wait for it
// (a collective would fail after the group's 5 s timeout) nor move the group's sequence number.
DISTRPC_MP_TEST("SyncBatchNorm: eval mode uses the running statistics and makes no collective", 2,
                60) {
  init(ctx, "distrpc", std::chrono::milliseconds(5000));
  if (ctx.rank == 1) {
    ctx.lookup("done", std::chrono::seconds(45));
    dist::destroy_process_group();
    return;
  }
  auto world = dist::get_default_group();
  const std::uint64_t seq_before = world->sequence_number();

  SyncBatchNorm bn(3);
  set_affine(bn->weight, bn->bias);
  {
    torch::NoGradGuard no_grad;
    bn->running_mean.copy_(at::tensor({1.0f, -2.0f, 0.5f}));
    bn->running_var.copy_(at::tensor({4.0f, 0.25f, 9.0f}));
  }
  bn->eval();
  torch::manual_seed(11);
  at::Tensor x = at::randn({2, 3, 4}).requires_grad_(true);
  at::Tensor y = bn->forward(x);
  const at::Tensor expected = (x.detach() - bn->running_mean.view({1, 3, 1})) /
                                  (bn->running_var.view({1, 3, 1}) + 1e-5).sqrt() *
                                  bn->weight.detach().view({1, 3, 1}) +
                              bn->bias.detach().view({1, 3, 1});
  check_close(y, expected, "eval output");
  y.sum().backward();  // BatchNorm's own backward: no collective either
  CHECK(x.grad().defined());
  CHECK(at::equal(bn->running_mean, at::tensor({1.0f, -2.0f, 0.5f})));  // not updated
  CHECK(bn->num_batches_tracked.item<int64_t>() == 0);

  // Without running statistics, eval mode normalizes with this rank's batch alone (PyTorch's
  // behaviour: statistics are only shared in training mode).
  SyncBatchNorm batch_only(SyncBatchNormOptions(3).track_running_stats(false));
  torch::nn::BatchNorm1d ref(torch::nn::BatchNorm1dOptions(3).track_running_stats(false));
  batch_only->eval();
  ref->eval();
  check_close(batch_only->forward(x.detach()), ref->forward(x.detach()), "local batch statistics");

  CHECK(world->sequence_number() == seq_before);
  ctx.publish("done", "1");
  dist::destroy_process_group();
}

// A group of one: training mode is a local BatchNorm, and nothing is sent.
DISTRPC_MP_TEST("SyncBatchNorm: a group of one is torch::nn::BatchNorm", 1, 60) {
  init(ctx, "distrpc");
  auto world = dist::get_default_group();
  const std::uint64_t seq_before = world->sequence_number();
  check_against_batch_norm("group of one", torch::nn::BatchNorm2d(2), SyncBatchNorm(2),
                           {0, 2, 3, 3}, {4}, 0, world, 1);
  // check_against_batch_norm's own all-reduces of the gradients are the only collectives.
  CHECK(world->sequence_number() == seq_before + 2);
  dist::destroy_process_group();
}
