// poll_event: waits for a CUDA event by querying it, so that the waiter can give up (a stop, a
// lost peer, a deadline) where cudaEventSynchronize could block for good. Only for code built
// with the CUDA runtime.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <thread>

namespace distrpc {

// Until `e` is reached (cudaSuccess), CUDA reports an error (returned, and cleared so that later
// calls are not blamed), or `go_on()`, asked between looks, returns false (cudaErrorNotReady).
// Yields between the first `spins` looks (a copy or a call of microseconds is seen at once),
// then sleeps 50 us between looks (a long wait does not keep a core busy).
template <class GoOn>
cudaError_t poll_event(cudaEvent_t e, const GoOn& go_on, int spins = 1000) {
  for (int n = 0;; n = n < spins ? n + 1 : n) {
    const cudaError_t r = cudaEventQuery(e);
    if (r == cudaSuccess) return r;
    if (r != cudaErrorNotReady) {
      (void)cudaGetLastError();
      return r;
    }
    if (!go_on()) return cudaErrorNotReady;
    if (n < spins) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

}  // namespace distrpc
