// Nccl<T>: DeviceDirect<T, NcclChannel> (device_direct.hpp). The CUDA tensors of a message travel
// GPU to GPU over NCCL point-to-point (ncclSend / ncclRecv) while the message itself travels over
// the policy T it wraps: `Nccl<Tcp>`, `Nccl<Auto<Shm, Tcp>>`. Between processes that see the same
// GPU, where NCCL cannot run (it refuses one device twice in a communicator), the channel moves
// the buffer through CUDA IPC instead (cuda_ipc.hpp), so every pair of GPU processes is served.
//
// Per buffer, the sender chooses:
//  - the peer sees the buffer's GPU (same host, same device): CUDA IPC, as CudaIpc<T> does;
//  - else NCCL: a communicator of two ranks per direction, sending process and its GPU to
//    receiving process (a "link"; rank 0 sends, rank 1 receives), made on first use. Its unique
//    id rides in the descriptor of every buffer sent over it, so the receiver joins on the first
//    one it reads and no store or extra round trip is needed. The sender snapshots the buffer on
//    the caller's current stream (the caller may change the tensor once the call returns) and
//    hands it to the link's own thread, which waits for that snapshot on the link's stream and
//    queues the ncclSend: nothing on the caller's thread waits for the GPU or for the peer.
// The receiver, on DeviceDirect's receiving thread, queues the matching ncclRecv on a stream of
// its own into memory from libtorch's caching allocator, on its GPU of the sender's device index
// (its first GPU when it has fewer): a device map to another GPU moves it there in the decoder.
// A receive matches the sends of its link in order, so exports to a peer are ordered with the
// sends of their Transfers (ordered_exports), and each descriptor carries its sequence number:
// one out of order fails that link instead of pairing the wrong buffers.
//
// Failures end in bounded time, each with the link it hit:
//  - a peer lost (T reports it, peer_lost): its links end at once (their threads abort their
//    communicators, which are non-blocking), a receive waiting for it gives up within
//    microseconds and aborts its side, and nothing is exported to it until it is registered
//    again (its buffers are staged, and T refuses the send);
//  - the receiver cannot import a buffer (its communicator does not come up within kJoinTimeout,
//    an NCCL error, a buffer out of order, no memory): it aborts its side, remembers the link as
//    dead (later buffers of it fail at once), and its Release says so (refused): the sender
//    aborts its side too, and its next buffer to that peer makes a new link;
//  - the sender's side fails (an NCCL error, or the receiver not joining within kInitTimeout):
//    that link ends and the next buffer makes a new one; its receiver, which nothing tells over
//    NVLink, gives up a receive after kReceiveTimeout;
//  - a Transfer that could not be sent after its export (unsent): the link's earlier sends still
//    go (their receivers wait for them), then the link ends;
//  - stop(): waits end, links are aborted.
// A snapshot stays allocated until its send completed or its link was aborted and its stream came
// to rest; a stream that does not within kDrainTimeout keeps its snapshots for good (freed memory
// a running kernel still reads could be anything's).
//
// Known limit: NCCL asks that operations of different communicators on one GPU not be issued
// concurrently from several threads, as their kernels may wait on each other; here each link's
// thread, the receiving thread and a process group's nccl backend may do so. NCCL's
// point-to-point kernels are small and run side by side on current GPUs; with
// CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware queue) they might not.
//
// Needs NCCL (meson: distrpc_nccl_transport_dep, where the nccl backend is found) and a CUDA
// libtorch at run time. A GPU machine runs its CUDA IPC side; its NCCL side needs two GPUs.
#pragma once

#include <nccl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
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
#include "distrpc/transport/cuda_ipc.hpp"
#include "distrpc/transport/device_direct.hpp"

namespace distrpc::transport {

namespace detail {

inline void nccl_p2p_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess && r != ncclInProgress) {
    throw DistNetworkError(std::string("nccl: ") + what + " failed: " + ncclGetErrorString(r) +
                           " (" + ncclGetLastError(nullptr) + ")");
  }
}

// What the NCCL side of a descriptor says (after its tag byte), in the host's byte order (see
// DeviceDirect's Transfer header).
struct NcclDescriptor {
  std::uint64_t generation = 0;  // of the sender's link (a new communicator each)
  std::uint64_t seq = 0;         // 1, 2, ... within the link
  std::int32_t device = 0;       // the sender's GPU (its index in the sender's process)
  ncclUniqueId id{};             // the link's communicator
};

