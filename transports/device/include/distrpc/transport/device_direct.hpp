// DeviceDirect<T, Channel>: a decorator policy that moves a message's device buffers (the bytes of
// CUDA tensors) through a device channel while the message itself travels over the policy T it
// wraps, so a GPU tensor never makes the round trip through host memory. `CudaIpc<T>`
// (cuda_ipc.hpp) is this with CUDA IPC as the channel: processes on one host share the GPU's
// memory directly.
//
// The agent encodes device tensors without a CPU copy for such a policy (carries_device_buffers,
// wire/device_buffers.hpp). On send():
//  - a message without device buffers goes to T as it is (nothing added, nothing slower);
//  - to a peer the channel cannot reach (another host, or a peer without the channel), each device
//    buffer is staged through a CPU copy, as every other policy does, and the receiver's decoder
//    moves the tensor to its device;
//  - else each device buffer is exported to the channel (a descriptor of a few dozen bytes, e.g. an
//    IPC memory handle, an offset and an event recorded on the producing stream), its place in the
//    message holds an empty CPU buffer, the descriptors ride in one more CPU buffer at the end, and
//    the message goes to T as a `Transfer` (a transport message kind). The sender keeps the
//    exported buffers alive (lent) until the receiver says it has its copies.
// On receipt a `Transfer` goes to this Context's receiving thread, never handled on T's reading
// thread: it imports each buffer (the channel copies the bytes into memory of its own on the
// receiver's side, after the producer's event), puts the original message back together, hands it
// to the agent, and sends a `Release` naming the loan back (and whether every buffer came in). A
// peer's messages keep their order: while a Transfer from a peer is queued, that peer's other
// messages queue behind it.
//
// Failures: a descriptor the channel cannot import (a CUDA error) leaves that buffer empty and is
// logged; the message still reaches the agent, whose decoder then fails the call at once (nothing
// waits for a timeout). A receiver that shuts down with Transfers still queued sends their
// Releases unread, best effort, so their senders need not wait for its loss. A lost peer's
// loans are not returned at once: a receiver that read the
// Transfer before the connection broke may still be copying, and memory returned to the
// allocator could be reused under it. They are returned when that worker is registered again,
// after kOrphanGrace (10 s), or at shutdown, and the channel is told (retire), so that memory it
// pools is never reused: a receiver alive but slow may still read it. Shutdown first waits (for
// half the time it is given) for the loans still out to come back. What the channel opened for a
// lost peer is closed after its queued messages were handed over, on the receiving thread. A
// Release that cannot be sent yet (the sender is not registered here: messages may arrive before
// add_peer) is sent once it is.
//
// One receiving thread serves every peer, and its queue is not bounded: a Transfer whose
// producer's stream never reaches its event holds up the GPU messages of every peer (the channel
// gives up when the Context stops).
//
// The Channel (what cuda_ipc.hpp's CudaIpcChannel provides; tests use a host-memory stand-in):
//   static constexpr std::string_view name;
//   explicit Channel(int self_id);
//   std::string address() const;              what a peer needs to tell whether it reaches us
//   bool connect(int peer, const std::string& peer_address);
//                                             from add_peer: whether the channel reaches it
//   bool carries(const at::Tensor& buffer) const;       this buffer travels through the channel
//   ChannelExport export_buffer(int peer, const at::Tensor& buffer);
//                                             on the sending thread: the descriptor, and what
//                                             stays alive with the buffer until the receiver
//                                             releases the loan; throws if this buffer cannot
//                                             go to that peer (it is then staged)
//   at::Tensor import_buffer(int peer, std::string_view descriptor, std::int64_t nbytes);
//                                             on the receiving thread: a buffer of nbytes
//                                             holding the bytes, ready to read
//   void forget(int peer);                    on the receiving thread: the peer is gone
//   void stop();                              optional: give up waits inside import_buffer
//   void peer_lost(int peer);                 optional, must not block: on T's thread as soon
//                                             as the peer is lost (forget() comes later, behind
//                                             its queued messages): give up waits for it
//   static constexpr bool ordered_exports;    optional, true: the receiver must import a
//                                             peer's buffers in the order they were exported
//                                             (exports to one peer and the sends of their
//                                             Transfers then take one lock per peer)
//   void unsent(const std::shared_ptr<void>& keep);
//                                             optional: `keep` was exported but its Transfer
//                                             could not be sent, so no import will match it
//   void refused(const std::shared_ptr<void>& keep);
//                                             optional: the receiver's Release says some
//                                             buffers of the loan `keep` came with could not be
//                                             imported (it may not have read this one)
//   void retire(const std::shared_ptr<void>& keep);
//                                             optional, must not block: the loan `keep` came
//                                             with ends without its receiver's Release (the
//                                             peer was lost, registered again, or this Context
//                                             stopped), so the receiver may still read what it
//                                             lent: a channel that reuses that memory (a pool)
//                                             must not reuse it
#pragma once

