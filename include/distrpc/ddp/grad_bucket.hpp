// GradBucket: what DistributedDataParallel hands a communication hook (PyTorch's
// torch.distributed.GradBucket). One bucket is a flat buffer holding the gradients of several
// parameters back to back (same dtype and device), in the order the bucket lists them.
//
// A hook receives the bucket once its last gradient is ready and returns a Future of the tensor
// that replaces the buffer (the averaged gradients, flat, same numel and dtype as buffer()). The
// reducer copies that result back into each parameter's gradient.
//
//   auto hook = [](MyState& s, distrpc::ddp::GradBucket& b) -> distrpc::Future<at::Tensor> {...};
//   ddp.register_comm_hook(std::make_shared<MyState>(...), hook);
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <distrpc/future.hpp>

namespace distrpc::ddp {

class GradBucket {
 public:
  // buffer: the flat gradients; offsets/lengths: where parameter i's gradient lies in it (in
  // elements); parameters: the bucket's parameters, in the same order; sizes: their shapes
  // (default: 1-D of each length).
  GradBucket(std::size_t index, std::size_t bucket_count, at::Tensor buffer,
             std::vector<std::size_t> offsets, std::vector<std::size_t> lengths,
             std::vector<at::Tensor> parameters = {}, std::vector<std::vector<int64_t>> sizes = {})
      : index_(index),
        bucket_count_(bucket_count),
        buffer_(std::move(buffer)),
        offsets_(std::move(offsets)),
        lengths_(std::move(lengths)),
        parameters_(std::move(parameters)),
        sizes_(std::move(sizes)) {
    if (offsets_.size() != lengths_.size()) {
      throw std::invalid_argument("GradBucket: " + std::to_string(offsets_.size()) +
                                  " offsets but " + std::to_string(lengths_.size()) + " lengths");
    }
    if (sizes_.empty()) {
      for (auto n : lengths_) sizes_.push_back({static_cast<int64_t>(n)});
    }
  }

  // The bucket's position in the current bucket order (0 is reduced first).
  std::size_t index() const noexcept { return index_; }
  // True for the last bucket of an iteration (a hook may flush state there).
  bool is_last() const noexcept { return index_ + 1 == bucket_count_; }

  // The flat buffer of this bucket's gradients (1-D, contiguous).
  const at::Tensor& buffer() const noexcept { return buffer_; }
  // Replaces the buffer (a hook that compresses in place may swap in its own tensor).
  void set_buffer(at::Tensor buffer) { buffer_ = std::move(buffer); }

  // Each parameter's gradient as a view of buffer(), shaped like the parameter.
  std::vector<at::Tensor> gradients() const {
    std::vector<at::Tensor> out;
    out.reserve(offsets_.size());
    for (std::size_t i = 0; i < offsets_.size(); ++i) {
      out.push_back(
          buffer_.narrow(0, static_cast<int64_t>(offsets_[i]), static_cast<int64_t>(lengths_[i]))
              .view(sizes_[i]));
    }
    return out;
  }

  // The parameters whose gradients this bucket holds (empty when the reducer did not say).
  const std::vector<at::Tensor>& parameters() const noexcept { return parameters_; }
  const std::vector<std::size_t>& offsets() const noexcept { return offsets_; }
  const std::vector<std::size_t>& lengths() const noexcept { return lengths_; }

 private:
  std::size_t index_;
  std::size_t bucket_count_;
  at::Tensor buffer_;
  std::vector<std::size_t> offsets_;
  std::vector<std::size_t> lengths_;
  std::vector<at::Tensor> parameters_;
  std::vector<std::vector<int64_t>> sizes_;
};

// A registered hook with its state bound: what the reducer calls per bucket.
using CommHook = std::function<Future<at::Tensor>(GradBucket&)>;

}  // namespace distrpc::ddp
