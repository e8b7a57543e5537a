// Tensors in wire archives: metadata in the payload, bytes out of band. A strided tensor sends only
// the span of its storage that it covers, keeps its sizes and strides (views stay views), and is
// rebuilt on the receiver directly over the received buffer, without a copy. A tensor written twice
// in one message arrives as one tensor. Sparse COO tensors travel as their indices and values.
// Record layouts: docs/wire-protocol.md, "Tensor records".
#pragma once

#include <distrpc/torch_compat.hpp>
#include <distrpc/wire/archive.hpp>
#include <distrpc/wire/device_buffers.hpp>
#include <distrpc/wire/device_route.hpp>
#include <distrpc/wire/tensor_observer.hpp>

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/ScalarTypeToTypeMeta.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/SmallVector.h>

#include <concepts>
#include <cstdint>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>

namespace distrpc::wire {

namespace detail {

// First byte of every tensor record.
enum class TensorKind : std::uint8_t {
  Undefined = 0,      // at::Tensor() (no further bytes)
  Strided = 1,        // a dense tensor
  SparseCoo = 2,      // a sparse COO tensor
  BackReference = 3,  // u32 slot: the same tensor as an earlier record in this payload
};

inline constexpr std::uint8_t kFlagRequiresGrad = 1;
inline constexpr std::uint8_t kFlagConj = 2;
inline constexpr std::uint8_t kFlagNeg = 4;
inline constexpr std::uint8_t kFlagCoalesced = 8;  // sparse records only
inline constexpr std::uint8_t kDeviceTypeCpu = 0;
inline constexpr std::uint8_t kDeviceTypeCuda = 1;
inline constexpr std::uint32_t kNoBuffer = 0xFFFFFFFFu;
inline constexpr std::size_t kMaxTensorDims = 64;

// Wire dtype codes. They equal libtorch 1.13's ScalarType numbers but are fixed here, so a libtorch
// that renumbers its enum cannot change the protocol. Quantized types have no code.
struct DtypeCode {
  at::ScalarType dtype;
  std::uint8_t code;
};
inline constexpr DtypeCode kDtypeCodes[] = {
    {at::kByte, 0},        {at::kChar, 1},         {at::kShort, 2},          {at::kInt, 3},
    {at::kLong, 4},        {at::kHalf, 5},         {at::kFloat, 6},          {at::kDouble, 7},
    {at::kComplexHalf, 8}, {at::kComplexFloat, 9}, {at::kComplexDouble, 10}, {at::kBool, 11},
    {at::kBFloat16, 15},
};

inline std::optional<std::uint8_t> dtype_code(at::ScalarType dtype) {
  for (const DtypeCode& e : kDtypeCodes) {
    if (e.dtype == dtype) return e.code;
  }
  return std::nullopt;
}

inline std::optional<at::ScalarType> dtype_from_code(std::uint8_t code) {
  for (const DtypeCode& e : kDtypeCodes) {
    if (e.code == code) return e.dtype;
  }
  return std::nullopt;
}

inline std::string layout_name(at::Layout layout) {
  std::ostringstream s;
  s << layout;
  return s.str();
}

// The device the receiver puts `t` on: the route's answer, or the CPU for a CPU tensor when this
// thread has no route.
inline c10::Device target_device(const at::Tensor& t) {
  if (tls_device_route != nullptr) return tls_device_route->target(t.device());
  if (!t.device().is_cpu()) {
    throw EncodeError(
        "cannot encode tensor: only CPU tensors can be sent without a device map (device " +
        t.device().str() + ")");
  }
  return c10::Device(c10::kCPU);
}

inline void check_sendable(const at::Tensor& t) {
  if (t.is_nested()) {
    throw EncodeError("cannot encode tensor: nested tensors are not supported");
  }
  if (t.is_quantized()) {
    throw EncodeError(
        std::string("cannot encode tensor: quantized tensors are not supported (dtype ") +
        c10::toString(t.scalar_type()) + ")");
  }
}

// Elements of storage that a strided tensor with these sizes and strides reaches from its offset:
// 1 + sum((size_i - 1) * stride_i), or 0 when it has no elements. Overflow yields nullopt.
inline std::optional<std::int64_t> span_elements(c10::IntArrayRef sizes, c10::IntArrayRef strides) {
  std::int64_t span = 1;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == 0) return 0;
  }
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    std::int64_t reach = 0;
    if (__builtin_mul_overflow(sizes[i] - 1, strides[i], &reach) ||
        __builtin_add_overflow(span, reach, &span)) {
      return std::nullopt;
    }
  }
  return span;
}

