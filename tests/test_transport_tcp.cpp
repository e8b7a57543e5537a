// What only the TCP transport policy has: its address, and hostile input on raw sockets. What every
// policy must do (delivery, refusals, peer loss, limits, shutdown, hand-back, drive()) is tested
// once for all of them in test_transport_conformance.cpp.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <doctest/doctest.h>

#include "distrpc/transport/tcp.hpp"
#include "distrpc/wire/frame.hpp"
#include "distrpc/wire/handshake.hpp"
#include "multiprocess.hpp"
#include "support/transport_test_util.hpp"

namespace {

using namespace distrpc::testing::transport_names;
using distrpc::transport::Tcp;

using Node = distrpc::testing::NodeOf<Tcp>;

// ---- raw sockets, to play a broken or hostile peer ----------------------------------------------

int raw_connect(const std::string& address) {
  const auto hp = distrpc::transport::tcp::detail::split_host_port(address);
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(std::stoi(hp.port)));
  REQUIRE(::inet_pton(AF_INET, hp.host.c_str(), &a.sin_addr) == 1);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  timeval tv{5, 0};  // a read that would hang fails the test instead
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

void raw_write(int fd, const std::string& bytes) {
  REQUIRE(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) ==
          static_cast<ssize_t>(bytes.size()));
}

std::string frame_bytes(const Message& m) {
  std::string out = distrpc::wire::encode_frame_header(m);
  out += m.payload;
  return out;
}

std::string hello_frame(int id, const std::string& name, const std::string& token,
                        std::uint32_t version = distrpc::wire::kProtocolVersion) {
  distrpc::wire::Hello h;
  h.protocol_version = version;
  h.worker_name = name;
  h.worker_id = id;
  if (!token.empty()) h.auth_token = token;
  return frame_bytes(distrpc::wire::encode_hello(h));
}

// Reads the server's Hello reply; false if the connection ended or timed out first.
bool raw_read_hello(int fd, distrpc::wire::Hello& out) {
  std::string header(distrpc::wire::kFrameFixedBytes, '\0');
  std::size_t got = 0;
  while (got < header.size()) {
    const ssize_t r = ::recv(fd, header.data() + got, header.size() - got, 0);
    if (r <= 0) return false;
    got += static_cast<std::size_t>(r);
  }
  Message m = distrpc::wire::allocate_message(distrpc::wire::decode_frame_header(header));
  got = 0;
  while (got < m.payload.size()) {
    const ssize_t r = ::recv(fd, m.payload.data() + got, m.payload.size() - got, 0);
    if (r <= 0) return false;
    got += static_cast<std::size_t>(r);
  }
  out = distrpc::wire::decode_hello(m);
  return true;
}

// True when the other end closed the connection (EOF, or a reset when it closed with unread
// bytes): false when it stayed open for 5 s (SO_RCVTIMEO) or sent data instead.
bool closed_by_server(int fd) {
  char c;
  const ssize_t r = ::recv(fd, &c, 1, 0);
  if (r == 0) return true;
  return r < 0 && (errno == ECONNRESET || errno == EPIPE);
}

// The good peer still works both ways: proves one bad connection did not take the agent down.
void check_still_works(Node& a, Node& b, std::uint64_t id) {
  const std::size_t before_a = a.inbox.message_count();
  const std::size_t before_b = b.inbox.message_count();
  b.ctx->send(0, make_message(MessageType::Request, id, "still-alive"));
  a.ctx->send(1, make_message(MessageType::Response, id, "still-alive"));
  REQUIRE(a.inbox.wait_messages(before_a + 1));
  REQUIRE(b.inbox.wait_messages(before_b + 1));
  std::lock_guard<std::mutex> lk(a.inbox.mu);
  CHECK(a.inbox.messages.back().first == 1);
  CHECK(a.inbox.messages.back().second.id == id);
  CHECK(a.inbox.messages.back().second.payload == "still-alive");
}

}  // namespace

TEST_CASE("tcp: the policy satisfies the Transport concept") {
  static_assert(distrpc::transport::check_transport<Tcp>());
  CHECK(Tcp::name == "tcp");
  CHECK(Tcp::viable());
  CHECK(Tcp::domain_key() == "tcp");
  Node a(0);
  const std::string addr = a.ctx->address();
  CHECK(addr.rfind("127.0.0.1:", 0) == 0);
  CHECK(std::stoi(addr.substr(addr.find(':') + 1)) > 0);
}

