// SyncBatchNorm: batch normalization over the batch of a whole process group (PyTorch's
// torch.nn.SyncBatchNorm), and convert_sync_batchnorm, which swaps it in for the
// torch::nn::BatchNorm1d/2d/3d layers of a model before it is wrapped for data-parallel training.
//
//   distrpc::nn::SyncBatchNorm bn(distrpc::nn::SyncBatchNormOptions(64).momentum(0.01));
//   auto model = distrpc::nn::convert_sync_batchnorm(my_model.ptr(), group);  // null: the world
//
// In training mode every member computes its batch's per-channel mean, sum of squared deviations
// and count, the group all-gathers them, and each member normalizes its own slice with the mean
// and (biased) variance of the concatenated batch; the running statistics take the unbiased
// variance, as torch::nn::BatchNorm does. The backward all-reduces the per-channel sums of the
// output gradient and of the output gradient times (x - mean), so the input gradient is that of
// batch normalization over the concatenated batch. The weight and bias gradients stay local (each
// member's share): data-parallel training averages them like any other parameter's.
//
// A member whose batch is empty (size 0 on dimension 0) takes part in both collectives with a
// count of 0: its output and input gradient are empty, its weight and bias gradients zero, and the
// others normalize as if it were absent. Every member of the group must run the same forward and
// backward passes (the collectives pair up in order), in training mode on all or none of them.
//
// Eval mode (with running statistics), a group of one, and a process with no default group when
// none is named fall back to torch::nn::BatchNorm's computation, with no collective.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <ostream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/arg.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/functional/batchnorm.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <distrpc/dist.hpp>

namespace distrpc::nn {

// ---- Options (torch::nn::BatchNormOptions' fields, plus the group).

struct SyncBatchNormOptions {
  /* implicit */ SyncBatchNormOptions(int64_t num_features) : num_features_(num_features) {}

  // C of an input of size (N, C, ...).
  TORCH_ARG(int64_t, num_features);
  // Added to the variance before its square root.
  TORCH_ARG(double, eps) = 1e-5;
  // Weight of the new batch in the running statistics; nullopt: a cumulative average over the
  // batches seen (1 / num_batches_tracked). Write std::nullopt (c10::nullopt is another type in
  // libtorch 1.13).
  TORCH_ARG(std::optional<double>, momentum) = 0.1;
  // Learnable per-channel weight (ones) and bias (zeros).
  TORCH_ARG(bool, affine) = true;
  // Keep running_mean / running_var (used in eval mode); false: batch statistics always.
  TORCH_ARG(bool, track_running_stats) = true;
  // The group whose members share statistics; null: the default group (the world).
  TORCH_ARG(std::shared_ptr<dist::ProcessGroup>, process_group) = nullptr;
};

class SyncBatchNormImpl;

namespace detail {

// What the autograd function needs besides its differentiable inputs (passed as one value so that
// autograd gives it no gradient slot of its own).
struct SyncBatchNormArgs {
  at::Tensor running_mean;  // undefined: no running statistics to update
  at::Tensor running_var;
  double eps = 1e-5;
  double momentum = 0.1;  // the factor of this step (already resolved for a cumulative average)
  std::shared_ptr<dist::ProcessGroup> group;  // a member of it, size >= 2
};

// Carries the group from forward to backward: AutogradContext::saved_data holds IValues only, and
// a capsule is the IValue that holds an arbitrary C++ object.
struct GroupCapsule : torch::CustomClassHolder {
  explicit GroupCapsule(std::shared_ptr<dist::ProcessGroup> g) : group(std::move(g)) {}
  std::shared_ptr<dist::ProcessGroup> group;
};

// The dimensions statistics are taken over: all but the channel dimension 1.
inline std::vector<int64_t> reduced_dims(const at::Tensor& input) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < input.dim(); ++d) dims.push_back(d);
  return dims;
}

