// Futures with devices: the C++ counterpart of PyTorch's Future(devices=["cuda:0", ...]), for
// values computed on GPU streams and handed to code running on other streams or threads.
//
//   auto f = distrpc::make_future<at::Tensor>({c10::Device("cuda:0")});
//   // producer, on its own stream:  f.set_value(y);          (y on cuda:0)
//   // consumer, on another stream:  at::Tensor z = f.value() + 1;   (sees y finished)
//
// What happens where (PyTorch's rules, one stricter, see "every declared device" below):
//   - set_value / set_result (and a then()-callback's return value) first checks the value's
//     tensors: one on a device that is not declared fails the future with "The result contained
//     tensors residing on device(s) cuda:1 which are not among the expected device(s) cuda:0"
//     (std::invalid_argument); CPU tensors are always allowed. Then it records an event on the
//     current stream of every declared device: the end of the work the producer queued.
//   - wait() / value() make the waiting thread's current streams wait for those events (the GPU
//     waits, the thread does not), and tell the caching allocator that the value's memory is in
//     use on those streams.
//   - then() / add_done_callback() callbacks run with streams taken from the device's pool made
//     current, each waiting for the events (after an error: none to wait for); the device current
//     at completion is current. The child future of then() / via() has the same devices and
//     records its own events on those streams, so a chain of callbacks stays ordered without any
//     thread blocking on the GPU. A then() callback that returns a future: the child completes
//     with that future's value, on the streams current where it completes (pool streams when
//     that future has devices too).
//   - Two completions racing (try_set_value from two threads): only the one that stores its value
//     keeps its events.
//   - Every declared device, not only those the value's tensors are on: tensors inside class
//     types other than the standard containers are not found by the check (detail::visit_tensors
//     says which are), so the events cover them anyway.
//   - The devices: all of one type, with indices ("Expected devices to have indices, got cpu";
//     "Expected all devices to be of the same type, but got a mismatch between cuda:0 and cpu");
//     repeats are dropped; none at all, or CPU ones with indices (cpu:0), give a plain future. A
//     device type this libtorch has no streams for (CUDA on a CPU-only build) is refused when the
//     future is made.
// Streams, events and the allocator are reached through c10's device-generic interface, so this
// header has no CUDA dependency: a CUDA libtorch supplies the CUDA implementation.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/Storage.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "distrpc/future.hpp"

namespace distrpc {
namespace detail {

// "cuda:0", "cuda:0 and cuda:1", "cuda:0, cuda:1 and cuda:2", "(none)": PyTorch's wording.
inline std::string format_devices(const std::vector<c10::Device>& devices) {
  if (devices.empty()) return "(none)";
  std::ostringstream out;
  for (std::size_t i = 0; i < devices.size(); ++i) {
    if (i > 0) out << (i + 1 == devices.size() ? " and " : ", ");
    out << devices[i];
  }
  return out.str();
}

// The declared devices, checked, sorted by index and without repeats.
inline std::vector<c10::Device> checked_devices(std::vector<c10::Device> devices) {
  for (const c10::Device& d : devices) {
    if (d.type() != devices.front().type()) {
      throw std::invalid_argument(
          "Expected all devices to be of the same type, but got a mismatch between " +
          devices.front().str() + " and " + d.str());
    }
  }
  for (const c10::Device& d : devices) {
    if (!d.has_index())
      throw std::invalid_argument("Expected devices to have indices, got " + d.str());
  }
  std::sort(devices.begin(), devices.end(),
            [](const c10::Device& a, const c10::Device& b) { return a.index() < b.index(); });
  devices.erase(std::unique(devices.begin(), devices.end()), devices.end());
  if (!devices.empty() && !devices.front().is_cpu() &&
      !c10::impl::hasDeviceGuardImpl(devices.front().type())) {
    throw std::invalid_argument("distrpc::make_future: this libtorch has no streams for " +
                                c10::DeviceTypeName(devices.front().type(), true) +
                                " devices (a build without them), so a future on " +
                                format_devices(devices) + " cannot be made");
  }
  return devices;
}

// A stream from the pool of each of `devices` (all of one type, with a stream implementation).
inline std::vector<c10::Stream> pool_streams(const c10::impl::VirtualGuardImpl& impl,
                                             const std::vector<c10::Device>& devices) {
  std::vector<c10::Stream> streams;
  streams.reserve(devices.size());
  for (const c10::Device& d : devices) streams.push_back(impl.getStreamFromGlobalPool(d));
  return streams;
}

// The storages of the tensors a value holds (sparse tensors: their indices and values).
class StorageCollector final : public TensorSink {
 public:
  void tensor(const at::Tensor& t) override {
    if (!t.defined()) return;
    if (t.is_sparse()) {
      tensor(t._indices());
      tensor(t._values());
      return;
    }
    if (t.has_storage()) storages.push_back(t.storage());
  }
  void ivalue(const c10::IValue& v) override {
    c10::IValue::HashAliasedIValues subs;
    v.getSubValues(subs);
    for (const c10::IValue& s : subs) {
      if (s.isTensor()) tensor(s.toTensor());
    }
  }
  std::vector<c10::Storage> storages;
};

// The CompletionSync of a future with devices (the header comment says what each step does).
class DeviceSync final : public CompletionSync {
 public:
  // `devices`: already checked (checked_devices), not empty, not CPU.
  explicit DeviceSync(std::vector<c10::Device> devices)
      : impl_(devices.front().type()), devices_(std::move(devices)) {}

  const std::vector<c10::Device>& devices() const noexcept { return devices_; }

