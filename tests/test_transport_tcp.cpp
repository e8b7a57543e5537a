// The TCP transport policy: delivery (values, exact bytes, order, concurrency, large buffers),
// connection failures, hostile input on raw sockets, peer loss and shutdown.
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

using distrpc::DistNetworkError;
using distrpc::transport::Tcp;
using distrpc::transport::TransportCallbacks;
using distrpc::transport::TransportOptions;
using distrpc::wire::Message;
using distrpc::wire::MessageType;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

using distrpc::testing::bytes_of;
using distrpc::testing::contains;
using distrpc::testing::Inbox;
using distrpc::testing::introduce;
using distrpc::testing::make_message;
using distrpc::testing::options_for;
using distrpc::testing::pattern_bytes;
using distrpc::testing::same_bytes;
using Node = distrpc::testing::NodeOf<Tcp>;

// ---- raw sockets, to play a broken or hostile peer ----------------------------------------------

int raw_connect(const std::string& address) {
  const auto hp = distrpc::transport::tcp_detail::split_host_port(address);
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

int free_port() {
  return distrpc::testing::free_loopback_port();
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

TEST_CASE("tcp: two contexts exchange messages with tensors both ways") {
  Node a(0), b(1);
  introduce(a, 0, b, 1);

  const at::Tensor floats = at::arange(0, 1000, at::kFloat) * 0.5;
  const at::Tensor raw = pattern_bytes(4097, 7);
  a.ctx->send(1, make_message(MessageType::Request, 42, "hello from w0",
                              {bytes_of(floats), bytes_of(raw)}));
  const at::Tensor ints = at::arange(-50, 50, at::kLong);
  b.ctx->send(0, make_message(MessageType::Response, 43, std::string("\0bin\xff", 5),
                              {bytes_of(ints), at::empty({0}, at::kByte)}));

  REQUIRE(b.inbox.wait_messages(1));
  REQUIRE(a.inbox.wait_messages(1));
  {
    auto& [peer, m] = b.inbox.messages[0];
    CHECK(peer == 0);
    CHECK(m.type == MessageType::Request);
    CHECK(m.id == 42);
    CHECK(m.payload == "hello from w0");
    REQUIRE(m.buffers.size() == 2);
    CHECK((m.buffers[0].scalar_type() == at::kByte));
    CHECK(m.buffers[0].dim() == 1);
    CHECK(m.buffers[0].numel() == 4000);
    const at::Tensor back = at::from_blob(m.buffers[0].data_ptr(), {1000}, at::kFloat);
    CHECK(at::equal(back, floats));
    CHECK(same_bytes(m.buffers[1], raw));
  }
  {
    auto& [peer, m] = a.inbox.messages[0];
    CHECK(peer == 1);
    CHECK(m.type == MessageType::Response);
    CHECK(m.id == 43);
    CHECK(m.payload == std::string("\0bin\xff", 5));
    REQUIRE(m.buffers.size() == 2);
    const at::Tensor back = at::from_blob(m.buffers[0].data_ptr(), {100}, at::kLong);
    CHECK(at::equal(back, ints));
    CHECK(m.buffers[1].numel() == 0);
  }
  CHECK(a.inbox.lost_count() == 0);
  CHECK(b.inbox.lost_count() == 0);
}

TEST_CASE("tcp: 1000 messages arrive in order with exact bytes") {
  Node a(0), b(1);
  introduce(a, 0, b, 1);
  constexpr int kCount = 1000;
  // Every 10th message carries buffers, some large enough to be read straight into the tensor.
  std::vector<std::vector<at::Tensor>> sent(kCount);
  for (int i = 0; i < kCount; ++i) {
    if (i % 10 == 0) {
      sent[i] = {pattern_bytes(i % 30 == 0 ? 200 * 1024 : 100 + i, static_cast<std::uint32_t>(i)),
                 pattern_bytes(i, static_cast<std::uint32_t>(i + 1))};
    }
    a.ctx->send(1, make_message(MessageType::Request, static_cast<std::uint64_t>(i),
                                "m" + std::to_string(i), sent[i]));
  }
  REQUIRE(b.inbox.wait_messages(kCount, 30s));
  std::lock_guard<std::mutex> lk(b.inbox.mu);
  REQUIRE(b.inbox.messages.size() == kCount);
  int mismatches = 0;
  for (int i = 0; i < kCount; ++i) {
    const Message& m = b.inbox.messages[static_cast<std::size_t>(i)].second;
    bool ok = m.id == static_cast<std::uint64_t>(i) && m.payload == "m" + std::to_string(i) &&
              m.buffers.size() == sent[i].size();
    for (std::size_t k = 0; ok && k < sent[i].size(); ++k)
      ok = same_bytes(m.buffers[k], sent[i][k]);
    if (!ok) ++mismatches;
  }
  CHECK(mismatches == 0);
}

TEST_CASE("tcp: 4 threads sending to one peer deliver every message exactly once, in order") {
  Node a(0), b(1);
  introduce(a, 0, b, 1);
  constexpr int kThreads = 4, kPerThread = 500;
  std::vector<std::thread> threads;
  std::atomic<int> errors{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      try {
        for (int i = 0; i < kPerThread; ++i) {
          std::vector<at::Tensor> bufs;
          if (i % 7 == 0) bufs.push_back(pattern_bytes(64 * 1024, static_cast<std::uint32_t>(t)));
          a.ctx->send(
              1, make_message(MessageType::Request, static_cast<std::uint64_t>(t) * 1000000 + i,
                              "t" + std::to_string(t), std::move(bufs)));
        }
      } catch (const std::exception&) {
        ++errors;
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(errors == 0);
  REQUIRE(b.inbox.wait_messages(kThreads * kPerThread, 30s));
  std::this_thread::sleep_for(100ms);  // a duplicate would show up as an extra message
  std::lock_guard<std::mutex> lk(b.inbox.mu);
  CHECK(b.inbox.messages.size() == kThreads * kPerThread);
  std::set<std::uint64_t> seen;
  std::map<std::uint64_t, std::int64_t> last_per_thread;
  int out_of_order = 0, corrupt = 0;
  const at::Tensor expect[kThreads] = {pattern_bytes(64 * 1024, 0), pattern_bytes(64 * 1024, 1),
                                       pattern_bytes(64 * 1024, 2), pattern_bytes(64 * 1024, 3)};
  for (auto& [peer, m] : b.inbox.messages) {
    seen.insert(m.id);
    const std::uint64_t t = m.id / 1000000;
    const auto i = static_cast<std::int64_t>(m.id % 1000000);
    auto it = last_per_thread.find(t);
    if (it != last_per_thread.end() && it->second >= i) ++out_of_order;
    last_per_thread[t] = i;
    if (m.payload != "t" + std::to_string(t)) ++corrupt;
    if (i % 7 == 0 && (m.buffers.size() != 1 || !same_bytes(m.buffers[0], expect[t]))) ++corrupt;
  }
  CHECK(seen.size() == kThreads * kPerThread);
  CHECK(out_of_order == 0);
  CHECK(corrupt == 0);
}

TEST_CASE("tcp: a 64 MiB buffer makes a round trip intact") {
  Node a(0), b(1);
  introduce(a, 0, b, 1);
  const at::Tensor big = pattern_bytes(64 << 20, 99);
  const auto t0 = Clock::now();
  a.ctx->send(1, make_message(MessageType::Request, 1, "big", {big}));
  REQUIRE(b.inbox.wait_messages(1, 30s));
  Message got;
  {
    std::lock_guard<std::mutex> lk(b.inbox.mu);
    got = std::move(b.inbox.messages[0].second);
  }
  REQUIRE(got.buffers.size() == 1);
  CHECK(got.buffers[0].numel() == (64 << 20));
  b.ctx->send(0, make_message(MessageType::Response, 1, "big back", {got.buffers[0]}));
  REQUIRE(a.inbox.wait_messages(1, 30s));
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  std::lock_guard<std::mutex> lk(a.inbox.mu);
  const Message& back = a.inbox.messages[0].second;
  CHECK(back.payload == "big back");
  REQUIRE(back.buffers.size() == 1);
  CHECK(same_bytes(back.buffers[0], big));
  MESSAGE("64 MiB round trip: " << seconds * 1000 << " ms");
}

DISTRPC_MP_TEST("tcp: two processes echo messages with tensors", 2, 90) {
  Inbox inbox;
  std::unique_ptr<Tcp::Context> ctx_ptr;
  TransportCallbacks cb = inbox.callbacks();
  if (ctx.rank == 1) {
    // Echo from the I/O thread itself: a send made inside a callback, connecting on first use.
    cb.on_message = [&ctx_ptr, &inbox](int peer, Message&& m) {
      Message echo = make_message(MessageType::Response, m.id, "echo:" + m.payload, m.buffers);
      ctx_ptr->send(peer, std::move(echo));
      std::lock_guard<std::mutex> lk(inbox.mu);
      inbox.messages.emplace_back(peer, std::move(m));
      inbox.cv.notify_all();
    };
  }
  ctx_ptr = std::make_unique<Tcp::Context>(options_for(ctx.rank, "", 20s), std::move(cb));
  ctx.publish("addr" + std::to_string(ctx.rank), ctx_ptr->address());
  const int other = 1 - ctx.rank;
  ctx_ptr->add_peer(other, "w" + std::to_string(other), ctx.lookup("addr" + std::to_string(other)));
  // Rank 1 answers on its own connection, which needs the address add_peer() gives: rank 0 waits
  // for it, as the agent holds early requests until its worker table is read.
  ctx.publish("added" + std::to_string(ctx.rank), "1");
  ctx.lookup("added" + std::to_string(other));
  constexpr int kCount = 200;
  if (ctx.rank == 0) {
    for (int i = 0; i < kCount; ++i) {
      ctx_ptr->send(
          1, make_message(MessageType::Request, static_cast<std::uint64_t>(i), std::to_string(i),
                          {pattern_bytes(1 + i * 97, static_cast<std::uint32_t>(i))}));
    }
    REQUIRE(inbox.wait_messages(kCount, 30s));
    std::lock_guard<std::mutex> lk(inbox.mu);
    int bad = 0;
    for (int i = 0; i < kCount; ++i) {
      const auto& [peer, m] = inbox.messages[static_cast<std::size_t>(i)];
      if (peer != 1 || m.type != MessageType::Response || m.id != static_cast<std::uint64_t>(i) ||
          m.payload != "echo:" + std::to_string(i) || m.buffers.size() != 1 ||
          !same_bytes(m.buffers[0], pattern_bytes(1 + i * 97, static_cast<std::uint32_t>(i)))) {
        ++bad;
      }
    }
    CHECK(bad == 0);
    ctx.publish("done", "1");
  } else {
    REQUIRE(inbox.wait_messages(kCount, 30s));
    ctx.lookup("done");
  }
  ctx_ptr->shutdown();
}

TEST_CASE("tcp: connecting where nothing listens fails within connect_timeout, naming the peer") {
  Node a(options_for(0, "", 600ms));
  const std::string ghost = "127.0.0.1:" + std::to_string(free_port());
  a.ctx->add_peer(3, "ghost", ghost);
  const auto t0 = Clock::now();
  std::string text;
  try {
    a.ctx->send(3, make_message(MessageType::Request, 1, "anyone?"));
  } catch (const DistNetworkError& e) {
    text = e.what();
  }
  const auto took = Clock::now() - t0;
  CHECK(contains(text, "worker 3"));
  CHECK(contains(text, "ghost"));
  CHECK(contains(text, ghost));
  CHECK(contains(text, "600 ms"));
  CHECK(took >= 500ms);  // it retried until the deadline...
  CHECK(took < 1600ms);  // ...and not much longer
  // A second sender gives up within the timeout again instead of waiting forever.
  const auto t1 = Clock::now();
  CHECK_THROWS_AS(a.ctx->send(3, make_message(MessageType::Request, 2, "again?")),
                  DistNetworkError);
  CHECK(Clock::now() - t1 < 1600ms);
}

TEST_CASE("tcp: an unknown peer and a peer answering with another identity are refused") {
  Node a(0), b(1);
  CHECK_THROWS_WITH_AS(a.ctx->send(5, make_message(MessageType::Request, 1, "x")),
                       doctest::Contains("worker 5"), DistNetworkError);
  // Worker 2's address points at worker 1: the handshake reply exposes the mistake.
  a.ctx->add_peer(2, "w2", b.ctx->address());
  std::string text;
  try {
    a.ctx->send(2, make_message(MessageType::Request, 1, "x"));
  } catch (const DistNetworkError& e) {
    text = e.what();
  }
  CHECK(contains(text, "worker 2 ('w2')"));
  CHECK(contains(text, "reached worker 1 ('w1')"));
  CHECK(b.inbox.message_count() == 0);
}

// The transport contract: send() needs add_peer() first, even to a peer that reached us.
TEST_CASE("tcp: a peer that reached us is answered only once add_peer() named it") {
  distrpc::testing::answer_needs_add_peer_scenario<Tcp>();
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

TEST_CASE("tcp: a destroyed peer context is reported lost within 2 s, once") {
  Node a(0);
  auto b = std::make_unique<Node>(1);
  introduce(a, 0, *b, 1);
  a.ctx->send(1, make_message(MessageType::Request, 1, "ping"));
  b->ctx->send(0, make_message(MessageType::Request, 2, "ping"));
  REQUIRE(a.inbox.wait_messages(1));
  REQUIRE(b->inbox.wait_messages(1));
  const auto t0 = Clock::now();
  b.reset();
  REQUIRE(a.inbox.wait_lost(1, 2s));
  CHECK(a.inbox.lost_at[0] - t0 < 2s);
  CHECK(a.inbox.lost[0].first == 1);
  CHECK(contains(a.inbox.lost[0].second, "closed by peer"));
  std::this_thread::sleep_for(200ms);
  CHECK(a.inbox.lost_count() == 1);  // both connections broke; the peer is reported once
  // Sending to it now fails at once, naming it and why.
  const auto t1 = Clock::now();
  CHECK_THROWS_WITH_AS(a.ctx->send(1, make_message(MessageType::Request, 3, "anyone?")),
                       doctest::Contains("worker 1 ('w1')"), DistNetworkError);
  CHECK(Clock::now() - t1 < 500ms);
}

DISTRPC_MP_TARGET("tcp target: rank 1 is SIGKILLed") {
  Inbox inbox;
  Tcp::Context tcp(options_for(ctx.rank, "", 20s), inbox.callbacks());
  ctx.publish("addr" + std::to_string(ctx.rank), tcp.address());
  const int other = 1 - ctx.rank;
  tcp.add_peer(other, "w" + std::to_string(other), ctx.lookup("addr" + std::to_string(other)));
  if (ctx.rank == 1) {
    tcp.send(0, make_message(MessageType::Request, 1, "about to die"));
    ctx.lookup("ready");
    const auto now = Clock::now().time_since_epoch();
    ctx.publish("killed_at",
                std::to_string(std::chrono::duration_cast<std::chrono::microseconds>(now).count()));
    ::kill(::getpid(), SIGKILL);
  }
  REQUIRE(inbox.wait_messages(1, 20s));
  tcp.send(1, make_message(MessageType::Request, 2, "hi"));  // connections both ways
  ctx.publish("ready", "1");
  REQUIRE(inbox.wait_lost(1, 20s));
  // steady_clock is CLOCK_MONOTONIC: one clock for every process on this machine.
  const auto killed_at = std::chrono::microseconds(std::stoll(ctx.lookup("killed_at")));
  const auto noticed =
      std::chrono::duration_cast<std::chrono::microseconds>(inbox.lost_at[0].time_since_epoch());
  const auto delay = noticed - killed_at;
  CHECK(inbox.lost[0].first == 1);
  CHECK(delay < 2s);
  MESSAGE("SIGKILLed peer noticed after " << delay.count() << " us: " << inbox.lost[0].second);
}

TEST_CASE("tcp: a SIGKILLed peer process is reported lost within 2 s") {
  distrpc::testing::RunOptions o;
  o.world = 2;
  o.limit = 60s;
  o.may_die = {1};
  const auto r = distrpc::testing::run_ranks("tcp target: rank 1 is SIGKILLed", o);
  INFO(r.report());
  REQUIRE(r.ranks.size() == 2);
  CHECK(r.ranks[1].signal == SIGKILL);
  CHECK(r.ranks[0].exit_code == 0);
  CHECK(r.ok);
}

TEST_CASE("tcp: an oversized message is refused before anything is written") {
  TransportOptions o = options_for(0);
  o.limits.max_message_bytes = 1 << 20;
  Node a(o), b(1);
  introduce(a, 0, b, 1);
  std::string text;
  try {
    a.ctx->send(1, make_message(MessageType::Request, 1, "too big", {pattern_bytes(2 << 20, 1)}));
  } catch (const distrpc::DistError& e) {
    text = e.what();
  }
  CHECK(contains(text, "1048576"));
  CHECK(contains(text, std::to_string((2 << 20) + 7)));  // the buffer plus the payload
  CHECK(contains(text, "worker 1"));
  // Nothing of it reached the wire: the next message is the first one worker 1 sees.
  a.ctx->send(1, make_message(MessageType::Request, 2, "fits", {pattern_bytes(1000, 2)}));
  REQUIRE(b.inbox.wait_messages(1));
  std::this_thread::sleep_for(50ms);
  std::lock_guard<std::mutex> lk(b.inbox.mu);
  CHECK(b.inbox.messages.size() == 1);
  CHECK(b.inbox.messages[0].second.id == 2);
  CHECK(b.inbox.lost.empty());
}

TEST_CASE("tcp: a receiver drops a sender exceeding its limits") {
  TransportOptions o = options_for(1);
  o.limits.max_payload_bytes = 1000;
  Node a(0), b(o);
  introduce(a, 0, b, 1);
  a.ctx->send(1, make_message(MessageType::Request, 1, std::string(5000, 'x')));
  REQUIRE(b.inbox.wait_lost(1, 2s));
  CHECK(b.inbox.lost[0].first == 0);
  CHECK(contains(b.inbox.lost[0].second, "5000"));
  CHECK(b.inbox.message_count() == 0);
}

TEST_CASE("tcp: shutdown with traffic in flight does not hang, and no callback follows it") {
  Node a(0), b(1);
  introduce(a, 0, b, 1);
  std::atomic<bool> shut{false};
  std::atomic<int> late_callbacks{0};
  TransportCallbacks cb;
  // Replace b's context with one that counts callbacks arriving after its shutdown returned.
  b.ctx.reset();
  cb.on_message = [&](int, Message&&) {
    if (shut.load()) ++late_callbacks;
  };
  cb.on_peer_lost = [&](int, const std::string&) {
    if (shut.load()) ++late_callbacks;
  };
  b.ctx = std::make_unique<Tcp::Context>(options_for(1), cb);
  introduce(a, 0, b, 1);

  std::atomic<bool> stop{false};
  std::atomic<int> sent{0}, failed{0};
  std::vector<std::thread> senders;
  for (int t = 0; t < 3; ++t) {
    senders.emplace_back([&, t] {
      const at::Tensor buf = pattern_bytes(256 * 1024, static_cast<std::uint32_t>(t));
      while (!stop.load()) {
        try {
          a.ctx->send(1, make_message(MessageType::Request, 1, "load", {buf}));
          ++sent;
        } catch (const DistNetworkError&) {
          ++failed;
          return;
        }
      }
    });
  }
  // b replies from a thread of its own while a's I/O thread is busy receiving.
  std::thread replier([&] {
    while (!stop.load()) {
      try {
        b.ctx->send(0, make_message(MessageType::Response, 1, "ack"));
      } catch (const DistNetworkError&) {
        return;
      }
    }
  });
  while (sent.load() < 20) std::this_thread::sleep_for(1ms);

  auto t0 = Clock::now();
  b.ctx->shutdown();
  shut = true;
  CHECK(Clock::now() - t0 < 2s);
  b.ctx->shutdown();  // idempotent
  t0 = Clock::now();
  a.ctx->shutdown();
  CHECK(Clock::now() - t0 < 2s);
  stop = true;
  for (auto& th : senders) th.join();
  replier.join();
  std::this_thread::sleep_for(100ms);
  CHECK(late_callbacks == 0);
  CHECK(failed == 3);  // every sender learned that the transport went away
  CHECK_THROWS_AS(a.ctx->send(1, make_message(MessageType::Request, 9, "after")), DistNetworkError);
}

// Leader/follower (transport.hpp InlineScope): the scenario is shared with the shm policy.
TEST_CASE("tcp: a handed-back task runs on the reading thread without blocking reading") {
  distrpc::testing::handed_back_task_scenario<Tcp>();
}

// A blocked task at the head of a stream: the rest is still read, soon, and queued.
TEST_CASE("tcp: a stream whose first task blocks is still read and delivered in order") {
  distrpc::testing::blocked_stream_scenario<Tcp>(false);
}

// A caller waiting for a reply reads it itself (drive()); the scenario is shared with shm.
TEST_CASE("tcp: drive() reads on the waiting thread, never runs a task there, and hands back") {
  distrpc::testing::driven_reply_scenario<Tcp>();
}
