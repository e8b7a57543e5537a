// DistributedDataParallel: data-parallel training of a libtorch module over a process group
// (PyTorch's torch.nn.parallel.DistributedDataParallel). Every rank holds a replica; the wrapper
// checks at construction that the replicas agree (parameter names, shapes, dtypes), makes them
// equal (rank 0's parameters and buffers are broadcast), and from then on averages the gradients
// over the group during each backward pass, bucket by bucket (see reducer.hpp).
//
//   auto model = std::make_shared<Net>();
//   distrpc::nn::DistributedDataParallel ddp(model, {.bucket_cap_mb = 25});
//   torch::optim::SGD opt(model->parameters(), 0.1);
//   at::Tensor loss = ddp.forward(x).sum();      // or ddp(x)
//   loss.backward();                             // gradients averaged over the group
//   opt.step();
//   { auto guard = ddp.no_sync(); ddp(x2).sum().backward(); }   // accumulate locally
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Type.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <distrpc/ddp/grad_bucket.hpp>
#include <distrpc/ddp/reducer.hpp>
#include <distrpc/dist.hpp>
#include <distrpc/future.hpp>

namespace distrpc::nn {

// Aggregate: use designated initializers, in this order.
struct DDPOptions {
  std::shared_ptr<dist::ProcessGroup> process_group{};  // null: the default group
  double bucket_cap_mb = 25;                            // later buckets' size limit (MiB)
  bool broadcast_buffers = true;                        // rank 0's buffers before each forward
  bool find_unused_parameters = false;   // search the graph after forward for unused parameters
  bool gradient_as_bucket_view = false;  // param.grad is a view of its bucket (no copy back)
  bool static_graph = false;             // the graph is the same every iteration
};

namespace detail {

// The tensors of a forward's result, for the unused-parameter search: a tensor, and tensors
// inside vectors, arrays, tuples, pairs, optionals and the values of maps (recursively); other
// types hold none.
inline void collect_tensors(const at::Tensor& t, std::vector<at::Tensor>& out);
template <class T>
void collect_tensors(const std::vector<T>& v, std::vector<at::Tensor>& out);
template <class T, std::size_t N>
void collect_tensors(const std::array<T, N>& v, std::vector<at::Tensor>& out);
template <class... T>
void collect_tensors(const std::tuple<T...>& t, std::vector<at::Tensor>& out);
template <class A, class B>
void collect_tensors(const std::pair<A, B>& p, std::vector<at::Tensor>& out);
template <class T>
void collect_tensors(const std::optional<T>& o, std::vector<at::Tensor>& out);
template <class K, class V, class C, class A>
void collect_tensors(const std::map<K, V, C, A>& m, std::vector<at::Tensor>& out);
template <class K, class V, class H, class E, class A>
void collect_tensors(const std::unordered_map<K, V, H, E, A>& m, std::vector<at::Tensor>& out);
template <class T>
void collect_tensors(const T&, std::vector<at::Tensor>&) {}

inline void collect_tensors(const at::Tensor& t, std::vector<at::Tensor>& out) {
  out.push_back(t);
}
template <class T>
void collect_tensors(const std::vector<T>& v, std::vector<at::Tensor>& out) {
  for (const auto& x : v) collect_tensors(x, out);
}
template <class... T>
void collect_tensors(const std::tuple<T...>& t, std::vector<at::Tensor>& out) {
  std::apply([&](const auto&... x) { (collect_tensors(x, out), ...); }, t);
}
template <class A, class B>
void collect_tensors(const std::pair<A, B>& p, std::vector<at::Tensor>& out) {
  collect_tensors(p.first, out);
  collect_tensors(p.second, out);
}
template <class T, std::size_t N>
void collect_tensors(const std::array<T, N>& v, std::vector<at::Tensor>& out) {
  for (const auto& x : v) collect_tensors(x, out);
}
template <class T>
void collect_tensors(const std::optional<T>& o, std::vector<at::Tensor>& out) {
  if (o) collect_tensors(*o, out);
}
template <class K, class V, class C, class A>
void collect_tensors(const std::map<K, V, C, A>& m, std::vector<at::Tensor>& out) {
  for (const auto& [k, v] : m) collect_tensors(v, out);
}
template <class K, class V, class H, class E, class A>
void collect_tensors(const std::unordered_map<K, V, H, E, A>& m, std::vector<at::Tensor>& out) {
  for (const auto& [k, v] : m) collect_tensors(v, out);
}

// Broadcasts tensors from `src` (a global rank), one flat tensor per dtype.
inline void broadcast_coalesced(const std::vector<at::Tensor>& tensors, int src,
                                const std::shared_ptr<dist::ProcessGroup>& group) {
  at::NoGradGuard no_grad;
  std::vector<bool> done(tensors.size(), false);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (done[i]) continue;
    std::vector<std::size_t> same;
    for (std::size_t j = i; j < tensors.size(); ++j) {
      if (!done[j] && tensors[j].scalar_type() == tensors[i].scalar_type() &&
          tensors[j].device() == tensors[i].device()) {
        same.push_back(j);
        done[j] = true;
      }
    }
    std::vector<at::Tensor> flat;
    for (std::size_t j : same) flat.push_back(tensors[j].detach().reshape({-1}));
    at::Tensor all = at::cat(flat);
    dist::broadcast(all, src, {.group = group});
    std::int64_t off = 0;
    for (std::size_t j : same) {
      at::Tensor t = tensors[j].detach();
      t.copy_(all.narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
  }
}

}  // namespace detail

// While alive, backward passes through the wrapper accumulate gradients locally without
// communicating (PyTorch's no_sync()); the next synchronized backward reduces the sum.
class NoSyncGuard {
 public:
  NoSyncGuard(NoSyncGuard&& o) noexcept : flag_(std::move(o.flag_)), saved_(o.saved_) {}
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(NoSyncGuard&&) = delete;
  ~NoSyncGuard() {
    if (flag_) *flag_ = saved_;
  }

