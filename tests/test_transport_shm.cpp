// What only the shared-memory policy (Shm) and the per-peer composite (Auto) have: Shm's address
// and domain key, address validation, non-contiguous tensors through the codec, messages larger
// than the ring, segment reuse and tensors held past their sender, garbage on the listener, a
// corrupted ring header, idle CPU, a peer dying mid-transfer with nothing left in /dev/shm or the
// abstract socket namespace; and Auto's addresses and its choice for same-host and "other host"
// peers. What every policy must do is tested once for all of them in
// test_transport_conformance.cpp.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <doctest/doctest.h>

#include "distrpc/net/handoff.hpp"
#include "distrpc/transport/auto.hpp"
#include "distrpc/transport/shm.hpp"
#include "distrpc/transport/tcp.hpp"
#include "distrpc/wire.hpp"
#include "multiprocess.hpp"
#include "support/scoped_env.hpp"
#include "support/transport_test_util.hpp"

#ifdef DISTRPC_UNDER_TSAN  // net/handoff.hpp's detection of a ThreadSanitizer build
// ThreadSanitizer's own entry points (libtsan): accesses made between them are not recorded.
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();
#endif

namespace {

// Writes over shared memory as another process would: ThreadSanitizer sees one process, so the
// peer's reads of a page this test thread garbles on purpose would be reported as a race.
void garble_as_another_process(void* at, std::size_t size) {
#ifdef DISTRPC_UNDER_TSAN
  __tsan_ignore_thread_begin();
#endif
  std::memset(at, 0x5a, size);
#ifdef DISTRPC_UNDER_TSAN
  __tsan_ignore_thread_end();
#endif
}

using namespace distrpc::testing::transport_names;
using distrpc::transport::Shm;
using distrpc::transport::Tcp;
using AutoShmTcp = distrpc::transport::Auto<Shm, Tcp>;

using ShmNode = NodeOf<Shm>;

// Lines of /proc/self/maps naming `part` (memfd mappings show as "/memfd:<name> (deleted)").
std::vector<std::string> maps_lines(const std::string& part) {
  std::ifstream in("/proc/self/maps");
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) {
    if (contains(line, part)) out.push_back(line);
  }
  return out;
}

// Resident kB of this process's mappings naming `part` (/proc/self/smaps: a mapping's line, then
// its fields, each a word ending in ':').
long resident_kb(const std::string& part) {
  std::ifstream in("/proc/self/smaps");
  long kb = 0;
  bool named = false;
  for (std::string line; std::getline(in, line);) {
    const std::string first = line.substr(0, line.find(' '));
    if (first.empty() || first.back() != ':') {
      named = contains(line, part);
    } else if (named && first == "Rss:") {
      kb += std::stol(line.substr(first.size()));
    }
  }
  return kb;
}

// The names in /dev/shm, and every "@distrpc-shm-<pid>-..." abstract socket whose pid is dead
// (an abstract socket disappears with its last descriptor, so there must never be any).
std::set<std::string> dev_shm_entries() {
  std::set<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
    out.insert(e.path().filename().string());
  }
  return out;
}
std::vector<std::string> orphaned_abstract_sockets() {
  std::ifstream in("/proc/net/unix");
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) {
    const auto at = line.find("@distrpc-shm-");
    if (at == std::string::npos) continue;
    const std::string rest = line.substr(at + 13);
    const int pid = std::atoi(rest.c_str());
    if (pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH) out.push_back(line.substr(at));
  }
  return out;
}

}  // namespace

TEST_CASE("shm: the policy satisfies the Transport concept and names its domain") {
  static_assert(distrpc::transport::check_transport<Shm>());
  static_assert(distrpc::transport::check_transport<AutoShmTcp>());
  CHECK(Shm::name == "shm");
  CHECK(Shm::viable());
  const std::string key = Shm::domain_key();
  CHECK(contains(key, "boot="));
  CHECK(contains(key, "ipc=ipc:["));
  CHECK(contains(key, "net=net:["));
  CHECK(key == Shm::domain_key());  // stable
  ShmNode a(0);
  const std::string addr = a.ctx->address();
  CHECK(addr.rfind("distrpc-shm-" + std::to_string(::getpid()) + "-", 0) == 0);
  // The listener is an abstract socket: nothing in the file system, and it shows in the kernel's
  // table with a leading '@'.
  std::ifstream in("/proc/net/unix");
  std::stringstream all;
  all << in.rdbuf();
  CHECK(contains(all.str(), "@" + addr));
}

TEST_CASE("shm: add_peer and send refuse bad input, naming what was wrong") {
  ShmNode a(0);
  CHECK_THROWS_WITH_AS(a.ctx->add_peer(-1, "neg", "distrpc-shm-1-2"), doctest::Contains("negative"),
                       DistNetworkError);
  CHECK_THROWS_WITH_AS(a.ctx->add_peer(2, "w2", "127.0.0.1:80"),
                       doctest::Contains("does not start with 'distrpc-shm-'"), DistNetworkError);
  CHECK_THROWS_WITH_AS(a.ctx->add_peer(2, "w2", "distrpc-shm-1/../x"),
                       doctest::Contains("a character other than"), DistNetworkError);
  CHECK_THROWS_WITH_AS(a.ctx->send(5, make_message(MessageType::Request, 1, "x")),
                       doctest::Contains("worker 5"), DistNetworkError);
}

// While it lives, this process can open no descriptor: the soft limit on descriptors is set to
// the lowest free one (every lower one is taken, so the next open fails with EMFILE).
class NoNewDescriptors {
 public:
  NoNewDescriptors() {
    REQUIRE(::getrlimit(RLIMIT_NOFILE, &saved_) == 0);
    const int lowest_free = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    REQUIRE(lowest_free >= 0);
    ::close(lowest_free);
    rlimit tight = saved_;
    tight.rlim_cur = static_cast<rlim_t>(lowest_free);
    REQUIRE(::setrlimit(RLIMIT_NOFILE, &tight) == 0);
  }
  ~NoNewDescriptors() { ::setrlimit(RLIMIT_NOFILE, &saved_); }
  NoNewDescriptors(const NoNewDescriptors&) = delete;
  NoNewDescriptors& operator=(const NoNewDescriptors&) = delete;

 private:
  rlimit saved_{};
};