#include <atomic>
#include <bit>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "distrpc/bounded_thread.hpp"
#include "distrpc/error.hpp"
#include "distrpc/log.hpp"
#include "distrpc/transport/detail/decorated_name.hpp"
#include "distrpc/transport/transport.hpp"
#include "distrpc/wire/message.hpp"

namespace distrpc::transport {

// What export_buffer() hands back: the descriptor the peer imports from, and whatever must stay
// alive with the buffer until the peer released the loan (e.g. an event the peer waits on).
struct ChannelExport {
  std::string descriptor;
  std::shared_ptr<void> keep;
};

// Counters of one Context, for tests and diagnostics.
struct DeviceDirectStats {
  std::uint64_t exported = 0;  // device buffers sent through the channel
  std::uint64_t staged = 0;    // device buffers sent through a CPU copy (peer not reached)
  std::uint64_t imported = 0;  // device buffers received through the channel
  std::uint64_t failed = 0;    // device buffers that could not be imported (left empty)
  std::uint64_t released = 0;  // loans the receivers returned
  std::uint64_t lent = 0;      // loans not yet returned
  std::uint64_t orphaned = 0;  // loans to peers lost before releasing them (kept a while)
  std::uint64_t queued = 0;    // received messages waiting for (or in) the receiving thread
};

namespace detail {

// The kinds this policy sends to its own peer (wire/message.hpp, the transport range).
inline constexpr wire::MessageType kTransfer = wire::transport_message_type(0);
inline constexpr wire::MessageType kRelease = wire::transport_message_type(1);

// The last buffer of a Transfer, in the host's byte order: a device channel reaches hosts with
// GPUs, and every platform CUDA runs on is little-endian (static_assert below):
//   u8 version | u8 original kind | u32 count | u64 loan id |
//   count x { u32 buffer index | i64 nbytes | u32 descriptor length | descriptor }
struct TransferEntry {
  std::uint32_t index = 0;
  std::int64_t nbytes = 0;
  std::string descriptor;
};
struct TransferHeader {
  wire::MessageType kind = wire::MessageType::Request;
  std::uint64_t loan = 0;
  std::vector<TransferEntry> entries;
};
inline constexpr std::uint8_t kTransferVersion = 1;
static_assert(std::endian::native == std::endian::little,
              "DeviceDirect's Transfer header is written in the host's byte order");

template <class V>
void put_raw(std::string& out, V v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}

inline at::Tensor encode_transfer_header(const TransferHeader& h) {
  std::string out;
  put_raw<std::uint8_t>(out, kTransferVersion);
  put_raw<std::uint8_t>(out, static_cast<std::uint8_t>(h.kind));
  put_raw<std::uint32_t>(out, static_cast<std::uint32_t>(h.entries.size()));
  put_raw<std::uint64_t>(out, h.loan);
  for (const auto& e : h.entries) {
    put_raw<std::uint32_t>(out, e.index);
    put_raw<std::int64_t>(out, e.nbytes);
    put_raw<std::uint32_t>(out, static_cast<std::uint32_t>(e.descriptor.size()));
    out += e.descriptor;
  }
  at::Tensor t = at::empty({static_cast<std::int64_t>(out.size())}, at::kByte);
  std::memcpy(t.data_ptr(), out.data(), out.size());
  return t;
}

// Parses and checks the header a peer sent: every field is untrusted. `buffers` is the count of
// the message's other buffers; `max_bytes` bounds their sum (0: no bound).
inline TransferHeader decode_transfer_header(const at::Tensor& b, std::size_t buffers,
                                             std::int64_t max_bytes) {
  const auto fail = [](const std::string& why) -> void {
    throw DistNetworkError("device transfer header: " + why);
  };
  const char* p = static_cast<const char*>(b.data_ptr());
  const std::size_t size = static_cast<std::size_t>(b.numel());
  std::size_t at = 0;
  const auto take = [&](void* dst, std::size_t n) {
    if (size - at < n)
      fail("truncated at byte " + std::to_string(at) + " of " + std::to_string(size));
    std::memcpy(dst, p + at, n);
    at += n;
  };
  std::uint8_t version = 0;
  std::uint8_t kind = 0;
  std::uint32_t count = 0;
  TransferHeader h;
  take(&version, 1);
  if (version != kTransferVersion) fail("unknown version " + std::to_string(version));
  take(&kind, 1);
  const auto k = static_cast<wire::MessageType>(kind);
  if (!wire::is_valid_message_type(kind) || k == wire::MessageType::Handshake ||
      wire::is_transport_message_type(k)) {
    fail("message kind " + std::to_string(kind) + " cannot carry device buffers");
  }
  h.kind = k;
  take(&count, 4);
  take(&h.loan, 8);
  if (count == 0 || count > buffers) {
    fail(std::to_string(count) + " device buffers named in a message of " +
         std::to_string(buffers) + " buffers");
  }
  std::set<std::uint32_t> seen;
  std::int64_t total = 0;
  for (std::uint32_t i = 0; i < count; ++i) {
    TransferEntry e;
    std::uint32_t len = 0;
    take(&e.index, 4);
    take(&e.nbytes, 8);
    take(&len, 4);
    if (e.index >= buffers || !seen.insert(e.index).second) {
      fail("device buffer index " + std::to_string(e.index) + " is out of range or repeated");
    }
    if (e.nbytes <= 0) fail("device buffer of " + std::to_string(e.nbytes) + " bytes");
    if (max_bytes > 0 && e.nbytes > max_bytes - total) {
      fail("device buffers of more than " + std::to_string(max_bytes) +
           " bytes in one message (Limits::max_message_bytes)");
    }
    total += e.nbytes;
    if (size - at < len) fail("descriptor of " + std::to_string(len) + " bytes is truncated");
    e.descriptor.assign(p + at, len);
    at += len;
    h.entries.push_back(std::move(e));
  }
  if (at != size) fail(std::to_string(size - at) + " trailing bytes");
  return h;
}

inline constexpr std::string_view kAddressMark = "#device-channel:";
// A Release's payload when some buffers of its Transfer could not be imported (empty otherwise).
inline constexpr std::string_view kReleaseFailed = "F";

}  // namespace detail

template <class T, class Channel>
struct DeviceDirect {
  static_assert(check_transport<T>(), "DeviceDirect<T, Channel>: T must be a transport policy");