// A per-channel vector shaped to broadcast against the input: (1, C, 1, ...).
inline at::Tensor per_channel(const at::Tensor& v, const at::Tensor& input) {
  std::vector<int64_t> shape(static_cast<std::size_t>(input.dim()), 1);
  shape[1] = input.size(1);
  return v.reshape(shape);
}

// The type statistics are accumulated and exchanged in: double, so that counts stay exact and the
// combination of members' moments loses nothing over a local batch norm.
inline constexpr at::ScalarType kStatsType = at::kDouble;

// forward: (input, weight, bias, args) -> output; backward gives input, weight and bias gradients.
struct SyncBatchNormFunction : torch::autograd::Function<SyncBatchNormFunction> {
  // weight and bias: both or neither (affine). They come as optionals because libtorch 1.13's
  // Function records every Tensor argument as a variable, and an undefined one has no device.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input_,
                            const c10::optional<at::Tensor>& weight_opt,
                            const c10::optional<at::Tensor>& bias_opt,
                            const SyncBatchNormArgs& args) {
    const at::Tensor input = input_.contiguous();
    const at::Tensor weight = weight_opt.value_or(at::Tensor());
    const at::Tensor bias = bias_opt.value_or(at::Tensor());
    const int64_t channels = input.size(1);
    const int64_t local_count = input.numel() / channels;
    const auto dims = reduced_dims(input);
    const auto& group = args.group;

    // This member's moments: per-channel mean, sum of squared deviations (M2), and the count.
    // An empty batch sends zeros with a count of 0, which drop out of the combination below.
    at::Tensor mine = at::zeros({2 * channels + 1}, input.options().dtype(kStatsType));
    if (local_count > 0) {
      auto [var, mean] = at::var_mean(input.to(kStatsType), dims, /*unbiased=*/false);
      mine.narrow(0, 0, channels).copy_(mean);
      mine.narrow(0, channels, channels).copy_(var * static_cast<double>(local_count));
      mine[2 * channels].fill_(static_cast<double>(local_count));
    }
    // All-gather rather than all-reduce: members' counts differ, and combining means and M2
    // (Chan et al.) is exact where sums of squares would cancel.
    std::vector<at::Tensor> gathered;
    for (int r = 0; r < group->size(); ++r) gathered.push_back(at::empty_like(mine));
    dist::all_gather(gathered, mine, {.group = group});
    const at::Tensor all = at::stack(gathered);  // (world, 2C + 1)
    const at::Tensor means = all.narrow(1, 0, channels);
    const at::Tensor m2s = all.narrow(1, channels, channels);
    const at::Tensor counts = all.narrow(1, 2 * channels, 1);
    const double total = counts.sum().item<double>();
    if (total == 1) {
      // The same on every member (they all gathered the same counts), so all of them throw.
      throw std::invalid_argument(
          "SyncBatchNorm: expected more than 1 value per channel when training, got 1 over the "
          "whole group of " +
          std::to_string(group->size()) + " (this member's input size " + c10::str(input.sizes()) +
          ")");
    }

    at::Tensor mean = at::zeros({channels}, means.options());
    at::Tensor invstd = at::zeros({channels}, means.options());
    if (total > 0) {
      mean = (means * counts).sum(0) / total;
      const at::Tensor m2 = (m2s + counts * (means - mean).pow(2)).sum(0);
      invstd = (m2 / total + args.eps).rsqrt();
      if (args.running_mean.defined()) {
        at::NoGradGuard no_grad;
        const double m = args.momentum;
        args.running_mean.mul_(1 - m).add_(mean.to(args.running_mean.scalar_type()), m);
        args.running_var.mul_(1 - m).add_((m2 / (total - 1)).to(args.running_var.scalar_type()), m);
      }
    }

    ctx->save_for_backward({input, weight, mean, invstd});
    ctx->saved_data["total"] = total;
    ctx->saved_data["group"] = at::IValue::make_capsule(c10::make_intrusive<GroupCapsule>(group));

    if (local_count == 0) return at::empty_like(input);
    const at::Tensor scale =
        weight.defined() ? invstd.to(input.scalar_type()) * weight : invstd.to(input.scalar_type());
    at::Tensor out =
        (input - per_channel(mean.to(input.scalar_type()), input)) * per_channel(scale, input);
    if (bias.defined()) out.add_(per_channel(bias, input));
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& mean = saved[2];
    const at::Tensor& invstd = saved[3];
    const double total = ctx->saved_data["total"].toDouble();
    const auto group =
        c10::static_intrusive_pointer_cast<GroupCapsule>(ctx->saved_data["group"].toCapsule())
            ->group;
    const at::Tensor grad_out = grad_outputs[0].contiguous();
    const int64_t channels = input.size(1);
    const bool local = input.numel() > 0;

    // Per channel: sum(dy) and sum(dy * (x - mean)) over this member's batch (zeros when empty).
    at::Tensor sums = at::zeros({2 * channels}, input.options().dtype(kStatsType));
    at::Tensor xmu;
    if (local) {
      const auto dims = reduced_dims(input);
      xmu = input - per_channel(mean.to(input.scalar_type()), input);
      sums.narrow(0, 0, channels).copy_(grad_out.to(kStatsType).sum(dims));
      sums.narrow(0, channels, channels).copy_((grad_out * xmu).to(kStatsType).sum(dims));
    }
    // The parameters' gradients are this member's share, before the group's sums replace these.
    at::Tensor grad_weight, grad_bias;
    if (weight.defined() && ctx->needs_input_grad(1)) {
      grad_weight = (sums.narrow(0, channels, channels) * invstd).to(weight.scalar_type());
    }
    if (weight.defined() && ctx->needs_input_grad(2)) {
      grad_bias = sums.narrow(0, 0, channels).to(weight.scalar_type());
    }
    // Always joined, even where this member's input needs no gradient, so that members never
    // disagree on whether the collective happens.
    dist::all_reduce(sums, {.op = dist::ReduceOp::SUM, .group = group});

    at::Tensor grad_input;
    if (ctx->needs_input_grad(0)) {
      if (!local || total == 0) {
        grad_input = at::zeros_like(input);
      } else {
        // d/dx of BN over the concatenated batch:
        // (dy - sum(dy)/N - (x - mean) * invstd^2 * sum(dy (x - mean))/N) * invstd * weight
        const auto dt = input.scalar_type();
        const at::Tensor mean_dy = (sums.narrow(0, 0, channels) / total).to(dt);
        const at::Tensor proj =
            (sums.narrow(0, channels, channels) / total * invstd * invstd).to(dt);
        at::Tensor scale = invstd.to(dt);
        if (weight.defined()) scale = scale * weight;
        grad_input = (grad_out - per_channel(mean_dy, input) - xmu * per_channel(proj, input)) *
                     per_channel(scale, input);
      }
    }
    return {grad_input, grad_weight, grad_bias, at::Tensor()};
  }
};

}  // namespace detail

