// Reducer: the gradient side of DistributedDataParallel (PyTorch's c10d::Reducer). It keeps the
// parameters' gradients in flat buckets, learns from hooks on each parameter's AccumulateGrad when
// a gradient is ready, and launches a bucket's reduction (the comm hook, by default an all-reduce
// then a division by the world size) the moment its last gradient is ready, in bucket order, so
// that communication overlaps the rest of the backward pass and every rank issues its collectives
// in the same order. At the end of the backward pass (a final callback of libtorch's engine) it
// waits for every bucket and writes the averaged gradients back: into `.grad`, or into the
// distributed-autograd context the pass runs in.
//
// One iteration, as DistributedDataParallel drives it:
//   forward:  rebuild_buckets_if_needed() (once, after the first iteration), the module's forward,
//             prepare_for_backward(outputs) (with find_unused_parameters: the graph search)
//   backward: each hook marks its parameter ready and copies its gradient into its bucket; the
//             first hook marks the unused parameters ready and queues the final callback's
//             schedule; a bucket whose gradients are all there is launched once the buckets
//             before it are; when the last bucket is launched the final callback is queued
//   end:      finalize: wait for every bucket (a failure fails backward()), copy back, reset
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <distrpc/ddp/grad_bucket.hpp>
#include <distrpc/dist.hpp>
#include <distrpc/dist/bucket_assignment.hpp>
#include <distrpc/dist_autograd.hpp>
#include <distrpc/future.hpp>

namespace distrpc::ddp {

// PyTorch's dist._DEFAULT_FIRST_BUCKET_BYTES: the first bucket is small so that the first
// reduction starts early.
inline constexpr std::size_t kDefaultFirstBucketBytes = std::size_t{1} << 20;

struct ReducerOptions {
  std::size_t first_bucket_bytes = kDefaultFirstBucketBytes;
  std::size_t bucket_bytes_cap = std::size_t{25} << 20;
  bool find_unused_parameters = false;
  bool gradient_as_bucket_view = false;
  bool static_graph = false;
};

// Counters for tests and benchmarks; a snapshot.
struct ReducerStats {
  std::size_t bucket_count = 0;
  std::vector<std::size_t> bucket_bytes;                 // per bucket, in bucket order
  std::vector<std::vector<std::size_t>> bucket_indices;  // parameter indices per bucket
  std::size_t iterations = 0;                            // synchronized backward passes finished
  std::size_t reductions_launched = 0;  // buckets launched in the last synchronized pass
  // Of those, how many were launched while some gradient of the pass was still being computed:
  // the reductions that overlapped the backward pass.
  std::size_t reductions_before_last_gradient = 0;
  bool buckets_rebuilt = false;
  std::vector<std::size_t> unused_parameters;  // found in the last synchronized pass
};

class Reducer : public std::enable_shared_from_this<Reducer> {
 public:
  // params: the parameters to reduce (distinct, requiring grad, one dtype and device per bucket);
  // names: theirs, for errors; group: the process group (non-null, this process a member).
  static std::shared_ptr<Reducer> create(std::vector<at::Tensor> params,
                                         std::vector<std::string> names,
                                         std::shared_ptr<dist::ProcessGroup> group,
                                         ReducerOptions opts) {
    std::shared_ptr<Reducer> r(
        new Reducer(std::move(params), std::move(names), std::move(group), opts));
    r->install_hooks();
    return r;
  }

  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;
  ~Reducer() {
    // The hooks hold only a weak reference; removing them keeps the accumulators clean for a
    // later wrapper of the same parameters.
    for (std::size_t i = 0; i < accumulators_.size(); ++i) {
      accumulators_[i]->del_post_hook(hook_keys_[i]);
    }
  }

  void register_comm_hook(CommHook hook) {
    if (!hook) throw std::invalid_argument("register_comm_hook: the hook is empty");
    std::lock_guard<std::mutex> lk(mu_);
    if (comm_hook_) {
      throw std::runtime_error(
          "register_comm_hook or register_builtin_comm_hook can only be called once.");
    }
    comm_hook_ = std::move(hook);
  }