  static constexpr std::string_view name =
      transport::detail::DecoratedName<Channel::name, T::name>::value;
  static constexpr bool carries_device_buffers = true;
  static bool viable() { return T::viable(); }
  static std::string domain_key() { return T::domain_key(); }

  class Context {
   public:
    Context(const TransportOptions& options, TransportCallbacks callbacks)
        : self_(options.self_id),
          max_bytes_(static_cast<std::int64_t>(options.limits.max_message_bytes)),
          channel_(options.self_id),
          up_(std::move(callbacks)) {
      TransportCallbacks mine;
      mine.on_message = [this](int peer, wire::Message&& m) { received(peer, std::move(m)); };
      mine.on_peer_lost = [this](int peer, const std::string& why) { lost(peer, why); };
      // The thread holds its own share of `alive_`: a shutdown from inside one of its
      // deliveries detaches it, and it must not touch this Context once that returns.
      receiver_ = std::thread([this, alive = alive_] { run_receiver(*alive); });
      try {
        inner_ = std::make_unique<typename T::Context>(options, std::move(mine));
      } catch (...) {
        stop_receiver();
        throw;
      }
    }
    ~Context() { shutdown(); }
    Context(const Context&) = delete;
    Context& operator=(const Context&) = delete;

    // T's address, then the channel's (which the peer's channel judges in connect()).
    std::string address() const {
      return inner_->address() + std::string(detail::kAddressMark) + channel_.address();
    }

