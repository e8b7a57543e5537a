// CudaIpc<T>: DeviceDirect<T, CudaIpcChannel> (device_direct.hpp). CUDA tensors between processes
// on one host go GPU to GPU through CUDA IPC: the receiver maps the sender's allocation once (an
// IPC memory handle, cached per sender allocation) and copies the bytes into memory of its own on
// its GPU, after an interprocess event the sender recorded on its current stream, so the copy
// starts when the tensor is complete. The message itself travels over T. Peers on other hosts, and
// tensors the channel cannot export, go through a CPU copy as on any other policy.
//
// Needs the CUDA runtime (meson: distrpc_cuda_ipc_dep, found where the nccl backend's is) and a
// CUDA libtorch at run time; the receiver's buffer comes from libtorch's caching allocator.
#pragma once

#include <dlfcn.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "distrpc/error.hpp"
#include "distrpc/torch_compat.hpp"
#include "distrpc/transport/device_direct.hpp"

namespace distrpc::transport {

namespace detail {

inline void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free error so later calls are not blamed
    throw DistNetworkError(std::string("cuda_ipc: ") + what + " failed: " + cudaGetErrorString(e));
  }
}

// Restores the calling thread's current CUDA device on exit.
class CudaDeviceScope {
 public:
  explicit CudaDeviceScope(int device) {
    cuda_check(cudaGetDevice(&saved_), "cudaGetDevice");
    if (device != saved_) cuda_check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~CudaDeviceScope() { (void)cudaSetDevice(saved_); }
  CudaDeviceScope(const CudaDeviceScope&) = delete;
  CudaDeviceScope& operator=(const CudaDeviceScope&) = delete;

 private:
  int saved_ = 0;
};

// The allocation that holds `p` (base, size): the driver's cuMemGetAddressRange, reached through
// libcuda itself (the runtime API has no equivalent, and libcuda is loaded wherever a GPU is).
inline std::pair<char*, std::size_t> allocation_of(const void* p) {
  using GetRange = int (*)(unsigned long long*, std::size_t*, unsigned long long);
  static const GetRange get_range = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    return lib == nullptr ? nullptr
                          : reinterpret_cast<GetRange>(dlsym(lib, "cuMemGetAddressRange_v2"));
  }();
  if (get_range == nullptr) {
    throw DistNetworkError("cuda_ipc: libcuda's cuMemGetAddressRange_v2 is not available");
  }
  unsigned long long base = 0;
  std::size_t size = 0;
  if (const int r = get_range(&base, &size, reinterpret_cast<unsigned long long>(p)); r != 0) {
    throw DistNetworkError("cuda_ipc: cuMemGetAddressRange failed with CUresult " +
                           std::to_string(r));
  }
  return {reinterpret_cast<char*>(base), size};
}

// What a receiver imports from (native layout: sender and receiver share the host).
struct IpcDescriptor {
  char bus_id[32] = {};  // the sender's GPU, as the PCI bus id every process names alike
  cudaIpcMemHandle_t memory{};
  std::uint64_t allocation_bytes = 0;
  std::uint64_t offset = 0;  // of the buffer in the allocation
  cudaIpcEventHandle_t event{};
};

// This boot of this host: processes that share it share its GPUs.
inline std::string host_identity() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

}  // namespace detail

class CudaIpcChannel {
 public:
  static constexpr std::string_view name = "cuda_ipc";

  explicit CudaIpcChannel(int /*self_id*/) : host_(detail::host_identity()) {}
  ~CudaIpcChannel() {
    for (auto& [peer, opened] : peers_) close_all(opened);
    for (cudaEvent_t e : free_events_) (void)cudaEventDestroy(e);
  }
  CudaIpcChannel(const CudaIpcChannel&) = delete;
  CudaIpcChannel& operator=(const CudaIpcChannel&) = delete;

  // Empty when this process sees no GPU: then no peer reaches it, nor it any peer.
  std::string address() const {
    return compat::cuda_device_count() > 0 && !host_.empty() ? "host=" + host_ : std::string();
  }
  bool reaches(const std::string& peer_address) const {
    return !peer_address.empty() && peer_address == address();
  }
  bool carries(const at::Tensor& buffer) const { return buffer.is_cuda(); }

