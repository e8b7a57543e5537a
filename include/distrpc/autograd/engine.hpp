// One local pass of the distributed backward, on libtorch's own engine.
//
// A pass starts from roots with their gradients: the user's roots (seeded with ones) on the worker
// that called backward(), or a send function with the gradients that came back for it. It asks
// libtorch's engine for the gradients at two kinds of edges, which the engine then computes
// without running the nodes behind them: each leaf's AccumulateGrad (accumulated into the context
// after the leaf's hooks, never into `.grad`), and each RecvRpcBackward's inputs (sent to the
// worker that sent those tensors, whose own pass then continues from its send function). A pass
// never waits for a send function that no gradient reaches, so an unused RPC result cannot hang
// a backward (layer.hpp tracks when all the passes a backward started are done).
//
// Passes of one context on one worker run one at a time. Where two of them can reach the same
// node (a tensor that both flows on locally and was sent), the engine keeps that node's saved
// tensors (it runs once per pass, each time with its share of the gradient; the sum is the same
// by linearity); they are freed with the graph, when the context and the outputs are released.
#pragma once

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <algorithm>
#include <atomic>
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

#include "distrpc/autograd/context.hpp"
#include "distrpc/autograd/functions.hpp"
#include "distrpc/torch_compat.hpp"

namespace distrpc::dist_autograd::detail {

using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::Node;
using torch::autograd::variable_list;

// "Error on Node N: <message>": the worker where a backward failed, named once (a failure that
// came from another worker already names it).
inline std::string node_error_text(int worker, const std::string& message) {
  static const std::string kPrefix = "Error on Node ";
  if (message.rfind(kPrefix, 0) == 0) return message;
  return kPrefix + std::to_string(worker) + ": " + message;
}

inline std::string message_of(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error& ex) {
    return ex.what_without_backtrace();
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
    return "unknown error";
  }
}

// Where a pass asks the engine for gradients, found by walking the graph from its roots.
struct PassPlan {
  edge_list outputs;  // every leaf's AccumulateGrad, then every RecvRpcBackward's inputs
  std::vector<std::shared_ptr<torch::autograd::AccumulateGrad>> leaves;
  std::vector<std::shared_ptr<RecvRpcBackward>> recvs;
  std::unordered_set<const Node*> interior;  // the nodes the engine runs
};

inline void walk(const edge_list& roots, std::unordered_set<const Node*>& interior,
                 PassPlan* plan) {
  std::unordered_set<const Node*> seen;
  std::vector<const std::shared_ptr<Node>*> stack;  // the graph owns the pointers meanwhile
  for (const auto& e : roots) {
    if (e.function) stack.push_back(&e.function);
  }
  std::vector<std::shared_ptr<RecvRpcBackward>> recvs;
  while (!stack.empty()) {
    const std::shared_ptr<Node>& n = *stack.back();
    stack.pop_back();
    if (!seen.insert(n.get()).second) continue;
    if (auto acc = std::dynamic_pointer_cast<torch::autograd::AccumulateGrad>(n)) {
      if (plan != nullptr) {
        plan->outputs.emplace_back(acc, 0);
        plan->leaves.push_back(std::move(acc));
      }
      continue;
    }
    if (auto recv = std::dynamic_pointer_cast<RecvRpcBackward>(n)) {
      if (plan != nullptr) recvs.push_back(std::move(recv));
      continue;
    }
    if (dynamic_cast<const SendRpcBackward*>(n.get()) == nullptr) interior.insert(n.get());
    for (const auto& e : n->next_edges()) {
      if (e.function) stack.push_back(&e.function);
    }
  }
  if (plan != nullptr) {
    for (auto& r : recvs) {
      for (std::uint32_t i = 0; i < r->num_inputs(); ++i) plan->outputs.emplace_back(r, i);
    }
    plan->recvs = std::move(recvs);
  }
}

