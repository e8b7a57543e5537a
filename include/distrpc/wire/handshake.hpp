// The first frame each side sends on a new connection: who it is and which protocol it speaks, plus
// an optional shared secret. Its payload has a fixed little-endian layout (not cereal) that starts
// with the version, so a peer of any version can be told, in words, why it was refused.
#pragma once

#include <distrpc/wire/byte_order.hpp>
#include <distrpc/wire/errors.hpp>
#include <distrpc/wire/message.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace distrpc::wire {

// Version of the payload encoding and message semantics; bumped whenever either changes.
// 1: RPC core. 2: the request header gained a mode byte and RRef ids; control types 16-20 (RRefs).
inline constexpr std::uint32_t kProtocolVersion = 3;
// Bounds the decoder enforces, so a handshake cannot make the receiver allocate much.
inline constexpr std::size_t kMaxHelloNameBytes = 1024;
inline constexpr std::size_t kMaxHelloTokenBytes = 4096;

struct Hello {
  std::uint32_t protocol_version = kProtocolVersion;
  std::string worker_name;
  std::int64_t worker_id = -1;
  std::optional<std::string> auth_token;  // a shared secret; never logged
};

// Payload: u32 protocol_version | u32 name length | name | i64 worker_id | u8 has_token
//          [| u32 token length | token]
inline Message encode_hello(const Hello& hello) {
  if (hello.worker_name.size() > kMaxHelloNameBytes) {
    throw EncodeError("handshake worker name of " + std::to_string(hello.worker_name.size()) +
                      " bytes exceeds the limit of " + std::to_string(kMaxHelloNameBytes));
  }
  if (hello.auth_token && hello.auth_token->size() > kMaxHelloTokenBytes) {
    throw EncodeError("handshake auth token of " + std::to_string(hello.auth_token->size()) +
                      " bytes exceeds the limit of " + std::to_string(kMaxHelloTokenBytes));
  }
  Message m;
  m.type = MessageType::Handshake;
  m.id = 0;
  const std::size_t token_bytes = hello.auth_token ? 4 + hello.auth_token->size() : 0;
  m.payload.resize(4 + 4 + hello.worker_name.size() + 8 + 1 + token_bytes);
  char* p = m.payload.data();
  detail::put_le<std::uint32_t>(p, hello.protocol_version);
  detail::put_le<std::uint32_t>(p + 4, static_cast<std::uint32_t>(hello.worker_name.size()));
  p += 8;
  hello.worker_name.copy(p, hello.worker_name.size());
  p += hello.worker_name.size();
  detail::put_le<std::int64_t>(p, hello.worker_id);
  p += 8;
  detail::put_le<std::uint8_t>(p, hello.auth_token ? 1 : 0);
  p += 1;
  if (hello.auth_token) {
    detail::put_le<std::uint32_t>(p, static_cast<std::uint32_t>(hello.auth_token->size()));
    hello.auth_token->copy(p + 4, hello.auth_token->size());
  }
  return m;
}

// Decodes and version-checks a peer's Hello. Throws ProtocolError when the message is not a
// handshake, when the versions differ (the text gives both) or when the payload is malformed.
inline Hello decode_hello(const Message& m, std::uint32_t supported_version = kProtocolVersion) {
  if (m.type != MessageType::Handshake) {
    throw ProtocolError("expected a Handshake message first on the connection, got " +
                        to_string(m.type));
  }
  if (!m.buffers.empty()) {
    throw ProtocolError("handshake carries " + std::to_string(m.buffers.size()) +
                        " out-of-band buffers (expected none)");
  }
  std::string_view in = m.payload;
  const auto need = [&](std::size_t n, const char* field) {
    if (in.size() < n) {
      throw ProtocolError(std::string("handshake truncated at ") + field + ": " +
                          std::to_string(n) + " bytes needed, " + std::to_string(in.size()) +
                          " left");
    }
  };
  Hello hello;
  need(4, "protocol_version");
  hello.protocol_version = detail::get_le<std::uint32_t>(in.data());
  in.remove_prefix(4);
  if (hello.protocol_version != supported_version) {
    throw ProtocolError("peer speaks distrpc protocol version " +
                        std::to_string(hello.protocol_version) + " but this build speaks version " +
                        std::to_string(supported_version));
  }
  need(4, "worker_name length");
  const auto name_len = detail::get_le<std::uint32_t>(in.data());
  in.remove_prefix(4);
  if (name_len > kMaxHelloNameBytes) {
    throw ProtocolError("handshake worker name length " + std::to_string(name_len) +
                        " exceeds limit " + std::to_string(kMaxHelloNameBytes));
  }
  need(name_len, "worker_name");
  hello.worker_name.assign(in.substr(0, name_len));
  in.remove_prefix(name_len);
  need(8, "worker_id");
  hello.worker_id = detail::get_le<std::int64_t>(in.data());
  in.remove_prefix(8);
  need(1, "auth token flag");
  const auto has_token = detail::get_le<std::uint8_t>(in.data());
  in.remove_prefix(1);
  if (has_token > 1) {
    throw ProtocolError("handshake auth token flag " + std::to_string(has_token) +
                        " is neither 0 nor 1");
  }
  if (has_token == 1) {
    need(4, "auth token length");
    const auto token_len = detail::get_le<std::uint32_t>(in.data());
    in.remove_prefix(4);
    if (token_len > kMaxHelloTokenBytes) {
      throw ProtocolError("handshake auth token length " + std::to_string(token_len) +
                          " exceeds limit " + std::to_string(kMaxHelloTokenBytes));
    }
    need(token_len, "auth token");
    hello.auth_token.emplace(in.substr(0, token_len));
    in.remove_prefix(token_len);
  }
  if (!in.empty()) {
    throw ProtocolError("handshake from worker '" + hello.worker_name + "' has " +
                        std::to_string(in.size()) + " trailing bytes");
  }
  return hello;
}

// Checks the peer's token against the expected one (none expected: anything is accepted). The
// comparison takes the same time wherever the first difference is, so timing does not leak the
// secret. The error names the peer, never the tokens.
inline void verify_auth_token(const Hello& peer, const std::optional<std::string>& expected) {
  if (!expected) return;
  const auto who = [&] {
    return "worker '" + peer.worker_name + "' (id " + std::to_string(peer.worker_id) + ")";
  };
  if (!peer.auth_token) {
    throw ProtocolError("authentication failed: " + who() + " sent no auth token");
  }
  const std::string& a = *expected;
  const std::string& b = *peer.auth_token;
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const std::size_t n = std::max(a.size(), b.size());
  for (std::size_t i = 0; i < n; ++i) {
    const auto x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const auto y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff = static_cast<unsigned char>(diff | (x ^ y));
  }
  if (diff != 0) {
    throw ProtocolError("authentication failed: " + who() + " sent a wrong auth token");
  }
}

}  // namespace distrpc::wire