    // Registering a worker again returns the loans its previous incarnation left (see above),
    // and sends the Releases that could not be sent before it was registered.
    void add_peer(int id, const std::string& peer_name, const std::string& address) {
      const auto mark = address.rfind(detail::kAddressMark);
      const bool reached = mark != std::string::npos &&
                           channel_.connect(id, address.substr(mark + detail::kAddressMark.size()));
      inner_->add_peer(id, peer_name,
                       mark == std::string::npos ? address : address.substr(0, mark));
      std::map<std::uint64_t, Loan> returned;
      std::vector<UnsentRelease> releases;
      {
        std::lock_guard<std::mutex> lk(mu_);
        reached_[id] = reached;
        lost_at_.erase(id);
        if (const auto it = orphaned_.find(id); it != orphaned_.end()) {
          for (auto& [loan, o] : it->second) returned.emplace(loan, std::move(o.loan));
          orphaned_.erase(it);
        }
        if (const auto it = unsent_releases_.find(id); it != unsent_releases_.end()) {
          releases.swap(it->second);
          unsent_releases_.erase(it);
        }
      }
      for (auto& [loan, l] : returned) retire(l);
      for (const auto& r : releases) send_release(id, r.loan, r.failed);
    }

    // See the top of this file.
    void send(int peer, wire::Message&& m) {
      std::vector<std::uint32_t> on_device;
      for (std::size_t i = 0; i < m.buffers.size(); ++i) {
        if (m.buffers[i].defined() && channel_.carries(m.buffers[i])) {
          on_device.push_back(static_cast<std::uint32_t>(i));
        }
      }
      if (on_device.empty()) {
        inner_->send(peer, std::move(m));
        return;
      }
      // A message over T's size limit goes as T would send it, so T refuses it with its own
      // text before anything is lent or written.
      if (!reaches(peer) || over_limit(m)) {
        for (const auto i : on_device) m.buffers[i] = m.buffers[i].cpu();
        count(&DeviceDirectStats::staged, on_device.size());
        inner_->send(peer, std::move(m));
        return;
      }
      // A channel whose receiver must import in the order its sender exported (NCCL: a receive
      // matches the peer's sends in order) gets its exports to a peer, and T's sends of their
      // Transfers, in one order.
      std::unique_lock<std::mutex> in_order;
      if constexpr (kOrdered) in_order = std::unique_lock<std::mutex>(order_of(peer));
      Lent lent = lend(peer, m, on_device);
      if (lent.header.entries.empty()) {
        count(&DeviceDirectStats::staged, lent.staged);
        inner_->send(peer, std::move(m));
        return;
      }
      // If T cannot send the Transfer, the channel hears of the exported buffers (see `unsent` at
      // the top): the receiver will never hear of them.
      std::vector<std::shared_ptr<void>> keeps;
      if constexpr (kTellsUnsent) keeps = lent.loan.keep;
      const std::uint64_t id = lent.header.loan;
      {
        std::lock_guard<std::mutex> lk(mu_);
        loans_[peer].emplace(id, std::move(lent.loan));
        stats_.exported += lent.header.entries.size();
        stats_.staged += lent.staged;
        ++stats_.lent;
      }
      m.type = detail::kTransfer;
      try {
        inner_->send(peer, std::move(m));
      } catch (...) {
        tell_unsent(keeps);
        return_loan(peer, id, /*released=*/false);
        throw;
      }
    }