  ChannelExport export_buffer(const at::Tensor& buffer) {
    const int device = buffer.device().index();
    detail::CudaDeviceScope on(device);
    detail::IpcDescriptor d;
    detail::cuda_check(cudaDeviceGetPCIBusId(d.bus_id, sizeof d.bus_id, device),
                       "cudaDeviceGetPCIBusId");
    const auto [base, size] = detail::allocation_of(buffer.data_ptr());
    detail::cuda_check(cudaIpcGetMemHandle(&d.memory, base), "cudaIpcGetMemHandle");
    d.allocation_bytes = size;
    d.offset = static_cast<std::uint64_t>(static_cast<const char*>(buffer.data_ptr()) - base);
    // The producer's work is queued on the device's current stream: the receiver's copy waits
    // for this event, not for the whole device.
    const c10::Stream current = c10::impl::VirtualGuardImpl(c10::kCUDA).getStream(buffer.device());
    const auto stream = compat::native_stream(current);
    if (!stream) {
      throw DistNetworkError("cuda_ipc: this libtorch cannot name a CUDA stream's handle");
    }
    cudaEvent_t event = take_event();
    std::shared_ptr<void> keep(event, [this](void* e) { give_event(static_cast<cudaEvent_t>(e)); });
    detail::cuda_check(cudaEventRecord(event, static_cast<cudaStream_t>(*stream)),
                       "cudaEventRecord");
    detail::cuda_check(cudaIpcGetEventHandle(&d.event, event), "cudaIpcGetEventHandle");
    return {std::string(reinterpret_cast<const char*>(&d), sizeof d), std::move(keep)};
  }

