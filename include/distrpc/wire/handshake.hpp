// The first frame each side sends on a new connection: who it is and which protocol it speaks, and
// with a shared secret configured, a challenge (a fresh nonce) and, from the accepting side, its
// proof of the secret (auth.hpp). The secret itself is never sent. Its payload has a fixed
// little-endian layout (not cereal) that starts with the version, so a peer of any version can be
// told, in words, why it was refused.
//
// With a secret, a connection opens in three frames: the dialler's Hello (its nonce), the
// acceptor's Hello (its nonce and its proof over both), then the dialler's AuthAnswer (its proof).
// Each side checks the other's proof before it trusts the connection. Without one, the Tcp
// dialler's third frame is a Confirm (the version only): it says the dialler found the identity it
// meant to reach. Either way the Tcp acceptor takes the connection into use only after the third
// frame, so a dialler that reached the wrong worker (a stale address) hangs up, and that hang-up
// is no loss of the dialler. (Shm sends no Confirm: its dialler's ring setup comes after the same
// check.)
#pragma once

#include <distrpc/wire/auth.hpp>
#include <distrpc/wire/byte_order.hpp>
#include <distrpc/wire/errors.hpp>
#include <distrpc/wire/message.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

namespace distrpc::wire {

// Version of the payload encoding and message semantics; bumped whenever either changes.
// 1: RPC core. 2: the request header gained a mode byte and RRef ids; control types 16-20 (RRefs).
// 3: (current transports). 4: the Hello carries a nonce and a proof instead of the secret, and an
// AuthAnswer frame follows when a secret is configured. 5: a layer's control message with id 0
// gets no answer; distributed autograd's gradients message carries its backward before its tensors.
// 6: without a secret, the Tcp dialler's Confirm frame follows the two Hellos. 7: the Hello carries
// the address the sender listens at.
inline constexpr std::uint32_t kProtocolVersion = 7;
// Bounds the decoder enforces, so a handshake cannot make the receiver allocate much.
inline constexpr std::size_t kMaxHelloNameBytes = 1024;
inline constexpr std::size_t kMaxHelloAddressBytes = 1024;

// What a Hello carries of authentication (the byte after the worker id).
enum class HelloAuth : std::uint8_t {
  kNone = 0,       // the sender has no secret
  kChallenge = 1,  // the dialler: its nonce
  kAnswer = 2,     // the acceptor: its nonce, then its proof over both nonces
};

struct Hello {
  std::uint32_t protocol_version = kProtocolVersion;
  std::string worker_name;
  std::int64_t worker_id = -1;
  // Where the sender's peers reach it (its transport's address(), as registered for it). An
  // acceptor that has the sender registered at another address knows the dialler is a later
  // incarnation it has not been told of yet. Empty: not said.
  std::string listen_address;
  std::optional<auth::Nonce> nonce;  // the sender's challenge: present when it has a secret
  std::optional<auth::Proof> proof;  // the acceptor's answer to the dialler's challenge
};

// "worker 'trainer3' (id 3)": how refusals name the peer (never with anything secret).
inline std::string hello_who(const Hello& h) {
  return "worker '" + h.worker_name + "' (id " + std::to_string(h.worker_id) + ")";
}

// Payload: u32 protocol_version | u32 name length | name | i64 worker_id | u32 address length |
//          address | u8 HelloAuth [| nonce (32 bytes) [| proof (32 bytes)]]
inline Message encode_hello(const Hello& hello) {
  if (hello.worker_name.size() > kMaxHelloNameBytes) {
    throw EncodeError("handshake worker name of " + std::to_string(hello.worker_name.size()) +
                      " bytes exceeds the limit of " + std::to_string(kMaxHelloNameBytes));
  }
  if (hello.listen_address.size() > kMaxHelloAddressBytes) {
    throw EncodeError("handshake listen address of " + std::to_string(hello.listen_address.size()) +
                      " bytes exceeds the limit of " + std::to_string(kMaxHelloAddressBytes));
  }
  if (hello.proof && !hello.nonce) {
    throw EncodeError("handshake with a proof but no nonce (the acceptor sends both)");
  }
  const HelloAuth kind =
      hello.proof ? HelloAuth::kAnswer : (hello.nonce ? HelloAuth::kChallenge : HelloAuth::kNone);
  Message m;
  m.type = MessageType::Handshake;
  m.id = 0;
  const std::size_t auth_bytes =
      (hello.nonce ? auth::kNonceBytes : 0) + (hello.proof ? auth::kProofBytes : 0);
  m.payload.resize(4 + 4 + hello.worker_name.size() + 8 + 4 + hello.listen_address.size() + 1 +
                   auth_bytes);
  char* p = m.payload.data();
  detail::put_le<std::uint32_t>(p, hello.protocol_version);
  detail::put_le<std::uint32_t>(p + 4, static_cast<std::uint32_t>(hello.worker_name.size()));
  p += 8;
  hello.worker_name.copy(p, hello.worker_name.size());
  p += hello.worker_name.size();
  detail::put_le<std::int64_t>(p, hello.worker_id);
  p += 8;
  detail::put_le<std::uint32_t>(p, static_cast<std::uint32_t>(hello.listen_address.size()));
  p += 4;
  hello.listen_address.copy(p, hello.listen_address.size());
  p += hello.listen_address.size();
  detail::put_le<std::uint8_t>(p, static_cast<std::uint8_t>(kind));
  p += 1;
  if (hello.nonce) {
    std::memcpy(p, hello.nonce->data(), hello.nonce->size());
    p += hello.nonce->size();
  }
  if (hello.proof) std::memcpy(p, hello.proof->data(), hello.proof->size());
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
  // A u32 length (at most `limit`), then that many bytes: `field` names it in errors,
  // `words` in the limit's.
  const auto text = [&](const std::string& field, const char* words, std::size_t limit) {
    need(4, (field + " length").c_str());
    const auto len = detail::get_le<std::uint32_t>(in.data());
    in.remove_prefix(4);
    if (len > limit) {
      throw ProtocolError(std::string("handshake ") + words + " length " + std::to_string(len) +
                          " exceeds limit " + std::to_string(limit));
    }
    need(len, field.c_str());
    std::string out(in.substr(0, len));
    in.remove_prefix(len);
    return out;
  };
  hello.worker_name = text("worker_name", "worker name", kMaxHelloNameBytes);
  need(8, "worker_id");
  hello.worker_id = detail::get_le<std::int64_t>(in.data());
  in.remove_prefix(8);
  hello.listen_address = text("listen_address", "listen address", kMaxHelloAddressBytes);
  need(1, "authentication kind");
  const auto kind = detail::get_le<std::uint8_t>(in.data());
  in.remove_prefix(1);
  if (kind > static_cast<std::uint8_t>(HelloAuth::kAnswer)) {
    throw ProtocolError("handshake authentication kind " + std::to_string(kind) +
                        " is none of 0 (none), 1 (challenge), 2 (answer)");
  }
  if (kind >= static_cast<std::uint8_t>(HelloAuth::kChallenge)) {
    need(auth::kNonceBytes, "nonce");
    hello.nonce.emplace();
    std::memcpy(hello.nonce->data(), in.data(), auth::kNonceBytes);
    in.remove_prefix(auth::kNonceBytes);
  }
  if (kind == static_cast<std::uint8_t>(HelloAuth::kAnswer)) {
    need(auth::kProofBytes, "proof");
    hello.proof.emplace();
    std::memcpy(hello.proof->data(), in.data(), auth::kProofBytes);
    in.remove_prefix(auth::kProofBytes);
  }
  if (!in.empty()) {
    throw ProtocolError("handshake from worker '" + hello.worker_name + "' has " +
                        std::to_string(in.size()) + " trailing bytes");
  }
  return hello;
}

// The dialler's third frame (with a secret only): its proof. Payload: u32 protocol_version | proof.
inline Message encode_auth_answer(const auth::Proof& proof) {
  Message m;
  m.type = MessageType::Handshake;
  m.id = 0;
  m.payload.resize(4 + proof.size());
  detail::put_le<std::uint32_t>(m.payload.data(), kProtocolVersion);
  std::memcpy(m.payload.data() + 4, proof.data(), proof.size());
  return m;
}

// Throws ProtocolError naming `who` when the frame is not an AuthAnswer of this version.
inline auth::Proof decode_auth_answer(const Message& m, const std::string& who) {
  if (m.type != MessageType::Handshake || !m.buffers.empty() ||
      m.payload.size() != 4 + auth::kProofBytes ||
      detail::get_le<std::uint32_t>(m.payload.data()) != kProtocolVersion) {
    throw ProtocolError("authentication failed: " + who +
                        " did not answer our challenge with a proof (got a " + to_string(m.type) +
                        " frame of " + std::to_string(m.payload.size()) + " payload bytes)");
  }
  auth::Proof p{};
  std::memcpy(p.data(), m.payload.data() + 4, p.size());
  return p;
}

// The dialler's third frame without a secret: it reached the worker it dialled. Payload: u32
// protocol_version.
inline Message encode_confirm() {
  Message m;
  m.type = MessageType::Handshake;
  m.id = 0;
  m.payload.resize(4);
  detail::put_le<std::uint32_t>(m.payload.data(), kProtocolVersion);
  return m;
}

// Throws ProtocolError naming `who` when the frame is not a Confirm of this version.
inline void check_confirm(const Message& m, const std::string& who) {
  if (m.type != MessageType::Handshake || !m.buffers.empty() || m.payload.size() != 4) {
    throw ProtocolError(who + " did not confirm the handshake (got a " + to_string(m.type) +
                        " frame of " + std::to_string(m.payload.size()) + " payload bytes)");
  }
  const auto version = detail::get_le<std::uint32_t>(m.payload.data());
  if (version != kProtocolVersion) {
    throw ProtocolError(who + " confirmed the handshake with protocol version " +
                        std::to_string(version) + " but this build speaks version " +
                        std::to_string(kProtocolVersion));
  }
}

// The acceptor, on the dialler's Hello: both sides have a secret, or neither does. The error
// names the peer, never the secret.
inline void check_auth_offer(const Hello& dialler, bool have_secret) {
  if (dialler.proof) {
    throw ProtocolError("authentication failed: " + hello_who(dialler) +
                        " sent a proof before it was challenged");
  }
  if (have_secret && !dialler.nonce) {
    throw ProtocolError("authentication failed: " + hello_who(dialler) +
                        " has no shared secret configured, and this worker requires one");
  }
  if (!have_secret && dialler.nonce) {
    throw ProtocolError("authentication failed: " + hello_who(dialler) +
                        " has a shared secret configured, and this worker has none");
  }
}

// The acceptor's Hello in reply to the dialler's: with a secret, a fresh nonce of its own and its
// proof over both nonces and both identities.
inline Hello make_acceptor_hello(Hello mine, const Hello& dialler,
                                 const std::optional<std::string>& secret) {
  mine.nonce.reset();
  mine.proof.reset();
  if (!secret) return mine;
  mine.nonce = auth::make_nonce();
  mine.proof = auth::compute_proof(*secret, auth::Prover::kAcceptor, *dialler.nonce, *mine.nonce,
                                   {dialler.worker_name, dialler.worker_id},
                                   {mine.worker_name, mine.worker_id});
  return mine;
}

// The dialler, on the acceptor's Hello (`mine`: the Hello it sent, its nonce included): checks the
// acceptor's proof and returns the dialler's own, to send back as an AuthAnswer (nullopt without a
// secret: the handshake is done).
inline std::optional<auth::Proof> answer_acceptor(const Hello& mine, const Hello& acceptor,
                                                  const std::optional<std::string>& secret) {
  if (!secret) {
    if (acceptor.nonce) {
      throw ProtocolError("authentication failed: " + hello_who(acceptor) +
                          " has a shared secret configured, and this worker has none");
    }
    return std::nullopt;
  }
  if (!acceptor.nonce || !acceptor.proof) {
    throw ProtocolError("authentication failed: " + hello_who(acceptor) +
                        " did not answer our challenge (it has no shared secret configured)");
  }
  const auth::Party dialler{mine.worker_name, mine.worker_id};
  const auth::Party answerer{acceptor.worker_name, acceptor.worker_id};
  const auth::Proof expected = auth::compute_proof(*secret, auth::Prover::kAcceptor, *mine.nonce,
                                                   *acceptor.nonce, dialler, answerer);
  if (!auth::same_proof(expected, *acceptor.proof)) {
    throw ProtocolError("authentication failed: " + hello_who(acceptor) +
                        " answered our challenge with a wrong proof (a different shared secret, "
                        "or a replayed answer)");
  }
  return auth::compute_proof(*secret, auth::Prover::kDialler, *mine.nonce, *acceptor.nonce, dialler,
                             answerer);
}

// The acceptor, on the dialler's AuthAnswer (`mine`: the Hello it replied with).
inline void verify_dialler_answer(const Hello& mine, const Hello& dialler,
                                  const auth::Proof& answer, const std::string& secret) {
  const auth::Proof expected = auth::compute_proof(
      secret, auth::Prover::kDialler, *dialler.nonce, *mine.nonce,
      {dialler.worker_name, dialler.worker_id}, {mine.worker_name, mine.worker_id});
  if (!auth::same_proof(expected, answer)) {
    throw ProtocolError("authentication failed: " + hello_who(dialler) +
                        " answered our challenge with a wrong proof (a different shared secret, "
                        "or a replayed answer)");
  }
}

}  // namespace distrpc::wire
