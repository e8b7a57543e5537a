// The Linux pieces the shared-memory transport is built from: owned file descriptors, sealed memfds
// and their mappings, eventfds, SOCK_SEQPACKET Unix sockets in the abstract namespace with
// SCM_RIGHTS, and the host identity used as the policy's domain key.
//
// Nothing here ever creates a name in a file system: memfds are anonymous (no /dev/shm entry) and
// abstract sockets vanish with their last descriptor, so a crashed process leaves nothing behind.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "distrpc/error.hpp"
#include "distrpc/net/errno_text.hpp"
#include "distrpc/net/fd.hpp"
#include "distrpc/net/wait_fd.hpp"
#include "distrpc/wire/errors.hpp"

namespace distrpc::transport::shm::detail {

using Clock = std::chrono::steady_clock;

// Blocking waits on a calling thread wake this often to notice shutdown().
inline constexpr int kPollSliceMs = net::kPollSliceMs;
// MADV_POPULATE_WRITE (Linux 5.14); older headers lack the name, older kernels return EINVAL.
inline constexpr int kMadvPopulateWrite = 23;
// Seals every shared region carries: its size is fixed for good, so a peer cannot shrink it under
// our mapping (which would turn our next access into SIGBUS).
inline constexpr int kRequiredSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

using net::errno_text;
using net::Fd;

// A shared mapping, unmapped when the last owner lets go (received tensors are owners too, so a
// region outlives the connection it came from as long as a tensor uses it).
class Mapping {
 public:
  Mapping(void* base, std::size_t size) : base_(static_cast<char*>(base)), size_(size) {}
  ~Mapping() { ::munmap(base_, size_); }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  char* base() const { return base_; }
  std::size_t size() const { return size_; }

 private:
  char* base_;
  std::size_t size_;
};

// Faults every page of [p, p + n) in at once. Page by page inside a memcpy costs ~10x more; this is
// advice: failure (an old kernel) changes nothing but speed.
inline void populate(void* p, std::size_t n) {
  ::madvise(p, n, kMadvPopulateWrite);
}

// The text of an error thrown here, without its "distrpc shm: " prefix: for callers that wrap it
// in a text of their own, which already starts so.
inline std::string reason_without_prefix(const std::exception& e) {
  constexpr std::string_view kPrefix = "distrpc shm: ";
  std::string_view text = e.what();
  if (text.substr(0, kPrefix.size()) == kPrefix) text.remove_prefix(kPrefix.size());
  return std::string(text);
}

inline std::shared_ptr<Mapping> map_shared(int fd, std::size_t size, bool prefault) {
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    throw DistNetworkError("distrpc shm: cannot map " + std::to_string(size) +
                           " bytes of shared memory: " + errno_text(errno));
  }
  auto m = std::make_shared<Mapping>(p, size);
  if (prefault) populate(p, size);
  return m;
}

// Bytes of memory the file holds already (its allocated blocks; 0 when fstat fails).
inline std::uint64_t allocated_bytes(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return 0;
  return static_cast<std::uint64_t>(st.st_blocks) * 512;
}

// Maps shared memory a peer made (a ring, a segment). Its page tables are filled in bulk only when
// the peer has filled its pages already, as ours does: prefaulting pages it never touched would
// allocate them, so a peer announcing a ring or segment of up to the limit and writing nothing
// could make this process commit all of it. Unfilled, a page is allocated when a record touches it.
inline std::shared_ptr<Mapping> map_peer_memory(int fd, std::size_t size) {
  return map_shared(fd, size, /*prefault=*/allocated_bytes(fd) >= size);
}

// An anonymous, sealed memfd of `size` bytes. `name` only shows in /proc/<pid>/fd and maps.
inline Fd make_memfd(const std::string& name, std::size_t size) {
  Fd fd(::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) {
    throw DistNetworkError("distrpc shm: memfd_create('" + name +
                           "') failed: " + errno_text(errno));
  }
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) {
    throw DistNetworkError("distrpc shm: cannot size shared memory '" + name + "' to " +
                           std::to_string(size) + " bytes: " + errno_text(errno));
  }
  if (::fcntl(fd.get(), F_ADD_SEALS, kRequiredSeals) != 0) {
    throw DistNetworkError("distrpc shm: cannot seal shared memory '" + name +
                           "': " + errno_text(errno));
  }
  return fd;
}

