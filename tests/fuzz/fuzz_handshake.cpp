// libFuzzer target: the handshake (wire/handshake.hpp, wire/auth.hpp) as a peer's packets reach
// it: the Shm transport's packet parsers (a frame header and its payload: parse_hello_packet,
// parse_auth_answer_packet), and the Tcp transport's path (frames, then decode_hello /
// decode_auth_answer / check_confirm), then the authentication decisions both sides take on a
// decoded Hello.
// Only wire::ProtocolError may come out.
#include "common.hpp"

#include <distrpc/transport/shm/detail/protocol.hpp>
#include <distrpc/wire/handshake.hpp>

#include <optional>
#include <string>

namespace {

using namespace distrpc;

const std::optional<std::string> kSecret = std::string("fuzzing secret");

// What each side does with a peer's Hello, with and without a secret.
void judge(const wire::Hello& peer) {
  for (bool have_secret : {false, true}) {
    try {
      wire::check_auth_offer(peer, have_secret);
    } catch (const wire::ProtocolError&) {
    }
  }
  wire::Hello mine;
  mine.worker_name = "fuzzer";
  mine.worker_id = 0;
  mine.nonce.emplace();
  mine.nonce->fill(7);
  for (const auto& secret : {std::optional<std::string>(), kSecret}) {
    try {
      const auto answer = wire::answer_acceptor(mine, peer, secret);
      // Only a proof over our nonce with the secret gets here: a fuzzer cannot forge one.
      if (secret && answer) __builtin_trap();
    } catch (const wire::ProtocolError&) {
    }
  }
  if (peer.nonce && !peer.proof) {
    // The acceptor's reply to this dialler, then its check of an answer.
    const wire::Hello reply = wire::make_acceptor_hello(mine, peer, kSecret);
    try {
      wire::verify_dialler_answer(reply, peer, wire::auth::Proof{}, *kSecret);
    } catch (const wire::ProtocolError&) {
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string packet(reinterpret_cast<const char*>(data), size);
  try {
    judge(transport::shm::detail::parse_hello_packet(packet));
  } catch (const wire::ProtocolError&) {
  }
  try {
    (void)transport::shm::detail::parse_auth_answer_packet(packet, "the fuzzer");
  } catch (const wire::ProtocolError&) {
  }
  try {
    fuzz::for_each_frame(data, size, [](const wire::Message& m) {
      try {
        judge(wire::decode_hello(m));
      } catch (const wire::ProtocolError&) {
      }
      try {
        (void)wire::decode_auth_answer(m, "the fuzzer");
      } catch (const wire::ProtocolError&) {
      }
      try {
        wire::check_confirm(m, "the fuzzer");
      } catch (const wire::ProtocolError&) {
      }
    });
  } catch (const wire::ProtocolError&) {
  }
  return 0;
}