// A kByte CPU tensor over bytes [byte_offset, byte_offset + nbytes) of `storage`, sharing it. Built
// on a TensorImpl directly: this runs once per tensor per message, and the dispatcher would cost
// more than the rest of the encoding.
// The dispatch key of a strided tensor over storage on `d`: CPU, or CUDA for a device buffer.
inline c10::DispatchKey storage_key(c10::Device d) {
  return d.is_cpu() ? c10::DispatchKey::CPU : c10::DispatchKey::CUDA;
}

inline at::Tensor byte_view(const c10::Storage& storage, std::int64_t byte_offset,
                            std::int64_t nbytes) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(storage), c10::DispatchKeySet(storage_key(storage.device())),
      caffe2::TypeMeta::Make<std::uint8_t>());
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  const std::int64_t size[1] = {nbytes};
  impl->set_sizes_contiguous(size);
  impl->set_storage_offset(byte_offset);
  return t;
}

// Body of a strided record (after the kind byte):
//   u8 dtype | u8 flags | u8 device type | i8 device index | u8 ndim | i64 sizes[ndim] |
//   i64 strides[ndim] | i64 storage offset (elements, into the buffer) | u32 buffer index
// `src` is on the CPU, or on a CUDA device inside a DeviceBuffersScope; `target` is where the
// receiver puts it.
inline void write_strided_body(OutputArchive& ar, const at::Tensor& src, bool requires_grad,
                               c10::Device target) {
  // ZeroTensors (autograd's lazily materialised zeros) have no memory to point at.
  const at::Tensor t = src._is_zerotensor() ? at::zeros(src.sizes(), src.options()) : src;
  const auto code = dtype_code(t.scalar_type());
  if (!code) {
    throw EncodeError(std::string("cannot encode tensor of dtype ") +
                      c10::toString(t.scalar_type()) + ": the wire format has no code for it");
  }
  const auto ndim = static_cast<std::size_t>(t.dim());
  if (ndim > kMaxTensorDims) {
    throw EncodeError("cannot encode tensor with " + std::to_string(ndim) +
                      " dimensions: the wire format allows at most " +
                      std::to_string(kMaxTensorDims));
  }
  const c10::IntArrayRef sizes = t.sizes();
  const c10::IntArrayRef strides = t.strides();
  const std::uint8_t flags =
      static_cast<std::uint8_t>((requires_grad ? kFlagRequiresGrad : 0) |
                                (t.is_conj() ? kFlagConj : 0) | (t.is_neg() ? kFlagNeg : 0));
  std::uint32_t buffer = kNoBuffer;
  if (t.numel() != 0) {
    const std::int64_t item = static_cast<std::int64_t>(t.element_size());
    const std::int64_t span = *span_elements(sizes, strides);  // valid: the tensor exists
    buffer = ar.add_buffer(byte_view(t.storage(), t.storage_offset() * item, span * item));
  }
  char* p = ar.append_uninitialized(5 + 16 * ndim + 12);
  p[0] = static_cast<char>(*code);
  p[1] = static_cast<char>(flags);
  p[2] = static_cast<char>(target.is_cpu() ? kDeviceTypeCpu : kDeviceTypeCuda);
  p[3] = static_cast<char>(target.is_cpu() ? -1 : target.index());
  p[4] = static_cast<char>(ndim);
  p += 5;
  std::memcpy(p, sizes.data(), 8 * ndim);
  p += 8 * ndim;
  std::memcpy(p, strides.data(), 8 * ndim);
  p += 8 * ndim;
  const std::int64_t offset = 0;  // the buffer starts where the tensor's span does
  std::memcpy(p, &offset, 8);
  std::memcpy(p + 8, &buffer, 4);
}

