// CudaDeviceScope: makes a CUDA device current on the calling thread (its primary context too,
// which driver calls and events need) for the scope's lifetime, and restores the previous one.
// Only for code built with the CUDA runtime (the cuda_ipc and nccl transports, the nccl backend).
#pragma once

#include <cuda_runtime_api.h>

#include <string>
#include <string_view>

#include "distrpc/error.hpp"

namespace distrpc {

class CudaDeviceScope {
 public:
  // Quiet, for teardown paths (destructors, aborts): a device that cannot be made current
  // leaves the thread's as it was, and the error is cleared.
  explicit CudaDeviceScope(int device) noexcept { enter(device); }
  // Checked: throws DistNetworkError "<who>: making cuda:<device> current failed: <CUDA's
  // text>".
  CudaDeviceScope(int device, std::string_view who) {
    if (const cudaError_t e = enter(device); e != cudaSuccess) {
      throw DistNetworkError(std::string(who) + ": making cuda:" + std::to_string(device) +
                             " current failed: " + cudaGetErrorString(e));
    }
  }
  ~CudaDeviceScope() {
    if (changed_) (void)cudaSetDevice(saved_);
  }
  CudaDeviceScope(const CudaDeviceScope&) = delete;
  CudaDeviceScope& operator=(const CudaDeviceScope&) = delete;

 private:
  cudaError_t enter(int device) noexcept {
    cudaError_t e = cudaGetDevice(&saved_);
    // Set even when it is current already: that is what makes its primary context current.
    if (e == cudaSuccess) {
      e = cudaSetDevice(device);
      changed_ = e == cudaSuccess && saved_ != device;
    }
    if (e != cudaSuccess) (void)cudaGetLastError();  // not sticky: later calls are not blamed
    return e;
  }

  int saved_ = 0;
  bool changed_ = false;
};

}  // namespace distrpc