  std::shared_ptr<const void> record(FunctionRef<void(TensorSink&)> visit) const override {
    StorageCollector found;
    visit(found);
    auto marks = std::make_shared<Marks>();
    std::vector<c10::Device> excess;
    for (const c10::Storage& s : found.storages) {
      const c10::Device d = s.device();
      if (d.is_cpu()) continue;
      if (d.type() != impl_.type()) {
        throw std::invalid_argument("Expected all data ptrs to be on a device of type " +
                                    c10::DeviceTypeName(impl_.type(), true) +
                                    ", got one on device " + d.str());
      }
      if (!declared(d) && std::find(excess.begin(), excess.end(), d) == excess.end()) {
        excess.push_back(d);
      }
      marks->storages.push_back(s.getWeakStorageImpl());
    }
    if (!excess.empty()) {
      std::sort(excess.begin(), excess.end(),
                [](const c10::Device& a, const c10::Device& b) { return a.index() < b.index(); });
      throw std::invalid_argument(
          "The result contained tensors residing on device(s) " + format_devices(excess) +
          " which are not among the expected device(s) " + format_devices(devices_));
    }
    marks->events.reserve(devices_.size());
    for (const c10::Device& d : devices_) {
      marks->events.emplace_back(impl_.type());
      marks->events.back().record(impl_.getStream(d));
    }
    marks->device = impl_.getDevice();
    return marks;
  }

  void commit(std::shared_ptr<const void> marks) noexcept override {
    marks_ = std::static_pointer_cast<const Marks>(std::move(marks));
  }

  void synchronize() const override {
    if (!marks_) return;
    for (const c10::Event& e : marks_->events) e.block(impl_.getStream(e.device()));
    mark_in_use([&](const c10::Device& d) { return impl_.getStream(d); });
  }

  std::shared_ptr<void> enter() const override {
    const std::vector<c10::Stream> streams = pool_streams(impl_, devices_);
    auto stream_on = [&](const c10::Device& d) {
      return *std::find_if(streams.begin(), streams.end(),
                           [&](const c10::Stream& s) { return s.device() == d; });
    };
    if (!marks_) return std::make_shared<Scope>(c10::nullopt, streams);
    for (const c10::Event& e : marks_->events) e.block(stream_on(e.device()));
    mark_in_use(stream_on);
    return std::make_shared<Scope>(marks_->device, streams);
  }

  std::shared_ptr<CompletionSync> fresh() const override {
    return std::make_shared<DeviceSync>(devices_);
  }

 private:
  // What a completion leaves for the waiters: an event per declared device, the value's device
  // memory, and the device current at completion.
  struct Marks {
    std::vector<c10::Event> events;
    std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> storages;  // weak: not kept alive
    c10::optional<c10::Device> device;
  };

  // The device, then the streams, made current; restored in the reverse order.
  struct Scope {
    Scope(c10::optional<c10::Device> d, const std::vector<c10::Stream>& s)
        : device(d), streams(s) {}
    c10::OptionalDeviceGuard device;
    c10::MultiStreamGuard streams;
  };

  bool declared(const c10::Device& d) const {
    return std::find(devices_.begin(), devices_.end(), d) != devices_.end();
  }

  // Tells the caching allocator that the value's memory is used on `stream_of(device)` too, so
  // it is not reused before the work queued there is done.
  template <class StreamOf>
  void mark_in_use(StreamOf&& stream_of) const {
    for (const auto& weak : marks_->storages) {
      c10::intrusive_ptr<c10::StorageImpl> s = weak.lock();
      if (s) impl_.recordDataPtrOnStream(s->data_ptr(), stream_of(s->device()));
    }
  }

  const c10::impl::VirtualGuardImpl impl_;
  const std::vector<c10::Device> devices_;
  std::shared_ptr<const Marks> marks_;  // set by the winning completion, before publication
};

// Makes a stream from the pool current on each of `devices` for its lifetime, and restores the
// streams that were current; no devices: does nothing. A worker with devices decodes each reply
// to its calls under it (agent/calls.hpp), so that the reply's copies and the events of the
// future the caller gets are on streams no other work is queued on.
// `devices`: of one type with a stream implementation, without repeats.
class PoolStreamsScope {
 public:
  explicit PoolStreamsScope(const std::vector<c10::Device>& devices) {
    if (devices.empty()) return;
    guard_.emplace(pool_streams(c10::impl::VirtualGuardImpl(devices.front().type()), devices));
  }
  PoolStreamsScope(const PoolStreamsScope&) = delete;
  PoolStreamsScope& operator=(const PoolStreamsScope&) = delete;

 private:
  c10::optional<c10::MultiStreamGuard> guard_;
};

}  // namespace detail

// A pending future whose value is synchronized on `devices` (see the header comment); no devices,
// or CPU ones (cpu:0): a plain future, as make_future<T>(). Throws std::invalid_argument for
// devices of two types, a device without an index (e.g. cpu), or a device type this libtorch has no
// streams for.
template <class T>
Future<T> make_future(std::vector<c10::Device> devices) {
  Future<T> f;
  devices = detail::checked_devices(std::move(devices));
  // CPU devices with indices (cpu:0) are accepted and need nothing, as in PyTorch.
  if (!devices.empty() && !devices.front().is_cpu()) {
    detail::FutureAccess::state(f)->set_sync(
        std::make_shared<detail::DeviceSync>(std::move(devices)));
  }
  return f;
}

// The devices `f` synchronizes on (sorted by index); empty for a plain future.
inline std::vector<c10::Device> future_devices(const FutureBase& f) {
  auto* sync = dynamic_cast<detail::DeviceSync*>(detail::FutureAccess::state(f)->sync());
  return sync != nullptr ? sync->devices() : std::vector<c10::Device>{};
}

}  // namespace distrpc