inline constexpr char kViaIpc = 'I';
inline constexpr char kViaNccl = 'N';

inline std::string encode_nccl_descriptor(const NcclDescriptor& d) {
  std::string out(1, kViaNccl);
  out.append(reinterpret_cast<const char*>(&d), sizeof d);
  return out;
}

// `body` is what follows the tag; every field of it is the peer's word.
inline NcclDescriptor decode_nccl_descriptor(std::string_view body) {
  NcclDescriptor d;
  if (body.size() != sizeof d) {
    throw DistNetworkError("nccl: descriptor of " + std::to_string(body.size()) +
                           " bytes (expected " + std::to_string(sizeof d) + ")");
  }
  std::memcpy(&d, body.data(), sizeof d);
  if (d.seq == 0 || d.device < 0) {
    throw DistNetworkError("nccl: descriptor with sequence number " + std::to_string(d.seq) +
                           " and device " + std::to_string(d.device));
  }
  return d;
}

// Whether an address a CudaIpcChannel made names at least one GPU.
inline bool address_has_gpus(const std::string& address) {
  const auto at = address.find("gpus=");
  if (at == std::string::npos) return false;
  const auto end = address.find(';', at);
  return (end == std::string::npos ? address.size() : end) > at + 5;
}

// How a wait on a non-blocking communicator ended before NCCL settled.
enum class WaitEnd { settled, gave_up, timed_out };

// While `r` is ncclInProgress: polls `comm` (ncclCommGetAsyncError), yielding between the first
// `spins` looks and sleeping `nap` between later ones, until NCCL settles (the result returned,
// `end` settled), `give_up()` says to stop or `until` passes (ncclInProgress returned, `end`
// says which).
template <class GiveUp>
ncclResult_t poll_nccl(ncclComm_t comm, ncclResult_t r, std::chrono::steady_clock::time_point until,
                       const GiveUp& give_up, int spins, std::chrono::microseconds nap,
                       WaitEnd& end) {
  end = WaitEnd::settled;
  for (int n = 0; r == ncclInProgress; n = n < spins ? n + 1 : n) {
    if (give_up()) {
      end = WaitEnd::gave_up;
      return r;
    }
    if (std::chrono::steady_clock::now() >= until) {
      end = WaitEnd::timed_out;
      return r;
    }
    if (n < spins) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(nap);
    }
    if (ncclCommGetAsyncError(comm, &r) != ncclSuccess) r = ncclInternalError;
  }
  return r;
}

// A communicator of two ranks, non-blocking (so that it can be aborted from any thread), made
// with `device` current; polls every millisecond until it is up, `give_up()` says to stop, or
// `until`.
template <class GiveUp>
ncclComm_t make_p2p_comm(const ncclUniqueId& id, int rank,
                         std::chrono::steady_clock::time_point until, const GiveUp& give_up) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  WaitEnd end = WaitEnd::settled;
  ncclResult_t r = ncclCommInitRankConfig(&comm, 2, id, rank, &config);
  r = poll_nccl(comm, r, until, give_up, 0, std::chrono::milliseconds(1), end);
  if (end != WaitEnd::settled) {
    (void)ncclCommAbort(comm);
    throw DistNetworkError(end == WaitEnd::gave_up
                               ? "nccl: stopped while a communicator was being made"
                               : "nccl: the peer did not join the communicator in time");
  }
  if (r != ncclSuccess) {
    if (comm != nullptr) (void)ncclCommAbort(comm);
    nccl_p2p_check(r, "ncclCommInitRankConfig");
  }
  return comm;
}

// After an operation on a non-blocking communicator returned ncclInProgress: until it is queued
// (NCCL's rule before the next call on it). The first operation of a link connects the two ranks
// and needs the peer to reach its own, so this can take as long as the peer takes: `give_up()`
// ends the wait (a lost peer, a stop, an ended link), as does `until`.
template <class GiveUp>
void settle(ncclComm_t comm, ncclResult_t r, const char* what,
            std::chrono::steady_clock::time_point until, const GiveUp& give_up) {
  WaitEnd end = WaitEnd::settled;
  r = poll_nccl(comm, r, until, give_up, 1000, std::chrono::microseconds(100), end);
  if (end == WaitEnd::gave_up) {
    throw DistNetworkError(std::string("nccl: gave up waiting for ") + what);
  }
  if (end == WaitEnd::timed_out) {
    throw DistNetworkError(std::string("nccl: ") + what + " was not queued in time");
  }
  nccl_p2p_check(r, what);
}