    // Idempotent. Waits (for half the time left until `deadline`) for the loans still out to
    // come back, then stops T and the receiving thread; loans still out then are returned,
    // queued messages dropped. Half, because a loan may never come back before T notices that
    // its peer is gone (a peer shutting down at the same time drops the Transfers it queued),
    // and T needs the rest to stop its own threads.
    std::size_t shutdown(std::chrono::steady_clock::time_point deadline) {
      std::vector<std::pair<int, std::uint64_t>> unread;
      Clock::time_point loans_until;
      {
        std::unique_lock<std::mutex> lk(mu_);
        if (shut_down_) return 0;
        shut_down_ = true;
        const auto now = Clock::now();
        loans_until = deadline > now ? now + (deadline - now) / 2 : deadline;
        cv_.wait_until(lk, loans_until, [&] { return stats_.lent == 0; });
        // The receiving thread takes nothing more (no import for a worker that is going away),
        // and what T still delivers while it stops is dropped.
        stopping_ = true;
        unread = unread_loans_locked();
        queue_.clear();
      }
      cv_.notify_all();
      // Transfers dropped unread: their senders may free those buffers now rather than keep them
      // until they notice this worker is gone (kOrphanGrace after). Best effort, while T still
      // runs, and only within the half of the time left that was the loans' (a send may block);
      // nothing here read their memory. Marked failed: a channel that pairs sends with
      // receives learns that none will come for them (see `refused` at the top).
      for (const auto& [peer, loan] : unread) {
        if (Clock::now() >= loans_until) break;
        send_release(peer, loan, /*failed=*/true);
      }
      if constexpr (requires { channel_.stop(); }) channel_.stop();
      const std::size_t abandoned = inner_ ? shutdown_until(*inner_, deadline) : 0;
      stop_receiver();
      std::map<int, std::map<std::uint64_t, Loan>> loans;
      std::map<int, std::map<std::uint64_t, Orphan>> orphaned;
      {
        std::lock_guard<std::mutex> lk(mu_);
        loans.swap(loans_);
        orphaned.swap(orphaned_);
        stats_.lent = 0;
      }
      for (auto& [peer, by_id] : loans) {
        for (auto& [id, l] : by_id) retire(l);
      }
      for (auto& [peer, by_id] : orphaned) {
        for (auto& [id, o] : by_id) retire(o.loan);
      }
      return abandoned;
    }
    void shutdown() { shutdown(std::chrono::steady_clock::now() + kDefaultShutdownGrace); }

    void drive(const std::function<bool()>& done, std::chrono::steady_clock::time_point until)
      requires has_drive<typename T::Context>
    {
      inner_->drive(done, until);
    }

    DeviceDirectStats stats() const {
      std::lock_guard<std::mutex> lk(mu_);
      DeviceDirectStats out = stats_;
      for (const auto& [peer, n] : queued_) out.queued += n;
      return out;
    }
    // Whether the channel reaches worker `peer` (known once add_peer() ran).
    bool reaches(int peer) const {
      std::lock_guard<std::mutex> lk(mu_);
      const auto it = reached_.find(peer);
      return it != reached_.end() && it->second;
    }
    Channel& channel() { return channel_; }
    typename T::Context& inner() { return *inner_; }

    // How long the loans of a lost peer are kept before they are returned: 10 s, or the
    // channel's `orphan_grace` where it names one.
    static constexpr std::chrono::milliseconds kOrphanGrace = [] {
      if constexpr (requires { Channel::orphan_grace; }) {
        return std::chrono::milliseconds(Channel::orphan_grace);
      } else {
        return std::chrono::milliseconds(10000);
      }
    }();

   private:
    using Clock = std::chrono::steady_clock;
    struct Loan {
      std::vector<at::Tensor> buffers;
      std::vector<std::shared_ptr<void>> keep;
    };
    struct Orphan {
      Loan loan;
      Clock::time_point since;
    };
    struct UnsentRelease {
      std::uint64_t loan;
      bool failed;
    };
    // One entry of the receiving thread's queue: a message, or the loss of its peer.
    struct Item {
      int peer;
      wire::Message message;
      std::optional<std::string> lost;
    };

    static constexpr bool kOrdered = [] {
      if constexpr (requires { Channel::ordered_exports; }) {
        return static_cast<bool>(Channel::ordered_exports);
      } else {
        return false;
      }
    }();

    // The lock that orders exports to `peer` (kOrdered); never erased, so the reference lasts.
    std::mutex& order_of(int peer) {
      std::lock_guard<std::mutex> lk(mu_);
      auto& m = order_[peer];
      if (!m) m = std::make_unique<std::mutex>();
      return *m;
    }

    bool over_limit(const wire::Message& m) const {
      if (max_bytes_ <= 0) return false;
      std::int64_t total = static_cast<std::int64_t>(m.payload.size());
      for (const auto& b : m.buffers) total += b.defined() ? b.numel() : 0;
      return total > max_bytes_;
    }

