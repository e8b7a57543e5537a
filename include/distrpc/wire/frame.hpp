// Stream framing shared by every byte-stream transport: a fixed little-endian header, a table of
// out-of-band buffer lengths, then the payload and the buffers themselves. The receiver validates
// the header against configurable limits before allocating anything, so a hostile or confused peer
// cannot make it allocate more than the limits allow. Layout: docs/wire-protocol.md, "Frames".
#pragma once

#include <distrpc/wire/byte_order.hpp>
#include <distrpc/wire/errors.hpp>
#include <distrpc/wire/message.hpp>
#include <distrpc/wire/recv_storage.hpp>

#include <ATen/ops/empty.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace distrpc::wire {

// "DRPC" as the first four bytes on the wire.
inline constexpr std::uint32_t kFrameMagic = 0x43505244u;
// The layout of the frame header itself. Payload encoding and message semantics are versioned by
// the handshake's protocol_version instead, so that a peer of another version can still be told
// why.
inline constexpr std::uint16_t kFrameVersion = 1;
// Bytes of the fixed part of the header; the buffer-length table (8 bytes per buffer) follows it.
inline constexpr std::size_t kFrameFixedBytes = 32;

// What a receiver accepts and a sender may send. Exceeding one on receipt is a ProtocolError (the
// transport drops the connection); on send, check_limits refuses the message with an EncodeError.
struct Limits {
  std::uint64_t max_payload_bytes = std::uint64_t{1} << 30;  // 1 GiB of cereal payload
  std::uint32_t max_buffers = std::uint32_t{1} << 16;        // out-of-band regions per message
  std::uint64_t max_message_bytes = std::uint64_t{1} << 34;  // payload plus all buffers: 16 GiB
};

// A validated frame header: what the receiver must read next.
struct FrameHeader {
  MessageType type = MessageType::Request;
  std::uint64_t id = 0;
  std::uint64_t payload_bytes = 0;
  std::vector<std::uint64_t> buffer_bytes;

  // Payload plus buffers; the decoder has checked that the sum fits the limits (no overflow).
  std::uint64_t body_bytes() const noexcept {
    std::uint64_t total = payload_bytes;
    for (std::uint64_t n : buffer_bytes) total += n;
    return total;
  }
};

namespace detail {

inline std::string hex32(std::uint32_t v) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s = "0x00000000";
  for (int i = 0; i < 8; ++i) s[9 - i] = kDigits[(v >> (4 * i)) & 0xF];
  return s;
}

inline bool is_plain_byte_buffer(const at::Tensor& b) {
  return b.defined() && b.device().is_cpu() && b.scalar_type() == at::kByte && b.dim() == 1 &&
         b.layout() == at::kStrided && (b.numel() <= 1 || b.stride(0) == 1);
}

}  // namespace detail

// Refuses, before anything is sent, a message the receiver would reject or the transport could not
// write: payload, buffer count or total size over `limits`, or a buffer that is not a 1-D
// contiguous kByte CPU tensor. The text gives the size and the limit.
inline void check_limits(const Message& message, const Limits& limits = {}) {
  const auto prefix = [&] {
    return "cannot send " + to_string(message.type) + " message " + std::to_string(message.id) +
           ": ";
  };
  if (message.payload.size() > limits.max_payload_bytes) {
    throw EncodeError(prefix() + "payload of " + std::to_string(message.payload.size()) +
                      " bytes exceeds the limit of " + std::to_string(limits.max_payload_bytes) +
                      " bytes (Limits::max_payload_bytes)");
  }
  if (message.buffers.size() > limits.max_buffers) {
    throw EncodeError(prefix() + std::to_string(message.buffers.size()) +
                      " out-of-band buffers exceed the limit of " +
                      std::to_string(limits.max_buffers) + " (Limits::max_buffers)");
  }
  std::uint64_t total = message.payload.size();
  for (std::size_t i = 0; i < message.buffers.size(); ++i) {
    const at::Tensor& b = message.buffers[i];
    if (!detail::is_plain_byte_buffer(b)) {
      throw EncodeError(prefix() + "buffer " + std::to_string(i) +
                        " is not a 1-D contiguous kByte CPU tensor");
    }
    total += static_cast<std::uint64_t>(b.numel());
  }
  if (total > limits.max_message_bytes) {
    throw EncodeError(prefix() + "message of " + std::to_string(total) +
                      " bytes (payload and buffers) exceeds the limit of " +
                      std::to_string(limits.max_message_bytes) +
                      " bytes (Limits::max_message_bytes)");
  }
}

