// The two autograd functions that stand for an RPC in the graph (libtorch Nodes, named as
// PyTorch names them, so profiles and graph dumps read the same). A message that carries tensors
// requiring grad gets one SendRpcBackward on its sender, whose next edges are those tensors, and
// one RecvRpcBackward on its receiver, the grad_fn of every such tensor received. In the backward
// pass the gradients that reach a RecvRpcBackward travel back to the sender, where its
// SendRpcBackward feeds them into the sender's graph.
#pragma once

#include <torch/csrc/autograd/function.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace distrpc::dist_autograd {

inline constexpr const char* kSendRpcBackwardName = "torch::distributed::autograd::SendRpcBackward";
inline constexpr const char* kRecvRpcBackwardName = "torch::distributed::autograd::RecvRpcBackward";

// A root of the sender's part of the graph: one input per tensor sent that required grad, passed
// unchanged to that tensor's edge.
class SendRpcBackward final : public torch::autograd::Node {
 public:
  explicit SendRpcBackward(torch::autograd::edge_list&& next) : Node(std::move(next)) {}

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    return std::move(grads);
  }
  std::string name() const override { return kSendRpcBackwardName; }
};

// A leaf of the receiver's part of the graph. The distributed backward pass captures the
// gradients flowing into it and sends them to worker `from` for its send function `send_id`;
// libtorch's engine never runs it there. A local backward (tensor.backward()) that reaches it
// fails: gradients cannot cross workers outside a distributed pass.
class RecvRpcBackward final : public torch::autograd::Node {
 public:
  // `in_reply`: the tensors came in a reply to a call of this worker (else in `from`'s request),
  // which decides the device route their gradients take back.
  RecvRpcBackward(std::int64_t context_id, int from, std::int64_t send_id, bool in_reply = false)
      : context_id_(context_id), from_(from), send_id_(send_id), in_reply_(in_reply) {}

  torch::autograd::variable_list apply(torch::autograd::variable_list&& /*grads*/) override {
    throw std::runtime_error(
        "RecvRpcBackward of autograd context " + std::to_string(context_id_) +
        " reached by a local backward pass: gradients of tensors received over RPC flow back to "
        "worker " +
        std::to_string(from_) + " only in distrpc::dist_autograd::backward()");
  }
  std::string name() const override { return kRecvRpcBackwardName; }

  std::int64_t context_id() const { return context_id_; }
  int from() const { return from_; }
  std::int64_t send_id() const { return send_id_; }
  bool in_reply() const { return in_reply_; }

 private:
  const std::int64_t context_id_;
  const int from_;
  const std::int64_t send_id_;
  const bool in_reply_;
};

}  // namespace distrpc::dist_autograd