  // Called by the wrapper after a forward pass whose backward must be synchronized.
  void prepare_for_backward(const std::vector<at::Tensor>& outputs) {
    std::lock_guard<std::mutex> lk(mu_);
    if (require_finalize_) throw std::runtime_error(prior_reduction_text());
    reset_pass_locked();
    expect_hooks_ = true;
    if (dynamic_find_unused() || static_first()) {
      if (!static_first()) unused_ = search_unused(outputs);
    } else if (opts_.static_graph) {
      unused_ = static_unused_;
      hook_counts_left_ = hook_counts_;
    }
  }

  // Called by the wrapper before a forward pass: after the first synchronized iteration, the
  // buckets are rebuilt in the order gradients arrived on rank 0 (broadcast, so all ranks agree).
  // Every rank calls it at the same point; returns true when it rebuilt.
  bool rebuild_buckets_if_needed() {
    const std::size_t n = params_.size();
    at::Tensor plan = at::zeros({static_cast<std::int64_t>(2 * n + 1)}, at::kLong);
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!should_rebuild() || iterations_ == 0 || ready_order_.size() != n) return false;
      std::vector<at::Tensor> tensors;
      std::vector<std::int64_t> indices;
      for (std::size_t i : ready_order_) {
        tensors.push_back(params_[i]);
        indices.push_back(static_cast<std::int64_t>(i));
      }
      const auto a = dist::compute_bucket_assignment_by_size(
          tensors, {opts_.first_bucket_bytes, opts_.bucket_bytes_cap}, {}, indices);
      auto* p = plan.data_ptr<std::int64_t>();
      p[0] = static_cast<std::int64_t>(a.buckets.size());
      std::size_t k = 0;
      for (std::size_t b = 0; b < a.buckets.size(); ++b) {
        p[1 + b] = static_cast<std::int64_t>(a.buckets[b].size());
        for (std::size_t i : a.buckets[b]) p[1 + n + k++] = static_cast<std::int64_t>(i);
      }
    }
    // On the parameters' device: a group of CUDA parameters may have no backend for the CPU
    // (init_process_group("nccl")). The copies are synchronous, so `plan` is complete below.
    at::Tensor sent = plan.to(comm_device());
    dist::broadcast(sent, group_->global_ranks().front(), {.group = group_});
    plan = sent.cpu();
    const auto* p = plan.data_ptr<std::int64_t>();
    std::vector<std::vector<std::size_t>> buckets(static_cast<std::size_t>(p[0]));
    std::size_t k = 0;
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      for (std::int64_t j = 0; j < p[1 + b]; ++j) {
        buckets[b].push_back(static_cast<std::size_t>(p[1 + n + k++]));
      }
    }
    std::lock_guard<std::mutex> lk(mu_);
    build_buckets_locked(buckets);
    rebuilt_ = true;
    return true;
  }

  ReducerStats stats() const {
    std::lock_guard<std::mutex> lk(mu_);
    ReducerStats s;
    s.bucket_count = buckets_.size();
    for (const auto& b : buckets_) {
      s.bucket_bytes.push_back(static_cast<std::size_t>(b.buffer.numel()) *
                               b.buffer.element_size());
      s.bucket_indices.push_back(b.params);
    }
    s.iterations = iterations_;
    s.reductions_launched = last_launched_;
    s.reductions_before_last_gradient = last_before_last_;
    s.buckets_rebuilt = rebuilt_;
    s.unused_parameters = last_unused_;
    return s;
  }

  // The buckets' flat buffers, in bucket order (with gradient_as_bucket_view, the storage of
  // the parameters' gradients).
  std::vector<at::Tensor> bucket_buffers() const {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<at::Tensor> out;
    for (const auto& b : buckets_) out.push_back(b.buffer);
    return out;
  }

  const std::vector<at::Tensor>& parameters() const noexcept { return params_; }
  const std::vector<std::string>& parameter_names() const noexcept { return names_; }

 private:
  struct Bucket {
    at::Tensor buffer;
    std::vector<std::size_t> params;
    std::vector<std::size_t> offsets, lengths;
    std::vector<std::vector<std::int64_t>> sizes;
    std::vector<at::Tensor> views;  // per parameter, views of buffer shaped like it
    std::size_t pending = 0;
    bool launched = false;
    std::shared_ptr<GradBucket> grad_bucket;  // alive until finalize: a hook may keep a reference
    Future<at::Tensor> result;
  };

  Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
          std::shared_ptr<dist::ProcessGroup> group, ReducerOptions opts)
      : params_(std::move(params)),
        names_(std::move(names)),
        group_(std::move(group)),
        opts_(opts) {
    if (!group_ || !group_->is_member()) {
      throw std::invalid_argument(
          "DistributedDataParallel: this process is not a member of the "
          "process group");
    }
    if (names_.size() != params_.size()) {
      throw std::invalid_argument("Reducer: " + std::to_string(params_.size()) +
                                  " parameters but " + std::to_string(names_.size()) + " names");
    }
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (!params_[i].requires_grad()) {
        throw std::invalid_argument("Reducer: parameter '" + names_[i] + "' does not require grad");
      }
      if (params_[i].is_sparse()) {
        throw std::invalid_argument("DistributedDataParallel: parameter '" + names_[i] +
                                    "' is sparse; sparse gradients are not supported");
      }
    }
    const std::size_t n = params_.size();
    marked_.assign(n, 0);
    local_used_.assign(n, 0);
    hook_counts_.assign(n, 0);
    // Reverse order approximates the order gradients are produced in (the layers registered
    // first are used first in forward, so their gradients come last).
    std::vector<at::Tensor> reversed;
    std::vector<std::int64_t> indices;
    for (std::size_t i = n; i-- > 0;) {
      reversed.push_back(params_[i]);
      indices.push_back(static_cast<std::int64_t>(i));
    }
    if (n > 0) {
      const auto a = dist::compute_bucket_assignment_by_size(
          reversed, {opts_.first_bucket_bytes, opts_.bucket_bytes_cap}, {}, indices);
      build_buckets_locked(a.buckets);
    }
  }

  void install_hooks() {
    std::weak_ptr<Reducer> weak = weak_from_this();
    for (std::size_t i = 0; i < params_.size(); ++i) {
      // The reducer holds the accumulator so that the hook stays on the node every graph uses.
      auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
      if (!acc) {
        throw std::invalid_argument("DistributedDataParallel: parameter '" + names_[i] +
                                    "' has no gradient accumulator (is it a leaf?)");
      }
      hook_keys_.push_back(
          acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
              [weak, i](const torch::autograd::variable_list& outputs,
                        const torch::autograd::variable_list&) {
                if (auto self = weak.lock()) self->run_hook(i);
                return outputs;
              })));
      accumulators_.push_back(std::move(acc));
    }
  }

  bool dynamic_find_unused() const { return opts_.find_unused_parameters && !opts_.static_graph; }
  bool static_first() const { return opts_.static_graph && !static_done_; }
  // PyTorch's rule: the buckets are rebuilt once, unless unused parameters are searched for
  // every iteration (the arrival order may then change from one iteration to the next).
  bool should_rebuild() const { return !rebuilt_ && !dynamic_find_unused(); }

  // ---- Buckets.

  void build_buckets_locked(const std::vector<std::vector<std::size_t>>& assignment) {
    std::vector<Bucket> out;
    locator_.assign(params_.size(), {0, 0});
    for (const auto& idx : assignment) {
      Bucket b;
      b.params = idx;
      std::size_t total = 0;
      for (std::size_t i : idx) {
        b.offsets.push_back(total);
        b.lengths.push_back(static_cast<std::size_t>(params_[i].numel()));
        b.sizes.push_back(params_[i].sizes().vec());
        total += b.lengths.back();
      }
      b.buffer = at::zeros({static_cast<std::int64_t>(total)}, params_[idx.front()].options());
      for (std::size_t s = 0; s < idx.size(); ++s) {
        const std::size_t i = idx[s];
        locator_[i] = {out.size(), s};
        b.views.push_back(b.buffer
                              .narrow(0, static_cast<std::int64_t>(b.offsets[s]),
                                      static_cast<std::int64_t>(b.lengths[s]))
                              .view(b.sizes[s]));
        if (opts_.gradient_as_bucket_view) {
          // Gradients that exist move into the new buffer (a rebuild keeps their values).
          at::Tensor& grad = params_[i].mutable_grad();
          if (grad.defined() && !grad.is_alias_of(b.views.back())) {
            at::NoGradGuard no_grad;
            b.views.back().copy_(grad);
            grad = b.views.back();
          }
        }
      }
      b.pending = idx.size();
      out.push_back(std::move(b));
    }
    buckets_ = std::move(out);
  }

  // ---- The backward pass.

  // A hook that throws fails the backward pass and leaves this pass unfinished (some buckets
  // may be reduced on other ranks only): the cause is kept for the error of every later
  // iteration.
  template <class Fn>
  void recording_failure(Fn&& fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lk(mu_);
      if (require_finalize_ && failed_pass_.empty()) failed_pass_ = e.what();
      throw;
    }
  }
  void run_hook(std::size_t i) {
    recording_failure([&] { autograd_hook(i); });
  }

  void autograd_hook(std::size_t i) {
    std::unique_lock<std::mutex> lk(mu_);
    // Recorded also under no_sync: a parameter used only in the accumulating passes has a
    // gradient to average at the next synchronized one (cleared once that one is reduced).
    if (dynamic_find_unused() || static_first()) local_used_[i] = 1;
    if (!expect_hooks_) return;  // no_sync, or a graph this wrapper did not prepare
    if (static_first()) {
      // The first iteration of a static graph only learns the graph: which parameters get
      // gradients and how many times; everything is reduced at the end of backward.
      ++hook_counts_[i];
      if (!first_hook_seen_) {
        first_hook_seen_ = true;
        require_finalize_ = true;
        if (!in_graph_task()) {
          throw std::runtime_error(
              "DistributedDataParallel: static_graph's first iteration needs the end of the "
              "local backward pass, which a distributed-autograd backward does not signal; run "
              "the first iteration outside a distributed-autograd context");
        }
        std::weak_ptr<Reducer> weak = weak_from_this();
        torch::autograd::Engine::get_default_engine().queue_callback([weak] {
          if (auto self = weak.lock()) self->recording_failure([&] { self->delay_all_reduce(); });
        });
      }
      return;
    }
    if (!first_hook_seen_) {
      first_hook_seen_ = true;
      require_finalize_ = true;
      ctx_ = current_dist_autograd_context();
      for (std::size_t u : unused_) mark_variable_ready(u);
    }
    if (opts_.static_graph) {
      if (hook_counts_left_[i] == 0) {
        throw std::runtime_error(
            "DistributedDataParallel: static_graph is set but parameter '" + names_[i] +
            "' got a gradient it did not get in the first iteration (the graph changed)");
      }
      if (--hook_counts_left_[i] > 0) return;
    }
    if (should_rebuild()) ready_order_.push_back(i);
    mark_variable_ready(i);
    launch_ready(lk);
  }

  // Marks all parameters ready at the end of the first static-graph backward.
  void delay_all_reduce() {
    std::unique_lock<std::mutex> lk(mu_);
    ctx_ = nullptr;
    unused_.clear();
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (hook_counts_[i] == 0) unused_.push_back(i);
      mark_variable_ready(i);
    }
    static_unused_ = unused_;
    launch_ready(lk);
  }

  void mark_variable_ready(std::size_t i) {
    if (marked_[i]) throw std::runtime_error(double_mark_text(i));
    at::Tensor grad = ctx_ ? ctx_->gradient(params_[i]) : params_[i].grad();
    if (grad.defined() && grad.is_sparse()) {
      // A dense parameter with a sparse gradient (an Embedding made with sparse(true)): the
      // buckets are dense.
      throw std::runtime_error("DistributedDataParallel: parameter '" + names_[i] +
                               "' got a sparse gradient, which is not supported; make its "
                               "module produce dense gradients (e.g. Embedding without sparse)");
    }
    marked_[i] = 1;
    --remaining_;
    auto [b, s] = locator_[i];
    Bucket& bucket = buckets_[b];
    at::Tensor& view = bucket.views[s];
    at::NoGradGuard no_grad;
    if (grad.defined()) {
      if (!grad.is_alias_of(view)) {
        view.copy_(grad);
        if (opts_.gradient_as_bucket_view && !ctx_) params_[i].mutable_grad() = view;
      }
    } else {
      view.zero_();
    }
    --bucket.pending;
  }

  // Launches the buckets that are ready, in bucket order, with mu_ released while the comm hook
  // runs. One thread launches at a time (the others' ready buckets are picked up by it), so the
  // order holds on every rank whatever thread delivers a gradient.
  void launch_ready(std::unique_lock<std::mutex>& lk) {
    if (launching_) return;
    launching_ = true;
    while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
      const std::size_t b = next_launch_++;
      Bucket& bucket = buckets_[b];
      bucket.grad_bucket =
          std::make_shared<GradBucket>(b, buckets_.size(), bucket.buffer, bucket.offsets,
                                       bucket.lengths, param_list(bucket), bucket.sizes);
      const bool before_last = remaining_ > 0;
      auto gb = bucket.grad_bucket;
      auto hook = comm_hook_;
      lk.unlock();
      Future<at::Tensor> f = run_comm(hook, *gb);
      lk.lock();
      buckets_[b].result = std::move(f);
      buckets_[b].launched = true;
      ++launched_;
      if (before_last) ++before_last_;
    }
    launching_ = false;
    if (next_launch_ < buckets_.size() || finalize_scheduled_) return;
    finalize_scheduled_ = true;
    if (dynamic_find_unused() || static_first()) {
      // Which parameters some rank used: a parameter no rank used keeps its gradient untouched.
      // Reduced on the parameters' device, for the same reason as the rebuild plan; the copy
      // there (synchronous, behind this thread's stream) is made outside the lock, and a failure
      // reaches the pass through used_future_ (finalize_backward reads it back).
      used_map_ = at::from_blob(local_used_.data(), {static_cast<std::int64_t>(local_used_.size())},
                                at::kInt)
                      .clone();
      // What the accumulating passes since the last reduction used is in the map now.
      std::fill(local_used_.begin(), local_used_.end(), 0);
      at::Tensor used = used_map_;
      const c10::Device device = comm_device();
      lk.unlock();
      try {
        used = used.to(device);
        auto w = dist::all_reduce(used, {.group = group_, .async_op = true});
        used_future_ = w->get_future();
      } catch (...) {
        used_future_ = make_exceptional_future<std::vector<at::Tensor>>(std::current_exception());
      }
      lk.lock();
      used_map_ = used;
    }
    if (in_graph_task()) {
      std::weak_ptr<Reducer> weak = weak_from_this();
      lk.unlock();
      torch::autograd::Engine::get_default_engine().queue_callback([weak] {
        if (auto self = weak.lock()) self->finalize_backward();
      });
      lk.lock();
    } else {
      // A distributed-autograd pass delivers gradients after libtorch's engine finished: the
      // last gradient is the end of the pass here.
      lk.unlock();
      finalize_backward();
      lk.lock();
    }
  }

  // Where the reducer's own small collectives (the rebuild plan, the used map) run: the first
  // parameter's device, which every rank's replica shares.
  c10::Device comm_device() const {
    return params_.empty() ? c10::Device(c10::kCPU) : params_.front().device();
  }

  std::vector<at::Tensor> param_list(const Bucket& b) const {
    std::vector<at::Tensor> out;
    for (std::size_t i : b.params) out.push_back(params_[i]);
    return out;
  }

  Future<at::Tensor> run_comm(const CommHook& hook, GradBucket& gb) {
    try {
      if (hook) {
        Future<at::Tensor> f = hook(gb);
        if (!f.valid()) throw std::runtime_error("the comm hook returned an empty Future");
        return f;
      }
      at::Tensor buf = gb.buffer();
      const double world = group_->size();
      auto w = dist::all_reduce(buf, {.group = group_, .async_op = true});
      return w->get_future().then([buf, world](const Future<std::vector<at::Tensor>>& f) {
        (void)f.value();
        buf.div_(world);
        return buf;
      });
    } catch (...) {
      return make_exceptional_future<at::Tensor>(std::current_exception());
    }
  }

  void finalize_backward() {
    std::vector<Future<at::Tensor>> results;
    Future<std::vector<at::Tensor>> used;
    bool have_used = false;
    at::Tensor used_map;
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (const auto& b : buckets_) results.push_back(b.result);
      have_used = used_map_.defined();
      if (have_used) {
        used = used_future_;
        used_map = used_map_;
      }
    }
    // Every bucket and the used map are waited for, so none is left in flight; the first error
    // (in bucket order) fails the backward pass.
    std::exception_ptr error;
    for (auto& f : results) {
      static_cast<const FutureBase&>(f).wait_for(std::chrono::hours(24 * 365 * 200));
      if (!error && f.has_error()) error = f.exception_ptr();
    }
    at::Tensor used_counts;  // on the CPU
    if (have_used) {
      static_cast<const FutureBase&>(used).wait_for(std::chrono::hours(24 * 365 * 200));
      if (!error && used.has_error()) error = used.exception_ptr();
      // Its all-reduce has completed, so the copy (from the GPU, where it ran there) reads the
      // final counts; made outside the lock, and a failure fails the pass like the others.
      if (!error) {
        try {
          used_counts = used_map.cpu();
        } catch (...) {
          error = std::current_exception();
        }
      }
    }
    std::unique_lock<std::mutex> lk(mu_);
    if (error) {
      reset_pass_locked();
      std::rethrow_exception(error);
    }
    std::vector<char> globally_unused(params_.size(), 0);
    if (have_used) {
      const auto u = used_counts.accessor<std::int32_t, 1>();
      for (std::size_t i = 0; i < params_.size(); ++i) {
        globally_unused[i] = u[static_cast<std::int64_t>(i)] == 0;
      }
      if (static_first()) static_globally_unused_ = globally_unused;
    } else if (opts_.static_graph) {
      globally_unused = static_globally_unused_;
    }
    at::NoGradGuard no_grad;
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      Bucket& bucket = buckets_[b];
      at::Tensor r = results[b].value();
      if (!r.defined() || r.numel() != bucket.buffer.numel() ||
          r.scalar_type() != bucket.buffer.scalar_type()) {
        const std::string got = r.defined() ? std::to_string(r.numel()) + " elements of " +
                                                  c10::toString(r.scalar_type())
                                            : std::string("an undefined tensor");
        reset_pass_locked();
        throw std::runtime_error("DistributedDataParallel: the comm hook's result for bucket " +
                                 std::to_string(b) + " is " + got + ", expected " +
                                 std::to_string(bucket.buffer.numel()) + " elements of " +
                                 c10::toString(bucket.buffer.scalar_type()));
      }
      if (!r.is_same(bucket.buffer)) bucket.buffer.copy_(r.reshape({-1}));
      for (std::size_t s = 0; s < bucket.params.size(); ++s) {
        const std::size_t i = bucket.params[s];
        if (globally_unused[i]) continue;
        const at::Tensor& view = bucket.views[s];
        if (ctx_) {
          ctx_->set_gradient(params_[i], view.clone());
          continue;
        }
        at::Tensor& grad = params_[i].mutable_grad();
        if (opts_.gradient_as_bucket_view) {
          if (!grad.defined() || !grad.is_alias_of(view)) grad = view;
        } else if (!grad.defined()) {
          grad = view.clone();
        } else {
          grad.copy_(view);
        }
      }
    }
    if (static_first()) {
      static_done_ = true;
    } else if (should_rebuild() && opts_.static_graph) {
      for (std::size_t u : unused_) ready_order_.push_back(u);
    }
    last_launched_ = launched_;
    last_before_last_ = before_last_;
    last_unused_ = unused_;
    ++iterations_;
    reset_pass_locked();
  }

  void reset_pass_locked() {
    expect_hooks_ = false;
    require_finalize_ = false;
    first_hook_seen_ = false;
    finalize_scheduled_ = false;
    std::fill(marked_.begin(), marked_.end(), 0);
    remaining_ = params_.size();
    next_launch_ = 0;
    launched_ = 0;
    before_last_ = 0;
    for (auto& b : buckets_) {
      b.pending = b.params.size();
      b.launched = false;
      b.grad_bucket.reset();
      b.result = Future<at::Tensor>();
    }
    used_map_ = at::Tensor();
    used_future_ = Future<std::vector<at::Tensor>>();
    ctx_ = nullptr;
    if (!rebuilt_ && !static_first()) {
      // The order is learnt from the first complete pass only.
      if (iterations_ == 0 || ready_order_.size() != params_.size()) ready_order_.clear();
    }
  }

  // Parameters whose AccumulateGrad the outputs' graph does not reach.
  std::vector<std::size_t> search_unused(const std::vector<at::Tensor>& outputs) const {
    std::unordered_set<const torch::autograd::Node*> seen;
    std::vector<std::shared_ptr<torch::autograd::Node>> stack;
    for (const auto& t : outputs) {
      if (!t.defined() || !t.requires_grad()) continue;
      auto e = torch::autograd::impl::gradient_edge(t);
      if (e.function) stack.push_back(std::move(e.function));
    }
    while (!stack.empty()) {
      auto n = std::move(stack.back());
      stack.pop_back();
      if (!seen.insert(n.get()).second) continue;
      for (const auto& e : n->next_edges()) {
        if (e.function) stack.push_back(e.function);
      }
    }
    std::vector<std::size_t> unused;
    for (std::size_t i = 0; i < accumulators_.size(); ++i) {
      if (seen.count(accumulators_[i].get()) == 0) unused.push_back(i);
    }
    return unused;
  }

  static bool in_graph_task() {
    return torch::autograd::get_current_graph_task_exec_info() != nullptr;
  }

  // The distributed-autograd context of the pass running on this thread, if any.
  static dist_autograd::ContextPtr current_dist_autograd_context() {
    if (dist_autograd::detail::tls_context_id < 0) return nullptr;
    return dist_autograd::current_context();
  }

  std::string double_mark_text(std::size_t i) const {
    return "Expected to mark a variable ready only once. This error is caused by one of the "
           "following reasons: 1) Use of a module parameter outside the `forward` function. "
           "Please make sure model parameters are not shared across multiple concurrent "
           "forward-backward passes. or try to use static_graph as a workaround if this module "
           "graph does not change during training loop.2) Reused parameters in multiple "
           "reentrant backward passes. For example, if you use multiple `checkpoint` functions "
           "to wrap the same part of your model, it would result in the same set of parameters "
           "been used by different reentrant backward passes multiple times, and hence marking "
           "a variable ready multiple times. DDP does not support such use cases in default. You "
           "can try to use static_graph as a workaround if your module graph does not change "
           "over iterations.\nParameter at index " +
           std::to_string(i) + " with name " + names_[i] +
           " has been marked as ready twice. This means that multiple autograd engine  hooks "
           "have fired for this particular parameter during this iteration.";
  }

  std::string prior_reduction_text() const {
    if (!failed_pass_.empty()) {
      return "DistributedDataParallel cannot run another iteration: a gradient hook of its last "
             "backward pass failed (" +
             failed_pass_ + ")";
    }
    std::string missing;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (!marked_[i]) missing += (missing.empty() ? "" : " ") + names_[i];
    }
    return "Expected to have finished reduction in the prior iteration before starting a new "
           "one. This error indicates that your module has parameters that were not used in "
           "producing loss. You can enable unused parameter detection by setting "
           "find_unused_parameters = true in DDPOptions, and by making sure all `forward` "
           "function outputs participate in calculating loss. If you already have done the "
           "above, then the distributed data parallel module wasn't able to locate the output "
           "tensors in the return value of your module's `forward` function.\nParameters which "
           "did not receive grad for rank " +
           std::to_string(group_->rank()) + ": " + missing;
  }

  // Set at construction.
  const std::vector<at::Tensor> params_;
  const std::vector<std::string> names_;
  const std::shared_ptr<dist::ProcessGroup> group_;
  const ReducerOptions opts_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<std::uintptr_t> hook_keys_;

  mutable std::mutex mu_;
  CommHook comm_hook_;
  std::vector<Bucket> buckets_;
  std::vector<std::pair<std::size_t, std::size_t>> locator_;  // parameter -> (bucket, slot)

  // One backward pass.
  bool expect_hooks_ = false;
  bool require_finalize_ = false;
  bool first_hook_seen_ = false;
  bool launching_ = false;
  bool finalize_scheduled_ = false;
  std::vector<char> marked_;
  std::vector<std::int32_t> local_used_;
  std::string failed_pass_;  // why a hook failed, leaving its pass unfinished (run_hook)
  std::vector<std::size_t> unused_;
  std::size_t remaining_ = 0;
  std::size_t next_launch_ = 0;
  std::size_t launched_ = 0;
  std::size_t before_last_ = 0;
  at::Tensor used_map_;
  Future<std::vector<at::Tensor>> used_future_;
  dist_autograd::ContextPtr ctx_;

  // Across passes.
  std::vector<std::size_t> ready_order_;
  bool rebuilt_ = false;
  std::size_t iterations_ = 0;
  std::size_t last_launched_ = 0;
  std::size_t last_before_last_ = 0;
  std::vector<std::size_t> last_unused_;
  bool static_done_ = false;
  std::vector<int> hook_counts_;       // static graph: hooks per parameter in the first pass
  std::vector<int> hook_counts_left_;  // ... still to come in this pass
  std::vector<std::size_t> static_unused_;
  std::vector<char> static_globally_unused_;
};

}  // namespace distrpc::ddp