 private:
  template <class M>
  friend class DistributedDataParallel;
  explicit NoSyncGuard(std::shared_ptr<bool> flag) : flag_(std::move(flag)), saved_(*flag_) {
    *flag_ = false;
  }
  std::shared_ptr<bool> flag_;
  bool saved_;
};

template <class M>
class DistributedDataParallel {
 public:
  explicit DistributedDataParallel(std::shared_ptr<M> module, DDPOptions opts = {})
      : module_(std::move(module)), opts_(std::move(opts)) {
    if (!module_) throw std::invalid_argument("DistributedDataParallel: the module is null");
    if (!(opts_.bucket_cap_mb >= 0)) {
      throw std::invalid_argument("DistributedDataParallel: bucket_cap_mb must be >= 0, got " +
                                  std::to_string(opts_.bucket_cap_mb));
    }
    group_ = opts_.process_group ? opts_.process_group : dist::get_default_group();
    if (!group_->is_member()) {
      throw std::invalid_argument(
          "DistributedDataParallel: this process is not a member of the process group");
    }
    // Every parameter once (a module may share one under two names), in registration order.
    std::vector<at::Tensor> all;
    std::vector<std::string> all_names;
    std::unordered_set<const c10::TensorImpl*> seen;
    for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
      if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
      all.push_back(item.value());
      all_names.push_back(item.key());
    }
    verify_across_ranks(all, all_names);
    for (const auto& b : module_->buffers(/*recurse=*/true)) buffers_.push_back(b);
    std::vector<at::Tensor> state = all;
    state.insert(state.end(), buffers_.begin(), buffers_.end());
    if (!state.empty()) detail::broadcast_coalesced(state, src(), group_);

