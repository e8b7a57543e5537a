// The built-in DDP communication hooks (PyTorch's
// torch.distributed.algorithms.ddp_comm_hooks.default_hooks): each takes the process group to
// reduce over (null: the default group) and a GradBucket, and returns a Future of the averaged
// flat gradients.
//
//   allreduce_hook       divides the buffer by the group's size and all-reduces it (what DDP does
//                        without a hook)
//   fp16_compress_hook   the same on a float16 copy, decompressed back into the buffer's dtype
//   bf16_compress_hook   the same on a bfloat16 copy
//
//   ddp.register_comm_hook(std::shared_ptr<distrpc::dist::ProcessGroup>{},
//                          distrpc::ddp::fp16_compress_hook);
//
// Threads: a hook issues its all-reduce (async) and returns at once; the Future completes on the
// backend's thread that completes the all-reduce, which also runs the decompression. Nothing
// waits on a thread.
// Errors: a bad argument (a group this process is not a member of, a buffer that is not 1-D and
// contiguous, a dtype the hook cannot reduce) throws std::invalid_argument from the call, before
// the buffer is touched; a failure of the collective itself (a lost peer, a timeout, a group that
// was destroyed) fails the returned Future.
#pragma once

#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include <distrpc/ddp/grad_bucket.hpp>
#include <distrpc/dist.hpp>
#include <distrpc/future.hpp>

namespace distrpc::ddp {

// Averages the bucket over `group` (null: the default group): the buffer is divided by the
// group's size first (keeps float16 from overflowing in the sum) and all-reduced in place; the
// Future holds the buffer. Floating-point and complex buffers.
inline Future<at::Tensor> allreduce_hook(std::shared_ptr<dist::ProcessGroup>& group,
                                         GradBucket& bucket);

// Casts the buffer to float16, divides by the group's size, all-reduces that and copies the
// result back into the buffer (its dtype unchanged), which the Future holds. Floating-point
// buffers (float32, float64, float16, bfloat16).
inline Future<at::Tensor> fp16_compress_hook(std::shared_ptr<dist::ProcessGroup>& group,
                                             GradBucket& bucket);

// As fp16_compress_hook, with bfloat16 (float32's range, fewer mantissa bits).
inline Future<at::Tensor> bf16_compress_hook(std::shared_ptr<dist::ProcessGroup>& group,
                                             GradBucket& bucket);

// ---- Implementation

namespace detail {

// The group a hook reduces over: the default one for null; refuses a group this process is not a
// member of (the free collectives would silently do nothing there and the Future never hold a
// reduced value).
inline std::shared_ptr<dist::ProcessGroup> hook_group(const std::shared_ptr<dist::ProcessGroup>& g,
                                                      const char* hook) {
  std::shared_ptr<dist::ProcessGroup> group = g ? g : dist::get_default_group();
  if (!group->is_member()) {
    throw std::invalid_argument(std::string(hook) +
                                ": this process is not a member of the process group " +
                                group->group_name());
  }
  return group;
}

enum class BufferKinds { floating_or_complex, floating };

// The bucket's buffer, after checking the hook can reduce it.
inline at::Tensor checked_buffer(const GradBucket& bucket, const char* hook, BufferKinds kinds) {
  const at::Tensor& buffer = bucket.buffer();
  const std::string where =
      std::string(hook) + ": bucket " + std::to_string(bucket.index()) + "'s buffer";
  if (!buffer.defined()) throw std::invalid_argument(where + " is undefined");
  if (buffer.dim() != 1) {
    throw std::invalid_argument(where + " must be 1-D, got shape " + c10::str(buffer.sizes()));
  }
  if (!buffer.is_contiguous()) {
    throw std::invalid_argument(where + " must be contiguous, got strides " +
                                c10::str(buffer.strides()));
  }
  const at::ScalarType t = buffer.scalar_type();
  const bool ok = kinds == BufferKinds::floating ? at::isFloatingType(t)
                                                 : (at::isFloatingType(t) || at::isComplexType(t));
  if (!ok) {
    throw std::invalid_argument(where + " has dtype " + c10::toString(t) + "; this hook reduces " +
                                (kinds == BufferKinds::floating
                                     ? "floating-point gradients (Float, Double, Half, BFloat16)"
                                     : "floating-point or complex gradients"));
  }
  return buffer;
}

// Issues an asynchronous all-reduce (SUM) of `tensor` over `group`: the Work's future. A failure
// to issue it (a group already shut down) fails the returned future instead of throwing, so a
// hook's caller meets every communication failure in one place.
inline Future<std::vector<at::Tensor>> issue_all_reduce(
    const std::shared_ptr<dist::ProcessGroup>& group, at::Tensor tensor) {
  try {
    std::shared_ptr<dist::Work> work = dist::all_reduce(tensor, {.group = group, .async_op = true});
    if (!work) {
      throw std::logic_error("all_reduce returned no Work for process group " +
                             group->group_name());
    }
    return work->get_future();
  } catch (...) {
    return make_exceptional_future<std::vector<at::Tensor>>(std::current_exception());
  }
}

// PyTorch's _allreduce_fut: divides first, then sums; the Future holds the reduced tensor.
inline Future<at::Tensor> allreduce_fut(const std::shared_ptr<dist::ProcessGroup>& group,
                                        at::Tensor tensor) {
  tensor.div_(group->size());
  return issue_all_reduce(group, tensor).then([](Future<std::vector<at::Tensor>>& f) -> at::Tensor {
    return f.value().at(0);
  });
}

inline Future<at::Tensor> compress_hook(at::ScalarType wire_dtype, const char* hook,
                                        std::shared_ptr<dist::ProcessGroup>& g,
                                        GradBucket& bucket) {
  std::shared_ptr<dist::ProcessGroup> group = hook_group(g, hook);
  at::Tensor buffer = checked_buffer(bucket, hook, BufferKinds::floating);
  // to() returns the buffer itself when it already has wire_dtype: then the reduction runs in
  // place, and the copy below is a no-op.
  at::Tensor compressed = buffer.to(wire_dtype).div_(group->size());
  return issue_all_reduce(group, compressed)
      .then([buffer](Future<std::vector<at::Tensor>>& f) -> at::Tensor {
        // Decompressed into the buffer itself, which keeps the peak memory at one extra
        // compressed copy (PyTorch does the same).
        at::Tensor out = buffer;
        out.copy_(f.value().at(0));
        return out;
      });
}

}  // namespace detail

inline Future<at::Tensor> allreduce_hook(std::shared_ptr<dist::ProcessGroup>& group,
                                         GradBucket& bucket) {
  std::shared_ptr<dist::ProcessGroup> g = detail::hook_group(group, "allreduce_hook");
  at::Tensor buffer =
      detail::checked_buffer(bucket, "allreduce_hook", detail::BufferKinds::floating_or_complex);
  return detail::allreduce_fut(g, buffer);
}

inline Future<at::Tensor> fp16_compress_hook(std::shared_ptr<dist::ProcessGroup>& group,
                                             GradBucket& bucket) {
  return detail::compress_hook(at::kHalf, "fp16_compress_hook", group, bucket);
}

inline Future<at::Tensor> bf16_compress_hook(std::shared_ptr<dist::ProcessGroup>& group,
                                             GradBucket& bucket) {
  return detail::compress_hook(at::kBFloat16, "bf16_compress_hook", group, bucket);
}

}  // namespace distrpc::ddp
