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
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <doctest/doctest.h>

#include "distrpc/transport/tcp.hpp"
#include "distrpc/wire/frame.hpp"
#include "distrpc/wire/handshake.hpp"
#include "multiprocess.hpp"
#include "support/scoped_env.hpp"
#include "support/tls_certs.hpp"
#include "support/transport_test_util.hpp"

namespace {

using namespace distrpc::testing::transport_names;
using distrpc::transport::Tcp;

using TcpNode = distrpc::testing::NodeOf<Tcp>;

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

// A listening socket on a free loopback port, to play a peer that others dial: (fd, address).
std::pair<int, std::string> raw_listen() {
  const int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(lfd >= 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(lfd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0);
  REQUIRE(::listen(lfd, 4) == 0);
  socklen_t len = sizeof sa;
  REQUIRE(::getsockname(lfd, reinterpret_cast<sockaddr*>(&sa), &len) == 0);
  return {lfd, "127.0.0.1:" + std::to_string(ntohs(sa.sin_port))};
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

// A dialler's Hello: with a challenge nonce when `nonce` is given (the dialler has a secret).
std::string hello_frame(int id, const std::string& name,
                        std::optional<distrpc::wire::auth::Nonce> nonce,
                        std::uint32_t version = distrpc::wire::kProtocolVersion) {
  distrpc::wire::Hello h;
  h.protocol_version = version;
  h.worker_name = name;
  h.worker_id = id;
  h.nonce = nonce;
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

// A raw acceptor's side of a dial, by hand: accepts on `lfd` (reads then time out after 5 s) and
// reads the dialler's Hello; -1 when no dial came. The caller answers (reply_as_w7) or not.
int raw_accept_hello(int lfd) {
  const int fd = ::accept(lfd, nullptr, nullptr);
  if (fd < 0) return -1;
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  distrpc::wire::Hello theirs;
  (void)raw_read_hello(fd, theirs);
  return fd;
}

// The acceptor's Hello of worker 7 ('w7', no secret), sent on `fd`.
void reply_as_w7(int fd) {
  distrpc::wire::Hello h;
  h.worker_id = 7;
  h.worker_name = "w7";
  const std::string reply = frame_bytes(distrpc::wire::encode_hello(h));
  (void)::send(fd, reply.data(), reply.size(), MSG_NOSIGNAL);
}

// The first two frames of an authenticated handshake, by hand, as worker `id` with `secret`:
// sends the Hello with `nonce`, reads the acceptor's, and returns the answer the dialler would send
// (computed with `secret`; not sent). The acceptor's Hello goes to `reply`.
distrpc::wire::auth::Proof raw_challenge(int fd, int id, const std::string& name,
                                         const std::string& secret,
                                         const distrpc::wire::auth::Nonce& nonce,
                                         distrpc::wire::Hello& reply) {
  namespace auth = distrpc::wire::auth;
  raw_write(fd, hello_frame(id, name, nonce));
  REQUIRE(raw_read_hello(fd, reply));
  REQUIRE(reply.nonce.has_value());
  REQUIRE(reply.proof.has_value());
  return auth::compute_proof(secret, auth::Prover::kDialler, nonce, *reply.nonce, {name, id},
                             {reply.worker_name, reply.worker_id});
}

// True when the other end closed the connection (EOF, or a reset when it closed with unread
// bytes): false when it stayed open for 5 s (SO_RCVTIMEO) or sent data instead.
bool closed_by_server(int fd) {
  char c;
  const ssize_t r = ::recv(fd, &c, 1, 0);
  if (r == 0) return true;
  return r < 0 && (errno == ECONNRESET || errno == EPIPE);
}

}  // namespace

TEST_CASE("tcp: the policy satisfies the Transport concept") {
  static_assert(distrpc::transport::check_transport<Tcp>());
  CHECK(Tcp::name == "tcp");
  CHECK(Tcp::viable());
  CHECK(Tcp::domain_key() == "tcp");
  TcpNode a(0);
  const std::string addr = a.ctx->address();
  CHECK(addr.rfind("127.0.0.1:", 0) == 0);
  CHECK(std::stoi(addr.substr(addr.find(':') + 1)) > 0);
}

TEST_CASE("tcp: hostile or broken connections are closed while a good peer keeps working") {
  const std::string token = "s3cret";
  TcpNode a(options_for(0, token)), b(options_for(1, token));
  introduce(a, 0, b, 1);
  check_still_works(a, b, 1);
  const std::string addr = a.ctx->address();

  LogLines log;
  const std::string wrong_proof =
      "bad handshake: authentication failed: worker 'w7' (id 7) answered our challenge with a "
      "wrong proof (a different shared secret, or a replayed answer)";
  // A raw client that completes a valid handshake as worker 7, then misbehaves.
  const auto nonce = distrpc::wire::auth::make_nonce();
  const auto handshaken = [&] {
    const int fd = raw_connect(addr);
    distrpc::wire::Hello reply;
    const auto answer = raw_challenge(fd, 7, "w7", token, nonce, reply);
    CHECK(reply.worker_id == 0);
    CHECK(reply.worker_name == "w0");
    raw_write(fd, frame_bytes(distrpc::wire::encode_auth_answer(answer)));
    return std::make_pair(fd, answer);
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
    raw_write(fd, hello_frame(7, "w7", nonce, 3));
    CHECK(closed_by_server(fd));  // no Hello back: the connection just ends
    ::close(fd);
    CHECK(contains(log.wait_for("protocol version"),
                   "bad handshake: peer speaks distrpc protocol version 3 but this build speaks "
                   "version 7"));
  }
  SUBCASE("a wrong secret") {
    const int fd = raw_connect(addr);
    distrpc::wire::Hello reply;
    const auto answer = raw_challenge(fd, 7, "w7", "guess", nonce, reply);
    raw_write(fd, frame_bytes(distrpc::wire::encode_auth_answer(answer)));
    CHECK(closed_by_server(fd));
    ::close(fd);
    CHECK(contains(log.wait_for("wrong proof"), wrong_proof));
  }
  SUBCASE("no secret") {
    const int fd = raw_connect(addr);
    raw_write(fd, hello_frame(7, "w7", std::nullopt));
    CHECK(closed_by_server(fd));
    ::close(fd);
    CHECK(contains(log.wait_for("w7"),
                   "bad handshake: authentication failed: worker 'w7' (id 7) has no shared secret "
                   "configured, and this worker requires one"));
  }
  SUBCASE("no answer after the challenge") {
    const int fd = raw_connect(addr);
    distrpc::wire::Hello reply;
    raw_challenge(fd, 7, "w7", token, nonce, reply);
    raw_write(fd, frame_bytes(make_message(MessageType::Request, 5, "skip the proof")));
    CHECK(closed_by_server(fd));
    ::close(fd);
    CHECK(contains(log.wait_for("w7"), "did not answer our challenge with a proof"));
    CHECK(a.inbox.message_count() == 1);  // nothing of it was delivered
  }
  SUBCASE("an answer replayed on a new connection") {
    // A first connection authenticates properly; its answer is recorded.
    const auto [first, recorded] = handshaken();
    raw_write(first, frame_bytes(make_message(MessageType::Request, 70, "first")));
    REQUIRE(a.inbox.wait_messages(2));
    // The same challenge on a second connection: a new nonce comes back, the old answer fails.
    const int fd = raw_connect(addr);
    distrpc::wire::Hello reply;
    const auto fresh = raw_challenge(fd, 7, "w7", token, nonce, reply);
    CHECK_FALSE(distrpc::wire::auth::same_proof(fresh, recorded));
    raw_write(fd, frame_bytes(distrpc::wire::encode_auth_answer(recorded)));
    raw_write(fd, frame_bytes(make_message(MessageType::Request, 71, "replayed")));
    CHECK(closed_by_server(fd));
    ::close(fd);
    ::close(first);
    CHECK(contains(log.wait_for("wrong proof"), wrong_proof));
    REQUIRE(a.inbox.wait_lost(1, 2s));  // the first connection's hang-up
    std::lock_guard<std::mutex> lk(a.inbox.mu);
    CHECK(a.inbox.messages.size() == 2);  // "replayed" never arrived
  }
  SUBCASE("an identity that contradicts add_peer") {
    const int fd = raw_connect(addr);
    raw_write(fd, hello_frame(1, "impostor", nonce));  // worker 1 is 'w1'
    CHECK(closed_by_server(fd));
    ::close(fd);
  }
  SUBCASE("a negative worker id") {
    const int fd = raw_connect(addr);
    raw_write(fd, hello_frame(-4, "w-4", nonce));
    CHECK(closed_by_server(fd));
    ::close(fd);
  }
  SUBCASE("garbage after the handshake") {
    const int fd = handshaken().first;
    raw_write(fd, std::string(64, '\x5a'));
    CHECK(closed_by_server(fd));
    ::close(fd);
    REQUIRE(a.inbox.wait_lost(1, 2s));
    CHECK(a.inbox.lost[0].first == 7);
    CHECK(contains(a.inbox.lost[0].second, "magic"));
  }
  SUBCASE("a truncated frame, then close") {
    const int fd = handshaken().first;
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
    const int fd = handshaken().first;
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
    const int fd = handshaken().first;
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
    const int fd = handshaken().first;
    raw_write(fd, hello_frame(7, "w7", nonce));
    CHECK(closed_by_server(fd));
    ::close(fd);
    REQUIRE(a.inbox.wait_lost(1, 2s));
    CHECK(contains(a.inbox.lost[0].second, "Handshake"));
  }
  SUBCASE("a valid frame from a raw peer is delivered") {
    // The positive control for the cases above: the raw client itself is not the problem.
    const int fd = handshaken().first;
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
  CHECK_FALSE(contains(log.all(), token));  // no diagnostic holds the secret
  // The bad peer is not the good one: worker 1 was never reported lost.
  std::lock_guard<std::mutex> lk(a.inbox.mu);
  for (auto& [peer, reason] : a.inbox.lost) CHECK(peer != 1);
}

TEST_CASE("tcp: without a secret, nothing is taken into use before the dialler's Confirm") {
  TcpNode a(0), b(1);
  introduce(a, 0, b, 1);
  check_still_works(a, b, 1);
  const std::string addr = a.ctx->address();
  LogLines log;
  // Worker 7's Hello and a's reply, by hand; what follows is up to the subcase.
  const auto hellos_exchanged = [&] {
    const int fd = raw_connect(addr);
    raw_write(fd, hello_frame(7, "w7", std::nullopt));
    distrpc::wire::Hello reply;
    REQUIRE(raw_read_hello(fd, reply));
    CHECK(reply.worker_id == 0);
    CHECK_FALSE(reply.nonce.has_value());
    return fd;
  };
  SUBCASE("a dialler that hangs up after the Hellos (it reached the wrong worker) is no loss") {
    ::close(hellos_exchanged());
    CHECK(contains(log.wait_for("during the handshake"),
                   ": the peer closed the connection during the handshake"));
    std::this_thread::sleep_for(200ms);  // time for a wrongly reported loss to arrive
    CHECK(a.inbox.lost_count() == 0);
  }
  SUBCASE("a message in place of the Confirm is refused, and never delivered") {
    const int fd = hellos_exchanged();
    raw_write(fd, frame_bytes(make_message(MessageType::Request, 5, "early")));
    CHECK(closed_by_server(fd));
    ::close(fd);
    CHECK(contains(log.wait_for("did not confirm"),
                   "bad handshake: worker 'w7' (id 7) did not confirm the handshake (got a "
                   "Request frame of 5 payload bytes)"));
    CHECK(a.inbox.message_count() == 1);  // only the first still-alive message
    CHECK(a.inbox.lost_count() == 0);
  }
  SUBCASE("after the Confirm, the raw peer's messages are delivered") {
    // The positive control: the same raw peer, confirming, becomes worker 7.
    const int fd = hellos_exchanged();
    raw_write(fd, frame_bytes(distrpc::wire::encode_confirm()) +
                      frame_bytes(make_message(MessageType::Request, 77, "confirmed")));
    REQUIRE(a.inbox.wait_messages(2));
    {
      std::lock_guard<std::mutex> lk(a.inbox.mu);
      CHECK(a.inbox.messages[1].first == 7);
      CHECK(a.inbox.messages[1].second.payload == "confirmed");
    }
    ::close(fd);
    REQUIRE(a.inbox.wait_lost(1, 2s));  // now it was a peer, so its hang-up is its loss
    CHECK(a.inbox.lost[0].first == 7);
  }
  check_still_works(a, b, 2);
  std::lock_guard<std::mutex> lk(a.inbox.mu);
  for (auto& [peer, reason] : a.inbox.lost) CHECK(peer != 1);
}

TEST_CASE("tcp: the secret never travels; an acceptor replaying a recorded proof is found out") {
  namespace auth = distrpc::wire::auth;
  const std::string token = "correct horse battery staple";
  // A genuine worker 0 answers one raw challenge: its reply (nonce and proof) is recorded.
  TcpNode a(options_for(0, token));
  distrpc::wire::Hello recorded;
  {
    const int fd = raw_connect(a.ctx->address());
    raw_challenge(fd, 1, "w1", token, auth::make_nonce(), recorded);
    ::close(fd);
  }
  // A raw socket posing as worker 0: it records every byte worker 1 sends and plays it the
  // recorded reply, which was made for another nonce.
  const auto listener = raw_listen();  // lambdas below capture lfd: no structured binding
  const int lfd = listener.first;
  const std::string fake_addr = listener.second;
  std::string received;
  std::thread fake([&] {
    const int fd = ::accept(lfd, nullptr, nullptr);
    if (fd < 0) return;
    timeval tv{5, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char buf[4096];
    // The dialler's Hello: a frame header and its payload.
    std::size_t want = distrpc::wire::kFrameFixedBytes;
    while (received.size() < want) {
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) break;
      received.append(buf, static_cast<std::size_t>(n));
      if (want == distrpc::wire::kFrameFixedBytes && received.size() >= want) {
        want += distrpc::wire::decode_frame_header(received.substr(0, want)).payload_bytes;
      }
    }
    const std::string reply = frame_bytes(distrpc::wire::encode_hello(recorded));
    (void)::send(fd, reply.data(), reply.size(), MSG_NOSIGNAL);
    for (;;) {  // whatever else comes, until the dialler hangs up
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) break;
      received.append(buf, static_cast<std::size_t>(n));
    }
    ::close(fd);
  });
  std::string text;
  {
    TcpNode b(options_for(1, token));
    b.ctx->add_peer(0, "w0", fake_addr);
    try {
      b.ctx->send(0, make_message(MessageType::Request, 1, "for w0"));
    } catch (const DistNetworkError& e) {
      text = e.what();
    }
  }
  fake.join();
  ::close(lfd);
  CHECK(text == "distrpc tcp: handshake with worker 0 ('w0') at " + fake_addr +
                    " failed: authentication failed: worker 'w0' (id 0) answered our challenge "
                    "with a wrong proof (a different shared secret, or a replayed answer)");
  // Worker 1 sent its Hello (its nonce) and nothing more: no answer to a failed acceptor, and
  // the secret is nowhere in what it sent.
  REQUIRE(received.size() > distrpc::wire::kFrameFixedBytes);
  const auto header =
      distrpc::wire::decode_frame_header(received.substr(0, distrpc::wire::kFrameFixedBytes));
  CHECK(received.size() == distrpc::wire::kFrameFixedBytes + header.payload_bytes);
  CHECK(received.find(token) == std::string::npos);
  CHECK_FALSE(contains(text, token));
}

// ---- TLS (docs/security.md, "TLS") -------------------------------------------------------------

namespace {

distrpc::transport::TransportOptions tls_node(int id, const distrpc::TlsOptions& tls,
                                              const std::string& token = "",
                                              std::chrono::milliseconds connect_timeout = 5s) {
  auto o = options_for(id, token, connect_timeout);
  o.tls = tls;
  return o;
}

// What `send` throws (DistNetworkError), or "<no exception>".
std::string send_error(TcpNode& from, int to) {
  try {
    from.ctx->send(to, make_message(MessageType::Request, 1, "hello"));
  } catch (const distrpc::DistNetworkError& e) {
    return e.what();
  }
  return "<no exception>";
}

}  // namespace

TEST_CASE("tcp TLS: small and 64 MiB messages cross mutual TLS both ways, with a secret inside") {
  const auto& certs = distrpc::testing::tls_files();
  const std::string token = "correct horse battery staple";
  TcpNode a(tls_node(0, certs.server, token));
  TcpNode b(tls_node(1, certs.client, token));
  introduce(a, 0, b, 1);
  // b dials a (its Request), a dials b (the echo): both directions run their own TLS connection.
  b.ctx->send(0, make_message(MessageType::Request, 1, "small"));
  const at::Tensor big = pattern_bytes(64 << 20, 7);
  const at::Tensor tail = pattern_bytes(1000, 8);
  b.ctx->send(0, make_message(MessageType::Request, 2, "big", {big, tail}));
  REQUIRE(a.inbox.wait_messages(2, 60s));
  Message small = a.inbox.take(0);
  CHECK(small.id == 1);
  CHECK(small.payload == "small");
  Message got = a.inbox.take(1);
  CHECK(got.id == 2);
  CHECK(got.payload == "big");
  REQUIRE(got.buffers.size() == 2);
  CHECK(same_bytes(got.buffers[0], big));
  CHECK(same_bytes(got.buffers[1], tail));
  a.ctx->send(1, make_message(MessageType::Response, 2, "echo", {got.buffers[0]}));
  a.ctx->send(1, make_message(MessageType::Response, 1, "echo-small"));
  REQUIRE(b.inbox.wait_messages(2, 60s));
  Message echo = b.inbox.take(0);
  CHECK(echo.payload == "echo");
  REQUIRE(echo.buffers.size() == 1);
  CHECK(same_bytes(echo.buffers[0], big));
  CHECK(b.inbox.take(1).payload == "echo-small");
  CHECK(a.inbox.lost_count() == 0);
  CHECK(b.inbox.lost_count() == 0);
}

TEST_CASE("tcp TLS: a peer whose certificate another CA signed is refused, with OpenSSL's reason") {
  const auto& certs = distrpc::testing::tls_files();
  SUBCASE("a rogue dialler: the acceptor refuses it, the dialler hears why") {
    LogLines log;
    TcpNode a(tls_node(0, certs.server));
    TcpNode rogue(tls_node(1, certs.rogue));
    introduce(a, 0, rogue, 1);
    CHECK(send_error(rogue, 0) == "distrpc tcp: TLS handshake with worker 0 ('w0') at " +
                                      a.ctx->address() + " failed: tlsv1 alert unknown ca");
    const std::string line = log.wait_for("TLS handshake failed");
    CHECK(contains(line, "tcp: dropping connection from 127.0.0.1:"));
    CHECK(contains(line, "TLS handshake failed: certificate verify failed"));
    CHECK(a.inbox.message_count() == 0);
    // The acceptor goes on serving a good peer.
    TcpNode b(tls_node(2, certs.client));
    a.ctx->add_peer(2, "w2", b.ctx->address());
    b.ctx->add_peer(0, "w0", a.ctx->address());
    b.ctx->send(0, make_message(MessageType::Request, 9, "good"));
    REQUIRE(a.inbox.wait_messages(1));
    CHECK(a.inbox.take(0).payload == "good");
  }
  SUBCASE("a rogue acceptor: the dialler refuses its certificate") {
    TcpNode rogue(tls_node(0, certs.rogue));
    TcpNode b(tls_node(1, certs.client));
    introduce(rogue, 0, b, 1);
    CHECK(send_error(b, 0) == "distrpc tcp: TLS handshake with worker 0 ('w0') at " +
                                  rogue.ctx->address() +
                                  " failed: certificate verify failed (self-signed "
                                  "certificate in certificate chain)");
    CHECK(rogue.inbox.message_count() == 0);
  }
}

TEST_CASE("tcp TLS: TLS on one side only fails cleanly, well within the connect timeout") {
  const auto& certs = distrpc::testing::tls_files();
  SUBCASE("a plain dialler, a TLS acceptor") {
    LogLines log;
    TcpNode a(tls_node(0, certs.server, "", 10s));
    TcpNode plain(options_for(1, "", 10s));
    introduce(a, 0, plain, 1);
    const auto t0 = std::chrono::steady_clock::now();
    const std::string text = send_error(plain, 0);
    CHECK(std::chrono::steady_clock::now() - t0 < 3s);
    CHECK(text == "distrpc tcp: handshake with worker 0 ('w0') at " + a.ctx->address() +
                      " failed: reading its Hello: the peer closed the connection (it refused our "
                      "handshake: see its log; a shared secret on one side only, TLS on one side "
                      "only, a protocol version or a worker identity are the usual reasons)");
    CHECK(contains(log.wait_for("TLS handshake failed"), "dropping connection from 127.0.0.1:"));
  }
  SUBCASE("a TLS dialler, a plain acceptor") {
    LogLines log;
    TcpNode plain(options_for(0, "", 10s));
    TcpNode b(tls_node(1, certs.client, "", 10s));
    introduce(plain, 0, b, 1);
    const auto t0 = std::chrono::steady_clock::now();
    const std::string text = send_error(b, 0);
    CHECK(std::chrono::steady_clock::now() - t0 < 3s);
    CHECK(text == "distrpc tcp: TLS handshake with worker 0 ('w0') at " + plain.ctx->address() +
                      " failed: the peer closed the connection during the TLS handshake (does it "
                      "have TLS configured?)");
    CHECK(contains(log.wait_for("the peer speaks TLS"),
                   "the peer speaks TLS, and this worker has no TLS configured"));
  }
}

TEST_CASE("tcp TLS: missing or unreadable files are named when the Context is made") {
  const auto& certs = distrpc::testing::tls_files();
  distrpc::TlsOptions bad = certs.client;
  bad.cert_file = certs.dir + "/no-such-cert.pem";
  const auto make = [&](const distrpc::TlsOptions& t) {
    try {
      TcpNode n(tls_node(0, t));
    } catch (const distrpc::DistError& e) {
      return std::string(e.what());
    }
    return std::string("<no exception>");
  };
  CHECK(make(bad) ==
        "TLS: cannot read the certificate file '" + bad.cert_file + "': No such file or directory");
  bad = certs.client;
  bad.ca_file = certs.client.key_file;  // readable, but no certificate in it
  CHECK(contains(make(bad),
                 "TLS: the CA file '" + bad.ca_file + "' holds no usable PEM certificate"));
}

// ---- polling after activity (DISTRPC_TCP_SPIN_US) -------------------------------------------------

// A reading thread polls for a while after each message; idle, it must sleep in the kernel.
TEST_CASE("tcp: an idle connected pair uses almost no CPU, and wakes up again") {
  TcpNode a(0), b(1);
  introduce(a, 0, b, 1);
  exchange_a_while(a, b);
  // Well past the reading threads' polling after activity.
  const double pct = distrpc::testing::cpu_percent_in_a_second(300ms);
  MESSAGE("idle CPU of a connected pair (two contexts, this whole process): " << pct
                                                                              << " % of one core");
  CHECK(pct < 10.0);
  check_still_works(a, b, 7);
}

TEST_CASE("tcp: DISTRPC_TCP_SPIN_US sets the polling after activity; a bad value is named") {
  using distrpc::testing::ScopedEnv;
  SUBCASE("0: never poll, and messages still flow both ways") {
    ScopedEnv spin("DISTRPC_TCP_SPIN_US", "0");
    TcpNode a(0), b(1);
    introduce(a, 0, b, 1);
    for (int i = 0; i < 50; ++i) {
      a.ctx->send(1, make_message(MessageType::Request, i, "ping"));
      REQUIRE(b.inbox.wait_messages(i + 1));
      b.ctx->send(0, make_message(MessageType::Response, i, "pong"));
      REQUIRE(a.inbox.wait_messages(i + 1));
    }
    CHECK(a.inbox.take(49).payload == "pong");
    // Nothing polls after the last message: the process is idle at once.
    const double pct = distrpc::testing::cpu_percent_in_a_second(0ms);
    MESSAGE("CPU in the second after the last message, polling off: " << pct << " % of one core");
    CHECK(pct < 5.0);
    check_still_works(a, b, 8);
  }
  SUBCASE("a long polling time: the reading thread polls for it after a message, then sleeps") {
    ScopedEnv spin("DISTRPC_TCP_SPIN_US", "1000000");  // 1 s
    TcpNode a(0), b(1);
    introduce(a, 0, b, 1);
    a.ctx->send(1, make_message(MessageType::Request, 1, "once"));
    REQUIRE(b.inbox.wait_messages(1));
    // A thread that polls without sleeping is on a core for much of that second, however
    // loaded the machine (it yields, but stays runnable); one that sleeps uses none of it.
    const double polling = distrpc::testing::cpu_percent_in_a_second(0ms);
    const double after = distrpc::testing::cpu_percent_in_a_second(300ms);
    MESSAGE("CPU while polling: " << polling << " %, after: " << after << " % of one core");
    CHECK(polling > 10.0);
    CHECK(after < 10.0);
    check_still_works(a, b, 9);
  }
  for (const char* bad : {"abc", "-1", "1000001", "12us", " 5", "+5"}) {
    CAPTURE(bad);
    ScopedEnv spin("DISTRPC_TCP_SPIN_US", bad);
    const std::string text = distrpc::testing::thrown_exactly<std::invalid_argument>(
        [] { TcpNode n(0); });
    CHECK(text == std::string("DISTRPC_TCP_SPIN_US='") + bad +
                      "' is not a number of microseconds in 0..1000000");
  }
}

// The received-buffer cache's limit is read when the transport starts: a bad one fails there,
// naming it, instead of a reading thread at the first large message.
TEST_CASE("tcp: a DISTRPC_RECV_CACHE_MB that is not a number of MiB fails the start, named") {
  using distrpc::testing::ScopedEnv;
  for (const char* bad : {"lots", "-1", "1048577", "64MB", " 8", "18446744073709551616"}) {
    CAPTURE(bad);
    ScopedEnv cache("DISTRPC_RECV_CACHE_MB", bad);
    const std::string text =
        distrpc::testing::thrown_exactly<std::invalid_argument>([] { TcpNode n(0); });
    CHECK(text ==
          std::string("DISTRPC_RECV_CACHE_MB='") + bad + "' is not a number of MiB in 0..1048576");
  }
  for (const char* good : {"0", "1048576", ""}) {
    CAPTURE(good);
    ScopedEnv cache("DISTRPC_RECV_CACHE_MB", good);
    TcpNode a(0), b(1);
    introduce(a, 0, b, 1);
    check_still_works(a, b, 11);
  }
  ScopedEnv unset(ScopedEnv::unset, {"DISTRPC_RECV_CACHE_MB"});
  CHECK(distrpc::wire::RecvStorage::limit_from_env() == std::size_t{128} << 20);
}

TEST_CASE("tcp: a dial under way when add_peer() moves the worker reaches the new address") {
  // The old incarnation of worker 7, played by hand: it answers the dial only once the test has
  // registered worker 7 at its replacement's address, then records what else it is sent.
  const auto listener = raw_listen();  // lambdas below capture lfd: no structured binding
  const int lfd = listener.first;
  std::promise<void> dialled, moved;
  std::future<void> moved_done = moved.get_future();
  std::string after_hello;
  std::thread old_incarnation([&] {
    const int fd = raw_accept_hello(lfd);
    if (fd < 0) return;
    dialled.set_value();
    moved_done.wait();
    reply_as_w7(fd);
    char buf[4096];
    for (;;) {
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) break;
      after_hello.append(buf, static_cast<std::size_t>(n));
    }
    ::close(fd);
  });
  TcpNode a(0), replacement(7);
  a.ctx->add_peer(7, "w7", listener.second);
  distrpc::testing::check_send_follows_move(a, replacement, dialled.get_future(), moved);
  ::shutdown(lfd, SHUT_RDWR);  // ends an accept() still waiting, should the dial never have come
  old_incarnation.join();
  ::close(lfd);
  // Nothing after its Hello: the dialler saw the move and hung up before confirming, so the old
  // incarnation never took the connection into use.
  CHECK(after_hello.empty());
}

// A peer whose host vanished: our send to it is blocked (nothing reads or acknowledges our bytes,
// and TCP would retry for many minutes) when its other connection is found broken. The loss
// reported there also ends the blocked send, with the reason. The vanished peer is a raw socket
// that completes the handshake of our connection to it and then never reads.
TEST_CASE("tcp: a peer reported lost also fails a send blocked on our connection to it") {
  const auto listener = raw_listen();  // lambdas below capture lfd: no structured binding
  const int lfd = listener.first;
  const std::string fake_addr = listener.second;
  std::atomic<int> accepted{-1};
  std::thread fake([&] {
    // The dialler's Hello, then ours; nothing is read after.
    const int fd = raw_accept_hello(lfd);
    if (fd < 0) return;
    reply_as_w7(fd);
    accepted = fd;
  });
  TcpNode a(0);
  a.ctx->add_peer(7, "w7", fake_addr);
  std::promise<std::string> failed;
  std::atomic<int> sent{0};
  std::thread sender([&] {
    const at::Tensor big = at::zeros({8 << 20}, at::kByte);
    try {
      for (;;) {
        a.ctx->send(7, make_message(MessageType::Request, 1, "big", {big}));
        ++sent;
      }
    } catch (const DistNetworkError& e) {
      failed.set_value(e.what());
    }
  });
  // The sender fills the socket buffers and blocks (the first 8 MiB may still fit in them).
  std::future<std::string> outcome = failed.get_future();
  CHECK(outcome.wait_for(1500ms) == std::future_status::timeout);
  CHECK(sent.load() <= 1);
  // Worker 7's connection to us: handshaken, then broken.
  const int in = raw_connect(a.ctx->address());
  raw_write(in, hello_frame(7, "w7", std::nullopt));
  distrpc::wire::Hello reply;
  REQUIRE(raw_read_hello(in, reply));
  raw_write(in, frame_bytes(distrpc::wire::encode_confirm()));
  ::close(in);
  REQUIRE(a.inbox.wait_lost(1, 5s));
  const bool ended = outcome.wait_for(3s) == std::future_status::ready;
  CHECK(ended);
  if (accepted.load() >= 0) ::close(accepted.load());  // lets the sender go if it is still stuck
  sender.join();
  fake.join();
  ::close(lfd);
  if (ended) {
    const std::string text = outcome.get();
    CHECK(contains(text, "to worker 7 ('w7')"));
    CHECK(contains(text, "worker 7 was lost: connection closed by peer"));
  }
}