    std::vector<at::Tensor> params;
    std::vector<std::string> names;
    for (std::size_t i = 0; i < all.size(); ++i) {
      if (!all[i].requires_grad()) continue;
      params.push_back(all[i]);
      names.push_back(all_names[i]);
    }
    ddp::ReducerOptions ro;
    ro.bucket_bytes_cap = static_cast<std::size_t>(opts_.bucket_cap_mb * 1024.0 * 1024.0);
    ro.find_unused_parameters = opts_.find_unused_parameters;
    ro.gradient_as_bucket_view = opts_.gradient_as_bucket_view;
    ro.static_graph = opts_.static_graph;
    reducer_ = ddp::Reducer::create(std::move(params), std::move(names), group_, ro);
  }

  template <class Impl>
  requires std::is_same_v<Impl, M>
  explicit DistributedDataParallel(const torch::nn::ModuleHolder<Impl>& holder,
                                   DDPOptions opts = {})
      : DistributedDataParallel(holder.ptr(), std::move(opts)) {}

  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;
  DistributedDataParallel(DistributedDataParallel&&) noexcept = default;
  DistributedDataParallel& operator=(DistributedDataParallel&&) noexcept = default;

  // The module's forward, with the gradient synchronization around it: rank 0's buffers first
  // (broadcast_buffers, when the forward before was synchronized), then, when grad mode is on
  // outside no_sync, the reducer is prepared for the backward pass of the result.
  template <class... Args>
  auto forward(Args&&... args) {
    const bool sync = at::GradMode::is_enabled() && *require_sync_;
    if (sync) reducer_->rebuild_buckets_if_needed();
    // As PyTorch: only after a synchronized forward (and before the first), so no_sync
    // micro-steps and evaluation under no-grad do not pay a collective each.
    if (opts_.broadcast_buffers && !buffers_.empty() && sync_buffers_) {
      detail::broadcast_coalesced(buffers_, src(), group_);
    }
    auto out = module_->forward(std::forward<Args>(args)...);
    sync_buffers_ = sync;
    if (sync) {
      std::vector<at::Tensor> outputs;
      if (opts_.find_unused_parameters && !opts_.static_graph) {
        detail::collect_tensors(out, outputs);
        // Searched from nothing, every parameter would count as unused, and the first gradient
        // would fail as a double mark: a result the search cannot see into is named instead.
        if (outputs.empty()) {
          throw std::invalid_argument(
              "DistributedDataParallel: find_unused_parameters searches the graph from the "
              "tensors of forward's result, and its result (" +
              c10::demangle(typeid(out).name()) +
              ") holds none that it can see: return a tensor, or tensors in a std::vector, "
              "std::array, std::tuple, std::pair, std::optional or the values of a std::map or "
              "std::unordered_map");
        }
      }
      reducer_->prepare_for_backward(outputs);
    }
    return out;
  }
  template <class... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  // The wrapped module (PyTorch's ddp.module).
  const std::shared_ptr<M>& module() const noexcept { return module_; }
  const std::shared_ptr<dist::ProcessGroup>& process_group() const noexcept { return group_; }
  const DDPOptions& options() const noexcept { return opts_; }

  // Replaces the default reduction: hook(state, bucket) returns a Future of the bucket's reduced
  // gradients (flat, as bucket.buffer()). The wrapper keeps `state` alive. Once only.
  template <class State, class Hook>
  void register_comm_hook(State state, Hook hook) {
    static_assert(std::is_invocable_r_v<Future<at::Tensor>, Hook&, State&, ddp::GradBucket&>,
                  "register_comm_hook: the hook must be callable as "
                  "hook(State& state, distrpc::ddp::GradBucket& bucket) -> "
                  "distrpc::Future<at::Tensor>");
    auto s = std::make_shared<State>(std::move(state));
    reducer_->register_comm_hook(
        [s, h = std::move(hook)](ddp::GradBucket& b) mutable -> Future<at::Tensor> {
          return std::invoke(h, *s, b);
        });
  }