TEST_CASE("shm: a send whose tensor segment cannot be made names the peer; the pair lives on") {
  ShmNode a(0), b(1);
  introduce(a, 0, b, 1);
  a.ctx->send(1, make_message(MessageType::Request, 1, "connect"));  // dials while it may
  REQUIRE(b.inbox.wait_messages(1, 5s));
  const at::Tensor big = pattern_bytes(1 << 20, 4);  // above the segment threshold
  std::string text;
  {
    const NoNewDescriptors none;
    try {
      a.ctx->send(1, make_message(MessageType::Request, 2, "big", {big}));
    } catch (const DistNetworkError& e) {
      text = e.what();
    }
  }
  INFO(text);
  CHECK(text.find("send of Request message 2 to worker 1 ('w1')") != std::string::npos);
  CHECK(text.find("segment") != std::string::npos);
  CHECK(text.find("Too many open files") != std::string::npos);
  CHECK(text.rfind("distrpc shm: ") == 0);  // said once, at the start
  // Nothing was written: the connection is still usable, and nothing was reported lost.
  a.ctx->send(1, make_message(MessageType::Request, 3, "big", {big}));
  REQUIRE(b.inbox.wait_messages(2, 5s));
  for (auto* n : {&a, &b}) {
    std::lock_guard<std::mutex> lk(n->inbox.mu);
    CHECK(n->inbox.lost.empty());
  }
  const Message m = b.inbox.take(1);
  CHECK(m.id == 3);
  REQUIRE(m.buffers.size() == 1);
  CHECK(same_bytes(m.buffers[0], big));
}

TEST_CASE("shm: tensors through the codec keep dtype, shape and strides (non-contiguous too)") {
  ShmNode a(0), b(1);
  introduce(a, 0, b, 1);
  const at::Tensor square = at::arange(0, 512 * 512, at::kFloat).reshape({512, 512});
  const at::Tensor transposed = square.t();  // non-contiguous, 1 MiB
  const at::Tensor strided = at::arange(0, 64, at::kDouble).slice(0, 1, 64, 3);  // small, inline
  const at::Tensor ints = at::arange(0, 100000, at::kInt).reshape({100, 1000}).narrow(1, 10, 500);
  Message m;
  distrpc::wire::encode(m, transposed, strided, ints, std::string("tag"));
  m.type = MessageType::Request;
  m.id = 9;
  a.ctx->send(1, std::move(m));
  REQUIRE(b.inbox.wait_messages(1));
  const Message got = b.inbox.take(0);
  auto [x, y, z, tag] =
      distrpc::wire::decode_as<at::Tensor, at::Tensor, at::Tensor, std::string>(got);
  CHECK(tag == "tag");
  CHECK(at::equal(x, transposed));
  CHECK(x.strides() == transposed.strides());
  CHECK_FALSE(x.is_contiguous());
  CHECK(at::equal(y, strided));
  CHECK(y.strides() == strided.strides());
  CHECK(at::equal(z, ints));
  CHECK((z.scalar_type() == at::kInt));
}

TEST_CASE("shm: messages larger than the ring stream through it, with many small tensors") {
  ShmNode a(0), b(1);
  introduce(a, 0, b, 1);
  // An 8 MiB payload is four times the ring; 3000 small tensors (inline) and two segment ones.
  std::string payload(8 << 20, '\0');
  for (std::size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<char>(i * 131 + 7);
  std::vector<at::Tensor> bufs;
  for (int i = 0; i < 3000; ++i) bufs.push_back(pattern_bytes(1 + (i * 37) % 2000, i));
  bufs.push_back(pattern_bytes(5 << 20, 77));
  bufs.push_back(pattern_bytes(64 * 1024, 78));
  a.ctx->send(1, make_message(MessageType::Request, 1, payload, bufs));
  a.ctx->send(1, make_message(MessageType::Request, 2, "after"));
  REQUIRE(b.inbox.wait_messages(2, 30s));
  const Message m = b.inbox.take(0);
  CHECK(m.payload == payload);
  REQUIRE(m.buffers.size() == bufs.size());
  int bad = 0;
  for (std::size_t i = 0; i < bufs.size(); ++i) bad += same_bytes(m.buffers[i], bufs[i]) ? 0 : 1;
  CHECK(bad == 0);
  CHECK(b.inbox.take(1).payload == "after");
}

TEST_CASE("shm: a 64 MiB tensor makes round trips intact, reusing its segments") {
  ShmNode a(0), b(1);
  introduce(a, 0, b, 1);
  const at::Tensor big = pattern_bytes(64 << 20, 99);
  std::vector<double> ms;
  for (int round = 0; round < 6; ++round) {
    const auto t0 = Clock::now();
    a.ctx->send(1, make_message(MessageType::Request, round, "big", {big}));
    REQUIRE(b.inbox.wait_messages(static_cast<std::size_t>(round) + 1, 30s));
    Message got = b.inbox.take(static_cast<std::size_t>(round));
    REQUIRE(got.buffers.size() == 1);
    b.ctx->send(0, make_message(MessageType::Response, round, "big back", {got.buffers[0]}));
    got = Message{};  // the receiver's tensor dies: its segment goes back to the sender
    REQUIRE(a.inbox.wait_messages(static_cast<std::size_t>(round) + 1, 30s));
    Message back = a.inbox.take(static_cast<std::size_t>(round));
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    REQUIRE(back.buffers.size() == 1);
    if (round == 0 || round == 5) CHECK(same_bytes(back.buffers[0], big));
  }
  // Each direction keeps one 65 MiB segment mapped on both sides: 4 mappings, not 24.
  const auto maps = maps_lines("distrpc-shm segment");
  CHECK(maps.size() <= 4);
  MESSAGE("64 MiB round trips (ms): first " << ms[0] << ", then " << ms[1] << ", " << ms[2] << ", "
                                            << ms[5] << "; segment mappings: " << maps.size());
}

TEST_CASE("shm: tensors the receiver holds keep their bytes while the sender goes on") {
  ShmNode a(0), b(1);
  introduce(a, 0, b, 1);
  // Twelve 1 MiB messages held by the receiver: more than the sender's cache (8 segments), so the
  // later ones use one-shot segments; none may be overwritten while held.
  constexpr int kHeld = 12;
  for (int i = 0; i < kHeld; ++i) {
    a.ctx->send(1, make_message(MessageType::Request, i, "", {pattern_bytes(1 << 20, 1000 + i)}));
  }
  REQUIRE(b.inbox.wait_messages(kHeld, 20s));
  int bad = 0;
  {
    std::lock_guard<std::mutex> lk(b.inbox.mu);
    for (int i = 0; i < kHeld; ++i) {
      bad += same_bytes(b.inbox.messages[static_cast<std::size_t>(i)].second.buffers.at(0),
                        pattern_bytes(1 << 20, 1000 + i))
                 ? 0
                 : 1;
    }
  }
  CHECK(bad == 0);
  // Released, the cached segments are reused: later messages still arrive intact.
  {
    std::lock_guard<std::mutex> lk(b.inbox.mu);
    b.inbox.messages.clear();
  }
  for (int i = 0; i < 8; ++i) {
    a.ctx->send(1, make_message(MessageType::Request, i, "", {pattern_bytes(1 << 20, 2000 + i)}));
    REQUIRE(b.inbox.wait_messages(1, 10s));
    CHECK(same_bytes(b.inbox.take(0).buffers.at(0), pattern_bytes(1 << 20, 2000 + i)));
    std::lock_guard<std::mutex> lk(b.inbox.mu);
    b.inbox.messages.clear();
  }
  // Held tensors outlive the contexts: their memory is the receiver's until they die.
  a.ctx->send(1, make_message(MessageType::Request, 99, "", {pattern_bytes(2 << 20, 3000)}));
  REQUIRE(b.inbox.wait_messages(1, 10s));
  Message keep = b.inbox.take(0);
  a.ctx.reset();
  b.ctx.reset();
  CHECK(same_bytes(keep.buffers.at(0), pattern_bytes(2 << 20, 3000)));
}

// Secrets and identities are refused in the conformance suite; here: a raw client on the
// SOCK_SEQPACKET listener sending garbage instead of a Hello.
TEST_CASE("shm: garbage instead of a handshake is refused; the listener lives on") {
  ShmNode a(options_for(0, "s3cret")), b(options_for(1, "s3cret"));
  introduce(a, 0, b, 1);
  check_still_works(a, b, 1);
  {
    // A raw client sending garbage instead of a Hello, and one sending descriptors too early.
    const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    REQUIRE(fd >= 0);
    sockaddr_un sa;
    const socklen_t len = distrpc::transport::shm::detail::abstract_sockaddr(a.ctx->address(), sa);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&sa), len) == 0);
    const std::string junk = "GET / HTTP/1.1\r\n\r\n";
    REQUIRE(::send(fd, junk.data(), junk.size(), MSG_NOSIGNAL) ==
            static_cast<ssize_t>(junk.size()));
    timeval tv{5, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char c;
    CHECK(::recv(fd, &c, 1, 0) == 0);  // closed without a reply
    ::close(fd);
  }
  check_still_works(a, b, 2);
  std::lock_guard<std::mutex> lk(a.inbox.mu);
  for (auto& [peer, reason] : a.inbox.lost) CHECK(peer != 1);
}