// What the context's other roots reach (other send functions, and the user's roots of a backward
// running from here): the interior nodes and the recv functions. A node among them can run again
// in another pass; a recv function among them can send gradients again.
struct Reach {
  std::unordered_set<const Node*> interior;
  std::unordered_set<const Node*> recvs;
};
inline Reach reached_by_others(const DistAutogradContext& ctx, const edge_list& roots) {
  std::unordered_set<const Node*> own;
  for (const auto& e : roots) own.insert(e.function.get());
  edge_list others;
  for (const auto& [id, send] : ctx.send_functions()) {
    if (own.count(send.get()) == 0) {
      for (std::uint32_t i = 0; i < send->num_inputs(); ++i) others.emplace_back(send, i);
    }
  }
  for (const auto& e : ctx.running_roots()) {
    if (e.function && own.count(e.function.get()) == 0) others.push_back(e);
  }
  Reach r;
  if (others.empty()) return r;
  PassPlan plan;
  walk(others, r.interior, &plan);
  for (const auto& recv : plan.recvs) r.recvs.insert(recv.get());
  return r;
}

// Runs the hooks registered on the tensors whose gradients `node` receives (a leaf's
// AccumulateGrad, or a recv function: the tensors a message brought), on `grads`.
inline variable_list run_tensor_hooks(Node& node, variable_list grads) {
  auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(&node);
  compat::for_each_tensor_hook(
      node,
      [&]() -> const auto* { return acc ? &torch::autograd::impl::hooks(acc->variable) : nullptr; },
      [&](auto& hook) { grads = hook(grads); });
  return grads;
}

// Whether the engine, when it ran, already ran the tensor hooks of the gradients it captured.
inline constexpr bool kEngineRanTensorHooks = compat::engine_runs_captured_tensor_hooks<Node>();

// The gradient a leaf receives after its hooks (the tensor's hooks unless `hooks_done`, then its
// AccumulateGrad's pre-hooks), accumulated into the context; the AccumulateGrad's post-hooks then
// see it.
inline void deliver_to_leaf(DistAutogradContext& ctx, torch::autograd::AccumulateGrad& acc,
                            at::Tensor grad, bool hooks_done) {
  if (!grad.defined()) return;
  const at::Tensor& leaf = acc.variable;
  if (!hooks_done) {
    variable_list g = run_tensor_hooks(acc, variable_list{std::move(grad)});
    grad = g.empty() ? at::Tensor() : g[0];
    if (!grad.defined()) return;
  }
  for (const auto& hook : acc.pre_hooks()) {
    variable_list g = (*hook)(variable_list{grad});
    grad = g.empty() ? at::Tensor() : g[0];
  }
  if (!grad.defined()) return;
  ctx.accumulate(leaf, grad);
  for (const auto& hook : acc.post_hooks()) (void)(*hook)(variable_list{}, variable_list{grad});
}

// A pass whose roots are send functions leading straight to leaves and recv functions (a tensor
// sent as it was: the gradients of an RPC's arguments arriving back at the caller) has nothing
// for the engine to run: what the engine would return is each root's gradient, summed per edge.
// Computed here it costs no graph task (a third of a small step's backward). False when the
// engine must run (an interior node, or a send function with hooks).
inline bool direct_outputs(const edge_list& roots, const variable_list& grads, const PassPlan& plan,
                           variable_list& out) {
  if (!plan.interior.empty()) return false;
  for (const auto& e : roots) {
    const auto* send = dynamic_cast<const SendRpcBackward*>(e.function.get());
    if (send == nullptr || !send->pre_hooks().empty() || !send->post_hooks().empty()) return false;
  }
  out.assign(plan.outputs.size(), at::Tensor());
  // The profiler sees the send function as if the engine had run it.
  RECORD_FUNCTION(kSendRpcBackwardName, std::vector<c10::IValue>());
  for (std::size_t i = 0; i < roots.size(); ++i) {
    const Node& send = *roots[i].function;
    const auto input = roots[i].input_nr;
    const Edge& next = send.next_edge(input);
    if (!next.function) continue;
    const auto& meta = send.input_metadata(input);
    at::Tensor g = grads[i];
    if (!meta.is_same_shape(g)) {
      throw std::runtime_error("Function " + send.name() + " returned an " +
                               meta.incompatible_shape_error_message(input, g).str());
    }
    if (g.scalar_type() != c10::typeMetaToScalarType(meta.options().dtype())) {
      g = g.to(c10::typeMetaToScalarType(meta.options().dtype()));
    }
    for (std::size_t k = 0; k < plan.outputs.size(); ++k) {
      if (plan.outputs[k].function != next.function || plan.outputs[k].input_nr != next.input_nr) {
        continue;
      }
      out[k] = out[k].defined() ? out[k] + g : g;
      break;
    }
  }
  return true;
}

