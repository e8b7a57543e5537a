// A distributed-autograd context: what one forward and backward pass recorded on this worker —
// the send and recv functions of its RPCs (keyed by autograd message id, ordered), the workers it
// sent autograd metadata to (cleanup goes to them), and the gradients accumulated for its leaves
// (never in `.grad`). Contexts live in the worker's container (container.hpp), keyed by an id
// that names the worker that made it: (worker_id << 48) | counter.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/edge.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "distrpc/autograd/functions.hpp"

namespace distrpc::dist_autograd {

class DistAutogradContext {
 public:
  explicit DistAutogradContext(std::int64_t id) : id_(id) {}
  DistAutogradContext(const DistAutogradContext&) = delete;
  DistAutogradContext& operator=(const DistAutogradContext&) = delete;

  std::int64_t context_id() const { return id_; }

  // The workers this context sent autograd metadata to (released there when it is released here).
  std::set<int> known_worker_ids() const {
    std::lock_guard<std::mutex> lk(mu_);
    return known_;
  }
  // The gradients accumulated here, keyed by the leaf (identity of its TensorImpl).
  c10::Dict<at::Tensor, at::Tensor> get_gradients() const {
    c10::Dict<at::Tensor, at::Tensor> out;
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& [impl, entry] : grads_) out.insert(entry.leaf, entry.grad);
    return out;
  }
  std::map<std::int64_t, std::shared_ptr<SendRpcBackward>> send_functions() const {
    std::lock_guard<std::mutex> lk(mu_);
    return sends_;
  }
  std::map<std::int64_t, std::shared_ptr<RecvRpcBackward>> recv_functions() const {
    std::lock_guard<std::mutex> lk(mu_);
    return recvs_;
  }

  // ---- what the library records ----------------------------------------------------------------

  // False once the context was released (close()): a call that would take the context to
  // `worker` now would make it there after the release went out, and nothing would release it.
  bool add_known_worker(int worker) {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return false;
    known_.insert(worker);
    return true;
  }
  // Marks the context released and returns the workers to release it on, in one step: a worker
  // is either among them or refused by add_known_worker, never missed.
  std::set<int> close() {
    std::lock_guard<std::mutex> lk(mu_);
    closed_ = true;
    return known_;
  }
  void add_send(std::int64_t message_id, std::shared_ptr<SendRpcBackward> fn) {
    std::lock_guard<std::mutex> lk(mu_);
    sends_[message_id] = std::move(fn);
  }
  void add_recv(std::int64_t message_id, std::shared_ptr<RecvRpcBackward> fn) {
    std::lock_guard<std::mutex> lk(mu_);
    recvs_[message_id] = std::move(fn);
  }
  std::shared_ptr<SendRpcBackward> send_function(std::int64_t message_id) const {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = sends_.find(message_id);
    return it == sends_.end() ? nullptr : it->second;
  }

  // Adds `grad` to what leaf `leaf` has (a new entry stores it: as is when nothing else refers to
  // a contiguous gradient, else a copy, so one buffer routed to two leaves gives two tensors).
  void accumulate(const at::Tensor& leaf, at::Tensor grad) {
    if (!grad.defined()) return;
    std::lock_guard<std::mutex> lk(mu_);
    auto it = grads_.find(leaf.unsafeGetTensorImpl());
    if (it == grads_.end()) {
      const bool keep = grad.is_sparse() || (grad.is_contiguous() && grad.use_count() == 1);
      grads_.emplace(
          leaf.unsafeGetTensorImpl(),
          Entry{leaf, keep ? std::move(grad) : grad.clone(at::MemoryFormat::Contiguous)});
      return;
    }
    // Out of place: a tensor get_gradients() handed out earlier keeps its value. ATen adds a
    // sparse tensor to a dense one, not a dense one to a sparse one: the dense one goes first.
    at::Tensor& sum = it->second.grad;
    sum = sum.is_sparse() && !grad.is_sparse() ? grad + sum : sum + grad;
  }

  // The gradient accumulated for `leaf` (undefined when none). With set_gradient, what
  // DistributedDataParallel uses to reduce the gradients of a pass across its process group.
  at::Tensor gradient(const at::Tensor& leaf) const {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = grads_.find(leaf.unsafeGetTensorImpl());
    return it == grads_.end() ? at::Tensor() : it->second.grad;
  }
  // Replaces the gradient of `leaf` (adds the entry when there is none).
  void set_gradient(const at::Tensor& leaf, at::Tensor grad) {
    std::lock_guard<std::mutex> lk(mu_);
    grads_.insert_or_assign(leaf.unsafeGetTensorImpl(), Entry{leaf, std::move(grad)});
  }

  // Serializes the passes of the backward that run here in this context (a node of the local
  // graph must not run in two passes at once).
  std::mutex& pass_mutex() { return pass_mu_; }

  // The user's roots of the backwards running from this worker in this context (while they
  // run; several threads may call backward() at once): a pass that reaches the nodes they reach
  // keeps the graph (see engine.hpp).
  void add_running_roots(std::int64_t backward_id, torch::autograd::edge_list roots) {
    std::lock_guard<std::mutex> lk(mu_);
    running_roots_[backward_id] = std::move(roots);
  }
  void remove_running_roots(std::int64_t backward_id) {
    std::lock_guard<std::mutex> lk(mu_);
    running_roots_.erase(backward_id);
  }
  torch::autograd::edge_list running_roots() const {
    std::lock_guard<std::mutex> lk(mu_);
    torch::autograd::edge_list all;
    for (const auto& [id, roots] : running_roots_)
      all.insert(all.end(), roots.begin(), roots.end());
    return all;
  }

 private:
  struct Entry {
    at::Tensor leaf;
    at::Tensor grad;
  };

  const std::int64_t id_;
  mutable std::mutex mu_;
  std::set<int> known_;
  bool closed_ = false;  // released: no worker is added any more
  std::map<std::int64_t, std::shared_ptr<SendRpcBackward>> sends_;
  std::map<std::int64_t, std::shared_ptr<RecvRpcBackward>> recvs_;
  std::unordered_map<const c10::TensorImpl*, Entry> grads_;
  std::map<std::int64_t, torch::autograd::edge_list> running_roots_;  // by backward id
  std::mutex pass_mu_;
};

using ContextPtr = std::shared_ptr<DistAutogradContext>;

}  // namespace distrpc::dist_autograd
