// The shm transport's constants and the packets of its handshake (the Unix socket's side of a
// connection; the ring's records are record.hpp's).
#pragma once

#include <sys/socket.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "distrpc/net/spin.hpp"
#include "distrpc/transport/shm/system.hpp"
#include "distrpc/wire/errors.hpp"
#include "distrpc/wire/frame.hpp"
#include "distrpc/wire/handshake.hpp"
#include "distrpc/wire/message.hpp"

namespace distrpc::transport::shm::detail {

// Data bytes of each connection's ring. Small messages need little; larger ones stream through.
inline constexpr std::uint64_t kDefaultRingCapacity = std::uint64_t{2} << 20;
// How long the I/O thread keeps polling after the last activity before it sleeps, unless
// DISTRPC_SHM_SPIN_US says otherwise (0: never spin). Spinning yields the CPU on every round, so on
// a busy 2-core machine it costs latency to no one; idle, it stops after this.
inline constexpr int kDefaultSpinUs = 200;
// While spinning or busy, sockets (hang-ups, segment descriptors) are polled this often.
inline constexpr auto kSocketPollPeriod = std::chrono::microseconds(500);
// A writer waiting for ring space spins this long before it sleeps.
inline constexpr auto kWriterSpin = std::chrono::microseconds(50);
// A handshake frame is a Hello or an AuthAnswer: their fields are bounded by the wire layer, so
// this is ample.
inline constexpr std::uint64_t kMaxHelloFrameBytes = 8 * 1024;

// Packets on the Unix socket after the Hello exchange.
inline constexpr std::uint32_t kSetupMagic = 0x43485344u;  // "DSHC": ring memfd + space eventfd
inline constexpr std::uint32_t kAckMagic = 0x41485344u;    // "DSHA": the acceptor adopted it
inline constexpr std::uint32_t kSetupVersion = 1;
struct SetupPacket {
  std::uint32_t magic;
  std::uint32_t version;
  std::uint64_t capacity;
};
struct AckPacket {
  std::uint32_t magic;
  std::uint32_t version;
};

inline int spin_us_from_env() { return net::spin_us_from_env("DISTRPC_SHM_SPIN_US", kDefaultSpinUs); }

inline wire::Limits hello_limits() {
  wire::Limits l;
  l.max_payload_bytes = kMaxHelloFrameBytes;
  l.max_buffers = 0;
  l.max_message_bytes = kMaxHelloFrameBytes;
  return l;
}

inline std::string hello_packet(const wire::Hello& h) {
  const wire::Message m = wire::encode_hello(h);
  return wire::encode_frame_header(m) + m.payload;
}

// A Hello packet: exactly one frame header and its payload. Throws ProtocolError.
inline wire::Hello parse_hello_packet(const std::string& data) {
  wire::FrameDecoder d(hello_limits());
  const std::size_t used = d.feed(data.data(), data.size());
  if (!d.done()) throw wire::ProtocolError("the handshake packet is shorter than a frame header");
  wire::Message m = wire::allocate_message(d.header());
  if (data.size() - used != m.payload.size()) {
    throw wire::ProtocolError("the handshake packet holds " + std::to_string(data.size() - used) +
                              " payload bytes, its header says " +
                              std::to_string(m.payload.size()));
  }
  std::memcpy(m.payload.data(), data.data() + used, m.payload.size());
  return wire::decode_hello(m);
}

// The dialler's AuthAnswer packet (with a secret only): one frame, like a Hello packet.
inline std::string auth_answer_packet(const wire::auth::Proof& proof) {
  const wire::Message m = wire::encode_auth_answer(proof);
  return wire::encode_frame_header(m) + m.payload;
}

// Throws ProtocolError naming `who` when the packet is not an AuthAnswer frame.
inline wire::auth::Proof parse_auth_answer_packet(const std::string& data, const std::string& who) {
  wire::FrameDecoder d(hello_limits());
  const std::size_t used = d.feed(data.data(), data.size());
  if (!d.done()) throw wire::ProtocolError("the answer packet is shorter than a frame header");
  wire::Message m = wire::allocate_message(d.header());
  if (data.size() - used != m.payload.size()) {
    throw wire::ProtocolError("the answer packet holds " + std::to_string(data.size() - used) +
                              " payload bytes, its header says " +
                              std::to_string(m.payload.size()));
  }
  std::memcpy(m.payload.data(), data.data() + used, m.payload.size());
  return wire::decode_auth_answer(m, who);
}

inline std::string peer_credentials(int fd) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return "(unknown process)";
  return "pid " + std::to_string(cred.pid);
}

}  // namespace distrpc::transport::shm::detail