inline std::string id_bytes(const ncclUniqueId& id) {
  return std::string(id.internal, sizeof id.internal);
}

}  // namespace detail

class NcclChannel {
 public:
  static constexpr std::string_view name = "nccl";
  static constexpr bool ordered_exports = true;
  // How long the receiver's side of a link may take to come up: the sender's side is up already
  // or coming up, so the join is quick unless the sender is gone.
  static constexpr std::chrono::seconds kJoinTimeout{60};
  // How long the sender's side may wait for its receiver to join: the receiver joins when its
  // receiving thread reaches the first Transfer, behind whatever it is importing, and a receiver
  // that fails first says so (refused) or is reported lost.
  static constexpr std::chrono::seconds kInitTimeout{600};
  // How long an aborted link's stream may take to come to rest before its snapshots are kept
  // for good (see the top).
  static constexpr std::chrono::seconds kDrainTimeout{2};
  // How long a receive may wait for its send while the peer is not reported lost: a sender whose
  // link failed on its side (an NCCL error there) never sends, and over NVLink nothing tells the
  // receiver.
  static constexpr std::chrono::seconds kReceiveTimeout{120};

  explicit NcclChannel(int self_id) : self_(self_id), ipc_(self_id) {
    if (cudaGetDeviceCount(&devices_) != cudaSuccess) {
      (void)cudaGetLastError();
      devices_ = 0;
    }
  }
  ~NcclChannel() {
    stop();
    std::vector<std::shared_ptr<OutLink>> links;
    {
      std::lock_guard<std::mutex> lk(mu_);
      links.swap(all_out_);
      out_.clear();
    }
    for (auto& l : links) {
      if (l->thread.joinable()) l->thread.join();
    }
    for (auto& [key, in] : in_) abort(in);
  }
  NcclChannel(const NcclChannel&) = delete;
  NcclChannel& operator=(const NcclChannel&) = delete;

  // The CUDA IPC channel's address (host, process, GPUs by bus id): enough for both sides.
  std::string address() const { return ipc_.address(); }

  // Reached: a peer with a GPU (NCCL), or one that sees one of our GPUs (IPC). A peer registered
  // (again) is a new process: the links to an old one are aborted and its loss is forgotten.
  bool connect(int peer, const std::string& peer_address) {
    const bool shared = ipc_.connect(peer, peer_address);
    abort_out_links(peer);
    {
      std::lock_guard<std::mutex> lk(mu_);
      lost_.erase(peer);
    }
    // This very process (NCCL would see its GPU twice): not reached, staged.
    if (peer_address == address()) return false;
    return shared || (!address().empty() && detail::address_has_gpus(peer_address));
  }
  bool carries(const at::Tensor& buffer) const { return buffer.is_cuda(); }

  ChannelExport export_buffer(int peer, const at::Tensor& buffer) {
    const int device = buffer.device().index();
    if (ipc_.sees(peer, device)) {
      ChannelExport e = ipc_.export_buffer(peer, buffer);
      ++ipc_sent_;
      return {std::string(1, detail::kViaIpc) + e.descriptor,
              std::make_shared<Keep>(Keep{std::move(e.keep), {}, 0})};
    }
    const CudaDeviceScope on(device, "nccl");
    const std::shared_ptr<OutLink> link = out_link(peer, device);  // throws for a lost peer
    auto keep = std::make_shared<Keep>(Keep{nullptr, link, 0});
    auto job = std::make_unique<Job>();
    const cudaStream_t current =
        detail::native(c10::impl::VirtualGuardImpl(c10::kCUDA).getStream(buffer.device()));
    job->snapshot = buffer.clone(at::MemoryFormat::Contiguous);
    job->ready = link->take_event();
    const cudaEvent_t ready = job->ready;
    if (const cudaError_t e = cudaEventRecord(ready, current); e != cudaSuccess) {
      link->give_event(ready);
      detail::cuda_check(e, "cudaEventRecord", "nccl");
    }
    detail::NcclDescriptor d;
    d.generation = link->generation;
    d.device = device;
    d.id = link->id;
    try {
      d.seq = link->push(std::move(job));
    } catch (...) {
      link->give_event(ready);
      throw;
    }
    keep->seq = d.seq;
    ++nccl_sent_;
    return {detail::encode_nccl_descriptor(d), std::move(keep)};
  }