// Checks a memfd received from a peer before it is mapped: sealed against resizing (else the peer
// could truncate it under us) and of a plausible size. Returns its size. Throws ProtocolError.
inline std::uint64_t checked_memfd_size(int fd, const std::string& what, std::uint64_t min_size,
                                        std::uint64_t max_size) {
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0) {
    throw wire::ProtocolError(what + " is not a memfd (F_GET_SEALS: " + errno_text(errno) + ")");
  }
  if ((seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW)) {
    throw wire::ProtocolError(what + " is not sealed against resizing (seals " +
                              std::to_string(seals) + ")");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    throw wire::ProtocolError("cannot stat " + what + ": " + errno_text(errno));
  }
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size < min_size || size > max_size) {
    throw wire::ProtocolError(what + " has " + std::to_string(size) + " bytes, outside " +
                              std::to_string(min_size) + ".." + std::to_string(max_size));
  }
  return size;
}

inline Fd make_eventfd() {
  Fd fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!fd) throw DistNetworkError("distrpc shm: eventfd failed: " + errno_text(errno));
  return fd;
}

// A descriptor received from a peer that we will write wake-ups to: it must be an eventfd (a pipe
// or socket could make a write block or reach something else), and non-blocking.
inline void check_eventfd(int fd, const std::string& what) {
  char link[64] = {};
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  const ssize_t n = ::readlink(path.c_str(), link, sizeof link - 1);
  if (n < 0 || std::string(link, static_cast<std::size_t>(n)) != "anon_inode:[eventfd]") {
    throw wire::ProtocolError(what + " is not an eventfd (" +
                              (n < 0 ? errno_text(errno) : std::string(link)) + ")");
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    throw wire::ProtocolError("cannot make " + what + " non-blocking: " + errno_text(errno));
  }
}

// A wake-up: never blocks (EAGAIN means the counter is already non-zero: the wake is pending).
inline void signal_eventfd(int fd) {
  const std::uint64_t one = 1;
  while (::write(fd, &one, sizeof one) < 0 && errno == EINTR) {
  }
}

inline void drain_eventfd(int fd) {
  std::uint64_t v;
  while (::read(fd, &v, sizeof v) < 0 && errno == EINTR) {
  }
}

// ---- abstract Unix sockets ----------------------------------------------------------------------

// Names are "distrpc-shm-<pid>-<random>"; the leading NUL that puts them in the abstract namespace
// is added here, never published.
inline constexpr std::string_view kAddressPrefix = "distrpc-shm-";
inline constexpr std::size_t kMaxAddressBytes = sizeof(sockaddr_un::sun_path) - 1;

inline socklen_t abstract_sockaddr(const std::string& name, sockaddr_un& out) {
  out = sockaddr_un{};
  out.sun_family = AF_UNIX;
  std::memcpy(out.sun_path + 1, name.data(), name.size());
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
}

// Why `address` cannot be a published shm address, or empty when it can.
inline std::string address_problem(const std::string& address) {
  if (address.compare(0, kAddressPrefix.size(), kAddressPrefix) != 0) {
    return "it does not start with '" + std::string(kAddressPrefix) + "'";
  }
  if (address.size() > kMaxAddressBytes) {
    return "it is " + std::to_string(address.size()) + " bytes long (at most " +
           std::to_string(kMaxAddressBytes) + ")";
  }
  for (char c : address) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-')) {
      return "it contains a character other than a-z, 0-9 and '-'";
    }
  }
  return {};
}

using net::wait_fd;  // distrpc/net/wait_fd.hpp

// Bytes of one control packet at most: a Hello frame (8 KiB bound) and the fixed records.
inline constexpr std::size_t kMaxPacketBytes = 16 * 1024;
// Descriptors one packet may carry; more is a protocol error (and every one of them is closed).
inline constexpr std::size_t kMaxPacketFds = 2;

struct Packet {
  std::string data;
  std::vector<Fd> fds;
};

inline constexpr int kPeerClosed = -1;