// The challenge-response by hand on the SOCK_SEQPACKET listener: an answer recorded on one
// connection is refused on the next (the acceptor's nonce is new), with the reason logged.
TEST_CASE("shm: an answer replayed on a new connection is refused") {
  namespace auth = distrpc::wire::auth;
  namespace sd = distrpc::transport::shm::detail;
  const std::string token = "s3cret";
  LogLines log;
  ShmNode a(options_for(0, token));
  const auth::Nonce nonce = auth::make_nonce();
  const auto raw_connect = [&] {
    const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    REQUIRE(fd >= 0);
    sockaddr_un sa;
    const socklen_t len = sd::abstract_sockaddr(a.ctx->address(), sa);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&sa), len) == 0);
    timeval tv{5, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
  };
  const auto raw_send = [](int fd, const std::string& packet) {
    REQUIRE(::send(fd, packet.data(), packet.size(), MSG_NOSIGNAL) ==
            static_cast<ssize_t>(packet.size()));
  };
  // Sends worker 7's Hello with `nonce`, reads the acceptor's; returns the right answer to it.
  const auto challenge = [&](int fd, distrpc::wire::Hello& reply) {
    distrpc::wire::Hello h;
    h.worker_name = "w7";
    h.worker_id = 7;
    h.nonce = nonce;
    raw_send(fd, sd::hello_packet(h));
    std::string buf(sd::kMaxHelloFrameBytes, '\0');
    const ssize_t n = ::recv(fd, buf.data(), buf.size(), 0);  // its eventfd is dropped
    REQUIRE(n > 0);
    buf.resize(static_cast<std::size_t>(n));
    reply = sd::parse_hello_packet(buf);
    REQUIRE(reply.nonce.has_value());
    REQUIRE(reply.proof.has_value());
    return auth::compute_proof(token, auth::Prover::kDialler, nonce, *reply.nonce, {"w7", 7},
                               {reply.worker_name, reply.worker_id});
  };
  // The first connection answers right: the acceptor goes on to wait for the ring, and says so
  // about the bad setup packet that follows.
  const int first = raw_connect();
  distrpc::wire::Hello reply1;
  const auth::Proof recorded = challenge(first, reply1);
  raw_send(first, sd::auth_answer_packet(recorded));
  raw_send(first, "not a setup packet");
  CHECK(contains(log.wait_for("setup packet"),
                 "bad handshake: the setup packet has 18 bytes (expected 16)"));
  ::close(first);
  // The second replays that answer: a new nonce came back, so it is wrong here.
  const int second = raw_connect();
  distrpc::wire::Hello reply2;
  challenge(second, reply2);
  CHECK(*reply2.nonce != *reply1.nonce);
  raw_send(second, sd::auth_answer_packet(recorded));
  char c;
  CHECK(::recv(second, &c, 1, 0) == 0);  // closed without a reply
  ::close(second);
  CHECK(contains(log.wait_for("wrong proof"),
                 "bad handshake: authentication failed: worker 'w7' (id 7) answered our "
                 "challenge with a wrong proof (a different shared secret, or a replayed "
                 "answer)"));
  CHECK_FALSE(contains(log.all(), token));
  CHECK(a.inbox.lost_count() == 0);  // neither ever became a peer
}

TEST_CASE("shm: a dial under way when add_peer() moves the worker reaches the new address") {
  namespace sd = distrpc::transport::shm::detail;
  // The old incarnation of worker 7, played by hand on its own abstract socket: it answers the
  // dial only once the test has registered worker 7 at its replacement's address.
  const std::string old_address =
      std::string(sd::kAddressPrefix) + std::to_string(::getpid()) + "-old-incarnation";
  const int lfd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  REQUIRE(lfd >= 0);
  sockaddr_un sa;
  const socklen_t len = sd::abstract_sockaddr(old_address, sa);
  REQUIRE(::bind(lfd, reinterpret_cast<sockaddr*>(&sa), len) == 0);
  REQUIRE(::listen(lfd, 4) == 0);
  std::promise<void> dialled, moved;
  std::future<void> moved_done = moved.get_future();
  std::atomic<bool> hung_up{false};
  std::thread old_incarnation([&] {
    const int fd = ::accept(lfd, nullptr, nullptr);
    if (fd < 0) return;
    std::string hello(sd::kMaxHelloFrameBytes, '\0');
    (void)::recv(fd, hello.data(), hello.size(), 0);
    dialled.set_value();
    moved_done.wait();
    const std::atomic<bool> never{false};
    const auto soon = [] { return std::chrono::steady_clock::now() + 5s; };
    distrpc::wire::Hello h;
    h.worker_id = 7;
    h.worker_name = "w7";
    const std::string reply = sd::hello_packet(h);
    const auto efd = sd::make_eventfd();
    const int efd_raw = efd.get();
    // The dialler sees the move after our Hello and hangs up before it hands over its ring.
    sd::Packet setup;
    hung_up = sd::send_packet(fd, reply.data(), reply.size(), &efd_raw, 1, soon(), never) == 0 &&
              sd::recv_packet(fd, setup, soon(), never) == sd::kPeerClosed;
    ::close(fd);
  });
  ShmNode a(0), replacement(7);
  a.ctx->add_peer(7, "w7", old_address);
  distrpc::testing::check_send_follows_move(a, replacement, dialled.get_future(), moved);
  ::shutdown(lfd, SHUT_RDWR);  // ends an accept() still waiting, should the dial never have come
  old_incarnation.join();
  ::close(lfd);
  CHECK(hung_up.load());  // no ring was handed to the old incarnation
}

