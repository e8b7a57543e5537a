// CudaIpc<T>: DeviceDirect<T, CudaIpcChannel> (device_direct.hpp). CUDA tensors between processes
// on one host go GPU to GPU through CUDA IPC: the sender copies the tensor into memory it lends
// (a snapshot, so the caller may change the tensor once the call returns), the receiver maps that
// memory (an IPC memory handle) and copies the bytes into memory of its own on its GPU, after an
// interprocess event the sender recorded behind its copy. The message itself travels over T.
// Peers on other hosts, and tensors the channel cannot export, go through a CPU copy as on any
// other policy.
//
// Mapping an allocation of another process and unmapping it cost far more than copying tens of
// MiB, so snapshots are made in slabs: device allocations the process makes for this alone, never
// frees, and reuses once their loan is back (a loan that ends without the receiver's Release, its
// peer lost or the Context stopped, retires its slab instead: that receiver may still read it). A
// snapshot takes a free slab of its size (a power of two) up to four times that, else a new one,
// else, at the limit, any larger free one. A receiver keeps a slab mapped for as long as it
// knows the sender. (A mapping may stay open only while the sender keeps the allocation: CUDA
// leaves freeing an allocation another process still maps undefined, and libtorch's caching
// allocator may free its blocks at any time.) Slabs come in powers of two from 64 KiB, up to
// DISTRPC_CUDA_IPC_POOL_MB per GPU and process (1024 by default, 0: none); past that, a snapshot
// is an allocation of libtorch's, mapped for one copy and closed right after it.
//
// Needs the CUDA runtime (meson: distrpc_cuda_ipc_dep, found where the nccl backend's is) and a
// CUDA libtorch at run time; the receiver's buffer comes from libtorch's caching allocator.
#pragma once

#include <dlfcn.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "distrpc/cuda_device_scope.hpp"
#include "distrpc/cuda_event_poll.hpp"
#include "distrpc/error.hpp"
#include "distrpc/net/env_number.hpp"
#include "distrpc/torch_compat.hpp"
#include "distrpc/transport/device_direct.hpp"

namespace distrpc::transport {

namespace detail {

// Throws DistNetworkError "<who>: <what> failed: <CUDA's text>" for an error.
inline void cuda_check(cudaError_t e, const char* what, const char* who = "cuda_ipc") {
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free error so later calls are not blamed
    throw DistNetworkError(std::string(who) + ": " + what + " failed: " + cudaGetErrorString(e));
  }
}

// The CUDA stream behind a c10 stream (compat::native_stream).
inline cudaStream_t native(const c10::Stream& s) {
  if (const auto h = compat::native_stream(s)) return static_cast<cudaStream_t>(*h);
  throw DistNetworkError("cuda_ipc: this libtorch cannot name a CUDA stream's handle");
}

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
  std::uint64_t slab = 0;  // 1: a slab, which the receiver may keep mapped (see the top)
};

// The slab limit per GPU in bytes, from DISTRPC_CUDA_IPC_POOL_MB (MiB; unset or empty: 1024).
// Throws std::invalid_argument naming the variable when its value is not a whole number of MiB
// in 0..1048576.
inline std::size_t slab_limit_from_env() {
  return static_cast<std::size_t>(
             net::whole_number_from_env("DISTRPC_CUDA_IPC_POOL_MB", 1024, 1ULL << 20, "MiB"))
         << 20;
}

// The process's slabs (see the top of this file): device allocations, each with its IPC handle,
// handed out for one loan at a time. Never freed: a receiver may keep a slab mapped until it
// notices that this process is gone, and CUDA leaves freeing an allocation another process still
// maps undefined. So the pool is one per process (process_slabs()), reused by every channel and
// every re-initialization, and its memory goes back to the driver when the process exits.
class SnapshotSlabs {
 public:
  struct Slab {
    int device;
    char* base;
    std::size_t bytes;
    cudaIpcMemHandle_t handle;
    // Recorded after each copy into the slab: the next copy waits for it on its own stream,
    // since a loan can come back without the receiver having waited for the last one (an import
    // that failed before its copy, Transfers dropped unread at shutdown).
    cudaEvent_t written;
  };

  SnapshotSlabs() = default;
  SnapshotSlabs(const SnapshotSlabs&) = delete;
  SnapshotSlabs& operator=(const SnapshotSlabs&) = delete;

  // The limit for slabs made from now on, per GPU (the last channel made sets it).
  void set_limit(std::size_t bytes) {
    std::lock_guard<std::mutex> lk(mu_);
    limit_ = bytes;
  }

