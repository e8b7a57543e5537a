// Distributed autograd: train a model whose parts live on several workers.
//
//   {
//     distrpc::dist_autograd::Context ctx;          // this thread's context, released on exit
//     auto loss = rm.forward(x).sum();             // RPCs inside record send/recv functions
//     distrpc::dist_autograd::backward(ctx.id(), {loss});
//     auto grads = distrpc::dist_autograd::get_gradients(ctx.id());   // never in .grad
//   }
//
// Everything here works on the agent of the calling thread (a handler's, else the process's
// init_rpc agent). The algorithm, and how it differs from PyTorch's: docs/dist_autograd.md.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "distrpc/agent/runtime.hpp"
#include "distrpc/autograd/container.hpp"
#include "distrpc/autograd/context.hpp"
#include "distrpc/autograd/functions.hpp"
#include "distrpc/autograd/layer.hpp"
#include "distrpc/log.hpp"
#include "distrpc/rpc_error.hpp"

namespace distrpc::dist_autograd {

namespace detail {
inline std::shared_ptr<AutogradLayer> layer() {
  auto agent = distrpc::detail::current_agent();
  auto l = agent->extension<AutogradLayer>();
  if (!l) {
    throw RpcError("distributed autograd is not plugged into the agent of " + agent->self().str());
  }
  return l;
}
inline const char* kNoCurrentContext =
    "Current thread doesn't have a valid autograd context. Please wrap your code in a "
    "distrpc::dist_autograd::Context scope to generate a valid context";
}  // namespace detail

// A new context of this worker, made the calling thread's current one. Throws "Already have an
// autograd context id for this thread" when the thread has one.
inline std::int64_t new_context() {
  if (detail::tls_context_id >= 0) {
    throw std::runtime_error("Already have an autograd context id for this thread.");
  }
  auto ctx = detail::layer()->contexts().make();
  detail::tls_context_id = ctx->context_id();
  return ctx->context_id();
}

// Releases context `id` on this worker and on every worker it sent autograd metadata to
// (transitively, in the background, retried on transient failures). Clears the thread's current
// context if it is `id`. Throws "Could not find autograd context with id: <id>".
inline void release_context(std::int64_t id) {
  if (detail::tls_context_id == id) detail::tls_context_id = -1;
  detail::layer()->release(id);
}

// The scoped form: the thread's current context while it lives.
class Context {
 public:
  Context() : id_(new_context()) {}
  ~Context() {
    try {
      release_context(id_);
    } catch (const std::exception& e) {
      // Already released (release_context(id) inside the scope), or the agent is gone.
      if (detail::tls_context_id == id_) detail::tls_context_id = -1;
      distrpc::detail::log_warning("dist_autograd", std::string("context release: ") + e.what());
    }
  }
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  std::int64_t id() const { return id_; }

 private:
  const std::int64_t id_;
};

// The calling thread's current context; throws when it has none.
inline ContextPtr current_context() {
  if (detail::tls_context_id < 0) throw std::runtime_error(detail::kNoCurrentContext);
  return detail::layer()->contexts().retrieve(detail::tls_context_id);
}

// Context `id` of this worker; throws "Could not find autograd context with id: <id>".
inline ContextPtr retrieve_context(std::int64_t id) {
  return detail::layer()->contexts().retrieve(id);
}

// Whether this worker has context `id`.
inline bool has_context(std::int64_t id) {
  return detail::layer()->contexts().find(id) != nullptr;
}

// The largest context id this worker can make: (worker_id << 48) + 2^48 - 1.
inline std::int64_t max_context_id() {
  return detail::layer()->contexts().max_id();
}

// Back-propagates from `roots` (scalars with a gradient function, seeded with ones) through every
// worker the forward pass of context `context_id` reached; blocks until all of them are done.
// Gradients of leaves accumulate in the context of the worker that holds the leaf
// (get_gradients), never in `.grad`. `retain_graph` keeps the graph on every worker for another
// pass. A failure anywhere throws "Error on Node <worker>: <what>", and leaves the context usable.
inline void backward(std::int64_t context_id, const std::vector<at::Tensor>& roots,
                     bool retain_graph = false) {
  detail::layer()->backward(context_id, roots, retain_graph);
}

// The gradients accumulated in context `context_id` on this worker, keyed by leaf (tensor
// identity).
inline c10::Dict<at::Tensor, at::Tensor> get_gradients(std::int64_t context_id) {
  return retrieve_context(context_id)->get_gradients();
}

// Exactly two counters of this worker: "num_current_backward_passes", "num_autograd_contexts".
inline std::map<std::string, std::string> get_debug_info() {
  return detail::layer()->debug_info();
}

}  // namespace distrpc::dist_autograd