TEST_CASE("shm: a corrupted ring header drops the connection with a reason; the process lives") {
  ShmNode a(0), b(1);
  introduce(a, 0, b, 1);
  check_still_works(a, b, 1);
  // The ring worker 0 writes to worker 1 is mapped twice in this process (writer and reader).
  const auto rings = maps_lines("distrpc-shm ring w0->w1");
  REQUIRE(rings.size() == 2);
  const auto base = std::stoull(rings[0].substr(0, rings[0].find('-')), nullptr, 16);
  garble_as_another_process(reinterpret_cast<void*>(base), 4096);  // the whole header page
  // Whichever side looks first (the reader's next poll, or this writer) finds it.
  try {
    a.ctx->send(1, make_message(MessageType::Request, 5, "into a broken ring"));
  } catch (const DistNetworkError&) {
    // Expected when this writer is the one that notices (or the reader dropped it first).
  }
  REQUIRE(a.inbox.wait_lost(1, 2s));
  REQUIRE(b.inbox.wait_lost(1, 2s));
  CHECK(a.inbox.lost[0].first == 1);
  CHECK(b.inbox.lost[0].first == 0);
  const bool named = contains(a.inbox.lost[0].second, "corrupted") ||
                     contains(b.inbox.lost[0].second, "corrupted");
  CHECK(named);
  MESSAGE("writer side: " << a.inbox.lost[0].second
                          << " | reader side: " << b.inbox.lost[0].second);
  // A fresh registration reconnects with a fresh ring.
  introduce(a, 0, b, 1);
  check_still_works(a, b, 2);
}

TEST_CASE("shm: an idle connected pair uses almost no CPU") {
  ShmNode a(0), b(1);
  introduce(a, 0, b, 1);
  exchange_a_while(a, b);
  const double pct = distrpc::testing::cpu_percent_in_a_second(300ms);  // past the spin after activity
  MESSAGE("idle CPU of a connected pair (two contexts, this whole process): " << pct
                                                                              << " % of one core");
  CHECK(pct < 10.0);
  check_still_works(a, b, 7);  // and it wakes up again
}

TEST_CASE("shm: a DISTRPC_SHM_SPIN_US that is not a number of microseconds is named") {
  for (const char* bad : {"x", "-3", "2000000"}) {
    CAPTURE(bad);
    distrpc::testing::ScopedEnv spin("DISTRPC_SHM_SPIN_US", bad);
    const std::string text =
        distrpc::testing::thrown_exactly<std::invalid_argument>([] { ShmNode n(0); });
    CHECK(text == std::string("DISTRPC_SHM_SPIN_US='") + bad +
                      "' is not a number of microseconds in 0..1000000");
  }
}

TEST_CASE("shm: a DISTRPC_RECV_CACHE_MB that is not a number of MiB fails the start, named") {
  for (const char* bad : {"many", "-2", "2000000"}) {
    CAPTURE(bad);
    distrpc::testing::ScopedEnv cache("DISTRPC_RECV_CACHE_MB", bad);
    const std::string text =
        distrpc::testing::thrown_exactly<std::invalid_argument>([] { ShmNode n(0); });
    CHECK(text ==
          std::string("DISTRPC_RECV_CACHE_MB='") + bad + "' is not a number of MiB in 0..1048576");
  }
}

// Rank 1 streams large messages (payloads four times the ring, and segment tensors) to rank 0 and
// is SIGKILLed (or crashes, with DISTRPC_SHM_TEST_CRASH) in the middle of it.
DISTRPC_MP_TARGET("shm target: rank 1 dies mid-transfer") {
  Inbox inbox;
  TransportCallbacks cb = inbox.callbacks();
  std::atomic<int> received{0};
  // Keeps the first message (to check its tensor after the sender died) and drops the others'
  // tensors at once, so their segments go back to the sender and memory stays flat.
  cb.on_message = [&](int peer, Message&& m) {
    if (received.fetch_add(1) == 0) {
      std::lock_guard<std::mutex> lk(inbox.mu);
      inbox.messages.emplace_back(peer, std::move(m));
    }
    inbox.cv.notify_all();
  };
  Shm::Context shm(options_for(ctx.rank, "", 20s), cb);
  ctx.publish("addr" + std::to_string(ctx.rank), shm.address());
  const int other = 1 - ctx.rank;
  shm.add_peer(other, "w" + std::to_string(other), ctx.lookup("addr" + std::to_string(other)));
  if (ctx.rank == 1) {
    ctx.publish("pid1", std::to_string(::getpid()));
    std::atomic<bool> stop{false};
    std::thread streamer([&] {
      const std::string payload(8 << 20, 'p');
      const at::Tensor t = pattern_bytes(16 << 20, 3);
      for (std::uint64_t i = 0; !stop.load(); ++i) {
        try {
          shm.send(0, make_message(MessageType::Request, i, payload, {t}));
        } catch (const std::exception&) {
          return;
        }
      }
    });
    ctx.lookup("ready");
    std::this_thread::sleep_for(20ms);  // well inside a stream of 8 MiB records
    ctx.publish("killed_at", std::to_string(std::chrono::duration_cast<std::chrono::microseconds>(
                                                Clock::now().time_since_epoch())
                                                .count()));
    if (std::getenv("DISTRPC_SHM_TEST_CRASH")) std::abort();
    ::kill(::getpid(), SIGKILL);
    stop = true;
    streamer.join();
  }
  {
    std::unique_lock<std::mutex> lk(inbox.mu);
    REQUIRE(inbox.cv.wait_for(lk, 20s, [&] { return received.load() >= 2; }));
  }
  ctx.publish("ready", "1");
  REQUIRE(inbox.wait_lost(1, 20s));
  const auto killed_at = std::chrono::microseconds(std::stoll(ctx.lookup("killed_at")));
  const auto noticed =
      std::chrono::duration_cast<std::chrono::microseconds>(inbox.lost_at[0].time_since_epoch());
  CHECK(inbox.lost[0].first == 1);
  CHECK(noticed - killed_at < 2s);
  MESSAGE("dead peer noticed after " << (noticed - killed_at).count()
                                     << " us: " << inbox.lost[0].second);
  // Its abstract sockets went with it: the kernel lists one of them until this side has closed
  // its end of the connection too (the I/O thread does that as it handles the hang-up).
  const std::string pid1 = ctx.lookup("pid1");
  bool listed = true;
  for (const auto until = Clock::now() + 2s; listed && Clock::now() < until;) {
    std::ifstream in("/proc/net/unix");
    std::stringstream all;
    all << in.rdbuf();
    listed = contains(all.str(), "@distrpc-shm-" + pid1 + "-");
    if (listed) std::this_thread::sleep_for(10ms);
  }
  CHECK_FALSE(listed);
  // Received tensors stay valid after their sender died.
  const Message first = inbox.take(0);
  REQUIRE(first.buffers.size() == 1);
  CHECK(same_bytes(first.buffers[0], pattern_bytes(16 << 20, 3)));
}