// ---- The module (torch::nn conventions: SyncBatchNormImpl, held by SyncBatchNorm).

class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  explicit SyncBatchNormImpl(const SyncBatchNormOptions& options_) : options(options_) {
    check_options(options);
    reset();
  }
  explicit SyncBatchNormImpl(int64_t num_features)
      : SyncBatchNormImpl(SyncBatchNormOptions(num_features)) {}

  // Registers fresh parameters (weight ones, bias zeros) and statistics (mean 0, variance 1), as
  // torch::nn::BatchNorm does; the first reset of a from_batch_norm layer registers the converted
  // layer's tensors instead.
  void reset() override {
    const int64_t c = options.num_features();
    Adopted from = std::move(adopted_);
    adopted_ = {};  // once: a clone must not share the converted layer's tensors
    if (options.affine()) {
      weight = register_parameter("weight", from.weight.defined() ? from.weight : at::ones({c}));
      bias = register_parameter("bias", from.bias.defined() ? from.bias : at::zeros({c}));
    } else {
      weight = register_parameter("weight", at::Tensor(), /*requires_grad=*/false);
      bias = register_parameter("bias", at::Tensor(), /*requires_grad=*/false);
    }
    if (options.track_running_stats()) {
      running_mean = register_buffer(
          "running_mean", from.running_mean.defined() ? from.running_mean : at::zeros({c}));
      running_var = register_buffer("running_var",
                                    from.running_var.defined() ? from.running_var : at::ones({c}));
      num_batches_tracked = register_buffer(
          "num_batches_tracked", from.num_batches_tracked.defined()
                                     ? from.num_batches_tracked
                                     : at::zeros({}, at::TensorOptions().dtype(at::kLong)));
    } else {
      running_mean = register_buffer("running_mean", at::Tensor());
      running_var = register_buffer("running_var", at::Tensor());
      num_batches_tracked = register_buffer("num_batches_tracked", at::Tensor());
    }
  }

  void reset_running_stats() {
    if (!options.track_running_stats()) return;
    at::NoGradGuard no_grad;
    running_mean.zero_();
    running_var.fill_(1);
    num_batches_tracked.zero_();
  }

  void reset_parameters() {
    reset_running_stats();
    if (!options.affine()) return;
    at::NoGradGuard no_grad;
    weight.fill_(1);
    bias.zero_();
  }

  // input: (N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W) with C = num_features, floating
  // point. In training mode (or without running statistics) it is normalized with the group's
  // batch statistics, otherwise with the running ones.
  at::Tensor forward(const at::Tensor& input) {
    check_input(input);
    double factor = options.momentum().value_or(0.0);
    if (is_training() && options.track_running_stats()) {
      at::NoGradGuard no_grad;
      num_batches_tracked.add_(1);
      if (!options.momentum()) factor = 1.0 / num_batches_tracked.item<double>();
    }
    // Batch statistics in training mode, and always where no running ones are kept.
    const bool batch_stats = is_training() || !running_mean.defined();
    // The running statistics are read in eval mode and updated in training mode when kept.
    const bool use_running = !is_training() || options.track_running_stats();
    const at::Tensor rm = use_running ? running_mean : at::Tensor();
    const at::Tensor rv = use_running ? running_var : at::Tensor();

    auto group = sync_group(batch_stats);
    if (!group) {
      return torch::nn::functional::batch_norm(input, rm, rv,
                                               torch::nn::functional::BatchNormFuncOptions()
                                                   .weight(weight)
                                                   .bias(bias)
                                                   .training(batch_stats)
                                                   .momentum(factor)
                                                   .eps(options.eps()));
    }
    auto opt = [](const at::Tensor& t) {
      return t.defined() ? c10::optional<at::Tensor>(t) : c10::optional<at::Tensor>();
    };
    return detail::SyncBatchNormFunction::apply(
        input, opt(weight), opt(bias),
        detail::SyncBatchNormArgs{rm, rv, options.eps(), factor, group});
  }

  void pretty_print(std::ostream& stream) const override {
    stream << "distrpc::nn::SyncBatchNorm(" << options.num_features() << ", eps=" << options.eps()
           << ", momentum=";
    if (options.momentum()) {
      stream << *options.momentum();
    } else {
      stream << "None";
    }
    stream << ", affine=" << std::boolalpha << options.affine()
           << ", track_running_stats=" << options.track_running_stats() << ")";
  }

  // The layer convert_sync_batchnorm puts in place of a torch::nn::BatchNorm{1,2,3}d: same
  // options, and the very same weight, bias and running-statistics tensors (so optimizers and
  // state dicts that refer to them keep working).
  template <class BatchNormImpl>
  static std::shared_ptr<SyncBatchNormImpl> from_batch_norm(
      const BatchNormImpl& bn, std::shared_ptr<dist::ProcessGroup> process_group = nullptr) {
    const auto& o = bn.options;
    auto opts = SyncBatchNormOptions(o.num_features())
                    .eps(o.eps())
                    .affine(o.affine())
                    .track_running_stats(o.track_running_stats())
                    .process_group(std::move(process_group));
    opts.momentum(o.momentum() ? std::optional<double>(*o.momentum()) : std::nullopt);
    auto sync = std::shared_ptr<SyncBatchNormImpl>(new SyncBatchNormImpl(
        opts,
        Adopted{bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.num_batches_tracked}));
    sync->train(bn.is_training());
    return sync;
  }

  SyncBatchNormOptions options;
  at::Tensor weight;               // (C), defined when affine
  at::Tensor bias;                 // (C), defined when affine
  at::Tensor running_mean;         // (C), defined when track_running_stats
  at::Tensor running_var;          // (C), defined when track_running_stats
  at::Tensor num_batches_tracked;  // scalar long, defined when track_running_stats

 private:
  struct Adopted {
    at::Tensor weight, bias, running_mean, running_var, num_batches_tracked;
  };

  SyncBatchNormImpl(const SyncBatchNormOptions& options_, Adopted adopted)
      : options(options_), adopted_(std::move(adopted)) {
    check_options(options);
    reset();
  }

  static void check_options(const SyncBatchNormOptions& o) {
    if (o.num_features() <= 0) {
      throw std::invalid_argument("SyncBatchNorm: num_features must be positive, got " +
                                  std::to_string(o.num_features()));
    }
    if (!(o.eps() >= 0) || !std::isfinite(o.eps())) {
      throw std::invalid_argument("SyncBatchNorm: eps must be finite and non-negative, got " +
                                  c10::str(o.eps()));
    }
    if (o.momentum() && !(*o.momentum() >= 0 && *o.momentum() <= 1)) {
      throw std::invalid_argument("SyncBatchNorm: momentum must lie in [0, 1], got " +
                                  c10::str(*o.momentum()));
    }
    if (o.process_group() && !o.process_group()->is_member()) {
      // PyTorch falls back to a local batch norm here; a C++ caller holding a non-member group
      // almost surely picked the wrong one, so say so.
      throw std::invalid_argument(
          "SyncBatchNorm: this process is not a member of the process group given "
          "(ProcessGroup::non_member())");
    }
  }

  void check_input(const at::Tensor& input) const {
    if (!input.defined()) throw std::invalid_argument("SyncBatchNorm: the input is undefined");
    if (input.dim() < 2 || input.dim() > 5) {
      throw std::invalid_argument("SyncBatchNorm: expected a 2D to 5D input (N, C, ...), got a " +
                                  std::to_string(input.dim()) + "D input of size " +
                                  c10::str(input.sizes()));
    }
    if (input.size(1) != options.num_features()) {
      throw std::invalid_argument(
          "SyncBatchNorm: expected " + std::to_string(options.num_features()) +
          " channels (num_features) in dimension 1 of the input, got " +
          std::to_string(input.size(1)) + " (input size " + c10::str(input.sizes()) + ")");
    }
    if (!at::isFloatingType(input.scalar_type())) {
      throw std::invalid_argument("SyncBatchNorm: expected a floating-point input, got " +
                                  std::string(c10::toString(input.scalar_type())));
    }
  }

  // The group to synchronize with, or null for a local batch norm: only batch statistics in
  // training mode are shared, and only within a group of two or more.
  std::shared_ptr<dist::ProcessGroup> sync_group(bool batch_stats) const {
    if (!batch_stats || !is_training()) return nullptr;
    std::shared_ptr<dist::ProcessGroup> g = options.process_group();
    if (!g) {
      if (!dist::is_initialized()) return nullptr;
      g = dist::get_default_group();
    }
    if (!g || !g->is_member() || g->size() < 2) return nullptr;
    return g;
  }

  Adopted adopted_;
};

