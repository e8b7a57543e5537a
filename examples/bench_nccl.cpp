// The nccl backend's all-reduce on one GPU, beside PyTorch's (examples/reference/
// torch_nccl_ref.py) and the GPU's own copy bandwidth. One process, a group of one: what a machine
// with one GPU allows (NCCL refuses two processes on one device). In a group of one an in-place
// all-reduce moves no data, so what it measures is the cost of a call: the time from the call
// until the GPU has finished it. Prints one JSON line:
//   allreduce_256MiB_us  a 256 MiB float all-reduce (SUM), until the GPU is done, median of 20
//   cuda_d2d_copy_GBps   bytes per second of a 256 MiB device-to-device copy, median of 20 (the
//                        GPU's limit, for scale)
// Without a GPU both are null and "skipped" says why.
//   build/examples/bench_nccl
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <vector>

#include "distrpc/dist/nccl_backend.hpp"
#include "distrpc/store/hash_store.hpp"
#include "distrpc/torch_compat.hpp"

namespace {

// Median seconds of `samples` runs of f after 3 unmeasured ones; f returns once the GPU is done.
double median_s(int samples, const std::function<void()>& f) {
  for (int i = 0; i < 3; ++i) f();
  std::vector<double> s;
  for (int i = 0; i < samples; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(s.begin(), s.begin() + samples / 2, s.end());
  return s[samples / 2];
}

}  // namespace

int main() {
  if (distrpc::compat::cuda_device_count() < 1) {
    std::printf(
        "{\"allreduce_256MiB_us\": null, \"cuda_d2d_copy_GBps\": null, \"skipped\": \"no "
        "GPU\"}\n");
    return 0;
  }
  using std::chrono::milliseconds;
  distrpc::dist::NcclBackend nccl(std::make_shared<distrpc::store::HashStore>(milliseconds(5000)),
                                  0, 1, milliseconds(60000));
  const std::int64_t n = 64 * 1024 * 1024;  // floats: 256 MiB
  const double bytes = static_cast<double>(n) * 4;
  std::vector<at::Tensor> t{torch::ones({n}, torch::TensorOptions().device(torch::kCUDA, 0))};
  // wait() returns once the GPU has finished the all-reduce (the backend's Work completes then).
  const double reduce = median_s(20, [&] { nccl.allreduce(t)->wait(); });
  at::Tensor dst = torch::empty_like(t[0]);
  const double copy = median_s(20, [&] {
    dst.copy_(t[0]);
    torch::cuda::synchronize();
  });
  std::printf("{\"allreduce_256MiB_us\": %.1f, \"cuda_d2d_copy_GBps\": %.1f}\n", reduce * 1e6,
              bytes / copy / 1e9);
  return 0;
}