// A record over the receiver's limits from a peer that exits right after sending it, seen by the
// reading thread as a hang-up first: it then reads the bad record while draining what the peer
// left. It must drop the connection once and go on reading the other peers (it re-read the
// failed record for ever, holding the lead: nothing was read again and shutdown never returned).
// The order is forced: the reading thread is held in a callback for another peer's ring (after
// the sender's in its pass) while the record and the hang-up arrive. A process of its own, so a
// hang ends at the run's limit instead of stalling the suite.
DISTRPC_MP_TARGET("shm target: an oversize record from a peer that exits at once") {
  TransportOptions o = options_for(1);
  o.limits.max_payload_bytes = 1000;
  Inbox inbox;
  const TransportCallbacks inner = inbox.callbacks();
  TransportCallbacks cb;
  cb.on_message = [&](int peer, Message&& m) {
    if (m.payload == "hold") std::this_thread::sleep_for(300ms);
    inner.on_message(peer, std::move(m));
  };
  cb.on_peer_lost = inner.on_peer_lost;
  Shm::Context b(o, cb);
  std::size_t messages = 0;
  std::size_t losses = 0;
  for (int round = 0; round < 3; ++round) {
    CAPTURE(round);
    const int id = 10 + round;
    auto a = std::make_unique<ShmNode>(id);
    a->ctx->add_peer(1, "w1", b.address());
    b.add_peer(id, "w" + std::to_string(id), a->ctx->address());
    a->ctx->send(1, make_message(MessageType::Request, 1, "first"));  // its ring is read first
    REQUIRE(inbox.wait_messages(++messages, 2s));
    ShmNode c(20 + round);
    c.ctx->add_peer(1, "w1", b.address());
    b.add_peer(20 + round, "w" + std::to_string(20 + round), c.ctx->address());
    c.ctx->send(1, make_message(MessageType::Request, 2, "hold"));
    std::this_thread::sleep_for(100ms);  // the reading thread is in the callback now
    a->ctx->send(1, make_message(MessageType::Request, 3, std::string(5000, 'x')));
    a.reset();                                     // its connections close right behind the record
    REQUIRE(inbox.wait_messages(++messages, 2s));  // "hold"
    REQUIRE(inbox.wait_lost(++losses, 2s));
    CHECK(inbox.lost.back().first == id);
    CHECK(contains(inbox.lost.back().second, "5000"));
    // The other peer is still read.
    c.ctx->send(1, make_message(MessageType::Request, 4, "still read"));
    REQUIRE(inbox.wait_messages(++messages, 2s));
    c.ctx->shutdown();
    REQUIRE(inbox.wait_lost(++losses, 2s));
  }
  const auto t0 = Clock::now();
  b.shutdown();
  CHECK(Clock::now() - t0 < 2s);
}

// A message at limits that are not a multiple of the segment granule (1 MiB): its segment is
// rounded up past max_message_bytes, which the receiver took for a violation and dropped the
// connection. Two buffers add alignment padding on top.
TEST_CASE("shm: a message at a limit that is not a multiple of 1 MiB arrives") {
  TransportOptions o0 = options_for(0);
  TransportOptions o1 = options_for(1);
  o0.limits.max_message_bytes = o1.limits.max_message_bytes = (3 << 20) / 2;  // 1.5 MiB
  ShmNode a(o0), b(o1);
  introduce(a, 0, b, 1);
  const at::Tensor one = pattern_bytes((3 << 20) / 2 - 10, 1);
  a.ctx->send(1, make_message(MessageType::Request, 1, "0123456789", {one}));
  const at::Tensor x = pattern_bytes(700001, 2);
  const at::Tensor y = pattern_bytes((3 << 20) / 2 - 700001 - 3, 3);
  a.ctx->send(1, make_message(MessageType::Request, 2, "abc", {x, y}));
  REQUIRE(b.inbox.wait_messages(2, 5s));
  CHECK(b.inbox.lost.empty());
  const Message m1 = b.inbox.take(0);
  REQUIRE(m1.buffers.size() == 1);
  CHECK(same_bytes(m1.buffers[0], one));
  const Message m2 = b.inbox.take(1);
  REQUIRE(m2.buffers.size() == 2);
  CHECK(same_bytes(m2.buffers[0], x));
  CHECK(same_bytes(m2.buffers[1], y));
}

TEST_CASE(
    "shm: an oversize record from a peer that exits at once is dropped once; reading goes on") {
  distrpc::testing::RunOptions o;
  o.world = 1;
  o.limit = 60s;
  const auto r = distrpc::testing::run_ranks(
      "shm target: an oversize record from a peer that exits at once", o);
  CHECK_MESSAGE(r.ok, r.report());
}

TEST_CASE("shm: a peer SIGKILLed or crashing mid-transfer is lost within 2 s; nothing is left") {
  const auto shm_before = dev_shm_entries();
  for (const bool crash : {false, true}) {
    CAPTURE(crash);
    distrpc::testing::RunOptions o;
    o.world = 2;
    o.limit = 60s;
    o.may_die = {1};
    if (crash) o.env.push_back("DISTRPC_SHM_TEST_CRASH=1");
    const auto r = distrpc::testing::run_ranks("shm target: rank 1 dies mid-transfer", o);
    INFO(r.report());
    REQUIRE(r.ranks.size() == 2);
    CHECK(r.ranks[1].signal == (crash ? SIGABRT : SIGKILL));
    CHECK(r.ranks[0].exit_code == 0);
    CHECK(r.ok);
  }
  // Neither the normal ends, the kill nor the crash left a name in /dev/shm or a socket behind
  // (this process's own contexts were destroyed by the earlier cases).
  std::vector<std::string> fresh;
  for (const auto& e : dev_shm_entries()) {
    if (!shm_before.count(e)) fresh.push_back(e);
  }
  CHECK(fresh.empty());
  CHECK(orphaned_abstract_sockets().empty());
  CHECK(maps_lines("distrpc-shm").empty());
}

// ---- Auto (its conformance to the transport contract: test_transport_conformance.cpp)
// -----------------------------------------------------------------------------------