// Appends the header for `message` (fixed part and buffer-length table) to `out`.
inline void append_frame_header(std::string& out, const Message& message) {
  if (message.buffers.size() > std::numeric_limits<std::uint32_t>::max()) {
    throw EncodeError("cannot frame a message with " + std::to_string(message.buffers.size()) +
                      " buffers: the frame header counts them in 32 bits");
  }
  const std::size_t start = out.size();
  out.resize(start + kFrameFixedBytes + 8 * message.buffers.size());
  char* p = out.data() + start;
  detail::put_le<std::uint32_t>(p + 0, kFrameMagic);
  detail::put_le<std::uint16_t>(p + 4, kFrameVersion);
  detail::put_le<std::uint8_t>(p + 6, static_cast<std::uint8_t>(message.type));
  detail::put_le<std::uint8_t>(p + 7, 0);  // flags: none defined in version 1
  detail::put_le<std::uint64_t>(p + 8, message.id);
  detail::put_le<std::uint64_t>(p + 16, message.payload.size());
  detail::put_le<std::uint32_t>(p + 24, static_cast<std::uint32_t>(message.buffers.size()));
  detail::put_le<std::uint32_t>(p + 28, 0);  // reserved
  p += kFrameFixedBytes;
  for (const at::Tensor& b : message.buffers) {
    detail::put_le<std::uint64_t>(p, b.defined() ? static_cast<std::uint64_t>(b.numel()) : 0);
    p += 8;
  }
}

inline std::string encode_frame_header(const Message& message) {
  std::string out;
  append_frame_header(out, message);
  return out;
}

// Incremental header decoder for stream transports. Read `bytes_needed()` bytes, `feed` them,
// repeat until `done()`; then read `header().payload_bytes` and each buffer into
// `allocate_message(...)`. Every field is validated as soon as it is complete, so nothing is
// allocated from a length that breaks the limits. Errors are ProtocolError naming the field, its
// value and the limit.
class FrameDecoder {
 public:
  explicit FrameDecoder(Limits limits = {}) : limits_(limits) {}

  // Header bytes still wanted before the header is complete (0 once it is).
  std::size_t bytes_needed() const noexcept {
    switch (stage_) {
      case Stage::Fixed:
        return kFrameFixedBytes - filled_;
      case Stage::Table:
        return table_.size() - filled_;
      case Stage::Done:
        break;
    }
    return 0;
  }

  bool done() const noexcept { return stage_ == Stage::Done; }

  // Consumes up to bytes_needed() bytes from `data` and returns how many it took.
  std::size_t feed(const void* data, std::size_t size) {
    const char* in = static_cast<const char*>(data);
    std::size_t used = 0;
    while (used < size && stage_ != Stage::Done) {
      const std::size_t take = std::min(size - used, bytes_needed());
      char* dst = stage_ == Stage::Fixed ? fixed_.data() : table_.data();
      std::memcpy(dst + filled_, in + used, take);
      filled_ += take;
      used += take;
      if (bytes_needed() == 0) advance();
    }
    return used;
  }

  // The complete header; only meaningful once done().
  const FrameHeader& header() const noexcept { return header_; }

  // Ready for the next frame on the same stream.
  void reset() noexcept {
    stage_ = Stage::Fixed;
    filled_ = 0;
    table_.clear();
    header_ = FrameHeader{};
  }

  const Limits& limits() const noexcept { return limits_; }

 private:
  enum class Stage { Fixed, Table, Done };

  void advance() {
    if (stage_ == Stage::Fixed) {
      parse_fixed();
    } else {
      parse_table();
    }
  }