TORCH_MODULE(SyncBatchNorm);

// ---- Conversion.

namespace detail {

// A SyncBatchNorm for a torch::nn::BatchNorm{1,2,3}d, or null for any other module.
inline std::shared_ptr<SyncBatchNormImpl> sync_for(
    const std::shared_ptr<torch::nn::Module>& m,
    const std::shared_ptr<dist::ProcessGroup>& process_group) {
  if (auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm1dImpl>(m)) {
    return SyncBatchNormImpl::from_batch_norm(*bn, process_group);
  }
  if (auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm2dImpl>(m)) {
    return SyncBatchNormImpl::from_batch_norm(*bn, process_group);
  }
  if (auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm3dImpl>(m)) {
    return SyncBatchNormImpl::from_batch_norm(*bn, process_group);
  }
  return nullptr;
}

// Puts `to` where `from` was in the containers that call their elements themselves (Sequential,
// ModuleList, ModuleDict keep their own lists beside the registered children).
inline void replace_in_container(torch::nn::Module& parent,
                                 const std::shared_ptr<torch::nn::Module>& from,
                                 const std::shared_ptr<SyncBatchNormImpl>& to) {
  if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(&parent)) {
    for (auto& any : *seq) {
      if (any.ptr() == from) any = torch::nn::AnyModule(to);
    }
  } else if (auto* list = dynamic_cast<torch::nn::ModuleListImpl*>(&parent)) {
    for (auto& element : *list) {
      if (element == from) element = to;
    }
  } else if (auto* dict = dynamic_cast<torch::nn::ModuleDictImpl*>(&parent)) {
    for (auto& item : *dict) {
      if (item.value() == from) item.value() = to;
    }
  }
}

}  // namespace detail

