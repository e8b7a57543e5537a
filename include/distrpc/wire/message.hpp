// The unit every transport moves: a typed header, a payload of cereal-encoded bytes, and the
// out-of-band byte regions that carry tensor data. Transports see tensors only as these regions.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace distrpc::wire {

// What a message is for. Values 1..4 are defined by the wire layer itself. Values in
// [kFirstControl, kLastControl] are reserved for the agent's control messages (join/shutdown,
// ping, RRef fork/confirm/delete, ...): the frame decoder accepts them and leaves their meaning to
// the agent, which rejects the ones it does not know. Values in [kFirstTransport, kLastTransport]
// are reserved for a decorator policy's messages to its own peer (e.g. device buffers travelling
// beside the message, transport/device_direct.hpp): the policy consumes them and the agent never
// sees one. Every other value is a protocol error, so a new kind can never be silently misread by
// an older peer.
enum class MessageType : std::uint8_t {
  Handshake = 1,  // the first frame on a connection, both ways: a Hello (see handshake.hpp)
  Request = 2,    // a call; `id` is the caller's request id
  Response = 3,   // a successful result; `id` echoes the request's
  Exception = 4,  // a failed call; `id` echoes the request's, the payload describes the error
  kFirstControl = 16,
  kLastControl = 127,
  kFirstTransport = 128,
  kLastTransport = 143,
};

// The n-th agent control kind (n = 0 .. 111): the agent names its kinds through this so their
// numbers stay inside the reserved range.
constexpr MessageType control_message_type(std::uint8_t n) noexcept {
  return static_cast<MessageType>(static_cast<std::uint8_t>(MessageType::kFirstControl) + n);
}

constexpr bool is_control_message_type(MessageType type) noexcept {
  return type >= MessageType::kFirstControl && type <= MessageType::kLastControl;
}

// The n-th kind of a decorator policy (n = 0 .. 15).
constexpr MessageType transport_message_type(std::uint8_t n) noexcept {
  return static_cast<MessageType>(static_cast<std::uint8_t>(MessageType::kFirstTransport) + n);
}

constexpr bool is_transport_message_type(MessageType type) noexcept {
  return type >= MessageType::kFirstTransport && type <= MessageType::kLastTransport;
}

// True for the values a receiver accepts: the four kinds above, the control range and the
// transport range.
constexpr bool is_valid_message_type(std::uint8_t value) noexcept {
  return (value >= static_cast<std::uint8_t>(MessageType::Handshake) &&
          value <= static_cast<std::uint8_t>(MessageType::Exception)) ||
         is_control_message_type(static_cast<MessageType>(value)) ||
         is_transport_message_type(static_cast<MessageType>(value));
}

// A readable name for logs ("Request", "Control+3"; "Invalid" outside the accepted values).
inline std::string to_string(MessageType type) {
  switch (type) {
    case MessageType::Handshake:
      return "Handshake";
    case MessageType::Request:
      return "Request";
    case MessageType::Response:
      return "Response";
    case MessageType::Exception:
      return "Exception";
    default:
      break;
  }
  if (is_control_message_type(type)) {
    return "Control+" +
           std::to_string(static_cast<int>(type) - static_cast<int>(MessageType::kFirstControl));
  }
  if (is_transport_message_type(type)) {
    return "Transport+" +
           std::to_string(static_cast<int>(type) - static_cast<int>(MessageType::kFirstTransport));
  }
  return "Invalid(" + std::to_string(static_cast<int>(type)) + ")";
}

struct Message {
  MessageType type = MessageType::Request;
  std::uint64_t id = 0;  // request id; a response or exception echoes it
  std::string payload;   // cereal-encoded body (archive.hpp)
  // Out-of-band byte regions, referenced from the payload by index. Each is a 1-D contiguous kByte
  // CPU tensor. On the sender it is a view over the span of the original storage that a tensor
  // covers (no copy); on the receiver the transport allocates each as `at::empty({n}, at::kByte)`
  // and reads straight into it, and the decoder adopts that memory as the tensor's storage.
  std::vector<at::Tensor> buffers;
};

}  // namespace distrpc::wire