// The device a record names: the CPU, or a CUDA device this process has.
inline c10::Device read_record_device(InputArchive& ar) {
  const auto device_type = ar.read<std::uint8_t>();
  const auto device_index = ar.read<std::int8_t>();
  if (device_type == kDeviceTypeCpu && (device_index == -1 || device_index == 0)) {
    return c10::Device(c10::kCPU);
  }
  if (device_type == kDeviceTypeCuda && device_index >= 0) {
    const int count = compat::cuda_device_count();
    if (device_index >= count) {
      decode_fail("tensor recorded for cuda:" + std::to_string(device_index) +
                  ", but this worker has " + std::to_string(count) + " CUDA device(s)");
    }
    return c10::Device(c10::kCUDA, device_index);
  }
  decode_fail("tensor recorded on device type " + std::to_string(device_type) + " index " +
              std::to_string(device_index) +
              ": only CPU (type 0, index -1 or 0) and CUDA (type 1, " +
              "index >= 0) tensors are supported");
}

// Whether elements of `item` bytes can be read in place from `base + byte_start`.
inline bool aligned_for(const char* base, std::int64_t byte_start, std::int64_t item) {
  return byte_start % item == 0 &&
         reinterpret_cast<std::uintptr_t>(base + byte_start) % static_cast<std::uintptr_t>(item) ==
             0;
}

// The storage of a tensor over a received CPU buffer `b` (its bytes from `byte_start`, `span`
// elements of `item` bytes) and the tensor's offset in it: the buffer's own storage when aligned
// for the dtype, else a copy.
inline std::pair<c10::Storage, std::int64_t> host_storage(const at::Tensor& b,
                                                          std::int64_t byte_start,
                                                          std::int64_t span, std::int64_t item,
                                                          at::ScalarType dtype) {
  const char* base = static_cast<const char*>(b.storage().data());
  if (dtype == at::kBool) {
    // A bool byte other than 0 or 1 is undefined behaviour in every kernel that reads it.
    const char* q = base + byte_start;
    for (std::int64_t i = 0; i < span; ++i) {
      if (static_cast<unsigned char>(q[i]) > 1) {
        decode_fail("bool tensor holds byte " + std::to_string(static_cast<unsigned char>(q[i])) +
                    " (only 0 and 1 are valid)");
      }
    }
  }
  if (aligned_for(base, byte_start, item)) {
    return {b.storage(), byte_start / item};
  }
  // A transport that packs buffers may hand over memory not aligned for this dtype: copy once.
  const std::int64_t nbytes = span * item;
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, c10::GetCPUAllocator(),
                       /*resizable=*/true);
  // data_ptr().get(): Storage::data() is const in libtorch 2.x.
  std::memcpy(storage.data_ptr().get(), base + byte_start, static_cast<std::size_t>(nbytes));
  return {std::move(storage), 0};
}

// The same over a device buffer (a policy that moves device memory handed it over): the
// buffer's own storage, else a device copy. A bool tensor's bytes are checked on the device (one
// reduction and a synchronization) as the host path checks them.
inline std::pair<c10::Storage, std::int64_t> device_storage(const at::Tensor& b,
                                                            std::int64_t byte_start,
                                                            std::int64_t span, std::int64_t item,
                                                            at::ScalarType dtype) {
  // The receiver reads these bytes on the streams current where it decodes (an RPC callee's
  // come from the pool): the allocator must not reuse them before that work is done.
  const c10::impl::VirtualGuardImpl impl(b.device().type());
  impl.recordDataPtrOnStream(b.storage().data_ptr(), impl.getStream(b.device()));
  const auto bytes = [&] { return b.narrow(0, byte_start - b.storage_offset(), span * item); };
  if (dtype == at::kBool && bytes().gt(1).any().item<bool>()) {
    decode_fail("bool tensor holds a byte other than 0 or 1 (only 0 and 1 are valid)");
  }
  const char* base = static_cast<const char*>(b.storage().data());
  if (aligned_for(base, byte_start, item)) {
    return {b.storage(), byte_start / item};
  }
  return {bytes().clone().storage(), 0};
}