    void count(std::uint64_t DeviceDirectStats::*field, std::uint64_t n) {
      std::lock_guard<std::mutex> lk(mu_);
      stats_.*field += n;
    }

    static constexpr bool kTellsUnsent = requires(Channel & c, std::shared_ptr<void> k) {
      c.unsent(k);
    };
    // The channel hears of exported buffers whose Transfer will never be sent (see `unsent` at
    // the top).
    void tell_unsent(const std::vector<std::shared_ptr<void>>& keeps) {
      if constexpr (kTellsUnsent) {
        for (const auto& k : keeps) channel_.unsent(k);
      }
    }

    // What lend() made of a message: the Transfer's header (no entries when nothing could be
    // exported), the loan that keeps the exported buffers, and how many buffers were staged.
    struct Lent {
      detail::TransferHeader header;
      Loan loan;
      std::uint64_t staged = 0;
    };
    // Exports `m`'s device buffers `on_device` to `peer`: each exported one moves into the loan,
    // leaving a 0-byte tensor at its index in `m` (the receiver puts the imported one there), and
    // gets an entry in the Transfer header, appended to `m`'s buffers when it has any; one the
    // channel cannot share with that peer is staged in place. If anything throws, what was
    // already exported is handed to tell_unsent().
    Lent lend(int peer, wire::Message& m, const std::vector<std::uint32_t>& on_device) {
      Lent out;
      out.header.kind = m.type;
      {
        std::lock_guard<std::mutex> lk(mu_);
        out.header.loan = ++next_loan_;
      }
      try {
        for (const auto i : on_device) {
          at::Tensor& b = m.buffers[i];
          ChannelExport e;
          try {
            e = channel_.export_buffer(peer, b);
          } catch (const std::exception&) {
            // Memory the channel cannot share with that peer (a GPU it does not see, memory
            // not from a plain device allocation): this buffer goes the way every policy sends
            // it.
            b = b.cpu();
            ++out.staged;
            continue;
          }
          out.loan.keep.push_back(std::move(e.keep));
          out.header.entries.push_back({i, b.numel(), std::move(e.descriptor)});
          out.loan.buffers.push_back(std::move(b));
          b = at::empty({0}, at::kByte);
        }
        if (!out.header.entries.empty()) {
          m.buffers.push_back(detail::encode_transfer_header(out.header));
        }
      } catch (...) {
        tell_unsent(out.loan.keep);
        throw;
      }
      return out;
    }

    // On T's reading thread: never imports here, only queues (see the top of this file).
    void received(int peer, wire::Message&& m) {
      if (m.type == detail::kRelease) {
        return_loan(peer, m.id, /*released=*/true, /*refused=*/!m.payload.empty());
        return;
      }
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (stopping_) return;
        if (m.type == detail::kTransfer || queued_[peer] > 0) {
          enqueue_locked(Item{peer, std::move(m), std::nullopt});
          return;
        }
      }
      up_.on_message(peer, std::move(m));
    }

    // The loss goes through the receiving thread, behind the peer's queued messages: the channel
    // forgets the peer there, where no import from it can be running.
    void lost(int peer, const std::string& why) {
      if constexpr (requires { channel_.peer_lost(peer); }) {
        {
          std::lock_guard<std::mutex> lk(mu_);
          if (stopping_) return;
        }
        // At once, not behind the queue: an import from that peer may be waiting for it.
        channel_.peer_lost(peer);
      }
      std::lock_guard<std::mutex> lk(mu_);
      if (stopping_) return;
      lost_at_[peer] = Clock::now();
      orphan_locked(peer);
      enqueue_locked(Item{peer, wire::Message{}, why});
    }

    void enqueue_locked(Item&& item) {
      ++queued_[item.peer];
      queue_.push_back(std::move(item));
      cv_.notify_all();
    }

    // Moves the loans to a lost `peer` (also one sent while its loss was being reported) to the
    // orphans.
    void orphan_locked(int peer) {
      const auto it = loans_.find(peer);
      if (it == loans_.end()) return;
      stats_.lent -= it->second.size();
      stats_.orphaned += it->second.size();
      for (auto& [id, loan] : it->second) {
        orphaned_[peer].emplace(id, Orphan{std::move(loan), Clock::now()});
      }
      loans_.erase(it);
      cv_.notify_all();
    }