  at::Tensor import_buffer(int peer, std::string_view descriptor, std::int64_t nbytes) {
    if (descriptor.empty()) throw DistNetworkError("nccl: empty descriptor");
    const std::string_view body = descriptor.substr(1);
    if (descriptor.front() == detail::kViaIpc) {
      at::Tensor out = ipc_.import_buffer(peer, body, nbytes);
      ++ipc_received_;
      return out;
    }
    if (descriptor.front() != detail::kViaNccl) {
      throw DistNetworkError("nccl: descriptor of unknown kind " +
                             std::to_string(static_cast<unsigned char>(descriptor.front())));
    }
    at::Tensor out = receive(peer, detail::decode_nccl_descriptor(body), nbytes);
    ++nccl_received_;
    return out;
  }

  // On the receiving thread, behind the peer's queued messages: the links it made before its
  // latest loss are aborted (one made since, with a new incarnation, stays).
  void forget(int peer) {
    const std::uint64_t losses = losses_of(peer);
    for (auto it = in_.begin(); it != in_.end();) {
      if (it->first.first == peer && it->second.losses != losses) {
        abort(it->second);
        it = in_.erase(it);
      } else {
        ++it;
      }
    }
    ipc_.forget(peer);
  }

  // On T's thread, at once: the peer's links are ended, receives waiting for it give up (they
  // watch its loss count), and nothing more is exported to it until it is registered again.
  void peer_lost(int peer) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      ++losses_[peer];
      lost_.insert(peer);
    }
    abort_out_links(peer);
  }

  void stop() {
    stopping_ = true;
    ipc_.stop();
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& l : all_out_) l->abort();
  }

  void retire(const std::shared_ptr<void>& keep) {
    if (auto* k = static_cast<Keep*>(keep.get()); k != nullptr && k->ipc) ipc_.retire(k->ipc);
  }

  // The Transfer of an exported buffer was never sent: its receive will never be queued, so the
  // link's later sends would pair with the wrong receives. The sends before it still go (their
  // Transfers were sent, and their receivers wait for them); then the link ends.
  void unsent(const std::shared_ptr<void>& keep) {
    if (auto* k = static_cast<Keep*>(keep.get()); k != nullptr) {
      if (const auto link = k->link.lock()) link->close_before(k->seq);
    }
  }

  // The receiver could not import some buffers of a loan (its Release says so): it ended its
  // side of the link, whose sends can no longer complete, so this side ends too.
  void refused(const std::shared_ptr<void>& keep) {
    if (auto* k = static_cast<Keep*>(keep.get()); k != nullptr) {
      if (const auto link = k->link.lock()) link->abort();
    }
  }

  // For tests and diagnostics.
  struct Stats {
    std::uint64_t ipc_sent = 0;
    std::uint64_t ipc_received = 0;
    std::uint64_t nccl_sent = 0;
    std::uint64_t nccl_received = 0;
    std::uint64_t communicators = 0;  // made, both directions
    std::uint64_t aborted = 0;        // links ended (lost peers, errors, unsent, stop), both ways
  };
  Stats stats() const {
    return {ipc_sent_.load(),      ipc_received_.load(),  nccl_sent_.load(),
            nccl_received_.load(), communicators_.load(), aborted_.load()};
  }
  CudaIpcChannel& ipc() { return ipc_; }

 private:
  using Clock = std::chrono::steady_clock;

  // One buffer to send: its snapshot, its number in the link, the event behind the snapshot on
  // the caller's stream, and the one behind the send on the link's stream.
  struct Job {
    at::Tensor snapshot;
    std::uint64_t seq = 0;
    cudaEvent_t ready = nullptr;
    cudaEvent_t sent = nullptr;
  };

  // This process's GPU `device` to one peer: its communicator (rank 0), stream and thread.
  struct OutLink {
    int peer = 0;
    int device = 0;
    std::uint64_t generation = 0;
    ncclUniqueId id{};
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::unique_ptr<Job>> jobs;  // exported, not queued on the GPU yet
    std::uint64_t seq = 0;                  // the last one handed out
    std::vector<cudaEvent_t> events;        // free, on `device`
    bool aborted = false;
    // Closing (unsent): the sends up to `last` still go (their receivers read them), later ones
    // never; then the link ends.
    std::uint64_t last = std::numeric_limits<std::uint64_t>::max();
    std::atomic<bool> finished{false};  // its thread returned
    std::thread thread;

    bool open_locked() const {
      return !aborted && last == std::numeric_limits<std::uint64_t>::max();
    }
    bool is_open() {
      std::lock_guard<std::mutex> lk(mu);
      return open_locked();
    }
    // Numbers the job and queues it for the link's thread; throws when the link takes no more
    // (the buffer is then staged).
    std::uint64_t push(std::unique_ptr<Job> job) {
      std::lock_guard<std::mutex> lk(mu);
      if (!open_locked()) throw DistNetworkError("nccl: the link to this peer just ended");
      job->seq = ++seq;
      jobs.push_back(std::move(job));
      cv.notify_all();
      return seq;
    }
    cudaEvent_t take_event() {
      {
        std::lock_guard<std::mutex> lk(mu);
        if (!events.empty()) {
          cudaEvent_t e = events.back();
          events.pop_back();
          return e;
        }
      }
      cudaEvent_t e = nullptr;
      detail::cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                         "cudaEventCreateWithFlags", "nccl");
      return e;
    }
    void give_event(cudaEvent_t e) {
      if (e == nullptr) return;
      std::lock_guard<std::mutex> lk(mu);
      events.push_back(e);
    }
    void abort() {
      std::lock_guard<std::mutex> lk(mu);
      aborted = true;
      cv.notify_all();
    }
    // Nothing more is to be done on it: aborted, or closed before anything was sent.
    bool done_locked() const { return aborted || last == 0; }
    bool is_done() {
      std::lock_guard<std::mutex> lk(mu);
      return done_locked();
    }
    // Buffer `n` will never be received: the sends before it go, then the link ends.
    void close_before(std::uint64_t n) {
      std::lock_guard<std::mutex> lk(mu);
      if (n > 0 && n - 1 < last) last = n - 1;
      cv.notify_all();
    }
  };

  // One peer's GPU to this process: its communicator (rank 1), the peer's loss count when it was
  // made (a later loss ends it), and where it lands.
  struct InLink {
    std::string id;  // the unique id's bytes: which link of which incarnation
    ncclComm_t comm = nullptr;
    std::uint64_t expected = 1;
    std::uint64_t losses = 0;
    int device = 0;
    std::optional<c10::Stream> stream;
    cudaEvent_t received = nullptr;
  };

  // What a loan keeps: the IPC channel's part, or the link an NCCL buffer went over and its
  // number there.
  struct Keep {
    std::shared_ptr<void> ipc;
    std::weak_ptr<OutLink> link;
    std::uint64_t seq = 0;
  };

  // The link to `peer` from `device`, made (and its thread started) when there is none open.
  // Throws for a peer lost and not registered again (the buffer is then staged, and T refuses
  // the send).
  std::shared_ptr<OutLink> out_link(int peer, int device) {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_) throw DistNetworkError("nccl: the channel is stopping");
    if (lost_.count(peer) != 0) {
      throw DistNetworkError("nccl: worker " + std::to_string(peer) + " was lost");
    }
    const auto key = std::make_pair(peer, device);
    if (const auto it = out_.find(key); it != out_.end() && it->second->is_open()) {
      return it->second;
    }
    // Threads of links that ended are joined here, so they do not pile up.
    for (auto it = all_out_.begin(); it != all_out_.end();) {
      if ((*it)->finished.load()) {
        (*it)->thread.join();
        it = all_out_.erase(it);
      } else {
        ++it;
      }
    }
    auto link = std::make_shared<OutLink>();
    link->peer = peer;
    link->device = device;
    link->generation = ++generations_;
    detail::nccl_p2p_check(ncclGetUniqueId(&link->id), "ncclGetUniqueId");
    link->thread = std::thread([this, raw = link.get()] { run_out_link(*raw); });
    all_out_.push_back(link);
    out_[key] = link;
    return link;
  }

  void abort_out_links(int peer) {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto it = out_.begin(); it != out_.end();) {
      if (it->first.first == peer) {
        it->second->abort();
        it = out_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // The link's thread: makes the communicator, then queues each job's send behind its snapshot,
  // and frees snapshots whose send is done. Ended (or failing), it aborts the communicator and
  // lets the stream come to rest before it frees anything.
  void run_out_link(OutLink& l) {
    mark_transport_thread();
    std::deque<std::unique_ptr<Job>> in_flight;  // queued on the GPU (or being queued)
    ncclComm_t comm = nullptr;
    cudaStream_t stream = nullptr;
    std::string why;
    const auto give_up = [&] { return stopping_.load() || l.is_done(); };
    try {
      detail::cuda_check(cudaSetDevice(l.device), "cudaSetDevice", "nccl");
      detail::cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                         "cudaStreamCreateWithFlags", "nccl");
      comm = detail::make_p2p_comm(l.id, 0, Clock::now() + kInitTimeout, give_up);
      ++communicators_;
      for (;;) {
        std::unique_ptr<Job> job;
        {
          std::unique_lock<std::mutex> lk(l.mu);
          if (l.jobs.empty() && !l.aborted) {
            // Closing, and everything that goes has gone: the link ends.
            if (!l.open_locked() && in_flight.empty()) break;
            const auto woken = [&] { return l.aborted || !l.jobs.empty() || !l.open_locked(); };
            if (in_flight.empty()) {
              l.cv.wait(lk, woken);
            } else {
              // Looks every millisecond for finished sends.
              l.cv.wait_for(lk, std::chrono::milliseconds(1),
                            [&] { return l.aborted || !l.jobs.empty(); });
            }
          }
          if (l.aborted) break;
          if (!l.jobs.empty()) {
            job = std::move(l.jobs.front());
            l.jobs.pop_front();
            if (job->seq > l.last) {  // never to be received (close_before)
              l.events.push_back(job->ready);
              job.reset();
            }
          }
        }
        if (job) {
          // In flight from here: its snapshot is freed only once the send is done or the link's
          // stream is at rest (below), whatever happens next.
          Job& j = *in_flight.emplace_back(std::move(job));
          detail::cuda_check(cudaStreamWaitEvent(stream, j.ready, 0), "cudaStreamWaitEvent",
                             "nccl");
          detail::settle(
              comm,
              ncclSend(j.snapshot.data_ptr(), static_cast<std::size_t>(j.snapshot.nbytes()),
                       ncclUint8, 1, comm, stream),
              "ncclSend", Clock::now() + kInitTimeout, give_up);
          j.sent = l.take_event();
          detail::cuda_check(cudaEventRecord(j.sent, stream), "cudaEventRecord", "nccl");
        }
        while (!in_flight.empty() && in_flight.front()->sent != nullptr) {
          const cudaError_t e = cudaEventQuery(in_flight.front()->sent);
          if (e == cudaErrorNotReady) break;
          detail::cuda_check(e, "cudaEventQuery", "nccl");
          l.give_event(in_flight.front()->ready);
          l.give_event(in_flight.front()->sent);
          in_flight.pop_front();
        }
        ncclResult_t async = ncclSuccess;
        if (ncclCommGetAsyncError(comm, &async) == ncclSuccess && async != ncclSuccess &&
            async != ncclInProgress) {
          detail::nccl_p2p_check(async, "a send to the peer");
        }
      }
    } catch (const std::exception& e) {
      why = e.what();
    }
    l.abort();  // no more jobs: a new link takes the next buffer
    if (!why.empty() && !stopping_) {
      distrpc::detail::log_warning("worker " + std::to_string(self_),
                                   "NCCL link to worker " + std::to_string(l.peer) + " from GPU " +
                                       std::to_string(l.device) + " ended: " + why);
    }
    ++aborted_;
    if (comm != nullptr) (void)ncclCommAbort(comm);
    std::deque<std::unique_ptr<Job>> queued;
    {
      std::lock_guard<std::mutex> lk(l.mu);
      queued.swap(l.jobs);
    }
    // Jobs never queued on the link's stream wait only for the caller's stream: their snapshots
    // go back to the allocator, which orders that reuse after it.
    std::vector<cudaEvent_t> events;
    for (auto& j : queued) events.push_back(j->ready);
    queued.clear();
    bool at_rest = true;
    if (stream != nullptr) {
      const auto until = Clock::now() + kDrainTimeout;
      cudaError_t e = cudaStreamQuery(stream);
      while (e == cudaErrorNotReady && Clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        e = cudaStreamQuery(stream);
      }
      at_rest = e != cudaErrorNotReady;
      (void)cudaGetLastError();
    }
    if (at_rest) {
      for (auto& j : in_flight) {
        events.push_back(j->ready);
        events.push_back(j->sent);
      }
      in_flight.clear();
      if (stream != nullptr) (void)cudaStreamDestroy(stream);
    } else {
      // A send still runs: its memory, stream and events are never given back (see the top).
      for (auto& j : in_flight) new at::Tensor(std::move(j->snapshot));
      in_flight.clear();
    }
    std::lock_guard<std::mutex> lk(l.mu);
    events.insert(events.end(), l.events.begin(), l.events.end());
    l.events.clear();
    for (cudaEvent_t e : events) {
      if (e != nullptr) (void)cudaEventDestroy(e);
    }
    (void)cudaGetLastError();
    l.finished = true;
  }

  int local_device(int sender_device) const {
    if (devices_ == 0) throw DistNetworkError("nccl: this process sees no GPU");
    return sender_device < devices_ ? sender_device : 0;
  }

  std::uint64_t losses_of(int peer) {
    std::lock_guard<std::mutex> lk(mu_);
    const auto it = losses_.find(peer);
    return it == losses_.end() ? 0 : it->second;
  }

  bool is_lost(int peer) {
    std::lock_guard<std::mutex> lk(mu_);
    return lost_.count(peer) != 0;
  }

  // On the receiving thread (the in-links are its alone).
  at::Tensor receive(int peer, const detail::NcclDescriptor& d, std::int64_t nbytes) {
    const std::string id = detail::id_bytes(d.id);
    if (is_lost(peer)) {
      throw DistNetworkError("nccl: worker " + std::to_string(peer) + " was lost");
    }
    if (dead_ids_.count(id) != 0) {
      throw DistNetworkError("nccl: link " + std::to_string(d.generation) + " from worker " +
                             std::to_string(peer) + " failed here before");
    }
    const int device = local_device(d.device);
    const CudaDeviceScope on(device, "nccl");
    const auto key = std::make_pair(peer, static_cast<int>(d.device));
    InLink& link = in_link(key, id, d, device);
    at::Tensor out;  // outlives the abort below: a receive may still be writing it
    try {
      if (d.seq != link.expected) {
        throw DistNetworkError("nccl: buffer " + std::to_string(d.seq) + " of link " +
                               std::to_string(d.generation) + " from worker " +
                               std::to_string(peer) + " arrived where " +
                               std::to_string(link.expected) + " was due");
      }
      const c10::Device where(c10::kCUDA, static_cast<c10::DeviceIndex>(device));
      {
        // Allocated while the link's stream is current: the caching allocator ties it there.
        c10::StreamGuard current(*link.stream);
        out = at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).device(where));
      }
      const cudaStream_t s = detail::native(*link.stream);
      const auto until = Clock::now() + kReceiveTimeout;
      const auto give_up = [&] { return stopping_.load() || losses_of(peer) != link.losses; };
      detail::settle(
          link.comm,
          ncclRecv(out.data_ptr(), static_cast<std::size_t>(nbytes), ncclUint8, 0, link.comm, s),
          "ncclRecv", until, give_up);
      detail::cuda_check(cudaEventRecord(link.received, s), "cudaEventRecord", "nccl");
      wait_received(peer, link, until);
      ++link.expected;
      c10::impl::VirtualGuardImpl cuda(c10::kCUDA);
      cuda.recordDataPtrOnStream(out.storage().data_ptr(), cuda.getDefaultStream(where));
      return out;
    } catch (...) {
      // Its sender hears of it through the Release (refused) and ends its side; this side takes
      // nothing more from that link.
      abort(link);
      remember_dead(id);
      in_.erase(key);
      throw;
    }
  }

  // The peer's link `id` from its GPU key.second: the one known, or a new communicator joined as
  // rank 1 (a link it replaced is aborted).
  InLink& in_link(const std::pair<int, int>& key, const std::string& id,
                  const detail::NcclDescriptor& d, int device) {
    const auto it = in_.find(key);
    if (it != in_.end() && it->second.id == id) return it->second;
    if (it != in_.end()) {
      abort(it->second);
      in_.erase(it);
    }
    InLink link;
    link.id = id;
    link.device = device;
    link.losses = losses_of(key.first);
    try {
      link.comm = detail::make_p2p_comm(d.id, 1, Clock::now() + kJoinTimeout, [&] {
        return stopping_.load() || losses_of(key.first) != link.losses;
      });
    } catch (...) {
      remember_dead(id);
      throw;
    }
    ++communicators_;
    const c10::Device where(c10::kCUDA, static_cast<c10::DeviceIndex>(device));
    link.stream = c10::impl::VirtualGuardImpl(c10::kCUDA).getStreamFromGlobalPool(where, true);
    if (const cudaError_t e = cudaEventCreateWithFlags(&link.received, cudaEventDisableTiming);
        e != cudaSuccess) {
      (void)ncclCommAbort(link.comm);
      remember_dead(id);
      detail::cuda_check(e, "cudaEventCreateWithFlags", "nccl");
    }
    return in_.emplace(key, std::move(link)).first->second;
  }

  // Links that failed here: a later buffer of theirs fails at once (joining again a communicator
  // whose first join failed would wait for nothing). The oldest are forgotten past kDeadKept.
  void remember_dead(const std::string& id) {
    if (!dead_ids_.insert(id).second) return;
    dead_order_.push_back(id);
    if (dead_order_.size() > kDeadKept) {
      dead_ids_.erase(dead_order_.front());
      dead_order_.pop_front();
    }
  }
  static constexpr std::size_t kDeadKept = 1024;

  // Until the receive is done, polling: the peer lost, stop(), an NCCL error or `until` end it.
  void wait_received(int peer, InLink& link, Clock::time_point until) {
    bool lost = false;
    std::string failed;
    const auto go_on = [&] {
      lost = losses_of(peer) != link.losses;
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(link.comm, &async) == ncclSuccess && async != ncclSuccess &&
          async != ncclInProgress) {
        failed = ncclGetErrorString(async);
      }
      return !stopping_.load() && !lost && failed.empty() && Clock::now() < until;
    };
    const cudaError_t e = poll_event(link.received, go_on);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) detail::cuda_check(e, "cudaEventQuery", "nccl");
    if (lost) {
      throw DistNetworkError("nccl: worker " + std::to_string(peer) + " was lost mid-transfer");
    }
    if (!failed.empty()) throw DistNetworkError("nccl: a receive from the peer failed: " + failed);
    if (stopping_) throw DistNetworkError("nccl: stopped while receiving");
    throw DistNetworkError("nccl: no data from worker " + std::to_string(peer) + " within " +
                           std::to_string(kReceiveTimeout.count()) +
                           " s (its link ended without a loss)");
  }

  // An in-link's communicator aborted (ends a receive still queued). The memory it received
  // into is libtorch's, ordered on the link's stream by the caching allocator.
  void abort(InLink& link) {
    if (link.comm == nullptr) return;
    const CudaDeviceScope on(link.device);
    (void)ncclCommAbort(link.comm);
    link.comm = nullptr;
    ++aborted_;
    if (link.received != nullptr) (void)cudaEventDestroy(link.received);
    link.received = nullptr;
    (void)cudaGetLastError();
  }

  const int self_;
  int devices_ = 0;
  CudaIpcChannel ipc_;
  std::atomic<bool> stopping_{false};
  std::atomic<std::uint64_t> ipc_sent_{0};
  std::atomic<std::uint64_t> ipc_received_{0};
  std::atomic<std::uint64_t> nccl_sent_{0};
  std::atomic<std::uint64_t> nccl_received_{0};
  std::atomic<std::uint64_t> communicators_{0};
  std::atomic<std::uint64_t> aborted_{0};
  std::mutex mu_;  // the out-links' maps, losses_, lost_, generations_
  std::map<std::pair<int, int>, std::shared_ptr<OutLink>> out_;  // (peer, our device): open
  std::vector<std::shared_ptr<OutLink>> all_out_;                // every one whose thread runs
  std::map<int, std::uint64_t> losses_;                          // per peer: losses reported
  std::set<int> lost_;  // lost and not registered again: nothing is exported to them
  std::uint64_t generations_ = 0;
  // The receiving thread's alone:
  std::map<std::pair<int, int>, InLink> in_;  // (peer, its device)
  std::set<std::string> dead_ids_;
  std::deque<std::string> dead_order_;
};

template <class T>
using Nccl = DeviceDirect<T, NcclChannel>;

}  // namespace distrpc::transport