// Reads a strided record. Built over the received CPU bytes; moved to the recorded device when
// `move` is set, else that device is left in `*device` (a sparse tensor's parts move as one).
inline at::Tensor read_strided_body(InputArchive& ar, bool allow_requires_grad, bool move = true,
                                    c10::Device* device = nullptr) {
  const auto code = ar.read<std::uint8_t>();
  const auto dtype = dtype_from_code(code);
  if (!dtype) decode_fail("unknown tensor dtype code " + std::to_string(code));
  const auto flags = ar.read<std::uint8_t>();
  if ((flags & ~(kFlagRequiresGrad | kFlagConj | kFlagNeg)) != 0) {
    decode_fail("tensor flags " + std::to_string(flags) + " has unknown bits");
  }
  const bool requires_grad = (flags & kFlagRequiresGrad) != 0;
  if (requires_grad && !allow_requires_grad) {
    decode_fail("requires_grad set on the indices or values of a sparse tensor");
  }
  if (requires_grad && !at::isFloatingType(*dtype) && !at::isComplexType(*dtype)) {
    decode_fail(std::string("requires_grad set on a tensor of dtype ") + c10::toString(*dtype) +
                " (only floating point and complex tensors can require gradients)");
  }
  if ((flags & kFlagConj) != 0 && !at::isComplexType(*dtype)) {
    decode_fail(std::string("conjugate bit set on a tensor of dtype ") + c10::toString(*dtype));
  }
  // libtorch has no negation of bools: every operation that reads a bool tensor with the
  // negative bit raises an error, so no sender can have meant one.
  if ((flags & kFlagNeg) != 0 && *dtype == at::kBool) {
    decode_fail("negative bit set on a tensor of dtype Bool");
  }
  const c10::Device target = read_record_device(ar);
  if (device != nullptr) *device = target;
  const auto ndim = ar.read<std::uint8_t>();
  if (ndim > kMaxTensorDims) {
    decode_fail("tensor with " + std::to_string(ndim) + " dimensions (at most " +
                std::to_string(kMaxTensorDims) + ")");
  }
  c10::SmallVector<std::int64_t, 6> sizes(ndim);
  c10::SmallVector<std::int64_t, 6> strides(ndim);
  ar.read_bytes(sizes.data(), 8 * std::size_t{ndim});
  ar.read_bytes(strides.data(), 8 * std::size_t{ndim});
  const auto offset = ar.read<std::int64_t>();
  const auto buffer_index = ar.read<std::uint32_t>();

  std::int64_t numel = 1;
  for (std::size_t i = 0; i < ndim; ++i) {
    if (sizes[i] < 0 || strides[i] < 0) {
      decode_fail("tensor dimension " + std::to_string(i) + " has size " +
                  std::to_string(sizes[i]) + " and stride " + std::to_string(strides[i]) +
                  " (negative values are not allowed)");
    }
    if (__builtin_mul_overflow(numel, sizes[i], &numel)) {
      decode_fail("tensor element count overflows 64 bits");
    }
  }
  if (offset < 0) decode_fail("negative tensor storage offset " + std::to_string(offset));

  const auto item = static_cast<std::int64_t>(c10::elementSize(*dtype));
  const auto meta = c10::scalarTypeToTypeMeta(*dtype);
  // A device buffer (a policy that moves device memory handed it over) stays on its device.
  auto keys = c10::DispatchKeySet(c10::DispatchKey::CPU);
  c10::Storage storage;
  std::int64_t storage_offset = 0;
  if (numel == 0) {
    if (buffer_index != kNoBuffer || offset != 0) {
      decode_fail("a tensor without elements must carry no buffer and offset 0 (buffer " +
                  std::to_string(buffer_index) + ", offset " + std::to_string(offset) + ")");
    }
    storage = c10::Storage(c10::Storage::use_byte_size_t(), 0, c10::GetCPUAllocator(),
                           /*resizable=*/true);
  } else {
    if (buffer_index == kNoBuffer) decode_fail("a tensor with elements carries no buffer");
    const at::Tensor& b = ar.buffer(buffer_index);
    const auto span = span_elements(sizes, strides);
    std::int64_t end_elems = 0;
    std::int64_t end_bytes = 0;
    if (!span || __builtin_add_overflow(offset, *span, &end_elems) ||
        __builtin_mul_overflow(end_elems, item, &end_bytes) || end_bytes > b.numel()) {
      decode_fail("tensor of sizes " + c10::str(c10::IntArrayRef(sizes)) + ", strides " +
                  c10::str(c10::IntArrayRef(strides)) + ", offset " + std::to_string(offset) +
                  " and " + std::to_string(item) + "-byte elements reaches outside buffer " +
                  std::to_string(buffer_index) + " of " + std::to_string(b.numel()) + " bytes");
    }
    const std::int64_t byte_start = b.storage_offset() + offset * item;
    if (b.device().is_cpu()) {
      std::tie(storage, storage_offset) = host_storage(b, byte_start, *span, item, *dtype);
    } else {
      std::tie(storage, storage_offset) = device_storage(b, byte_start, *span, item, *dtype);
      keys = c10::DispatchKeySet(storage_key(b.device()));
    }
  }
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), keys, meta);
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  impl->set_sizes_and_strides(sizes, strides, storage_offset);
  if ((flags & kFlagConj) != 0) impl->_set_conj(true);
  if ((flags & kFlagNeg) != 0) impl->_set_neg(true);
  // Moved before requires_grad is set: the tensor arrives as a leaf on its device.
  if (move && t.device() != target) t = t.to(target);
  if (requires_grad) t.set_requires_grad(true);
  return t;
}