    // A loan that ends without its receiver's Release: the channel must not reuse what it lent
    // (see `retire` at the top). A loan whose send failed never reached its receiver, and a
    // released one is done with: neither comes here.
    void retire(Loan& loan) {
      if constexpr (requires { channel_.retire(loan.keep.front()); }) {
        for (const auto& k : loan.keep) channel_.retire(k);
      }
    }

    // `refused`: the receiver's Release says it could not import some of the loan's buffers;
    // the channel hears of it (see `refused` at the top), outside the lock.
    void return_loan(int peer, std::uint64_t id, bool released, bool refused = false) {
      Loan gone;
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (const auto it = loans_.find(peer); it != loans_.end()) {
          if (const auto loan = it->second.find(id); loan != it->second.end()) {
            gone = std::move(loan->second);
            it->second.erase(loan);
            --stats_.lent;
            if (released) ++stats_.released;
            cv_.notify_all();
          }
        }
        // A Release for a loan orphaned meanwhile (T reconnected): it is back as well. A loan
        // whose send failed may have been orphaned meanwhile too (its peer's loss was swept
        // while T was still sending): it ends here, not with the orphans' retirement.
        if (gone.keep.empty()) {
          if (const auto it = orphaned_.find(peer); it != orphaned_.end()) {
            if (const auto loan = it->second.find(id); loan != it->second.end()) {
              gone = std::move(loan->second.loan);
              it->second.erase(loan);
              if (released) ++stats_.released;
            }
          }
        }
      }
      if constexpr (requires(std::shared_ptr<void> k) { channel_.refused(k); }) {
        if (refused) {
          for (const auto& k : gone.keep) channel_.refused(k);
        }
      }
    }

    // Returns the orphans older than kOrphanGrace, and orphans loans sent to lost peers after
    // their loss was reported.
    void sweep_locked(std::vector<Loan>& returned) {
      const auto now = Clock::now();
      for (const auto& [peer, at] : lost_at_) orphan_locked(peer);
      for (auto it = orphaned_.begin(); it != orphaned_.end();) {
        for (auto o = it->second.begin(); o != it->second.end();) {
          if (now - o->second.since >= kOrphanGrace) {
            returned.push_back(std::move(o->second.loan));
            o = it->second.erase(o);
          } else {
            ++o;
          }
        }
        it = it->second.empty() ? orphaned_.erase(it) : std::next(it);
      }
    }

    void run_receiver(const std::atomic<bool>& alive) {
      mark_transport_thread();
      std::unique_lock<std::mutex> lk(mu_);
      for (;;) {
        // Woken now and then to return old orphans.
        cv_.wait_for(lk, kOrphanGrace / 4, [&] { return stopping_ || !queue_.empty(); });
        if (stopping_) return;
        std::vector<Loan> returned;
        sweep_locked(returned);
        std::optional<Item> item;
        if (!queue_.empty()) {
          item = std::move(queue_.front());
          queue_.pop_front();
        }
        lk.unlock();
        for (Loan& l : returned) retire(l);
        returned.clear();  // their buffers freed outside the lock
        if (item) {
          if (item->lost) {
            channel_.forget(item->peer);
            up_.on_peer_lost(item->peer, *item->lost);
          } else {
            deliver(item->peer, std::move(item->message));
          }
          if (!alive.load()) return;  // shut down (and perhaps destroyed) from inside a delivery
        }
        lk.lock();
        if (item) --queued_[item->peer];
      }
    }

    // The (peer, loan) of every Transfer still queued (a header that does not decode is skipped:
    // its loan id cannot be trusted).
    std::vector<std::pair<int, std::uint64_t>> unread_loans_locked() const {
      std::vector<std::pair<int, std::uint64_t>> out;
      for (const auto& item : queue_) {
        const auto& m = item.message;
        if (item.lost || m.type != detail::kTransfer || m.buffers.empty()) continue;
        try {
          out.emplace_back(item.peer, detail::decode_transfer_header(
                                          m.buffers.back(), m.buffers.size() - 1, max_bytes_)
                                          .loan);
        } catch (const std::exception&) {
        }
      }
      return out;
    }