TEST_CASE("tcp: hostile or broken connections are closed while a good peer keeps working") {
  const std::string token = "s3cret";
  Node a(options_for(0, token)), b(options_for(1, token));
  introduce(a, 0, b, 1);
  check_still_works(a, b, 1);
  const std::string addr = a.ctx->address();

  // A raw client that completes a valid handshake as worker 7, then misbehaves.
  const auto handshaken = [&] {
    const int fd = raw_connect(addr);
    raw_write(fd, hello_frame(7, "w7", token));
    distrpc::wire::Hello reply;
    REQUIRE(raw_read_hello(fd, reply));
    CHECK(reply.worker_id == 0);
    CHECK(reply.worker_name == "w0");
    return fd;
  };

  SUBCASE("garbage instead of a handshake") {
    const int fd = raw_connect(addr);
    raw_write(fd, "GET / HTTP/1.1\r\nHost: example\r\n\r\n");
    CHECK(closed_by_server(fd));
    ::close(fd);
    CHECK(a.inbox.lost_count() == 0);  // it never became a peer
  }
  SUBCASE("a handshake of another protocol version") {
    const int fd = raw_connect(addr);
    raw_write(fd, hello_frame(7, "w7", token, 999));
    CHECK(closed_by_server(fd));  // no Hello back: the connection just ends
    ::close(fd);
  }
  SUBCASE("a wrong auth token") {
    const int fd = raw_connect(addr);
    raw_write(fd, hello_frame(7, "w7", "guess"));
    CHECK(closed_by_server(fd));
    ::close(fd);
  }
  SUBCASE("no auth token") {
    const int fd = raw_connect(addr);
    raw_write(fd, hello_frame(7, "w7", ""));
    CHECK(closed_by_server(fd));
    ::close(fd);
  }
  SUBCASE("an identity that contradicts add_peer") {
    const int fd = raw_connect(addr);
    raw_write(fd, hello_frame(1, "impostor", token));  // worker 1 is 'w1'
    CHECK(closed_by_server(fd));
    ::close(fd);
  }
  SUBCASE("a negative worker id") {
    const int fd = raw_connect(addr);
    raw_write(fd, hello_frame(-4, "w-4", token));
    CHECK(closed_by_server(fd));
    ::close(fd);
  }
  SUBCASE("garbage after the handshake") {
    const int fd = handshaken();
    raw_write(fd, std::string(64, '\x5a'));
    CHECK(closed_by_server(fd));
    ::close(fd);
    REQUIRE(a.inbox.wait_lost(1, 2s));
    CHECK(a.inbox.lost[0].first == 7);
    CHECK(contains(a.inbox.lost[0].second, "magic"));
  }
  SUBCASE("a truncated frame, then close") {
    const int fd = handshaken();
    const std::string frame =
        frame_bytes(make_message(MessageType::Request, 5, std::string(1000, 'p')));
    raw_write(fd, frame.substr(0, 600));
    ::shutdown(fd, SHUT_WR);
    CHECK(closed_by_server(fd));
    ::close(fd);
    REQUIRE(a.inbox.wait_lost(1, 2s));
    CHECK(a.inbox.lost[0].first == 7);
    CHECK(contains(a.inbox.lost[0].second, "truncated"));
    CHECK(a.inbox.message_count() == 1);  // only the first still-alive message
  }
  SUBCASE("an absurd length") {
    const int fd = handshaken();
    std::string header =
        distrpc::wire::encode_frame_header(make_message(MessageType::Request, 5, ""));
    distrpc::wire::detail::put_le<std::uint64_t>(header.data() + 16, std::uint64_t{1} << 62);
    raw_write(fd, header);
    CHECK(closed_by_server(fd));
    ::close(fd);
    REQUIRE(a.inbox.wait_lost(1, 2s));
    CHECK(contains(a.inbox.lost[0].second, "exceeds limit"));
  }
  SUBCASE("an unknown message type") {
    const int fd = handshaken();
    std::string header =
        distrpc::wire::encode_frame_header(make_message(MessageType::Request, 5, ""));
    header[6] = static_cast<char>(200);
    raw_write(fd, header);
    CHECK(closed_by_server(fd));
    ::close(fd);
    REQUIRE(a.inbox.wait_lost(1, 2s));
    CHECK(contains(a.inbox.lost[0].second, "type 200"));
  }
  SUBCASE("a second handshake on an established connection") {
    const int fd = handshaken();
    raw_write(fd, hello_frame(7, "w7", token));
    CHECK(closed_by_server(fd));
    ::close(fd);
    REQUIRE(a.inbox.wait_lost(1, 2s));
    CHECK(contains(a.inbox.lost[0].second, "Handshake"));
  }
  SUBCASE("a valid frame from a raw peer is delivered") {
    // The positive control for the cases above: the raw client itself is not the problem.
    const int fd = handshaken();
    raw_write(fd, frame_bytes(make_message(MessageType::Request, 77, "raw but valid")));
    REQUIRE(a.inbox.wait_messages(2));
    {
      std::lock_guard<std::mutex> lk(a.inbox.mu);
      CHECK(a.inbox.messages[1].first == 7);
      CHECK(a.inbox.messages[1].second.payload == "raw but valid");
    }
    ::close(fd);
  }
  check_still_works(a, b, 2);
  // The bad peer is not the good one: worker 1 was never reported lost.
  std::lock_guard<std::mutex> lk(a.inbox.mu);
  for (auto& [peer, reason] : a.inbox.lost) CHECK(peer != 1);
}