// Replaces every torch::nn::BatchNorm1d/2d/3d in the tree under `module` by a SyncBatchNorm on
// `process_group` (null: the default group at forward time) with the same options and the same
// weight, bias and running-statistics tensors. Returns `module`, changed in place, or the new
// SyncBatchNorm when `module` itself is a batch norm.
//
// Sequential, ModuleList and ModuleDict call the new layers. A module of your own that calls a
// batch norm through a member holder (bn_ = register_module("bn", BatchNorm2d(...))) keeps
// calling the old one: its registered child is replaced, so re-read the member after conversion
// (bn_ = std::dynamic_pointer_cast<...>(named_children()["bn"]), with a SyncBatchNorm member type)
// or build such models from the containers.
inline std::shared_ptr<torch::nn::Module> convert_sync_batchnorm(
    std::shared_ptr<torch::nn::Module> module,
    std::shared_ptr<dist::ProcessGroup> process_group = nullptr) {
  if (!module) throw std::invalid_argument("convert_sync_batchnorm: the module is null");
  if (process_group && !process_group->is_member()) {
    throw std::invalid_argument(
        "convert_sync_batchnorm: this process is not a member of the process group given "
        "(ProcessGroup::non_member())");
  }
  if (auto sync = detail::sync_for(module, process_group)) return sync;
  for (const auto& child : module->named_children()) {
    const std::shared_ptr<torch::nn::Module> old = child.value();
    auto converted = convert_sync_batchnorm(old, process_group);
    if (converted == old) continue;
    auto sync = std::dynamic_pointer_cast<SyncBatchNormImpl>(converted);
    detail::replace_in_container(*module, old, sync);
    module->replace_module(child.key(), sync);
  }
  return module;
}

template <class M>
std::shared_ptr<torch::nn::Module> convert_sync_batchnorm(
    const torch::nn::ModuleHolder<M>& module,
    std::shared_ptr<dist::ProcessGroup> process_group = nullptr) {
  if (module.is_empty()) throw std::invalid_argument("convert_sync_batchnorm: the module is null");
  return convert_sync_batchnorm(std::static_pointer_cast<torch::nn::Module>(module.ptr()),
                                std::move(process_group));
}

}  // namespace distrpc::nn