  // A free slab of at least n bytes on `device` (current on this thread): a free one of n's
  // size (rounded up to a power of two) up to four times it, else a new one within the limit,
  // else any larger free one (so that one big slab does not shut every other size out for good);
  // null when none of these exists or the GPU has no memory left (the snapshot is then an
  // ordinary allocation).
  Slab* take(int device, std::size_t n) {
    std::size_t bytes = std::size_t{64} << 10;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (n > limit_) return nullptr;
      while (bytes < n) bytes <<= 1;
      if (Slab* s = take_free_locked(device, bytes, 4 * bytes)) return s;
      if (bytes > limit_ || reserved_[device] > limit_ - bytes) {
        return take_free_locked(device, bytes, std::numeric_limits<std::size_t>::max());
      }
      reserved_[device] += bytes;
    }
    auto slab = std::make_unique<Slab>(Slab{device, nullptr, bytes, {}, nullptr});
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e == cudaSuccess) {
      slab->base = static_cast<char*>(p);
      e = cudaIpcGetMemHandle(&slab->handle, p);
      if (e == cudaSuccess) e = cudaEventCreateWithFlags(&slab->written, cudaEventDisableTiming);
      if (e != cudaSuccess) (void)cudaFree(p);  // never exported: safe to free
    }
    std::lock_guard<std::mutex> lk(mu_);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      reserved_[device] -= bytes;
      return nullptr;
    }
    all_.push_back(std::move(slab));
    return all_.back().get();
  }

  void give(Slab* s) {
    std::lock_guard<std::mutex> lk(mu_);
    free_[{s->device, s->bytes}].push_back(s);
  }
  // A slab that must never be handed out again: a receiver may still read it (its loan ended
  // without a Release), or a copy into it is not covered by `written`. It stays allocated and
  // counts against the limit.
  void retire(Slab* /*s*/) {
    std::lock_guard<std::mutex> lk(mu_);
    ++retired_;
  }

  struct Made {
    std::size_t slabs = 0;  // all GPUs
    std::size_t bytes = 0;
    std::size_t retired = 0;  // of those, never to be handed out again
  };
  Made made() const {
    std::lock_guard<std::mutex> lk(mu_);
    Made m{all_.size(), 0, retired_};
    for (const auto& s : all_) m.bytes += s->bytes;
    return m;
  }

 private:
  // Under mu_: the smallest free slab on `device` of `bytes` up to `most` bytes, taken.
  Slab* take_free_locked(int device, std::size_t bytes, std::size_t most) {
    for (auto it = free_.lower_bound({device, bytes});
         it != free_.end() && it->first.first == device && it->first.second <= most; ++it) {
      if (!it->second.empty()) {
        Slab* s = it->second.back();
        it->second.pop_back();
        return s;
      }
    }
    return nullptr;
  }

  mutable std::mutex mu_;
  std::size_t limit_ = 0;
  std::size_t retired_ = 0;
  std::vector<std::unique_ptr<Slab>> all_;
  std::map<std::pair<int, std::size_t>, std::vector<Slab*>> free_;  // by (device, bytes)
  std::map<int, std::size_t> reserved_;                             // bytes made, per device
};