// Body of a sparse COO record (after the kind byte):
//   u8 flags | u8 sparse_dim | u8 dense_dim | i64 sizes[sparse_dim + dense_dim] |
//   strided body of the indices (int64, [sparse_dim, nnz]) | strided body of the values
inline void write_sparse_body(OutputArchive& ar, const at::Tensor& t, c10::Device target) {
  const auto sparse_dim = static_cast<std::size_t>(t.sparse_dim());
  const auto dense_dim = static_cast<std::size_t>(t.dense_dim());
  if (sparse_dim + dense_dim > kMaxTensorDims) {
    throw EncodeError("cannot encode sparse tensor with " + std::to_string(sparse_dim + dense_dim) +
                      " dimensions: the wire format allows at most " +
                      std::to_string(kMaxTensorDims));
  }
  const std::uint8_t flags = static_cast<std::uint8_t>((t.requires_grad() ? kFlagRequiresGrad : 0) |
                                                       (t.is_coalesced() ? kFlagCoalesced : 0));
  char* p = ar.append_uninitialized(3 + 8 * (sparse_dim + dense_dim));
  p[0] = static_cast<char>(flags);
  p[1] = static_cast<char>(sparse_dim);
  p[2] = static_cast<char>(dense_dim);
  std::memcpy(p + 3, t.sizes().data(), 8 * (sparse_dim + dense_dim));
  write_strided_body(ar, t._indices(), false, target);
  write_strided_body(ar, t._values(), false, target);
}