    // `failed`: some of the loan's buffers could not be imported (the payload says so).
    void send_release(int peer, std::uint64_t loan, bool failed = false) {
      wire::Message release;
      release.type = detail::kRelease;
      release.id = loan;
      if (failed) release.payload = detail::kReleaseFailed;
      try {
        inner_->send(peer, std::move(release));
      } catch (const std::exception&) {
        // Not registered here yet (add_peer sends it), or gone (its loans are orphaned on its
        // side), or we are stopping.
        std::lock_guard<std::mutex> lk(mu_);
        if (!stopping_ && lost_at_.count(peer) == 0) {
          unsent_releases_[peer].push_back({loan, failed});
        }
      }
    }

    // On the receiving thread: a Transfer is put back together (or a plain message that queued
    // behind one passes as it is), handed to the agent, and its loan released.
    void deliver(int peer, wire::Message&& m) {
      if (m.type != detail::kTransfer) {
        up_.on_message(peer, std::move(m));
        return;
      }
      detail::TransferHeader h;
      try {
        if (m.buffers.empty()) throw DistNetworkError("device transfer without its header");
        h = detail::decode_transfer_header(m.buffers.back(), m.buffers.size() - 1, max_bytes_);
      } catch (const std::exception& e) {
        // Nothing of it can be trusted, and the loan id neither: the message is dropped.
        distrpc::detail::log_warning(
            "worker " + std::to_string(self_),
            "dropping a message from worker " + std::to_string(peer) + ": " + e.what());
        return;
      }
      m.buffers.pop_back();
      m.type = h.kind;
      std::uint64_t imported = 0;
      std::uint64_t failed = 0;
      for (auto& e : h.entries) {
        try {
          at::Tensor b = channel_.import_buffer(peer, e.descriptor, e.nbytes);
          if (b.numel() != e.nbytes) {
            throw DistNetworkError("the channel gave " + std::to_string(b.numel()) + " bytes");
          }
          m.buffers[e.index] = std::move(b);
          ++imported;
        } catch (const std::exception& ex) {
          ++failed;
          distrpc::detail::log_warning(
              "worker " + std::to_string(self_),
              "device buffer " + std::to_string(e.index) + " of " + std::to_string(e.nbytes) +
                  " bytes from worker " + std::to_string(peer) + " could not be imported through " +
                  std::string(Channel::name) +
                  " (the message's decoder will refuse it): " + ex.what());
        }
      }
      {
        std::lock_guard<std::mutex> lk(mu_);
        stats_.imported += imported;
        stats_.failed += failed;
      }
      // Released before the agent runs anything: the copies are ours now.
      send_release(peer, h.loan, failed > 0);
      up_.on_message(peer, std::move(m));
    }

    void stop_receiver() {
      {
        std::lock_guard<std::mutex> lk(mu_);
        stopping_ = true;
        queue_.clear();
      }
      cv_.notify_all();
      if (receiver_.joinable() && receiver_.get_id() == std::this_thread::get_id()) {
        alive_->store(false);
      }
      join_or_detach(receiver_);  // detached when shut down from inside a delivery
    }

    const int self_;
    const std::int64_t max_bytes_;
    Channel channel_;
    TransportCallbacks up_;  // the agent's callbacks
    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Item> queue_;             // for the receiving thread, in arrival order
    std::map<int, std::size_t> queued_;  // per peer: items queued or being handled
    std::map<int, bool> reached_;        // per peer: the channel reaches it
    std::map<int, std::map<std::uint64_t, Loan>> loans_;         // per peer, by loan id
    std::map<int, std::map<std::uint64_t, Orphan>> orphaned_;    // of lost peers (see the top)
    std::map<int, Clock::time_point> lost_at_;                   // peers lost, not registered again
    std::map<int, std::vector<UnsentRelease>> unsent_releases_;  // to peers not registered yet
    std::map<int, std::unique_ptr<std::mutex>> order_;           // per peer (kOrdered)
    std::uint64_t next_loan_ = 0;
    DeviceDirectStats stats_;
    bool stopping_ = false;
    bool shut_down_ = false;
    std::shared_ptr<std::atomic<bool>> alive_ = std::make_shared<std::atomic<bool>>(true);
    std::thread receiver_;
    std::unique_ptr<typename T::Context> inner_;  // last: its threads call into the members above
  };
};

}  // namespace distrpc::transport