// The one pool of this process; deliberately never destroyed (see SnapshotSlabs).
inline SnapshotSlabs& process_slabs() {
  static SnapshotSlabs* slabs = new SnapshotSlabs();
  return *slabs;
}

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

  explicit CudaIpcChannel(int /*self_id*/) : address_(own_address()) {
    detail::process_slabs().set_limit(detail::slab_limit_from_env());
  }
  ~CudaIpcChannel() {
    for (auto& [peer, opened] : peers_) close_all(opened);
    for (auto& [device, events] : free_events_) {
      for (cudaEvent_t e : events) (void)cudaEventDestroy(e);
    }
    for (auto& [device, c] : copy_streams_) (void)cudaEventDestroy(c.copied);
  }
  CudaIpcChannel(const CudaIpcChannel&) = delete;
  CudaIpcChannel& operator=(const CudaIpcChannel&) = delete;

  // "host=<boot id>;pid=<pid>;gpus=<bus id>,<bus id>...": empty when this process sees no GPU.
  std::string address() const { return address_; }

  // Reached: another process of this boot of this host that sees at least one GPU this one
  // sees (by PCI bus id, whatever CUDA_VISIBLE_DEVICES numbers them). A tensor on a GPU the peer
  // does not see is refused by export_buffer() (and staged).
  bool connect(int peer, const std::string& peer_address) {
    const auto mine = parse(address_);
    const auto theirs = parse(peer_address);
    std::set<std::string> common;
    if (!address_.empty() && mine.host == theirs.host && mine.pid != theirs.pid) {
      for (const auto& g : theirs.gpus) {
        if (mine.gpus.count(g) != 0) common.insert(g);
      }
    }
    // Replaces what an earlier incarnation of that worker left (forget() keeps it: the loss of
    // the old one may be handled after the new one connected).
    std::lock_guard<std::mutex> lk(mu_);
    peer_gpus_[peer] = common;
    return !common.empty();
  }
  bool carries(const at::Tensor& buffer) const { return buffer.is_cuda(); }

  // Whether worker `peer` sees GPU `device` of this process (known once connect() ran): a buffer
  // there can go to it through this channel.
  bool sees(int peer, int device) {
    char bus[32] = {};
    if (cudaDeviceGetPCIBusId(bus, sizeof bus, device) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    std::lock_guard<std::mutex> lk(mu_);
    const auto it = peer_gpus_.find(peer);
    return it != peer_gpus_.end() && it->second.count(normalized(bus)) != 0;
  }

  // Lends a snapshot: a copy made on the current stream, so that the caller may change the
  // tensor as soon as the call returns (the value semantics of every other policy). The copy is
  // on the same GPU, queued behind the tensor's producer, into a slab when one is free or can be
  // made (see the top of this file); the receiver waits for an interprocess event recorded after
  // it, not for the whole device.
  ChannelExport export_buffer(int peer, const at::Tensor& buffer) {
    const int device = buffer.device().index();
    const CudaDeviceScope on(device, "cuda_ipc");
    detail::IpcDescriptor d;
    detail::cuda_check(cudaDeviceGetPCIBusId(d.bus_id, sizeof d.bus_id, device),
                       "cudaDeviceGetPCIBusId");
    {
      std::lock_guard<std::mutex> lk(mu_);
      const auto it = peer_gpus_.find(peer);
      if (it == peer_gpus_.end() || it->second.count(normalized(d.bus_id)) == 0) {
        throw DistNetworkError(std::string("cuda_ipc: worker ") + std::to_string(peer) +
                               " does not see GPU " + d.bus_id);
      }
    }
    const cudaStream_t current =
        detail::native(c10::impl::VirtualGuardImpl(c10::kCUDA).getStream(buffer.device()));
    const auto nbytes = static_cast<std::size_t>(buffer.nbytes());
    // Owns the event, and the slab once taken: an error below gives both back.
    auto lent = std::make_shared<Lent>(take_event(device), device, this);
    if (buffer.is_contiguous() && nbytes > 0)
      lent->slab = detail::process_slabs().take(device, nbytes);
    if (detail::SnapshotSlabs::Slab* slab = lent->slab) {
      // Behind the slab's previous copy (see Slab::written). The source stays alive until the
      // loan is back (DeviceDirect keeps it with the loan).
      detail::cuda_check(cudaStreamWaitEvent(current, slab->written, 0), "cudaStreamWaitEvent");
      detail::cuda_check(
          cudaMemcpyAsync(slab->base, buffer.data_ptr(), nbytes, cudaMemcpyDeviceToDevice, current),
          "cudaMemcpyAsync");
      if (const cudaError_t e = cudaEventRecord(slab->written, current); e != cudaSuccess) {
        // The copy is queued but `written` does not cover it: a later copy into this slab
        // could be overtaken by it, so the slab is never handed out again.
        lent->slab_retired = true;
        detail::cuda_check(e, "cudaEventRecord");
      }
      d.memory = slab->handle;
      d.allocation_bytes = slab->bytes;
      d.offset = 0;
      d.slab = 1;
    } else {
      lent->snapshot = buffer.clone();
      const auto [base, size] = detail::allocation_of(lent->snapshot.data_ptr());
      detail::cuda_check(cudaIpcGetMemHandle(&d.memory, base), "cudaIpcGetMemHandle");
      d.allocation_bytes = size;
      d.offset =
          static_cast<std::uint64_t>(static_cast<const char*>(lent->snapshot.data_ptr()) - base);
    }
    const cudaEvent_t event = lent->event;
    detail::cuda_check(cudaEventRecord(event, current), "cudaEventRecord");
    detail::cuda_check(cudaIpcGetEventHandle(&d.event, event), "cudaIpcGetEventHandle");
    return {std::string(reinterpret_cast<const char*>(&d), sizeof d), std::move(lent)};
  }

  at::Tensor import_buffer(int peer, std::string_view descriptor, std::int64_t nbytes) {
    detail::IpcDescriptor d;
    if (descriptor.size() != sizeof d) {
      throw DistNetworkError("cuda_ipc: descriptor of " + std::to_string(descriptor.size()) +
                             " bytes (expected " + std::to_string(sizeof d) + ")");
    }
    std::memcpy(&d, descriptor.data(), sizeof d);
    d.bus_id[sizeof d.bus_id - 1] = '\0';
    int device = 0;
    detail::cuda_check(cudaDeviceGetByPCIBusId(&device, d.bus_id), "cudaDeviceGetByPCIBusId");
    const CudaDeviceScope on(device, "cuda_ipc");
    Opened& opened = opened_for(peer);
    // A slab stays mapped while the sender is known (kept in `opened`); any other allocation is
    // closed on every way out, on this device, once nothing queued can still read it.
    Mapping* kept = d.slab != 0 ? &kept_mapping(opened, d, device) : nullptr;
    Mapping once = kept != nullptr ? Mapping{} : map(d, device);
    const Mapping& mapping = kept != nullptr ? *kept : once;
    bool queued = false;  // a copy from it may still run: then it is never closed (below)
    struct Closer {
      Mapping* kept;
      const Mapping& m;
      const bool& queued;
      ~Closer() {
        if (kept == nullptr && !queued) (void)cudaIpcCloseMemHandle(m.base);
        // A kept mapping a queued copy may still read is never closed either.
        if (kept != nullptr && queued) kept->abandoned = true;
      }
    } closer{kept, mapping, queued};
    // Bounded by what the driver mapped, not by the sender's word.
    const std::uint64_t end = d.offset + static_cast<std::uint64_t>(nbytes);
    if (end < d.offset || end > mapping.bytes) {
      throw DistNetworkError("cuda_ipc: " + std::to_string(nbytes) + " bytes at offset " +
                             std::to_string(d.offset) + " lie outside the " +
                             std::to_string(mapping.bytes) + "-byte allocation");
    }
    cudaEvent_t ready = event(opened, d.event);
    // The copy lands on the same GPU, in the receiver's own memory; a device map to another GPU
    // moves it there in the decoder.
    const c10::Device where(c10::kCUDA, static_cast<c10::DeviceIndex>(device));
    c10::impl::VirtualGuardImpl cuda(c10::kCUDA);
    const CopyStream copy = copy_stream(where);
    const cudaStream_t s = detail::native(copy.stream);
    at::Tensor out;
    {
      // Allocated while the copy stream is current: the caching allocator ties the block to it.
      c10::StreamGuard current(copy.stream);
      out = at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).device(where));
    }
    detail::cuda_check(cudaStreamWaitEvent(s, ready, 0), "cudaStreamWaitEvent");
    detail::cuda_check(
        cudaMemcpyAsync(out.data_ptr(), mapping.base + d.offset, static_cast<std::size_t>(nbytes),
                        cudaMemcpyDeviceToDevice, s),
        "cudaMemcpyAsync");
    queued = true;
    detail::cuda_check(cudaEventRecord(copy.copied, s), "cudaEventRecord");
    // Complete before the sender hears its loan is back (and may reuse the memory), and before
    // the receiver's code, on whichever stream, reads it. Polled, so that stop() can end a wait
    // for a sender whose stream never gets there: the copy then stays queued, so the mapping it
    // reads is left open for good (closing it would make the copy fault, and a fault poisons the
    // whole process's CUDA context).
    wait(copy.copied);
    queued = false;
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

  // Ends waits inside import_buffer (the Context is stopping).
  void stop() { stopping_ = true; }

  // A loan ended without its receiver's Release (DeviceDirect's contract): its slab and event
  // are never reused. Every `keep` this channel hands out is a Lent.
  void retire(const std::shared_ptr<void>& keep) {
    if (keep) static_cast<Lent*>(keep.get())->retired = true;
  }

  // For tests and diagnostics: slabs this process made (as a sender, all channels together),
  // and this channel's mappings of other processes' memory (as a receiver): opened, and imports
  // served by one kept open.
  struct Stats {
    std::size_t slabs = 0;
    std::size_t slab_bytes = 0;
    std::size_t slabs_retired = 0;  // never handed out again (see Lent)
    std::uint64_t mappings_opened = 0;
    std::uint64_t mappings_reused = 0;
  };
  Stats stats() const {
    const auto m = detail::process_slabs().made();
    return {m.slabs, m.bytes, m.retired, opened_.load(), reused_.load()};
  }

 private:
  // Where this receiver copies on one device, and the event it records behind each copy (one
  // import at a time: imports run on the receiving thread only).
  struct CopyStream {
    c10::Stream stream;
    cudaEvent_t copied;
  };
  // A sender's allocation mapped here: for one copy, or kept (a slab).
  struct Mapping {
    char* base = nullptr;
    std::uint64_t bytes = 0;  // the driver's size of the mapped allocation
    int device = 0;           // where it was opened (and is closed)
    bool abandoned = false;   // a copy from it never finished: never closed
  };
  // What this receiver opened of one sender and keeps: its events and its slabs' mappings, keyed
  // by the handles' bytes (the sender pools both and they come back).
  struct Opened {
    std::map<std::string, cudaEvent_t> events;
    std::map<std::string, Mapping> slabs;
  };
  // A loan's part here: its event, and the slab or the snapshot lent, back once released.
  // Retired (the loan ended without a Release: retire()), the event and the slab are never
  // reused: the receiver may still wait on the one and read the other. (The event is left
  // undestroyed: that receiver may hold it open.) A snapshot outside the slabs goes back to
  // libtorch's allocator either way, after the grace DeviceDirect gives a lost peer.
  struct Lent {
    cudaEvent_t event;
    int device;
    CudaIpcChannel* channel;
    detail::SnapshotSlabs::Slab* slab = nullptr;
    at::Tensor snapshot;        // when not in a slab
    bool retired = false;       // set by retire(), on the thread that ends the loan
    bool slab_retired = false;  // the slab alone (see export_buffer)
    Lent(cudaEvent_t e, int d, CudaIpcChannel* c) : event(e), device(d), channel(c) {}
    Lent(const Lent&) = delete;
    Lent& operator=(const Lent&) = delete;
    ~Lent() {
      if (!retired) channel->give_event(device, event);
      if (slab == nullptr) return;
      if (retired || slab_retired) {
        detail::process_slabs().retire(slab);
      } else {
        detail::process_slabs().give(slab);
      }
    }
  };
  struct ParsedAddress {
    std::string host;
    std::string pid;
    std::set<std::string> gpus;
  };

  static std::string normalized(std::string bus) {
    for (auto& c : bus) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return bus;
  }

  static std::string own_address() {
    const std::string host = detail::host_identity();
    int count = 0;
    if (host.empty() || cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      (void)cudaGetLastError();
      return {};
    }
    std::string gpus;
    for (int i = 0; i < count; ++i) {
      char bus[32] = {};
      if (cudaDeviceGetPCIBusId(bus, sizeof bus, i) != cudaSuccess) {
        (void)cudaGetLastError();
        continue;
      }
      gpus += (gpus.empty() ? "" : ",") + normalized(bus);
    }
    return "host=" + host + ";pid=" + std::to_string(::getpid()) + ";gpus=" + gpus;
  }

  static ParsedAddress parse(const std::string& a) {
    ParsedAddress p;
    std::size_t at = 0;
    while (at < a.size()) {
      const std::size_t end = std::min(a.find(';', at), a.size());
      const std::string field = a.substr(at, end - at);
      const std::size_t eq = field.find('=');
      if (eq != std::string::npos) {
        const std::string key = field.substr(0, eq);
        const std::string value = field.substr(eq + 1);
        if (key == "host") p.host = value;
        if (key == "pid") p.pid = value;
        if (key == "gpus") {
          std::size_t g = 0;
          while (g < value.size()) {
            const std::size_t comma = std::min(value.find(',', g), value.size());
            if (comma > g) p.gpus.insert(normalized(value.substr(g, comma - g)));
            g = comma + 1;
          }
        }
      }
      at = end + 1;
    }
    return p;
  }

  // Until `copied` is reached (not the whole stream: work queued on it later is not waited for).
  void wait(cudaEvent_t copied) const {
    const cudaError_t e = poll_event(copied, [&] { return !stopping_.load(); });
    if (e == cudaErrorNotReady)
      throw DistNetworkError("cuda_ipc: stopped while waiting for a copy");
    detail::cuda_check(e, "cudaEventQuery");
  }

  // The stream this receiver copies on, one per device, taken from the pool once and kept: the
  // caching allocator reuses a freed block only for allocations on the stream it was made on, so
  // a stream per import (the pool hands them out in turn) made every received tensor a fresh
  // cudaMalloc, and held as many cached blocks of each size as the pool has streams. From the
  // high-priority pool: distrpc's other streams (the nccl backend's, futures' callbacks) come
  // from the ordinary one, so a copy never queues behind a collective waiting for its peers.
  // Called with `where` current (the event is made there).
  CopyStream copy_stream(const c10::Device& where) {
    std::lock_guard<std::mutex> lk(mu_);
    const auto it = copy_streams_.find(where.index());
    if (it != copy_streams_.end()) return it->second;
    cudaEvent_t copied = nullptr;
    detail::cuda_check(cudaEventCreateWithFlags(&copied, cudaEventDisableTiming),
                       "cudaEventCreateWithFlags");
    const CopyStream c{c10::impl::VirtualGuardImpl(c10::kCUDA).getStreamFromGlobalPool(where, true),
                       copied};
    copy_streams_.emplace(where.index(), c);
    return c;
  }

  // A peer's entry (a reference into a map no one erases from while it is used, see peers_).
  Opened& opened_for(int peer) {
    std::lock_guard<std::mutex> lk(mu_);
    return peers_[peer];
  }

  static void close_all(Opened& o) {
    for (auto& [key, e] : o.events) (void)cudaEventDestroy(e);
    int saved = 0;
    const bool restore = cudaGetDevice(&saved) == cudaSuccess;
    for (auto& [key, m] : o.slabs) {
      if (!m.abandoned && cudaSetDevice(m.device) == cudaSuccess) {
        (void)cudaIpcCloseMemHandle(m.base);
      }
    }
    if (restore) (void)cudaSetDevice(saved);
    (void)cudaGetLastError();
    o = Opened{};
  }

  // Maps the allocation `d` names, with `device` current (the caller closes it), and counts it.
  Mapping map(const detail::IpcDescriptor& d, int device) {
    void* p = nullptr;
    detail::cuda_check(cudaIpcOpenMemHandle(&p, d.memory, cudaIpcMemLazyEnablePeerAccess),
                       "cudaIpcOpenMemHandle");
    ++opened_;
    Mapping m{static_cast<char*>(p), 0, device, false};
    try {
      m.bytes = detail::allocation_of(p).second;
    } catch (...) {
      (void)cudaIpcCloseMemHandle(p);
      throw;
    }
    return m;
  }

  // The sender's slab `d` names, mapped once and kept in `o` (closed by close_all).
  Mapping& kept_mapping(Opened& o, const detail::IpcDescriptor& d, int device) {
    const std::string key(reinterpret_cast<const char*>(&d.memory), sizeof d.memory);
    if (const auto it = o.slabs.find(key); it != o.slabs.end()) {
      ++reused_;
      return it->second;
    }
    return o.slabs.emplace(key, map(d, device)).first->second;
  }

  static cudaEvent_t event(Opened& o, const cudaIpcEventHandle_t& h) {
    const std::string key(reinterpret_cast<const char*>(&h), sizeof h);
    if (const auto it = o.events.find(key); it != o.events.end()) return it->second;
    cudaEvent_t e = nullptr;
    detail::cuda_check(cudaIpcOpenEventHandle(&e, h), "cudaIpcOpenEventHandle");
    o.events.emplace(key, e);
    return e;
  }

  // Interprocess events of finished loans, per device (an event is recorded on its own
  // device's streams only). Called with `device` current.
  cudaEvent_t take_event(int device) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto& pool = free_events_[device];
      if (!pool.empty()) {
        cudaEvent_t e = pool.back();
        pool.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    detail::cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventInterprocess),
                       "cudaEventCreateWithFlags");
    return e;
  }
  void give_event(int device, cudaEvent_t e) {
    std::lock_guard<std::mutex> lk(mu_);
    free_events_[device].push_back(e);
  }

  const std::string address_;
  std::atomic<std::uint64_t> opened_{0};
  std::atomic<std::uint64_t> reused_{0};
  std::atomic<bool> stopping_{false};
  std::mutex mu_;  // the structure of the containers below
  std::map<int, std::vector<cudaEvent_t>> free_events_;
  std::map<int, CopyStream> copy_streams_;          // by device (copy_stream())
  std::map<int, std::set<std::string>> peer_gpus_;  // per peer: the GPUs both of us see
  // By peer. An entry's contents are used by the receiving thread only (import_buffer and
  // forget() both run there).
  std::map<int, Opened> peers_;
};

template <class T>
using CudaIpc = DeviceDirect<T, CudaIpcChannel>;

}  // namespace distrpc::transport