TEST_CASE("auto: addresses round-trip and malformed ones are refused, naming the peer") {
  using distrpc::transport::detail::decode_address;
  using distrpc::transport::detail::encode_address;
  const std::vector<distrpc::transport::detail::Entry> e{
      {"shm", "shm:boot=x;ipc=ipc:[1];net=net:[2]", "distrpc-shm-1-ab"},
      {"tcp", "tcp", "[::1]:80"},
      {"odd", "a=b@c%d e", "x;y"}};
  const auto back = decode_address(encode_address(e));
  REQUIRE(back.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(back[i].name == e[i].name);
    CHECK(back[i].domain == e[i].domain);
    CHECK(back[i].address == e[i].address);
  }
  NodeOf<AutoShmTcp> a(0);
  CHECK(a.ctx->candidates() == std::vector<std::string>{"shm", "tcp"});
  CHECK_THROWS_WITH_AS(a.ctx->add_peer(1, "w1", "127.0.0.1:5"),
                       doctest::Contains("worker 1 ('w1')"), DistNetworkError);
  CHECK_THROWS_WITH_AS(a.ctx->add_peer(1, "w1", "auto:v1;tcp=tcp"),
                       doctest::Contains("is not <name>=<domain key>@<address>"), DistNetworkError);
  CHECK_THROWS_WITH_AS(a.ctx->add_peer(1, "w1", "auto:v1;tcp=tc%4@x"),
                       doctest::Contains("percent-escape"), DistNetworkError);
  // A peer offering only what we do not share is refused with both sides' lists.
  CHECK_THROWS_WITH_AS(a.ctx->add_peer(1, "w1", "auto:v1;ib=fabric-7@mlx5"),
                       doctest::Contains("no transport can reach worker 1 ('w1')"),
                       DistNetworkError);
  CHECK_THROWS_WITH_AS((void)a.ctx->transport_for(1), doctest::Contains("worker 1"),
                       DistNetworkError);
  CHECK_THROWS_WITH_AS(a.ctx->send(1, make_message(MessageType::Request, 1, "x")),
                       doctest::Contains("worker 1"), DistNetworkError);
  // Refused peers count for no candidate, and with no peer at all a waiting caller has nothing
  // to read: drive() returns at once instead of polling until its deadline.
  CHECK(a.ctx->peers_using("shm") == 0);
  CHECK(a.ctx->peers_using("tcp") == 0);
  CHECK(a.ctx->peers_using("ib") == 0);
  const auto t0 = std::chrono::steady_clock::now();
  a.ctx->drive([] { return false; }, t0 + 5s);
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);
}

TEST_CASE("auto: peers of one host use shm") {
  NodeOf<AutoShmTcp> a(0), b(1);
  introduce(a, 0, b, 1);
  CHECK(a.ctx->transport_for(1) == "shm");
  CHECK(b.ctx->transport_for(0) == "shm");
  // A waiting caller reads shm only (tcp has no peer here).
  CHECK(a.ctx->peers_using("shm") == 1);
  CHECK(a.ctx->peers_using("tcp") == 0);
  a.ctx->send(1, make_message(MessageType::Request, 1, "via shm", {pattern_bytes(200000, 1)}));
  b.ctx->send(0, make_message(MessageType::Response, 1, "back"));
  REQUIRE(b.inbox.wait_messages(1));
  REQUIRE(a.inbox.wait_messages(1));
  CHECK(same_bytes(b.inbox.take(0).buffers.at(0), pattern_bytes(200000, 1)));
  CHECK(maps_lines("distrpc-shm ring w0->w1").size() == 2);  // it really went through a ring
}

TEST_CASE("auto: peers whose shm domain keys differ (forced) use tcp") {
  // "Another host", simulated: DISTRPC_TRANSPORT_DOMAIN_OVERRIDE_SHM gives every worker its own
  // shm domain ("{id}" is its id), so shm is not shared and the next candidate, tcp, is chosen.
  // Set before any context of this case exists and removed after construction.
  std::optional<distrpc::testing::ScopedEnv> override_shm(
      std::in_place, "DISTRPC_TRANSPORT_DOMAIN_OVERRIDE_SHM", "host-{id}");
  NodeOf<AutoShmTcp> a(0), b(1);
  override_shm.reset();
  CHECK(contains(a.ctx->address(), "shm=override:host-0@"));
  CHECK(contains(b.ctx->address(), "shm=override:host-1@"));
  introduce(a, 0, b, 1);
  CHECK(a.ctx->transport_for(1) == "tcp");
  CHECK(b.ctx->transport_for(0) == "tcp");
  CHECK(a.ctx->peers_using("tcp") == 1);
  CHECK(a.ctx->peers_using("shm") == 0);
  a.ctx->send(1, make_message(MessageType::Request, 1, "via tcp", {pattern_bytes(200000, 2)}));
  b.ctx->send(0, make_message(MessageType::Response, 1, "back"));
  REQUIRE(b.inbox.wait_messages(1));
  REQUIRE(a.inbox.wait_messages(1));
  CHECK(same_bytes(b.inbox.take(0).buffers.at(0), pattern_bytes(200000, 2)));
  CHECK(maps_lines("distrpc-shm ring").empty());  // no shared-memory connection was made
  // A dead peer is reported once although it had contexts of both candidates.
  b.ctx.reset();
  REQUIRE(a.inbox.wait_lost(1, 2s));
  std::this_thread::sleep_for(200ms);
  CHECK(a.inbox.lost_count() == 1);
  CHECK(a.inbox.lost[0].first == 1);
}

DISTRPC_MP_TEST("auto: two processes pick shm, or tcp when their shm domains are forced apart", 2,
                90) {
  const bool apart = std::getenv("DISTRPC_TRANSPORT_DOMAIN_OVERRIDE_SHM") != nullptr;
  Inbox inbox;
  AutoShmTcp::Context c(options_for(ctx.rank, "tok", 20s), inbox.callbacks());
  ctx.publish("addr" + std::to_string(ctx.rank), c.address());
  const int other = 1 - ctx.rank;
  c.add_peer(other, "w" + std::to_string(other), ctx.lookup("addr" + std::to_string(other)));
  CHECK(c.transport_for(other) == (apart ? "tcp" : "shm"));
  for (int i = 0; i < 50; ++i) {
    c.send(other, make_message(MessageType::Request, i, "m", {pattern_bytes(100000 + i, i)}));
  }
  REQUIRE(inbox.wait_messages(50, 30s));
  std::lock_guard<std::mutex> lk(inbox.mu);
  int bad = 0;
  for (int i = 0; i < 50; ++i) {
    const auto& m = inbox.messages[static_cast<std::size_t>(i)].second;
    bad += (m.id == static_cast<std::uint64_t>(i) &&
            same_bytes(m.buffers.at(0), pattern_bytes(100000 + i, i)))
               ? 0
               : 1;
  }
  CHECK(bad == 0);
  ctx.publish("done" + std::to_string(ctx.rank), "1");
  ctx.lookup("done" + std::to_string(other));
}