  void parse_fixed() {
    const char* p = fixed_.data();
    const auto magic = detail::get_le<std::uint32_t>(p + 0);
    if (magic != kFrameMagic) {
      throw ProtocolError("bad frame magic " + detail::hex32(magic) + " (expected " +
                          detail::hex32(kFrameMagic) +
                          ", \"DRPC\"): the peer does not speak the distrpc protocol");
    }
    const auto version = detail::get_le<std::uint16_t>(p + 4);
    if (version != kFrameVersion) {
      throw ProtocolError("frame version " + std::to_string(version) +
                          " is not supported: this build speaks frame version " +
                          std::to_string(kFrameVersion));
    }
    const auto type = detail::get_le<std::uint8_t>(p + 6);
    if (!is_valid_message_type(type)) {
      throw ProtocolError(
          "frame message type " + std::to_string(type) +
          " is unknown (accepted: 1-4, the control range 16-127 and the transport range 128-143)");
    }
    const auto flags = detail::get_le<std::uint8_t>(p + 7);
    if (flags != 0) {
      throw ProtocolError("frame flags " + std::to_string(flags) +
                          " are not defined in frame version 1 (must be 0)");
    }
    const auto reserved = detail::get_le<std::uint32_t>(p + 28);
    if (reserved != 0) {
      throw ProtocolError("frame reserved field " + std::to_string(reserved) + " must be 0");
    }
    header_.type = static_cast<MessageType>(type);
    header_.id = detail::get_le<std::uint64_t>(p + 8);
    header_.payload_bytes = detail::get_le<std::uint64_t>(p + 16);
    if (header_.payload_bytes > limits_.max_payload_bytes) {
      throw ProtocolError("frame payload length " + std::to_string(header_.payload_bytes) +
                          " exceeds limit " + std::to_string(limits_.max_payload_bytes));
    }
    if (header_.payload_bytes > limits_.max_message_bytes) {
      throw ProtocolError("frame payload length " + std::to_string(header_.payload_bytes) +
                          " exceeds the message limit " +
                          std::to_string(limits_.max_message_bytes));
    }
    const auto count = detail::get_le<std::uint32_t>(p + 24);
    if (count > limits_.max_buffers) {
      throw ProtocolError("frame buffer count " + std::to_string(count) + " exceeds limit " +
                          std::to_string(limits_.max_buffers));
    }
    filled_ = 0;
    if (count == 0) {
      stage_ = Stage::Done;
    } else {
      table_.assign(std::size_t{8} * count, '\0');
      stage_ = Stage::Table;
    }
  }

  void parse_table() {
    const std::size_t count = table_.size() / 8;
    header_.buffer_bytes.resize(count);
    std::uint64_t total = header_.payload_bytes;
    for (std::size_t i = 0; i < count; ++i) {
      const auto n = detail::get_le<std::uint64_t>(table_.data() + 8 * i);
      if (n > limits_.max_message_bytes - total) {
        if (n > limits_.max_message_bytes) {
          throw ProtocolError("frame buffer " + std::to_string(i) + " length " + std::to_string(n) +
                              " exceeds limit " + std::to_string(limits_.max_message_bytes));
        }
        throw ProtocolError("frame total length (payload and buffers 0.." + std::to_string(i) +
                            ") " + std::to_string(total + n) + " exceeds limit " +
                            std::to_string(limits_.max_message_bytes));
      }
      total += n;
      header_.buffer_bytes[i] = n;
    }
    table_.clear();
    filled_ = 0;
    stage_ = Stage::Done;
  }

  Limits limits_;
  Stage stage_ = Stage::Fixed;
  std::size_t filled_ = 0;
  std::array<char, kFrameFixedBytes> fixed_{};
  std::string table_;
  FrameHeader header_;
};

// Decodes a header that is wholly in memory (exactly the header bytes: fixed part and table).
inline FrameHeader decode_frame_header(std::string_view bytes, const Limits& limits = {}) {
  FrameDecoder decoder(limits);
  const std::size_t used = decoder.feed(bytes.data(), bytes.size());
  if (!decoder.done()) {
    throw ProtocolError("frame header truncated: " + std::to_string(bytes.size()) +
                        " bytes given, " + std::to_string(decoder.bytes_needed()) + " more needed");
  }
  if (used != bytes.size()) {
    throw ProtocolError("frame header followed by " + std::to_string(bytes.size() - used) +
                        " unexpected bytes");
  }
  return decoder.header();
}

// A message shaped by `header`, ready for the body: the payload is sized and each buffer is a 1-D
// kByte tensor that the transport reads straight into: `at::empty({n}, at::kByte)`, or from
// RecvStorage when large (resident already, see recv_storage.hpp).
inline Message allocate_message(const FrameHeader& header) {
  Message message;
  message.type = header.type;
  message.id = header.id;
  message.payload.resize(static_cast<std::size_t>(header.payload_bytes));
  message.buffers.reserve(header.buffer_bytes.size());
  for (std::uint64_t n : header.buffer_bytes) {
    message.buffers.push_back(n >= kRecvPooledBytes
                                  ? RecvStorage::instance().empty_bytes(static_cast<std::size_t>(n))
                                  : at::empty({static_cast<std::int64_t>(n)}, at::kByte));
  }
  return message;
}

}  // namespace distrpc::wire
