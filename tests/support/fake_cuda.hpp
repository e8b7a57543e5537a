// A stand-in CUDA implementation of c10's device interface, for tests of device-aware code on a
// libtorch without CUDA: registered for the length of a scope, it keeps a current device and
// current streams per thread as CUDA does, hands out numbered pool streams, and records what is
// asked of streams and events (which event was recorded or waited for on which device and
// stream). Tensors that claim to live on cuda:N (tensor_on) carry devices without a GPU.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Storage.h>
#include <c10/core/Stream.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

namespace distrpc::testing {

inline c10::Device gpu(int i) {
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i));
}

// One thing asked of the device interface.
struct Op {
  std::string what;  // "record", "block" (an event), "in_use" (the allocator told)
  std::intptr_t event = 0;
  int device = 0;
  c10::StreamId stream = 0;
  bool operator==(const Op&) const = default;
};
inline std::ostream& operator<<(std::ostream& out, const Op& op) {
  return out << "{" << op.what << " event " << op.event << " on " << op.device << "/" << op.stream
             << "}";
}

// Two devices; per thread, a current device and a current stream per device (0: the default
// stream), as CUDA keeps them; pool streams numbered from 100.
class FakeCuda final : public c10::impl::DeviceGuardImplInterface {
 public:
  c10::DeviceType type() const override { return c10::kCUDA; }
  c10::Device exchangeDevice(c10::Device d) const override {
    const c10::Device old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return gpu(current_device); }
  void setDevice(c10::Device d) const override { current_device = d.index(); }
  void uncheckedSetDevice(c10::Device d) const noexcept override { current_device = d.index(); }
  c10::Stream getStream(c10::Device d) const noexcept override {
    return stream(d.index(), current_streams[static_cast<std::size_t>(d.index())]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override { return stream(d.index(), 0); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    std::lock_guard lk(mu_);
    return stream(d.index(), next_pool_++);
  }
  // How many pool streams were handed out so far.
  int pool_streams_taken() const {
    std::lock_guard lk(mu_);
    return static_cast<int>(next_pool_ - 100);
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override {
    const c10::Stream old = getStream(s.device());
    current_streams[static_cast<std::size_t>(s.device_index())] = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 2; }
  void record(void** event, const c10::Stream& s, const c10::DeviceIndex,
              const c10::EventFlag) const override {
    std::lock_guard lk(mu_);
    if (*event == nullptr) *event = reinterpret_cast<void*>(++next_event_);
    ops_.push_back({"record", reinterpret_cast<std::intptr_t>(*event), s.device_index(), s.id()});
  }
  void block(void* event, const c10::Stream& s) const override {
    std::lock_guard lk(mu_);
    ops_.push_back({"block", reinterpret_cast<std::intptr_t>(event), s.device_index(), s.id()});
  }
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream& s) const override {
    std::lock_guard lk(mu_);
    ops_.push_back({"in_use", 0, s.device_index(), s.id()});
  }

  // What was asked since the last call.
  std::vector<Op> take() const {
    std::lock_guard lk(mu_);
    std::vector<Op> out;
    out.swap(ops_);
    return out;
  }

  static inline thread_local int current_device = 0;
  static inline thread_local std::array<c10::StreamId, 2> current_streams{0, 0};

 private:
  static c10::Stream stream(c10::DeviceIndex d, c10::StreamId id) {
    return c10::Stream(c10::Stream::UNSAFE, gpu(d), id);
  }
  mutable std::mutex mu_;
  mutable std::vector<Op> ops_;
  mutable std::intptr_t next_event_ = 0;
  mutable c10::StreamId next_pool_ = 100;
};

// Registers a FakeCuda for its lifetime, if this libtorch has no CUDA implementation.
class FakeCudaScope {
 public:
  FakeCudaScope() : active_(!c10::impl::hasDeviceGuardImpl(c10::kCUDA)) {
    if (active_) slot().store(&fake);
    FakeCuda::current_device = 0;
    FakeCuda::current_streams = {0, 0};
  }
  ~FakeCudaScope() {
    if (active_) slot().store(nullptr);
  }
  FakeCudaScope(const FakeCudaScope&) = delete;
  FakeCudaScope& operator=(const FakeCudaScope&) = delete;
  bool active() const { return active_; }
  FakeCuda fake;

 private:
  static std::atomic<const c10::impl::DeviceGuardImplInterface*>& slot() {
    return c10::impl::device_guard_impl_registry[static_cast<std::size_t>(c10::kCUDA)];
  }
  bool active_;
};

// A tensor of `n` elements of type E whose storage says it is on `d` (cpu or cuda:N); its bytes
// (at most 64) are host memory that only view operations may touch.
template <class E = float>
at::Tensor tensor_on(c10::Device d, std::int64_t n = 4) {
  alignas(16) static char bytes[64] = {};
  const auto nbytes = static_cast<std::size_t>(n) * sizeof(E);
  if (nbytes > sizeof(bytes)) throw std::invalid_argument("tensor_on: at most 64 bytes");
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, c10::DataPtr(bytes, d),
                       /*allocator=*/nullptr, /*resizable=*/false);
  const auto key = d.is_cpu() ? c10::DispatchKey::CPU : c10::DispatchKey::CUDA;
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(key),
                                                   caffe2::TypeMeta::Make<E>());
  impl->set_sizes_contiguous({n});
  return at::Tensor(std::move(impl));
}

inline at::Tensor cpu_tensor() {
  return tensor_on(c10::Device(c10::kCPU));
}

}  // namespace distrpc::testing