inline at::Tensor read_sparse_body(InputArchive& ar) {
  const auto flags = ar.read<std::uint8_t>();
  if ((flags & ~(kFlagRequiresGrad | kFlagCoalesced)) != 0) {
    decode_fail("sparse tensor flags " + std::to_string(flags) + " has unknown bits");
  }
  const std::size_t sparse_dim = ar.read<std::uint8_t>();
  const std::size_t dense_dim = ar.read<std::uint8_t>();
  if (sparse_dim + dense_dim > kMaxTensorDims) {
    decode_fail("sparse tensor with " + std::to_string(sparse_dim + dense_dim) +
                " dimensions (at most " + std::to_string(kMaxTensorDims) + ")");
  }
  c10::SmallVector<std::int64_t, 6> sizes(sparse_dim + dense_dim);
  ar.read_bytes(sizes.data(), 8 * sizes.size());
  std::int64_t sparse_numel = 1;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 0) {
      decode_fail("sparse tensor dimension " + std::to_string(i) + " has negative size " +
                  std::to_string(sizes[i]));
    }
    // The linear index of an entry must fit in 64 bits, or coalescing is meaningless.
    if (i < sparse_dim && __builtin_mul_overflow(sparse_numel, sizes[i], &sparse_numel)) {
      decode_fail("sparse tensor sizes " + c10::str(c10::IntArrayRef(sizes)) +
                  " overflow 64-bit linear indices");
    }
  }
  c10::Device indices_device(c10::kCPU);
  c10::Device target(c10::kCPU);
  at::Tensor indices = read_strided_body(ar, false, false, &indices_device);
  at::Tensor values = read_strided_body(ar, false, false, &target);
  if (indices_device != target) {
    decode_fail("sparse indices recorded for " + indices_device.str() + " but values for " +
                target.str());
  }
  if (indices.scalar_type() != at::kLong || indices.dim() != 2 ||
      indices.size(0) != static_cast<std::int64_t>(sparse_dim)) {
    decode_fail(std::string("sparse indices must be int64 of shape [") +
                std::to_string(sparse_dim) + ", nnz], got " + c10::toString(indices.scalar_type()) +
                " of shape " + c10::str(indices.sizes()));
  }
  const std::int64_t nnz = indices.size(1);
  bool values_ok =
      values.dim() == static_cast<std::int64_t>(1 + dense_dim) && values.size(0) == nnz;
  for (std::size_t d = 0; values_ok && d < dense_dim; ++d) {
    values_ok = values.size(static_cast<std::int64_t>(1 + d)) == sizes[sparse_dim + d];
  }
  if (!values_ok) {
    decode_fail("sparse values of shape " + c10::str(values.sizes()) + " do not match " +
                std::to_string(nnz) + " entries of a tensor of sizes " +
                c10::str(c10::IntArrayRef(sizes)) + " with " + std::to_string(sparse_dim) +
                " sparse dimensions");
  }
  if ((flags & kFlagRequiresGrad) != 0 && !at::isFloatingType(values.scalar_type()) &&
      !at::isComplexType(values.scalar_type())) {
    decode_fail(std::string("requires_grad set on a sparse tensor of dtype ") +
                c10::toString(values.scalar_type()));
  }
  at::Tensor t;
  try {
    // Indices outside `sizes` are refused here: later kernels would trust them. Checked
    // explicitly, because libtorch 2.x's constructor checks them only when the process-wide
    // sparse-invariants switch is on (1.13's always did).
    at::_validate_sparse_coo_tensor_args(indices, values, sizes);
    t = at::sparse_coo_tensor(indices, values, sizes);
  } catch (const c10::Error& e) {
    decode_fail(std::string("invalid sparse tensor: ") + e.what_without_backtrace());
  }
  if ((flags & kFlagCoalesced) != 0) {
    // Kernels trust the coalesced bit (sorted, unique indices); verify it rather than believe it.
    if (nnz > 1) {
      at::Tensor linear = at::zeros({nnz}, at::kLong);
      for (std::size_t d = 0; d < sparse_dim; ++d) {
        linear.mul_(sizes[d]).add_(indices[static_cast<std::int64_t>(d)]);
      }
      if (!(linear.slice(0, 1) > linear.slice(0, 0, nnz - 1)).all().item<bool>()) {
        decode_fail("sparse tensor marked coalesced has unsorted or duplicate indices");
      }
    }
    t._coalesced_(true);
  }
  if (!target.is_cpu()) t = t.to(target);
  if ((flags & kFlagRequiresGrad) != 0) t.set_requires_grad(true);
  return t;
}

}  // namespace detail