// How a pass hands the gradients of a recv function to its sender: a message the pass does not
// wait for (the backward's root learns when the pass it starts is done).
using SendGradients =
    std::function<void(const RecvRpcBackward& recv, variable_list grads, bool retain_graph)>;

// Runs one pass on this thread, sending the gradients it computes for recv functions as it goes.
// Throws "Error on Node <worker>: ..." when the pass fails.
inline void run_pass(const ContextPtr& ctx, int self_id, const edge_list& all_roots,
                     const variable_list& all_grads, bool retain_graph, const SendGradients& send) {
  // Roots without a gradient (a tensor the receiver did not use) are left out: the engine takes
  // defined gradients only.
  edge_list roots;
  variable_list grads;
  for (std::size_t i = 0; i < all_roots.size() && i < all_grads.size(); ++i) {
    if (!all_grads[i].defined()) continue;
    roots.push_back(all_roots[i]);
    grads.push_back(all_grads[i]);
  }
  if (roots.empty()) return;
  try {
    std::lock_guard<std::mutex> pass(ctx->pass_mutex());
    PassPlan plan;
    walk(roots, plan.interior, &plan);
    if (plan.outputs.empty()) return;
    // A node another root reaches too runs again in another pass: its saved tensors are kept
    // (freed with the graph when the context is released).
    const Reach others =
        plan.interior.empty() && plan.recvs.empty() ? Reach{} : reached_by_others(*ctx, roots);
    const bool keep =
        retain_graph || std::any_of(plan.interior.begin(), plan.interior.end(),
                                    [&](const Node* n) { return others.interior.count(n) != 0; });
    variable_list out;
    bool hooks_done = false;  // the tensor hooks of the captured gradients
    if (!direct_outputs(roots, grads, plan, out)) {
      out = torch::autograd::Engine::get_default_engine().execute(
          roots, grads, keep, /*create_graph=*/false, /*accumulate_grad=*/false, plan.outputs);
      hooks_done = kEngineRanTensorHooks;
    }
    // Gradients for other workers go first: their passes start while this one delivers to its
    // leaves (the backward's root then learns of both about as early). `out` follows
    // plan.outputs: the leaves, then each recv function's inputs.
    std::size_t k = plan.leaves.size();
    for (const auto& recv : plan.recvs) {
      variable_list g;
      bool any = false;
      for (std::uint32_t i = 0; i < recv->num_inputs(); ++i) {
        any = any || out[k].defined();
        g.push_back(std::move(out[k++]));
      }
      if (!any) continue;
      // Hooks on the tensors the message brought run as the engine would run them on the recv
      // function, once.
      if (!hooks_done) g = run_tensor_hooks(*recv, std::move(g));
      // A recv function another root reaches sends gradients again, in a pass of its own (a
      // skip connection around a nested call, an RRef's value fetched twice): the graph behind
      // the sender's send function must then outlive this message's pass.
      const bool again = retain_graph || others.recvs.count(recv.get()) != 0;
      // The recv function never runs on the engine here: its work is this send, profiled under
      // its name.
      RECORD_FUNCTION(kRecvRpcBackwardName, std::vector<c10::IValue>());
      send(*recv, std::move(g), again);
    }
    for (std::size_t i = 0; i < plan.leaves.size(); ++i) {
      deliver_to_leaf(*ctx, *plan.leaves[i], std::move(out[i]), hooks_done);
    }
  } catch (...) {
    throw std::runtime_error(node_error_text(self_id, message_of(std::current_exception())));
  }
}

}  // namespace distrpc::dist_autograd::detail
