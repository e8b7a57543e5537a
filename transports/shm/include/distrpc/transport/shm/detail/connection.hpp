// The state of the shm transport's connections and peers, shared by the calling threads, the
// listener and the reader.
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "distrpc/transport/detail/peer_liveness.hpp"
#include "distrpc/transport/shm/detail/record.hpp"
#include "distrpc/transport/shm/ring.hpp"
#include "distrpc/transport/shm/segment.hpp"
#include "distrpc/transport/shm/system.hpp"
#include "distrpc/wire/handshake.hpp"
#include "distrpc/wire/message.hpp"

namespace distrpc::transport::shm::detail {

// A connection this process opened: it writes the ring. Shared by the calling threads (writes,
// under write_mu) and the I/O thread (watches the socket for a hang-up). The socket is closed only
// holding write_mu, so a writer never touches a closed (possibly reused) descriptor; ::shutdown()
// first, so a writer blocked waiting for space wakes at once.
struct OutConn {
  OutConn(std::shared_ptr<Mapping> m, std::uint64_t capacity, std::string label)
      : ring_map(std::move(m)), writer(ring_map->base(), capacity), segments(std::move(label)) {}

  int peer = -1;
  // Of the Peer when this connection was made; atomic: set while the I/O thread may look at it.
  std::atomic<std::uint64_t> generation{0};
  std::string peer_name;
  std::string remote;
  Fd sock;
  std::shared_ptr<Mapping> ring_map;
  RingWriter writer;
  Fd space_efd;  // ours: the peer's reader signals it when it frees space we wait for
  Fd wake_efd;   // the peer's: signalled when its reader sleeps and we published
  SegmentCache segments;

  std::mutex write_mu;
  std::string scratch;               // under write_mu: record header, frame header, placements
  std::vector<std::uint64_t> place;  // under write_mu
  std::atomic<bool> closed{false};
  // Set when the socket is shut down: a write into the ring would still "succeed", into a ring
  // nobody reads any more, so writers check this instead of learning it from the socket.
  std::atomic<bool> broken{false};
  std::mutex close_mu;
  std::mutex failure_mu;
  std::string failure;

  std::string describe() const {
    return "worker " + std::to_string(peer) + " ('" + peer_name + "') at " + remote;
  }
  void record_failure(const std::string& why) {
    std::lock_guard<std::mutex> lk(failure_mu);
    if (failure.empty()) failure = why;
  }
  std::string recorded_failure() {
    std::lock_guard<std::mutex> lk(failure_mu);
    return failure;
  }
  void shutdown_sock() {
    std::lock_guard<std::mutex> lk(close_mu);
    broken.store(true);
    if (!closed.load()) ::shutdown(sock.get(), SHUT_RDWR);
  }
  // True if this call closed it.
  bool close() {
    {
      std::lock_guard<std::mutex> lk(close_mu);
      if (closed.load()) return false;
      broken.store(true);
      ::shutdown(sock.get(), SHUT_RDWR);
    }
    std::scoped_lock lk(write_mu, close_mu);
    closed.store(true);
    sock.reset();
    return true;
  }
};

// A connection a peer opened to us: we read its ring. Touched only by the I/O thread (and by

// A connection a peer opened to us: we read its ring. Touched only by the I/O thread (and by
// shutdown() after that thread stopped). Not copyable: its parser reads segment announcements
// from its own socket.
struct InConn {
  InConn(std::shared_ptr<Mapping> m, std::uint64_t capacity, const wire::Limits& limits)
      : ring_map(std::move(m)),
        reader(ring_map->base(), capacity),
        parser(limits, [this, max = max_segment_bytes(limits)](std::uint32_t id) {
          return receive_announced_segment(sock.get(), id, max);
        }) {}
  InConn(const InConn&) = delete;
  InConn& operator=(const InConn&) = delete;

  int peer = -1;
  std::uint64_t generation = 0;  // of the Peer when this connection was adopted
  std::string ahead;             // from an incarnation not registered yet: its address
  std::string peer_name;
  std::string remote;
  Fd sock;
  std::shared_ptr<Mapping> ring_map;
  RingReader reader;
  Fd space_efd;  // the peer's: signalled when we free space it waits for
  bool hung_up = false;
  RecordParser parser;  // the record being read

  bool mid_record() const { return parser.mid_record(); }
  std::string describe() const {
    return "worker " + std::to_string(peer) + " ('" + peer_name + "') at " + remote;
  }
};

// What this process knows about one worker: where it listens, the connection it opened to it.
struct Peer {
  explicit Peer(int id_) : id(id_) {}
  const int id;

  std::mutex connect_mu;                   // one connect attempt at a time, held across it
  std::atomic<std::uint64_t> attempts{0};  // finished failed attempts
  std::string last_failure;                // under connect_mu

  std::mutex mu;  // guards the fields below
  std::string name;
  std::string address;
  std::shared_ptr<OutConn> out;
  // A connection broke: sends fail fast until add_peer(); with the generation guard (a late
  // hang-up of the old pair must not mark a fresh registration lost).
  transport::detail::PeerLiveness liveness;

  std::string describe_locked() const {
    return "worker " + std::to_string(id) + " ('" + name + "')" +
           (address.empty() ? std::string() : " at " + address);
  }
};

// An incoming connection between accept and the end of its handshake (listener thread only).
struct PendingHandshake {
  Fd sock;
  std::string remote;
  Clock::time_point deadline;
  bool hello_done = false;
  bool answer_needed = false;  // a secret is configured and the dialler has not yet proved it
  wire::Hello hello;
  wire::Hello mine;  // the Hello sent back: its nonce is what the dialler's answer must cover
};

}  // namespace distrpc::transport::shm::detail