// Tensor record: u8 kind, then the kind's body (see detail::TensorKind).
// Templates taking exactly the type (no implicit conversions): at::Tensor, c10::IValue, c10::Scalar
// and c10::Device convert implicitly from each other and from enums, and a conversion would make
// cereal see two ways to write a type.
template <class T>
requires std::same_as<T, at::Tensor>
inline void CEREAL_SAVE_FUNCTION_NAME(OutputArchive& ar, const T& t) {
  if (!t.defined()) {
    ar.write(static_cast<std::uint8_t>(detail::TensorKind::Undefined));
    return;
  }
  if (const auto slot = ar.find_tensor(t.unsafeGetTensorImpl())) {
    char* p = ar.append_uninitialized(5);
    p[0] = static_cast<char>(detail::TensorKind::BackReference);
    std::memcpy(p + 1, &*slot, 4);
    return;
  }
  detail::check_sendable(t);
  const c10::Device target = detail::target_device(t);
  // The bytes travel from host memory: a device tensor is staged through a CPU copy, unless the
  // policy moves device memory itself (a strided CUDA tensor inside a DeviceBuffersScope).
  const bool keep_on_device =
      detail::tls_device_buffers && t.layout() == at::kStrided && t.device().is_cuda();
  const at::Tensor host = t.device().is_cpu() || keep_on_device ? t : t.cpu();
  switch (t.layout()) {
    case at::kStrided:
      ar.write(static_cast<std::uint8_t>(detail::TensorKind::Strided));
      detail::write_strided_body(ar, host, t.requires_grad(), target);
      break;
    case at::kSparse:
      ar.write(static_cast<std::uint8_t>(detail::TensorKind::SparseCoo));
      detail::write_sparse_body(ar, host, target);
      break;
    default:
      throw EncodeError("cannot encode tensor with layout " + detail::layout_name(t.layout()) +
                        ": only strided and sparse COO tensors are supported");
  }
  ar.remember_tensor(t);
  if (detail::tls_tensor_observer != nullptr && t.requires_grad()) {
    detail::tls_tensor_observer->encoded(t);
  }
}

inline void CEREAL_LOAD_FUNCTION_NAME(InputArchive& ar, at::Tensor& t) {
  const auto kind = ar.read<std::uint8_t>();
  switch (static_cast<detail::TensorKind>(kind)) {
    case detail::TensorKind::Undefined:
      t = at::Tensor();
      return;
    case detail::TensorKind::BackReference:
      t = ar.tensor(ar.read<std::uint32_t>());
      return;
    case detail::TensorKind::Strided:
      t = detail::read_strided_body(ar, true);
      break;
    case detail::TensorKind::SparseCoo:
      t = detail::read_sparse_body(ar);
      break;
    default:
      detail::decode_fail("unknown tensor record kind " + std::to_string(kind) + " at offset " +
                          std::to_string(ar.position() - 1));
  }
  ar.remember_tensor(t);
  if (detail::tls_tensor_observer != nullptr && t.requires_grad()) {
    detail::tls_tensor_observer->decoded(t);
  }
}

}  // namespace distrpc::wire

namespace cereal {

// Any other cereal archive: tensors cannot be written inline, their bytes travel beside the
// payload.
template <class Archive, class T>
requires std::same_as<T, at::Tensor>
void CEREAL_SAVE_FUNCTION_NAME(Archive&, const T&) {
  static_assert(distrpc::wire::detail::dependent_false<Archive>,
                "at::Tensor can only be serialized with distrpc::wire::OutputArchive (its bytes "
                "travel out of band): use distrpc::wire::encode(message, values...)");
}

template <class Archive>
void CEREAL_LOAD_FUNCTION_NAME(Archive&, at::Tensor&) {
  static_assert(distrpc::wire::detail::dependent_false<Archive>,
                "at::Tensor can only be deserialized with distrpc::wire::InputArchive (its bytes "
                "travel out of band): use distrpc::wire::decode(message, values...)");
}

}  // namespace cereal