TEST_CASE("auto: the multi-process case again with shm domains forced apart") {
  distrpc::testing::RunOptions o;
  o.world = 2;
  o.limit = 90s;
  o.env.push_back("DISTRPC_TRANSPORT_DOMAIN_OVERRIDE_SHM=host-{id}");
  const auto r = distrpc::testing::run_ranks(
      "auto: two processes pick shm, or tcp when their shm domains are forced apart", o);
  INFO(r.report());
  CHECK(r.ok);
}

// ---- the record parser, driven without sockets
// --------------------------------------------------- RecordParser (shm/detail/record.hpp) turns a
// ring's bytes back into messages. These tests put records into a ring in ordinary memory with the
// writer's own encoder and feed the parser the bytes in pieces, as a real writer publishes them.

namespace {

namespace sd = distrpc::transport::shm::detail;
namespace wire = distrpc::wire;

// A ring in this process's memory: no memfd, no socket.
struct MemRing {
  explicit MemRing(std::uint64_t capacity)
      : mem(static_cast<char*>(std::aligned_alloc(4096, sd::kRingHeaderBytes + capacity))),
        writer((sd::init_ring(mem.get(), capacity), mem.get()), capacity),
        reader(mem.get(), capacity) {}
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<char, Free> mem;
  sd::RingWriter writer;
  sd::RingReader reader;
};

at::Tensor bytes_tensor(std::size_t n, int seed) {
  auto t = at::empty({static_cast<std::int64_t>(n)}, at::kByte);
  auto* p = t.data_ptr<std::uint8_t>();
  for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<std::uint8_t>((i * 31 + seed) & 0xFF);
  return t;
}

std::string tensor_bytes(const at::Tensor& t) {
  return std::string(static_cast<const char*>(t.data_ptr()), static_cast<std::size_t>(t.numel()));
}

// The ring bytes of `m`'s record with every buffer inline (what write_message puts in the ring).
std::string inline_record(const wire::Message& m, std::uint32_t flags = 0,
                          std::uint32_t forget = 0) {
  std::string out;
  sd::append_record_head(out, m, 0, flags, forget,
                         std::vector<std::uint64_t>(m.buffers.size(), sd::kInline));
  out += m.payload;
  for (const auto& b : m.buffers) out += tensor_bytes(b);
  return out;
}

// Writes `bytes` into the ring `chunk` bytes at a time, publishing each piece and letting the
// parser read what is there before the next; returns the messages it produced.
std::vector<wire::Message> feed(MemRing& ring, sd::RecordParser& parser, const std::string& bytes,
                                std::size_t chunk, std::size_t* empty_reads = nullptr) {
  std::vector<wire::Message> out;
  std::size_t at = 0;
  while (at < bytes.size()) {
    const std::size_t k = static_cast<std::size_t>(
        std::min<std::uint64_t>({chunk, bytes.size() - at, ring.writer.free_space()}));
    REQUIRE(k > 0);  // the parser below frees what it read: the ring never stays full
    ring.writer.copy_in(bytes.data() + at, k);
    at += k;
    ring.writer.publish();
    std::uint64_t avail = ring.reader.available();
    while (avail > 0) {
      auto m = parser.parse(ring.reader, avail);
      if (!m) {
        if (empty_reads) ++*empty_reads;
        break;
      }
      out.push_back(std::move(*m));
    }
    ring.reader.release();
  }
  return out;
}

sd::RecordParser make_parser(wire::Limits limits = {}) {
  return sd::RecordParser(limits, nullptr);
}

// The parser's error for `bytes` (which must make it throw), or "" if it threw nothing.
std::string parse_error(const std::string& bytes, wire::Limits limits = {}) {
  MemRing ring(sd::kMinRingCapacity);
  auto parser = make_parser(limits);
  try {
    feed(ring, parser, bytes, bytes.size());
  } catch (const wire::ProtocolError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("shm records: messages arriving in small pieces are reassembled, back to back") {
  wire::Message a;
  a.type = wire::MessageType::Request;
  a.id = 41;
  a.payload = "a request's payload";
  a.buffers = {bytes_tensor(3, 1), bytes_tensor(1000, 2), bytes_tensor(0, 3)};
  wire::Message b;
  b.type = wire::MessageType::Response;
  b.id = 42;  // an empty message: header only
  wire::Message c;
  c.type = wire::MessageType::Exception;
  c.id = 43;
  c.payload = std::string(5000, 'x');

  const std::string bytes = inline_record(a) + inline_record(b) + inline_record(c);
  for (const std::size_t chunk : {std::size_t{1}, std::size_t{7}, std::size_t{4096}}) {
    CAPTURE(chunk);
    MemRing ring(sd::kMinRingCapacity);
    auto parser = make_parser();
    const auto got = feed(ring, parser, bytes, chunk);
    REQUIRE(got.size() == 3);
    CHECK(got[0].type == wire::MessageType::Request);
    CHECK(got[0].id == 41);
    CHECK(got[0].payload == a.payload);
    REQUIRE(got[0].buffers.size() == 3);
    for (std::size_t i = 0; i < 3; ++i)
      CHECK(tensor_bytes(got[0].buffers[i]) == tensor_bytes(a.buffers[i]));
    CHECK(got[1].type == wire::MessageType::Response);
    CHECK(got[1].id == 42);
    CHECK(got[1].payload.empty());
    CHECK(got[1].buffers.empty());
    CHECK(got[2].type == wire::MessageType::Exception);
    CHECK(got[2].id == 43);
    CHECK(got[2].payload == c.payload);
    CHECK_FALSE(parser.mid_record());
  }

  // Cut anywhere inside a record, the parser waits for the rest and says it is mid-record.
  MemRing ring(sd::kMinRingCapacity);
  auto parser = make_parser();
  const std::string first = inline_record(a);
  CHECK(feed(ring, parser, first.substr(0, first.size() - 1), first.size()).empty());
  CHECK(parser.mid_record());
  const auto rest = feed(ring, parser, first.substr(first.size() - 1), 1);
  REQUIRE(rest.size() == 1);
  CHECK(tensor_bytes(rest[0].buffers[1]) == tensor_bytes(a.buffers[1]));
  CHECK_FALSE(parser.mid_record());
}

TEST_CASE("shm records: a message larger than the ring streams through it intact") {
  wire::Message m;
  m.type = wire::MessageType::Request;
  m.id = 7;
  m.payload.resize(3 * sd::kMinRingCapacity + 123);
  for (std::size_t i = 0; i < m.payload.size(); ++i) m.payload[i] = static_cast<char>(i % 251);
  m.buffers = {bytes_tensor(2 * sd::kMinRingCapacity + 5, 9), bytes_tensor(17, 4)};
  const std::string bytes = inline_record(m);
  REQUIRE(bytes.size() > 5 * sd::kMinRingCapacity);

  MemRing ring(sd::kMinRingCapacity);
  auto parser = make_parser();
  std::size_t waits = 0;  // reads that ended mid-record: the ring held only part of it
  const auto got = feed(ring, parser, bytes, sd::kMinRingCapacity, &waits);
  REQUIRE(got.size() == 1);
  CHECK(waits >= 5);
  CHECK(got[0].id == 7);
  CHECK(got[0].payload == m.payload);
  REQUIRE(got[0].buffers.size() == 2);
  CHECK(tensor_bytes(got[0].buffers[0]) == tensor_bytes(m.buffers[0]));
  CHECK(tensor_bytes(got[0].buffers[1]) == tensor_bytes(m.buffers[1]));
}

TEST_CASE("shm records: a buffer placed in a segment is a view of the segment's bytes") {
  // A segment in a memfd of this process, standing in for one the writer announced.
  const std::uint64_t cap = 4096;
  auto fd = sd::make_memfd("distrpc-shm test segment", sd::kSegmentHeaderBytes + cap);
  auto seg = std::make_shared<sd::RecvSegment>();
  seg->map = sd::map_shared(fd.get(), sd::kSegmentHeaderBytes + cap, /*prefault=*/false);
  seg->capacity = cap;
  for (std::uint64_t i = 0; i < cap; ++i) seg->data()[i] = static_cast<char>(i & 0x7F);
  std::vector<std::uint32_t> asked;
  sd::RecordParser parser(wire::Limits{}, [&](std::uint32_t id) {
    asked.push_back(id);
    return seg;
  });

  wire::Message m;
  m.id = 5;
  m.buffers = {bytes_tensor(100, 0), bytes_tensor(6, 1)};
  std::string bytes;
  sd::append_record_head(bytes, m, /*segment=*/3, 0, 0, {64, sd::kInline});
  bytes += tensor_bytes(m.buffers[1]);  // only the inline buffer travels in the ring
  MemRing ring(sd::kMinRingCapacity);
  auto got = feed(ring, parser, bytes, bytes.size());
  REQUIRE(got.size() == 1);
  CHECK(asked == std::vector<std::uint32_t>{3});
  CHECK(parser.segments_in_use() == 1);
  CHECK(tensor_bytes(got[0].buffers[0]) == std::string(seg->data() + 64, 100));
  CHECK(tensor_bytes(got[0].buffers[1]) == tensor_bytes(m.buffers[1]));

  // The same segment again is not asked for; one reaching past its end is refused.
  std::string outside;
  sd::append_record_head(outside, m, 3, 0, 0, {cap - 50, sd::kInline});
  outside += tensor_bytes(m.buffers[1]);
  try {
    feed(ring, parser, outside, outside.size());
    FAIL("a buffer outside its segment was accepted");
  } catch (const wire::ProtocolError& e) {
    CHECK(std::string(e.what()) ==
          "buffer 0 of 100 bytes at offset 4046 reaches outside segment 3 of 4096 bytes");
  }
  CHECK(asked.size() == 1);
}

TEST_CASE("shm records: a segment the peer never filled is mapped without committing its memory") {
  const std::uint64_t cap = 64 << 20;
  const std::size_t size = sd::kSegmentHeaderBytes + cap;
  const auto write_header = [&](int fd) {
    const std::uint64_t header[2] = {sd::kSegmentMagic, cap};
    REQUIRE(::pwrite(fd, header, sizeof header, 0) == static_cast<ssize_t>(sizeof header));
  };
  // As a hostile peer makes it: sealed, announced at 64 MiB, nothing but its header written.
  auto empty = sd::make_memfd("distrpc-shm test empty segment", size);
  write_header(empty.get());
  const auto hollow = sd::adopt_segment(empty.get(), 1, cap, cap);
  CHECK(hollow->capacity == cap);
  // (Up to one 2 MiB page for the header, where shared memory uses transparent huge pages.)
  CHECK(sd::allocated_bytes(empty.get()) < (4 << 20));
  CHECK(resident_kb("distrpc-shm test empty segment") < 4096);
  // As our writer makes it: every page filled first. Then the receiver's mapping is filled in bulk.
  auto full = sd::make_memfd("distrpc-shm test full segment", size);
  std::memset(sd::map_shared(full.get(), size, /*prefault=*/false)->base(), 1, size);
  write_header(full.get());
  REQUIRE(sd::allocated_bytes(full.get()) >= size);
  const auto filled = sd::adopt_segment(full.get(), 2, cap, cap);
  // Prefaulting is advice (MADV_POPULATE_WRITE, Linux 5.14): without it there is nothing to see.
  if (::madvise(filled->map->base(), 4096, sd::kMadvPopulateWrite) == 0) {
    CHECK(resident_kb("distrpc-shm test full segment") == static_cast<long>(size / 1024));
  }
}

TEST_CASE("shm records: a corrupted record header is an error naming what was wrong") {
  wire::Message m;
  m.id = 1;
  m.payload = "p";
  const std::string good = inline_record(m);

  std::string bad_magic = good;
  bad_magic[0] = '\xEF';
  bad_magic[1] = '\xBE';
  bad_magic[2] = '\xAD';
  bad_magic[3] = '\xDE';
  CHECK(parse_error(bad_magic) ==
        "bad record magic 0xdeadbeef in the shared ring (the stream is "
        "corrupted)");
  CHECK(parse_error(inline_record(m, /*flags=*/6)) == "record flags 6 are not defined");
  CHECK(parse_error(inline_record(m, 0, /*forget=*/9)) ==
        "the peer releases segment 9, which is not in use");

  std::string named = good;
  named[4] = 2;  // names segment 2: this parser has no source of segments
  CHECK(parse_error(named) ==
        "a record names segment 2, which was never announced (this reader takes no segments)");

  wire::Message hello;
  hello.type = wire::MessageType::Handshake;
  CHECK(parse_error(inline_record(hello)) ==
        "unexpected Handshake record on an established connection");

  // The frame header inside the record is checked against the connection's limits.
  wire::Limits small;
  small.max_payload_bytes = 16;
  m.payload = std::string(17, 'p');
  CHECK(parse_error(inline_record(m), small) == "frame payload length 17 exceeds limit 16");

  // A good record still parses after all this (the helpers above are not what fails).
  CHECK(parse_error(good).empty());
}

TEST_CASE(
    "shm records: a ring header the peer corrupted is a ProtocolError, as every transport's") {
  MemRing ring(sd::kMinRingCapacity);
  CHECK(ring.reader.available() == 0);
  std::memset(ring.mem.get(), 0x5a, 8);  // the magic
  try {
    (void)ring.reader.available();
    FAIL("a corrupted ring header went unnoticed");
  } catch (const wire::ProtocolError& e) {
    CHECK(std::string(e.what()).rfind(
              "the shared ring header is corrupted (magic 0x5a5a5a5a5a5a5a5a", 0) == 0);
  }
  CHECK_THROWS_AS(ring.writer.free_space(), sd::RingCorrupt);
}