  at::Tensor import_buffer(int peer, std::string_view descriptor, std::int64_t nbytes) {
    detail::IpcDescriptor d;
    if (descriptor.size() != sizeof d) {
      throw DistNetworkError("cuda_ipc: descriptor of " + std::to_string(descriptor.size()) +
                             " bytes (expected " + std::to_string(sizeof d) + ")");
    }
    std::memcpy(&d, descriptor.data(), sizeof d);
    d.bus_id[sizeof d.bus_id - 1] = '\0';
    const std::uint64_t end = d.offset + static_cast<std::uint64_t>(nbytes);
    if (end < d.offset || end > d.allocation_bytes) {
      throw DistNetworkError("cuda_ipc: " + std::to_string(nbytes) + " bytes at offset " +
                             std::to_string(d.offset) + " lie outside the " +
                             std::to_string(d.allocation_bytes) + "-byte allocation");
    }
    int device = 0;
    detail::cuda_check(cudaDeviceGetByPCIBusId(&device, d.bus_id), "cudaDeviceGetByPCIBusId");
    detail::CudaDeviceScope on(device);
    Opened& opened = opened_for(peer);
    char* base = map(opened, d);
    cudaEvent_t ready = event(opened, d.event);
    const c10::Device where(c10::kCUDA, static_cast<c10::DeviceIndex>(device));
    c10::impl::VirtualGuardImpl cuda(c10::kCUDA);
    const c10::Stream copy = cuda.getStreamFromGlobalPool(where);
    const auto stream = compat::native_stream(copy);
    if (!stream) {
      throw DistNetworkError("cuda_ipc: this libtorch cannot name a CUDA stream's handle");
    }
    const auto s = static_cast<cudaStream_t>(*stream);
    // Allocated while the copy stream is current: the caching allocator ties the block to it.
    c10::StreamGuard current(copy);
    at::Tensor out = at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).device(where));
    detail::cuda_check(cudaStreamWaitEvent(s, ready, 0), "cudaStreamWaitEvent");
    detail::cuda_check(
        cudaMemcpyAsync(out.data_ptr(), base + d.offset, static_cast<std::size_t>(nbytes),
                        cudaMemcpyDeviceToDevice, s),
        "cudaMemcpyAsync");
    // Complete before the sender hears its loan is back (and may reuse the memory), and before
    // the receiver's code, on whichever stream, reads it.
    detail::cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    // The block belongs to the copy stream, but the decoder and handlers read it on the device's
    // default stream: the allocator then reuses it only after that stream's work on it is done.
    cuda.recordDataPtrOnStream(out.storage().data_ptr(), cuda.getDefaultStream(where));
    return out;
  }

  void forget(int peer) {
    std::map<int, Opened>::node_type gone;
    {
      std::lock_guard<std::mutex> lk(mu_);
      gone = peers_.extract(peer);
    }
    if (!gone.empty()) close_all(gone.mapped());
  }

 private:
  // What this receiver opened of one sender: its allocations mapped here and its events, each
  // keyed by the handle's bytes (a sender's allocation has one handle; its events are pooled and
  // come back). At most kMaxMapped allocations stay mapped: the oldest is closed first.
  static constexpr std::size_t kMaxMapped = 64;
  struct Opened {
    std::map<std::string, char*> mapped;
    std::deque<std::string> order;
    std::map<std::string, cudaEvent_t> events;
  };

  // A peer's entry (a reference into a map no one erases from while it is used, see peers_).
  Opened& opened_for(int peer) {
    std::lock_guard<std::mutex> lk(mu_);
    return peers_[peer];
  }

  static void close_all(Opened& o) {
    for (auto& [key, p] : o.mapped) (void)cudaIpcCloseMemHandle(p);
    for (auto& [key, e] : o.events) (void)cudaEventDestroy(e);
    o = Opened{};
  }

  static char* map(Opened& o, const detail::IpcDescriptor& d) {
    const std::string key(reinterpret_cast<const char*>(&d.memory), sizeof d.memory);
    if (const auto it = o.mapped.find(key); it != o.mapped.end()) return it->second;
    void* p = nullptr;
    detail::cuda_check(cudaIpcOpenMemHandle(&p, d.memory, cudaIpcMemLazyEnablePeerAccess),
                       "cudaIpcOpenMemHandle");
    // The driver's size of what was mapped, not the sender's word for it.
    if (detail::allocation_of(p).second < d.allocation_bytes) {
      (void)cudaIpcCloseMemHandle(p);
      throw DistNetworkError("cuda_ipc: the mapped allocation is smaller than described");
    }
    if (o.order.size() >= kMaxMapped) {
      (void)cudaIpcCloseMemHandle(o.mapped[o.order.front()]);
      o.mapped.erase(o.order.front());
      o.order.pop_front();
    }
    o.mapped.emplace(key, static_cast<char*>(p));
    o.order.push_back(key);
    return static_cast<char*>(p);
  }

  static cudaEvent_t event(Opened& o, const cudaIpcEventHandle_t& h) {
    const std::string key(reinterpret_cast<const char*>(&h), sizeof h);
    if (const auto it = o.events.find(key); it != o.events.end()) return it->second;
    cudaEvent_t e = nullptr;
    detail::cuda_check(cudaIpcOpenEventHandle(&e, h), "cudaIpcOpenEventHandle");
    o.events.emplace(key, e);
    return e;
  }

  cudaEvent_t take_event() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!free_events_.empty()) {
        cudaEvent_t e = free_events_.back();
        free_events_.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    detail::cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventInterprocess),
                       "cudaEventCreateWithFlags");
    return e;
  }
  void give_event(cudaEvent_t e) {
    std::lock_guard<std::mutex> lk(mu_);
    free_events_.push_back(e);
  }

  const std::string host_;
  std::mutex mu_;                         // the two containers below (their structure)
  std::vector<cudaEvent_t> free_events_;  // interprocess events of finished loans
  // By peer. An entry's contents are used by the receiving thread only, and by forget(), which
  // DeviceDirect calls where no import from that peer runs.
  std::map<int, Opened> peers_;
};

template <class T>
using CudaIpc = DeviceDirect<T, CudaIpcChannel>;

}  // namespace distrpc::transport
