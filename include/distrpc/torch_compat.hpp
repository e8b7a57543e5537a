// What differs between the libtorch versions distrpc builds against (Debian's 1.13 and 2.x), in
// one place: code elsewhere calls these and never tests TORCH_VERSION itself.
#pragma once

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/Device.h>

#include "distrpc/device_map.hpp"

namespace distrpc::compat {

// CUDA devices this process sees: 0 on a CPU-only libtorch or without a GPU. Asked once (the
// answer cannot change while the process runs, and the codec asks per tensor).
inline int cuda_device_count() {
  static const int count = [] {
    try {
      return static_cast<int>(at::detail::getCUDAHooks().getNumGPUs());
    } catch (...) {
      return 0;  // a CUDA libtorch on a machine whose driver is missing
    }
  }();
  return count;
}

inline c10::Device to_c10(DeviceName d) {
  return d.is_cpu() ? c10::Device(c10::kCPU)
                    : c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(d.index));
}

}  // namespace distrpc::compat