  // Backward passes of forwards run while the guard lives accumulate gradients locally.
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(require_sync_); }

  ddp::ReducerStats stats() const { return reducer_->stats(); }
  const std::shared_ptr<ddp::Reducer>& reducer() const noexcept { return reducer_; }

 private:
  int src() const { return group_->global_ranks().front(); }

  // Every rank describes its parameters; the first difference from rank 0 fails every rank with
  // the same text.
  void verify_across_ranks(const std::vector<at::Tensor>& params,
                           const std::vector<std::string>& names) {
    // Name, dtype, shape, and whether it is trained: the reducer's buckets hold the trained
    // ones only, so ranks that freeze different parameters of one shape would average unrelated
    // gradients.
    constexpr std::size_t kFields = 4;
    std::vector<std::string> mine;
    for (std::size_t i = 0; i < params.size(); ++i) {
      mine.push_back(names[i]);
      mine.push_back(c10::toString(params[i].scalar_type()));
      mine.push_back(c10::str(params[i].sizes()));
      mine.push_back(params[i].requires_grad() ? "requires grad" : "does not require grad");
    }
    std::vector<std::vector<std::string>> all;
    dist::all_gather_object(all, mine, {.group = group_});
    const auto& ranks = group_->global_ranks();
    const auto& first = all.front();
    for (std::size_t r = 1; r < all.size(); ++r) {
      const auto& other = all[r];
      const std::string r0 = "rank " + std::to_string(ranks.front());
      const std::string rr = "rank " + std::to_string(ranks[r]);
      for (std::size_t k = 0; k + kFields - 1 < std::min(first.size(), other.size());
           k += kFields) {
        if (first[k] != other[k]) {
          throw std::invalid_argument("DistributedDataParallel: parameter " +
                                      std::to_string(k / kFields) + " is '" + first[k] + "' on " +
                                      r0 + " but '" + other[k] + "' on " + rr);
        }
        if (first[k + 1] != other[k + 1]) {
          throw std::invalid_argument("DistributedDataParallel: parameter '" + first[k] +
                                      "' has dtype " + first[k + 1] + " on " + r0 + " but " +
                                      other[k + 1] + " on " + rr);
        }
        if (first[k + 2] != other[k + 2]) {
          throw std::invalid_argument("DistributedDataParallel: parameter '" + first[k] +
                                      "' has shape " + first[k + 2] + " on " + r0 + " but " +
                                      other[k + 2] + " on " + rr);
        }
        if (first[k + 3] != other[k + 3]) {
          throw std::invalid_argument("DistributedDataParallel: parameter '" + first[k] + "' " +
                                      first[k + 3] + " on " + r0 + " but " + other[k + 3] + " on " +
                                      rr + " (every rank must train the same parameters)");
        }
      }
      if (first.size() != other.size()) {
        throw std::invalid_argument("DistributedDataParallel: " + r0 + " has " +
                                    std::to_string(first.size() / kFields) + " parameters but " +
                                    rr + " has " + std::to_string(other.size() / kFields));
      }
    }
  }

  std::shared_ptr<M> module_;
  DDPOptions opts_;
  std::shared_ptr<dist::ProcessGroup> group_;
  std::vector<at::Tensor> buffers_;
  std::shared_ptr<ddp::Reducer> reducer_;
  std::shared_ptr<bool> require_sync_ = std::make_shared<bool>(true);
  // Whether the next forward broadcasts the buffers: the last forward was synchronized.
  bool sync_buffers_ = true;
};

template <class M>
DistributedDataParallel(std::shared_ptr<M>, DDPOptions = {}) -> DistributedDataParallel<M>;
template <class Impl>
DistributedDataParallel(const torch::nn::ModuleHolder<Impl>&, DDPOptions = {})
    -> DistributedDataParallel<Impl>;

}  // namespace distrpc::nn
