// What differs between the libtorch versions distrpc builds against (Debian's 1.13 and 2.x), in
// one place: code elsewhere calls these and never tests TORCH_VERSION itself. Where a difference
// is a member that only one version has, a template with a requires-expression picks the form
// that compiles, so no version macro is needed.
#pragma once

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/Device.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <optional>

#include "distrpc/device_map.hpp"

namespace distrpc::compat {

// CUDA devices this process sees: 0 on a CPU-only libtorch or without a GPU. ATen's CUDA hooks
// are asked once (the answer cannot change while the process runs, and the codec asks per
// tensor). Where they see none, a CUDA implementation of c10's device interface registered at run
// time (a stand-in for tests, on a CPU-only libtorch) is asked instead: the agent then takes its
// streams from that implementation too. (A CUDA libtorch loaded without libtorch_cuda would count
// GPUs here that ATen cannot use; distrpc's build always links libtorch_cuda, docs/cuda.md.)
inline int cuda_device_count() {
  static const int count = [] {
    try {
      return static_cast<int>(at::detail::getCUDAHooks().getNumGPUs());
    } catch (...) {
      return 0;  // a CUDA libtorch on a machine whose driver is missing
    }
  }();
  if (count > 0 || !c10::impl::hasDeviceGuardImpl(c10::kCUDA)) return count;
  return static_cast<int>(c10::impl::getDeviceGuardImpl(c10::kCUDA)->deviceCount());
}

// Hooks registered on a tensor (Tensor::register_hook) run on the gradient its node receives.
// libtorch 2.x keeps them as the node's "tensor pre-hooks" (a leaf's: its AccumulateGrad's), and
// its engine runs them even for a node whose gradient it only captures; 1.13 keeps a leaf's on
// the tensor and a non-leaf's as plain pre-hooks of its node, and a captured node runs none.
// `N` is torch::autograd::Node or a subclass (a template, so that the member's absence in 1.13
// is not an error).
template <class N>
constexpr bool engine_runs_captured_tensor_hooks() {
  return requires(N & n) {
    n.tensor_pre_hooks();
  };
}

// Calls f(hook) for each tensor hook of `node`. `leaf_hooks()` returns the leaf tensor's hook list
// when `node` is a leaf's AccumulateGrad, else null (where 1.13 keeps a leaf's hooks).
template <class N, class LeafHooks, class F>
void for_each_tensor_hook(N& node, LeafHooks&& leaf_hooks, F&& f) {
  if constexpr (engine_runs_captured_tensor_hooks<N>()) {
    for (const auto& h : node.tensor_pre_hooks()) f(*h);
    // retain_grad() on a non-leaf: a hook of its own in 2.x (1.13 keeps it with the others).
    if constexpr (requires { node.retains_grad_hooks(); }) {
      for (const auto& kv : node.retains_grad_hooks()) f(*kv.second);
    }
  } else if (const auto* hooks = leaf_hooks()) {
    for (const auto& h : *hooks) f(*h);
  } else {
    for (const auto& h : node.pre_hooks()) f(*h);
  }
}

// The runtime's handle of a device stream (a cudaStream_t for CUDA; null is the legacy default
// stream), or nothing where this libtorch cannot name it: 2.x has Stream::native_handle, 1.13 no
// device-generic way (and no CUDA build of 1.13 is supported here). `S` is c10::Stream (a
// template, for the member's absence in 1.13).
template <class S>
std::optional<void*> native_stream(const S& s) {
  if constexpr (requires { s.native_handle(); }) {
    return s.native_handle();
  } else {
    return std::nullopt;
  }
}

inline c10::Device to_c10(DeviceName d) {
  return d.is_cpu() ? c10::Device(c10::kCPU)
                    : c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(d.index));
}

}  // namespace distrpc::compat