// Sends one packet with `fds` attached. The socket is non-blocking: a full socket waits in poll.
// 0, or an errno value (ETIMEDOUT, ECANCELED as in wait_fd).
inline int send_packet(int fd, const void* data, std::size_t size, const int* fds, std::size_t nfds,
                       std::optional<Clock::time_point> deadline,
                       const std::atomic<bool>& stopping) {
  iovec iov{const_cast<void*>(data), size};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxPacketFds)] = {};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  if (nfds > 0) {
    mh.msg_control = control;
    mh.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
    cmsghdr* c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
    std::memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
  }
  for (;;) {
    if (::sendmsg(fd, &mh, MSG_NOSIGNAL) >= 0) return 0;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return errno;
    if (const int err = wait_fd(fd, POLLOUT, deadline, stopping)) return err;
  }
}

// Receives one packet if one is queued: 0 (got one), EAGAIN (none), kPeerClosed, or errno.
// Descriptors arrive close-on-exec; a packet that is too long or carries too many descriptors is
// refused with ProtocolError after closing all of them.
inline int try_recv_packet(int fd, Packet& out) {
  out.data.resize(kMaxPacketBytes + 1);
  out.fds.clear();
  iovec iov{out.data.data(), out.data.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * (kMaxPacketFds + 14))] = {};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = control;
  mh.msg_controllen = sizeof control;
  ssize_t n;
  do {
    n = ::recvmsg(fd, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return (errno == EAGAIN || errno == EWOULDBLOCK) ? EAGAIN : errno;
  for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (std::size_t i = 0; i < count; ++i) {
      int received;
      std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      out.fds.emplace_back(received);
    }
  }
  if (n == 0 && out.fds.empty()) return kPeerClosed;
  if (mh.msg_flags & MSG_CTRUNC) {
    throw wire::ProtocolError("a control packet carried more descriptors than allowed (" +
                              std::to_string(kMaxPacketFds) + ")");
  }
  if ((mh.msg_flags & MSG_TRUNC) || static_cast<std::size_t>(n) > kMaxPacketBytes) {
    throw wire::ProtocolError("a control packet exceeds " + std::to_string(kMaxPacketBytes) +
                              " bytes");
  }
  if (out.fds.size() > kMaxPacketFds) {
    throw wire::ProtocolError("a control packet carried " + std::to_string(out.fds.size()) +
                              " descriptors (at most " + std::to_string(kMaxPacketFds) + ")");
  }
  out.data.resize(static_cast<std::size_t>(n));
  return 0;
}

// Blocking receive with a deadline: 0, kPeerClosed or an errno value (ETIMEDOUT, ECANCELED).
inline int recv_packet(int fd, Packet& out, Clock::time_point deadline,
                       const std::atomic<bool>& stopping) {
  for (;;) {
    const int r = try_recv_packet(fd, out);
    if (r != EAGAIN) return r;
    if (const int err = wait_fd(fd, POLLIN, deadline, stopping)) return err;
  }
}

// ---- host identity ------------------------------------------------------------------------------

inline std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

inline std::string namespace_inode(const char* which) {
  char buf[128] = {};
  const std::string path = std::string("/proc/self/ns/") + which;
  const ssize_t n = ::readlink(path.c_str(), buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string("unknown");
}

// Peers with equal keys can reach each other's abstract sockets (same network namespace) on the
// same running kernel (boot id). The IPC namespace is included as the brief for shared-memory
// transports asks: peers in different IPC namespaces are usually different containers.
inline std::string host_domain_key() {
  return "shm:boot=" + read_first_line("/proc/sys/kernel/random/boot_id") +
         ";ipc=" + namespace_inode("ipc") + ";net=" + namespace_inode("net");
}

inline bool memfd_works() {
  Fd fd(::memfd_create("distrpc-shm probe", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd || ::ftruncate(fd.get(), 4096) != 0) return false;
  void* p = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (p == MAP_FAILED) return false;
  ::munmap(p, 4096);
  return ::fcntl(fd.get(), F_ADD_SEALS, kRequiredSeals) == 0;
}

// memfd_works(), probed once per process: it cannot change while the process runs.
inline bool memfd_usable() {
  static const bool ok = memfd_works();
  return ok;
}

}  // namespace distrpc::transport::shm::detail
