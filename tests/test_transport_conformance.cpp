// The transport conformance suite: every behaviour the transport contract (transport.hpp) asks of
// a policy, written once and run for Tcp, Shm, Auto<Shm, Tcp> and Faulty<Tcp> (no faults: the
// decorator must change nothing; it runs the in-process cases only, which take a few seconds: the
// two multi-process ones, echo between processes and a SIGKILLed peer, exercise only the reading
// threads and the loss detection of the policy it wraps, which it forwards untouched, and would
// add about 16 s). Delivery (values, exact bytes, order, concurrency, a 64 MiB buffer), the
// add_peer() rule, refused identities and tokens, peer loss (a destroyed context, a SIGKILLed
// process), limits on both ends, shutdown under load, the leader/follower hand-back and drive().
// What only one policy has (raw-socket hostility, ring and segment details, Auto's choice of
// candidate) stays in test_transport_tcp.cpp and test_transport_shm.cpp.
//
// Test names: "transport conformance <Policy>: <behaviour>". Multi-process cases re-execute this
// binary once per rank (tests/harness/multiprocess.hpp).
#include <signal.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include <doctest/doctest.h>

#include "distrpc/transport/auto.hpp"
#include "distrpc/transport/faulty.hpp"
#include "distrpc/transport/shm.hpp"
#include "distrpc/transport/tcp.hpp"
#include "distrpc/wire/errors.hpp"
#include "distrpc/wire/message.hpp"
#include "multiprocess.hpp"
#include "support/host_channel.hpp"
#include "support/transport_test_util.hpp"

namespace {

using namespace distrpc::testing::transport_names;
using distrpc::transport::Shm;
using distrpc::transport::Tcp;
using AutoShmTcp = distrpc::transport::Auto<Shm, Tcp>;
using FaultyTcp = distrpc::transport::Faulty<Tcp>;
// DeviceDirect over Tcp with the host-memory stand-in channel: every buffer of 64 bytes or more
// travels through the channel, so each scenario also checks that the decorator keeps the contract.
using DirectTcp = distrpc::testing::HostDirect<Tcp>;

// What differs between the policies where the contract leaves a choice.
template <class P>
struct Traits;
template <>
struct Traits<Tcp> {
  // One reading thread per connection runs the first task of a stream only when it is idle.
  static constexpr bool first_task_runs_inline = false;
  // Buffers are read into fresh tensors: no alignment promised beyond the allocator's.
  static constexpr bool aligned_buffers = false;
  // An address where nothing listens (a loopback port free a moment ago).
  static std::string ghost_address() {
    return "127.0.0.1:" + std::to_string(distrpc::testing::free_loopback_port());
  }
};
template <>
struct Traits<Shm> {
  static constexpr bool first_task_runs_inline = true;
  static constexpr bool aligned_buffers = true;  // segment tensors start on 64-byte boundaries
  static std::string ghost_address() { return "distrpc-shm-1-ghost"; }
};
template <>
struct Traits<AutoShmTcp> {
  // Two workers of this process share the shm domain: Auto carries their messages on shm.
  static constexpr bool first_task_runs_inline = Traits<Shm>::first_task_runs_inline;
  static constexpr bool aligned_buffers = Traits<Shm>::aligned_buffers;
  static std::string ghost_address() {
    namespace ad = distrpc::transport::detail;
    return ad::encode_address(
        {{"shm", ad::effective_domain_key<Shm>(3), Traits<Shm>::ghost_address()},
         {"tcp", ad::effective_domain_key<Tcp>(3), Traits<Tcp>::ghost_address()}});
  }
};

template <>
struct Traits<FaultyTcp> : Traits<Tcp> {};
template <>
struct Traits<DirectTcp> : Traits<Tcp> {};

using distrpc::testing::check_still_works;

// ---- delivery -------------------------------------------------------------------------------

template <class P>
void concept_scenario() {
  static_assert(distrpc::transport::check_transport<P>());
  CHECK(P::viable());
  CHECK_FALSE(P::domain_key().empty());
  CHECK(P::domain_key() == P::domain_key());  // stable
  NodeOf<P> a(0), b(1);
  CHECK_FALSE(a.ctx->address().empty());
  CHECK(a.ctx->address() != b.ctx->address());
}

// Every message shape both ways: tensors small and large (inline and in segments for shm), an
// empty one, binary payloads, an empty payload, and the message types beyond Request/Response.
template <class P>
void exchange_scenario() {
  NodeOf<P> a(0), b(1);
  introduce(a, 0, b, 1);
  const at::Tensor floats = at::arange(0, 1000, at::kFloat) * 0.5;  // 4000 bytes
  const at::Tensor raw = pattern_bytes(4097, 7);                    // odd size
  const at::Tensor big = pattern_bytes(300 * 1024, 7);              // a segment on shm
  const at::Tensor big2 = pattern_bytes(70 * 1024 + 3, 8);          // same segment, after it
  a.ctx->send(1, make_message(MessageType::Request, 42, "hello from w0",
                              {bytes_of(floats), raw, big, at::empty({0}, at::kByte), big2}));
  const at::Tensor ints = at::arange(-50, 50, at::kLong);
  b.ctx->send(0, make_message(MessageType::Response, 43, std::string("\0bin\xff", 5),
                              {bytes_of(ints), at::empty({0}, at::kByte)}));
  b.ctx->send(0, make_message(MessageType::Exception, 44, ""));
  b.ctx->send(0, make_message(distrpc::wire::control_message_type(3), 45, "ctl"));

  REQUIRE(b.inbox.wait_messages(1));
  REQUIRE(a.inbox.wait_messages(3));
  {
    std::lock_guard<std::mutex> lk(b.inbox.mu);
    REQUIRE(b.inbox.messages.size() == 1);
    auto& [peer, m] = b.inbox.messages[0];
    CHECK(peer == 0);
    CHECK(m.type == MessageType::Request);
    CHECK(m.id == 42);
    CHECK(m.payload == "hello from w0");
    REQUIRE(m.buffers.size() == 5);
    for (const auto& t : m.buffers) {
      CHECK((t.scalar_type() == at::kByte));
      CHECK(t.dim() == 1);
      CHECK(t.is_contiguous());
    }
    CHECK(m.buffers[0].numel() == 4000);
    CHECK(at::equal(at::from_blob(m.buffers[0].data_ptr(), {1000}, at::kFloat), floats));
    CHECK(same_bytes(m.buffers[1], raw));
    CHECK(same_bytes(m.buffers[2], big));
    CHECK(m.buffers[3].numel() == 0);
    CHECK(same_bytes(m.buffers[4], big2));
    if constexpr (Traits<P>::aligned_buffers) {
      CHECK(reinterpret_cast<std::uintptr_t>(m.buffers[4].data_ptr()) % 64 == 0);
    }
  }
  {
    std::lock_guard<std::mutex> lk(a.inbox.mu);
    REQUIRE(a.inbox.messages.size() == 3);
    auto& [peer, m] = a.inbox.messages[0];
    CHECK(peer == 1);
    CHECK(m.type == MessageType::Response);
    CHECK(m.id == 43);
    CHECK(m.payload == std::string("\0bin\xff", 5));
    REQUIRE(m.buffers.size() == 2);
    CHECK(at::equal(at::from_blob(m.buffers[0].data_ptr(), {100}, at::kLong), ints));
    CHECK(m.buffers[1].numel() == 0);
    CHECK(a.inbox.messages[1].first == 1);
    CHECK(a.inbox.messages[1].second.type == MessageType::Exception);
    CHECK(a.inbox.messages[1].second.id == 44);
    CHECK(a.inbox.messages[1].second.payload.empty());
    CHECK(a.inbox.messages[2].second.type == distrpc::wire::control_message_type(3));
    CHECK(a.inbox.messages[2].second.id == 45);
    CHECK(a.inbox.messages[2].second.payload == "ctl");
  }
  CHECK(a.inbox.lost_count() == 0);
  CHECK(b.inbox.lost_count() == 0);
}

template <class P>
void in_order_scenario() {
  NodeOf<P> a(0), b(1);
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
    const auto& [peer, m] = b.inbox.messages[static_cast<std::size_t>(i)];
    bool ok = peer == 0 && m.id == static_cast<std::uint64_t>(i) &&
              m.payload == "m" + std::to_string(i) && m.buffers.size() == sent[i].size();
    for (std::size_t k = 0; ok && k < sent[i].size(); ++k)
      ok = same_bytes(m.buffers[k], sent[i][k]);
    if (!ok) ++mismatches;
  }
  CHECK(mismatches == 0);
}

template <class P>
void four_threads_scenario() {
  NodeOf<P> a(0), b(1);
  introduce(a, 0, b, 1);
  constexpr int kThreads = 4, kPerThread = 500;
  std::vector<at::Tensor> expect;
  for (int t = 0; t < kThreads; ++t)
    expect.push_back(pattern_bytes(96 * 1024, static_cast<std::uint32_t>(t)));
  std::vector<std::thread> threads;
  std::atomic<int> errors{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      try {
        for (int i = 0; i < kPerThread; ++i) {
          std::vector<at::Tensor> bufs;
          if (i % 7 == 0) bufs.push_back(expect[static_cast<std::size_t>(t)]);
          a.ctx->send(
              1, make_message(MessageType::Request, static_cast<std::uint64_t>(t) * 1000000 + i,
                              "t" + std::to_string(t), std::move(bufs)));
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "sender %d: %s\n", t, e.what());
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
  std::map<std::uint64_t, std::int64_t> last;
  int out_of_order = 0, corrupt = 0;
  for (auto& [peer, m] : b.inbox.messages) {
    seen.insert(m.id);
    const std::uint64_t t = m.id / 1000000;
    const auto i = static_cast<std::int64_t>(m.id % 1000000);
    if (auto it = last.find(t); it != last.end() && it->second >= i) ++out_of_order;
    last[t] = i;
    if (peer != 0 || m.payload != "t" + std::to_string(t)) ++corrupt;
    if (i % 7 == 0 && (m.buffers.size() != 1 || !same_bytes(m.buffers[0], expect[t]))) ++corrupt;
  }
  CHECK(seen.size() == kThreads * kPerThread);
  CHECK(out_of_order == 0);
  CHECK(corrupt == 0);
}

// Two round trips, so that whatever a policy caches after the first (a segment) is used again.
template <class P>
void big_round_trip_scenario() {
  NodeOf<P> a(0), b(1);
  introduce(a, 0, b, 1);
  const at::Tensor big = pattern_bytes(64 << 20, 99);
  for (int round = 0; round < 2; ++round) {
    const auto t0 = Clock::now();
    a.ctx->send(1, make_message(MessageType::Request, round, "big", {big}));
    REQUIRE(b.inbox.wait_messages(static_cast<std::size_t>(round) + 1, 30s));
    Message got = b.inbox.take(static_cast<std::size_t>(round));
    REQUIRE(got.buffers.size() == 1);
    CHECK(got.buffers[0].numel() == (64 << 20));
    b.ctx->send(0, make_message(MessageType::Response, round, "big back", {got.buffers[0]}));
    got = Message{};
    REQUIRE(a.inbox.wait_messages(static_cast<std::size_t>(round) + 1, 30s));
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    const Message back = a.inbox.take(static_cast<std::size_t>(round));
    CHECK(back.payload == "big back");
    REQUIRE(back.buffers.size() == 1);
    CHECK(same_bytes(back.buffers[0], big));
    MESSAGE("64 MiB round trip " << round << ": " << ms << " ms");
  }
}

// Two processes, rank 1 echoing from its I/O thread: a send made inside a callback, connecting
// on first use.
template <class P>
void echo_processes(const distrpc::testing::RankContext& ctx) {
  Inbox inbox;
  std::unique_ptr<typename P::Context> ctx_ptr;
  TransportCallbacks cb = inbox.callbacks();
  if (ctx.rank == 1) {
    cb.on_message = [&ctx_ptr, &inbox](int peer, Message&& m) {
      ctx_ptr->send(peer,
                    make_message(MessageType::Response, m.id, "echo:" + m.payload, m.buffers));
      std::lock_guard<std::mutex> lk(inbox.mu);
      inbox.messages.emplace_back(peer, std::move(m));
      inbox.cv.notify_all();
    };
  }
  ctx_ptr = std::make_unique<typename P::Context>(options_for(ctx.rank, "", 20s), std::move(cb));
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
                          {pattern_bytes(1 + i * 997, static_cast<std::uint32_t>(i))}));
    }
    REQUIRE(inbox.wait_messages(kCount, 30s));
    std::lock_guard<std::mutex> lk(inbox.mu);
    int bad = 0;
    for (int i = 0; i < kCount; ++i) {
      const auto& [peer, m] = inbox.messages[static_cast<std::size_t>(i)];
      if (peer != 1 || m.type != MessageType::Response || m.id != static_cast<std::uint64_t>(i) ||
          m.payload != "echo:" + std::to_string(i) || m.buffers.size() != 1 ||
          !same_bytes(m.buffers[0], pattern_bytes(1 + i * 997, static_cast<std::uint32_t>(i)))) {
        ++bad;
      }
    }
    CHECK(bad == 0);
    CHECK(inbox.lost.empty());  // (rank 1 may see rank 0 go once "done" is published)
    ctx.publish("done", "1");
  } else {
    REQUIRE(inbox.wait_messages(kCount, 30s));
    ctx.lookup("done");
  }
  ctx_ptr->shutdown();
}

// ---- peers that are not (or no longer) who they should be -----------------------------------

// What a send() that must fail threw (a DistNetworkError), or "" when it did not throw.
template <class N>
std::string send_failure(N& node, int peer, Message m) {
  try {
    node.ctx->send(peer, std::move(m));
  } catch (const DistNetworkError& e) {
    return e.what();
  }
  return "";
}

template <class P>
void nothing_listens_scenario() {
  NodeOf<P> a(options_for(0, "", 600ms));
  const std::string ghost = Traits<P>::ghost_address();
  a.ctx->add_peer(3, "ghost", ghost);
  const auto t0 = Clock::now();
  const std::string text = send_failure(a, 3, make_message(MessageType::Request, 1, "anyone?"));
  const auto took = Clock::now() - t0;
  CHECK(contains(text, "worker 3 ('ghost')"));
  CHECK(contains(text, "600 ms"));
  if constexpr (std::is_same_v<P, Tcp> || std::is_same_v<P, FaultyTcp> ||
                std::is_same_v<P, DirectTcp>)
    CHECK(contains(text, ghost));
  CHECK(took >= 500ms);  // it retried until the deadline...
  CHECK(took < 1600ms);  // ...and not much longer
  // A second sender gives up within the timeout again instead of waiting forever.
  const auto t1 = Clock::now();
  CHECK_THROWS_AS(a.ctx->send(3, make_message(MessageType::Request, 2, "again?")),
                  DistNetworkError);
  CHECK(Clock::now() - t1 < 1600ms);
  CHECK(a.inbox.lost_count() == 0);
}

// An unknown peer, a wrong or missing secret, and an address that leads to another worker are
// refused with texts naming them; the good peer keeps working and is never reported lost.
template <class P>
void refused_identities_scenario() {
  const std::string token = "s3cret";
  NodeOf<P> a(options_for(0, token)), b(options_for(1, token));
  introduce(a, 0, b, 1);
  check_still_works(a, b, 1);
  CHECK_THROWS_WITH_AS(a.ctx->send(5, make_message(MessageType::Request, 1, "x")),
                       doctest::Contains("worker 5"), DistNetworkError);
  LogLines log;
  {
    // A wrong secret: the dialler finds a's proof wrong (a proves first) and gives up.
    NodeOf<P> intruder(options_for(7, "guess"));
    intruder.ctx->add_peer(0, "w0", a.ctx->address());
    const std::string text =
        send_failure(intruder, 0, make_message(MessageType::Request, 1, "let me in"));
    CHECK(contains(text, "handshake with worker 0 ('w0')"));
    CHECK(contains(text,
                   " failed: authentication failed: worker 'w0' (id 0) answered our "
                   "challenge with a wrong proof (a different shared secret, or a replayed "
                   "answer)"));
    CHECK_FALSE(contains(text, "guess"));
    CHECK_FALSE(contains(text, token));
  }
  {
    // No secret: a refuses it before anything else, and says why in its log.
    NodeOf<P> bare(options_for(8, ""));
    bare.ctx->add_peer(0, "w0", a.ctx->address());
    const std::string text =
        send_failure(bare, 0, make_message(MessageType::Request, 1, "let me in"));
    CHECK(contains(text, "refused our handshake"));
    const std::string line = log.wait_for("worker 'w8'");
    CHECK(contains(line, "dropping connection from "));
    CHECK(contains(line,
                   ": bad handshake: authentication failed: worker 'w8' (id 8) has no "
                   "shared secret configured, and this worker requires one"));
  }
  {
    // A secret on the dialler only: refused the same way.
    NodeOf<P> open(options_for(0, ""));
    NodeOf<P> keyed(options_for(9, token));
    keyed.ctx->add_peer(0, "w0", open.ctx->address());
    const std::string text = send_failure(keyed, 0, make_message(MessageType::Request, 1, "hello"));
    CHECK(contains(text, "refused our handshake"));
    CHECK(contains(log.wait_for("worker 'w9'"),
                   "authentication failed: worker 'w9' (id 9) has a shared secret configured, "
                   "and this worker has none"));
    CHECK(open.inbox.message_count() == 0);
  }
  {
    // Worker 2's address points at a worker 1 a does not work with (wrong_address_scenario has
    // one it does): the handshake reply exposes the mistake.
    NodeOf<P> stranger(options_for(1, token));
    a.ctx->add_peer(2, "w2", stranger.ctx->address());
    const std::string text = send_failure(a, 2, make_message(MessageType::Request, 1, "x"));
    CHECK(contains(text, "worker 2 ('w2')"));
    CHECK(contains(text, "reached worker 1 ('w1')"));
    CHECK(stranger.inbox.message_count() == 0);  // nothing of it was delivered
  }
  check_still_works(a, b, 2);
  std::this_thread::sleep_for(50ms);
  for (auto* n : {&a, &b}) {
    std::lock_guard<std::mutex> lk(n->inbox.mu);
    CHECK(n->inbox.lost.empty());  // neither good peer was reported lost
  }
  CHECK_FALSE(contains(log.all(), token));  // no diagnostic holds the secret
}

// An address that leads to a worker we already work with (a stale or mistyped address): the
// dialler finds the wrong identity in the reply and hangs up. That hang-up must not reach the
// worker it dialled as the loss of the dialler, with or without a secret: the answering side takes
// a connection into use only once the dialler has confirmed whom it reached.
template <class P>
void wrong_address_scenario() {
  for (const std::string token : {"", "s3cret"}) {
    CAPTURE(token);
    NodeOf<P> a(options_for(0, token)), b(options_for(1, token));
    introduce(a, 0, b, 1);
    check_still_works(a, b, 1);
    const std::size_t b_had = b.inbox.message_count();
    a.ctx->add_peer(2, "w2", b.ctx->address());
    for (int attempt = 0; attempt < 3; ++attempt) {
      const std::string text = send_failure(a, 2, make_message(MessageType::Request, 1, "for w2"));
      CHECK(contains(text, "worker 2 ('w2')"));
      CHECK(contains(text, "reached worker 1 ('w1') instead"));
    }
    std::this_thread::sleep_for(200ms);  // time for a wrongly reported loss to arrive
    check_still_works(a, b, 2);
    CHECK(b.inbox.message_count() == b_had + 1);  // nothing meant for w2 was delivered
    for (auto* n : {&a, &b}) {
      std::lock_guard<std::mutex> lk(n->inbox.mu);
      CHECK(n->inbox.lost.empty());
    }
  }
}

// The worker moved (add_peer() at a new address) while a send() was still dialling its old
// address, where nothing answers any more: the send gives up there and reaches the new address,
// well within connect_timeout.
template <class P>
void moved_during_dial_scenario() {
  NodeOf<P> a(options_for(0, "", 8s)), replacement(options_for(7, ""));
  a.ctx->add_peer(7, "w7", Traits<P>::ghost_address());
  std::promise<std::string> sent;
  std::thread sender([&] {
    try {
      a.ctx->send(7, make_message(MessageType::Request, 1, "for the replacement"));
      sent.set_value("");
    } catch (const DistNetworkError& e) {
      sent.set_value(e.what());
    }
  });
  std::this_thread::sleep_for(300ms);  // the dial is retrying the old address by now
  a.ctx->add_peer(7, "w7", replacement.ctx->address());
  std::future<std::string> outcome = sent.get_future();
  const bool prompt = outcome.wait_for(3s) == std::future_status::ready;
  CHECK(prompt);
  sender.join();  // within connect_timeout (8 s) either way
  CHECK(outcome.get() == "");
  REQUIRE(replacement.inbox.wait_messages(1, 5s));
  {
    std::lock_guard<std::mutex> lk(replacement.inbox.mu);
    CHECK(replacement.inbox.messages[0].second.payload == "for the replacement");
  }
  CHECK(a.inbox.lost_count() == 0);
}

template <class P>
void destroyed_peer_scenario() {
  NodeOf<P> a(0);
  auto b = std::make_unique<NodeOf<P>>(1);
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
  CHECK(a.inbox.lost_count() == 1);  // both directions broke; the peer is reported once
  // Sending to it now fails at once, naming it and why.
  const auto t1 = Clock::now();
  CHECK_THROWS_WITH_AS(a.ctx->send(1, make_message(MessageType::Request, 3, "anyone?")),
                       doctest::Contains("worker 1 ('w1')"), DistNetworkError);
  CHECK(Clock::now() - t1 < 500ms);
}

// `b`, a registered incarnation of worker 1 after one loss of worker 1 at `a`, dies: `a` reports
// that second loss, once.
template <class N>
void check_second_loss(N& a, std::unique_ptr<N>& b) {
  b.reset();
  REQUIRE(a.inbox.wait_lost(2, 2s));
  CHECK(a.inbox.lost[1].first == 1);
  std::this_thread::sleep_for(200ms);
  CHECK(a.inbox.lost_count() == 2);
}

// add_peer() after a loss starts a fresh incarnation (transport/detail/peer_liveness.hpp): the
// peer, restarted at a new address, is reached afresh both ways, and whatever the old pair still
// reports (a late hang-up) does not mark the new registration lost.
template <class P>
void registered_again_scenario() {
  NodeOf<P> a(0);
  auto b = std::make_unique<NodeOf<P>>(1);
  introduce(a, 0, *b, 1);
  check_still_works(a, *b, 1);
  b.reset();
  REQUIRE(a.inbox.wait_lost(1, 2s));
  auto b2 = std::make_unique<NodeOf<P>>(1);  // worker 1 again, restarted
  introduce(a, 0, *b2, 1);
  for (std::uint64_t id = 2; id < 5; ++id) check_still_works(a, *b2, id);
  std::this_thread::sleep_for(200ms);
  CHECK(a.inbox.lost_count() == 1);
  CHECK(b2->inbox.lost_count() == 0);
  // And the new incarnation is lost in its turn, reported once more.
  check_second_loss(a, b2);
}

// A peer restarted at a new address and registered before its old incarnation's loss was
// noticed (the old process still had its connections open): the old pair's hang-up, arriving
// after the new registration, is not reported, and the new incarnation is reached both ways.
template <class P>
void replaced_before_loss_scenario() {
  NodeOf<P> a(0);
  auto b = std::make_unique<NodeOf<P>>(1);
  introduce(a, 0, *b, 1);
  check_still_works(a, *b, 1);
  auto b2 = std::make_unique<NodeOf<P>>(1);  // worker 1 again, at a new address
  introduce(a, 0, *b2, 1);
  b.reset();  // the old incarnation's connections break only now
  for (std::uint64_t id = 2; id < 5; ++id) check_still_works(a, *b2, id);
  std::this_thread::sleep_for(300ms);
  CHECK(a.inbox.lost_count() == 0);
  CHECK(b2->inbox.lost_count() == 0);
  check_still_works(a, *b2, 5);
  // The new incarnation's own loss is reported, once.
  b2.reset();
  REQUIRE(a.inbox.wait_lost(1, 2s));
  CHECK(a.inbox.lost[0].first == 1);
}

// A replacement that dials before its registration reaches this side (it learnt of us first),
// after the old incarnation's loss was noticed (`old_lost_first`) or before: its connection is
// adopted while the old address is still registered, and its Hello says where it listens. Once
// add_peer() registers that address the connection is the new incarnation's, so its loss is
// reported, though this side never dialled the replacement (no connection of ours would break).
template <class P>
void replacement_dials_first(bool old_lost_first) {
  CAPTURE(old_lost_first);
  NodeOf<P> a(0);
  auto b = std::make_unique<NodeOf<P>>(1);
  introduce(a, 0, *b, 1);
  check_still_works(a, *b, 1);  // a's messages: 1
  if (old_lost_first) {
    b.reset();
    REQUIRE(a.inbox.wait_lost(1, 2s));
  }
  // A replacement that dies before it is registered here: nobody's loss (the old incarnation,
  // alive or not, is not lost by it), and its messages were delivered.
  {
    NodeOf<P> early(1);
    early.ctx->add_peer(0, "w0", a.ctx->address());
    early.ctx->send(0, make_message(MessageType::Request, 90, "short-lived"));
    REQUIRE(a.inbox.wait_messages(2));
  }
  std::this_thread::sleep_for(200ms);
  CHECK(a.inbox.lost_count() == (old_lost_first ? 1 : 0));
  auto b2 = std::make_unique<NodeOf<P>>(1);  // worker 1 again, at a new address
  b2->ctx->add_peer(0, "w0", a.ctx->address());
  b2->ctx->send(0, make_message(MessageType::Request, 2, "from the replacement"));
  REQUIRE(a.inbox.wait_messages(3));
  if (!old_lost_first) {
    b.reset();  // the old incarnation's connections break now: its loss is reported
    REQUIRE(a.inbox.wait_lost(1, 2s));
  }
  a.ctx->add_peer(1, "w1", b2->ctx->address());
  b2->ctx->send(0, make_message(MessageType::Request, 3, "registered now"));
  REQUIRE(a.inbox.wait_messages(4));
  {
    std::lock_guard<std::mutex> lk(a.inbox.mu);
    CHECK(a.inbox.messages.back().second.payload == "registered now");
  }
  std::this_thread::sleep_for(100ms);
  CHECK(a.inbox.lost_count() == 1);
  check_second_loss(a, b2);
}
template <class P>
void replacement_dials_first_scenario() {
  replacement_dials_first<P>(true);
  replacement_dials_first<P>(false);
}

// The rank body for "a SIGKILLed peer": rank 1 kills itself once messages flow both ways.
template <class P>
void sigkilled_target(const distrpc::testing::RankContext& ctx) {
  Inbox inbox;
  typename P::Context c(options_for(ctx.rank, "", 20s), inbox.callbacks());
  ctx.publish("addr" + std::to_string(ctx.rank), c.address());
  const int other = 1 - ctx.rank;
  c.add_peer(other, "w" + std::to_string(other), ctx.lookup("addr" + std::to_string(other)));
  if (ctx.rank == 1) {
    c.send(0, make_message(MessageType::Request, 1, "about to die"));
    ctx.lookup("ready");
    const auto now = Clock::now().time_since_epoch();
    ctx.publish("killed_at",
                std::to_string(std::chrono::duration_cast<std::chrono::microseconds>(now).count()));
    ::kill(::getpid(), SIGKILL);
  }
  REQUIRE(inbox.wait_messages(1, 20s));
  c.send(1, make_message(MessageType::Request, 2, "hi"));  // connections both ways
  ctx.publish("ready", "1");
  REQUIRE(inbox.wait_lost(1, 20s));
  // steady_clock is CLOCK_MONOTONIC: one clock for every process on this machine.
  const auto killed_at = std::chrono::microseconds(std::stoll(ctx.lookup("killed_at")));
  const auto noticed =
      std::chrono::duration_cast<std::chrono::microseconds>(inbox.lost_at[0].time_since_epoch());
  const auto delay = noticed - killed_at;
  CHECK(inbox.lost[0].first == 1);
  CHECK(delay < 2s);
  std::this_thread::sleep_for(200ms);
  CHECK(inbox.lost_count() == 1);
  MESSAGE("SIGKILLed peer noticed after " << delay.count() << " us: " << inbox.lost[0].second);
}

void run_sigkilled(const char* target) {
  distrpc::testing::RunOptions o;
  o.world = 2;
  o.limit = 60s;
  o.may_die = {1};
  const auto r = distrpc::testing::run_ranks(target, o);
  INFO(r.report());
  REQUIRE(r.ranks.size() == 2);
  CHECK(r.ranks[1].signal == SIGKILL);
  CHECK(r.ranks[0].exit_code == 0);
  CHECK(r.ok);
}

// ---- limits -----------------------------------------------------------------------------------

template <class P>
void oversize_refused_scenario() {
  TransportOptions o = options_for(0);
  o.limits.max_message_bytes = 1 << 20;
  NodeOf<P> a(o), b(1);
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

// One exception type per failure kind, whatever the policy: callers (the agent) catch by type.
// Exact types: a bad argument, an unknown or unreachable peer and a stopped transport are
// DistNetworkError (and not a ProtocolError, which means the peer broke the protocol); an
// oversized message is wire::EncodeError (nothing was sent, the connection is fine).
using distrpc::testing::thrown_exactly;

template <class P>
void failure_types_scenario() {
  TransportOptions o = options_for(0, "", 300ms);
  o.limits.max_message_bytes = 1 << 20;
  NodeOf<P> a(o), b(1);
  introduce(a, 0, b, 1);
  CHECK(contains(
      thrown_exactly<DistNetworkError>([&] { a.ctx->add_peer(-1, "neg", b.ctx->address()); }),
      "negative"));
  CHECK(contains(
      thrown_exactly<DistNetworkError>([&] { a.ctx->add_peer(4, "w4", "not an address"); }),
      "'not an address'"));
  CHECK(contains(thrown_exactly<DistNetworkError>(
                     [&] { a.ctx->send(5, make_message(MessageType::Request, 1, "x")); }),
                 "worker 5"));
  a.ctx->add_peer(3, "ghost", Traits<P>::ghost_address());
  CHECK(contains(thrown_exactly<DistNetworkError>(
                     [&] { a.ctx->send(3, make_message(MessageType::Request, 2, "anyone?")); }),
                 "worker 3 ('ghost')"));
  CHECK(contains(thrown_exactly<distrpc::wire::EncodeError>([&] {
                   a.ctx->send(1, make_message(MessageType::Request, 3, "too big",
                                               {pattern_bytes(2 << 20, 1)}));
                 }),
                 "worker 1"));
  a.ctx->send(1, make_message(MessageType::Request, 4, "fits"));
  REQUIRE(b.inbox.wait_messages(1));
  a.ctx->shutdown();
  CHECK(contains(thrown_exactly<DistNetworkError>(
                     [&] { a.ctx->send(1, make_message(MessageType::Request, 5, "after")); }),
                 "shut down"));
}

template <class P>
void receiver_drops_scenario() {
  TransportOptions o = options_for(1);
  o.limits.max_payload_bytes = 1000;
  NodeOf<P> a(0), b(o);
  introduce(a, 0, b, 1);
  a.ctx->send(1, make_message(MessageType::Request, 1, std::string(5000, 'x')));
  REQUIRE(b.inbox.wait_lost(1, 2s));
  CHECK(b.inbox.lost[0].first == 0);
  CHECK(contains(b.inbox.lost[0].second, "5000"));
  CHECK(b.inbox.message_count() == 0);
  REQUIRE(a.inbox.wait_lost(1, 2s));  // the sender sees its connection closed
  CHECK(a.inbox.lost[0].first == 1);
}

// ---- shutdown -----------------------------------------------------------------------------------

template <class P>
void shutdown_in_flight_scenario() {
  NodeOf<P> a(0);
  std::atomic<bool> shut{false};
  std::atomic<int> late{0};
  TransportCallbacks cb;
  cb.on_message = [&](int, Message&&) {
    if (shut.load()) ++late;
  };
  cb.on_peer_lost = [&](int, const std::string&) {
    if (shut.load()) ++late;
  };
  auto b = std::make_unique<typename P::Context>(options_for(1), cb);
  a.ctx->add_peer(1, "w1", b->address());
  b->add_peer(0, "w0", a.ctx->address());
  std::atomic<bool> stop{false};
  std::atomic<int> sent{0}, failed{0};
  std::vector<std::thread> senders;
  for (int t = 0; t < 3; ++t) {
    senders.emplace_back([&, t] {
      // Large buffers and one large payload: a write is often in progress at shutdown.
      const at::Tensor buf =
          pattern_bytes(t == 0 ? 4 << 20 : 256 * 1024, static_cast<std::uint32_t>(t));
      while (!stop.load()) {
        try {
          a.ctx->send(1, make_message(MessageType::Request, 1,
                                      std::string(t == 2 ? 3 << 20 : 10, 'p'), {buf}));
          ++sent;
        } catch (const DistNetworkError&) {
          ++failed;
          return;
        }
      }
    });
  }
  // b replies from a thread of its own while a's threads are busy receiving.
  std::thread replier([&] {
    while (!stop.load()) {
      try {
        b->send(0, make_message(MessageType::Response, 1, "ack"));
      } catch (const DistNetworkError&) {
        return;
      }
    }
  });
  while (sent.load() < 20) std::this_thread::sleep_for(1ms);
  auto t0 = Clock::now();
  b->shutdown();
  shut = true;
  CHECK(Clock::now() - t0 < 2s);
  b->shutdown();  // idempotent
  t0 = Clock::now();
  a.ctx->shutdown();
  CHECK(Clock::now() - t0 < 2s);
  // Every sender's next send fails now (one in flight may still have completed).
  for (const auto until = Clock::now() + 5s; failed.load() < 3 && Clock::now() < until;) {
    std::this_thread::sleep_for(1ms);
  }
  CHECK(failed == 3);  // every sender learned that the transport went away
  stop = true;
  for (auto& th : senders) th.join();
  replier.join();
  std::this_thread::sleep_for(100ms);
  CHECK(late == 0);
  CHECK_THROWS_AS(a.ctx->send(1, make_message(MessageType::Request, 9, "after")), DistNetworkError);
}

// A thread reading in drive() (a caller polling for its reply) is inside a callback when the
// owner shuts the Context down: shutdown() returns only after that callback did, so no callback
// runs after it (the owner may free what callbacks use), and the thread leaves drive().
template <class P>
void shutdown_waits_for_drive_scenario() {
  if constexpr (distrpc::transport::has_drive<typename P::Context>) {
    NodeOf<P> a(0);
    std::atomic<bool> shut{false};
    std::atomic<int> late{0};
    std::atomic<bool> held{false};  // the driving thread is inside a callback
    std::atomic<bool> stop{false};
    std::promise<std::thread::id> driver_id;
    std::shared_future<std::thread::id> driver = driver_id.get_future().share();
    TransportCallbacks cb;
    cb.on_message = [&](int, Message&&) {
      if (std::this_thread::get_id() == driver.get() && !held.exchange(true)) {
        std::this_thread::sleep_for(200ms);
      }
      if (shut.load()) ++late;
    };
    cb.on_peer_lost = [&](int, const std::string&) {
      if (shut.load()) ++late;
    };
    auto b = receiver_for(a, cb);
    std::thread driving([&] {
      driver_id.set_value(std::this_thread::get_id());
      while (!stop.load()) b->drive([&] { return stop.load(); }, Clock::now() + 50ms);
    });
    driver.wait();
    // Lone messages until the driving thread reads one (the reading threads read the others).
    for (std::uint64_t id = 1; !held.load() && id <= 20000; ++id) {
      a.ctx->send(1, make_message(MessageType::Response, id, "m"));
      std::this_thread::sleep_for(1ms);
    }
    REQUIRE(held.load());
    const auto t0 = Clock::now();
    b->shutdown();
    shut = true;
    CHECK(Clock::now() - t0 < 2s);
    stop = true;
    driving.join();
    a.ctx->shutdown();
    CHECK(late == 0);
  }
}

// A send blocked because the peer stopped reading (its callback holds the reading thread, the
// socket buffer or ring is full) fails when that peer is registered again at another address,
// and its error names the registration, not a closed connection the peer never closed.
template <class P>
void blocked_send_names_why_scenario() {
  NodeOf<P> a(0), other(2);
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<bool> holding{false};
  TransportCallbacks cb;
  cb.on_message = [&](int, Message&&) {
    if (!holding.exchange(true)) released.wait();
  };
  cb.on_peer_lost = [](int, const std::string&) {};
  auto b = receiver_for(a, cb);
  std::atomic<int> sent{0};
  std::promise<std::string> failure;
  auto failed = failure.get_future();
  std::thread sender([&] {
    const std::string chunk(256 * 1024, 'x');
    try {
      for (std::uint64_t id = 1; id <= 4096; ++id) {
        a.ctx->send(1, make_message(MessageType::Response, id, chunk));
        ++sent;
      }
      failure.set_value("");
    } catch (const distrpc::DistNetworkError& e) {
      failure.set_value(e.what());
    }
  });
  // Blocked: no send completed in three checks 200 ms apart, with the receiver holding.
  int last = -1;
  int still = 0;
  for (const auto until = Clock::now() + 20s; still < 3 && Clock::now() < until;) {
    std::this_thread::sleep_for(200ms);
    const int now = sent.load();
    still = now == last && holding.load() ? still + 1 : 0;
    last = now;
  }
  const bool blocked = still == 3 && sent.load() < 4096;
  bool in_time = false;
  if (blocked) {
    a.ctx->add_peer(1, "w1", other.ctx->address());
    in_time = failed.wait_for(5s) == std::future_status::ready;
  }
  // The sender is let go (and joined) before any REQUIRE can leave this scope.
  release.set_value();
  sender.join();
  REQUIRE(blocked);
  REQUIRE(in_time);
  const std::string text = failed.get();
  INFO(text);
  CHECK(text.find("worker 1") != std::string::npos);
  CHECK(text.find("was registered again") != std::string::npos);
  CHECK(text.find("closed the connection") == std::string::npos);
  b->shutdown();
  a.ctx->shutdown();
}

// The owner shuts a Context down while a callback on one of its threads calls shutdown() too (a
// layer that stops on a message): the callback's call returns at once (the owner's joins that
// thread, so waiting for it would leave both waiting for ever), and the owner's completes.
template <class P>
void shutdown_from_callback_during_shutdown_scenario() {
  NodeOf<P> a(0);
  std::atomic<bool> in_callback{false}, owner_in{false}, callback_returned{false};
  std::atomic<typename P::Context*> self{nullptr};
  TransportCallbacks cb;
  cb.on_message = [&](int, Message&&) {
    if (in_callback.exchange(true)) return;  // the first message only
    while (!owner_in.load()) std::this_thread::sleep_for(1ms);
    std::this_thread::sleep_for(100ms);  // the owner is inside shutdown() by now
    self.load()->shutdown();
    callback_returned = true;
  };
  cb.on_peer_lost = [](int, const std::string&) {};
  auto b = std::make_unique<typename P::Context>(options_for(1), cb);
  self = b.get();
  a.ctx->add_peer(1, "w1", b->address());
  b->add_peer(0, "w0", a.ctx->address());
  a.ctx->send(1, make_message(MessageType::Request, 1, "stop"));
  for (const auto until = Clock::now() + 10s; !in_callback.load() && Clock::now() < until;) {
    std::this_thread::sleep_for(1ms);
  }
  REQUIRE(in_callback.load());
  auto done = std::async(std::launch::async, [&] {
    owner_in = true;
    b->shutdown();
  });
  if (done.wait_for(20s) != std::future_status::ready) {
    // Stuck for good (the future would wait for it when destroyed): fail the process.
    std::fprintf(stderr, "shutdown() from the owner and from a callback: stuck for 20 s\n");
    std::_Exit(3);
  }
  CHECK(callback_returned.load());
  a.ctx->shutdown();
}

// ---- leader/follower and drive() (scenarios in support/transport_test_util.hpp) ---------------

template <class P>
void blocked_stream_scenario() {
  distrpc::testing::blocked_stream_scenario<P>(Traits<P>::first_task_runs_inline);
}

}  // namespace

// One TEST_CASE per policy for a scenario template.
#define DISTRPC_CONFORMANCE(what, scenario)                     \
  TEST_CASE("transport conformance Tcp: " what) {               \
    scenario<Tcp>();                                            \
  }                                                             \
  TEST_CASE("transport conformance Shm: " what) {               \
    scenario<Shm>();                                            \
  }                                                             \
  TEST_CASE("transport conformance Auto<Shm, Tcp>: " what) {    \
    scenario<AutoShmTcp>();                                     \
  }                                                             \
  TEST_CASE("transport conformance Faulty<Tcp>: " what) {       \
    scenario<FaultyTcp>();                                      \
  }                                                             \
  TEST_CASE("transport conformance DeviceDirect<Tcp>: " what) { \
    scenario<DirectTcp>();                                      \
  }

// One multi-process test per policy, each rank running body<Policy>(ctx).
#define DISTRPC_CONFORMANCE_MP(what, world, limit, body)                            \
  DISTRPC_MP_TEST_IMPL("transport conformance Tcp: " what, world, limit,            \
                       DISTRPC_MP_CAT(conformance_tcp_, __LINE__)) {                \
    body<Tcp>(ctx);                                                                 \
  }                                                                                 \
  DISTRPC_MP_TEST_IMPL("transport conformance Shm: " what, world, limit,            \
                       DISTRPC_MP_CAT(conformance_shm_, __LINE__)) {                \
    body<Shm>(ctx);                                                                 \
  }                                                                                 \
  DISTRPC_MP_TEST_IMPL("transport conformance Auto<Shm, Tcp>: " what, world, limit, \
                       DISTRPC_MP_CAT(conformance_auto_, __LINE__)) {               \
    body<AutoShmTcp>(ctx);                                                          \
  }

// A rank body started only by run_ranks() (DISTRPC_MP_TARGET), and the case that runs it.
#define DISTRPC_CONFORMANCE_TARGET(label, Policy, what, body)                \
  DISTRPC_MP_TARGET_IMPL("transport conformance " label " target: " what,    \
                         DISTRPC_MP_CAT(conformance_target_, __COUNTER__)) { \
    body<Policy>(ctx);                                                       \
  }                                                                          \
  TEST_CASE("transport conformance " label ": " what) {                      \
    run_sigkilled("transport conformance " label " target: " what);          \
  }

DISTRPC_CONFORMANCE("the policy satisfies the Transport concept", concept_scenario)
DISTRPC_CONFORMANCE("two contexts exchange messages of every shape both ways", exchange_scenario)
DISTRPC_CONFORMANCE("1000 messages arrive in order with exact bytes", in_order_scenario)
DISTRPC_CONFORMANCE("4 threads sending to one peer deliver every message once, in order per thread",
                    four_threads_scenario)
DISTRPC_CONFORMANCE("a 64 MiB buffer makes round trips intact", big_round_trip_scenario)
DISTRPC_CONFORMANCE_MP("two processes echo messages with tensors, from the I/O thread", 2, 90,
                       echo_processes)

// The transport contract: send() needs add_peer() first, even to a peer that reached us.
DISTRPC_CONFORMANCE("a peer that reached us is answered only once add_peer() named it",
                    distrpc::testing::answer_needs_add_peer_scenario)
DISTRPC_CONFORMANCE(
    "connecting where nothing listens fails within connect_timeout, naming the peer",
    nothing_listens_scenario)
DISTRPC_CONFORMANCE("an unknown peer, a wrong or missing secret and another identity are refused",
                    refused_identities_scenario)
DISTRPC_CONFORMANCE("an address leading to a worker we work with: refused, and nobody is lost",
                    wrong_address_scenario)
DISTRPC_CONFORMANCE("a worker moved while a send dials its dead address: the send follows it",
                    moved_during_dial_scenario)
DISTRPC_CONFORMANCE("a destroyed peer context is reported lost within 2 s, once",
                    destroyed_peer_scenario)
DISTRPC_CONFORMANCE("a peer lost and registered again is reached afresh, and lost once more",
                    registered_again_scenario)
DISTRPC_CONFORMANCE(
    "a peer registered at a new address before its loss was noticed: the old hang-up is ignored",
    replaced_before_loss_scenario)
DISTRPC_CONFORMANCE(
    "a replacement that dialled before its registration arrived is reported lost in its turn",
    replacement_dials_first_scenario)
DISTRPC_CONFORMANCE_TARGET("Tcp", Tcp, "a SIGKILLed peer process is reported lost within 2 s",
                           sigkilled_target)
DISTRPC_CONFORMANCE_TARGET("Shm", Shm, "a SIGKILLed peer process is reported lost within 2 s",
                           sigkilled_target)
DISTRPC_CONFORMANCE_TARGET("Auto<Shm, Tcp>", AutoShmTcp,
                           "a SIGKILLed peer process is reported lost within 2 s", sigkilled_target)

DISTRPC_CONFORMANCE("an oversized message is refused before anything is written",
                    oversize_refused_scenario)
DISTRPC_CONFORMANCE("a receiver drops a sender exceeding its limits", receiver_drops_scenario)
DISTRPC_CONFORMANCE("each failure kind raises the same exception type in every policy",
                    failure_types_scenario)
DISTRPC_CONFORMANCE("shutdown with traffic in flight does not hang, and no callback follows it",
                    shutdown_in_flight_scenario)
DISTRPC_CONFORMANCE("shutdown from a callback while the owner shuts down: neither waits for ever",
                    shutdown_from_callback_during_shutdown_scenario)
DISTRPC_CONFORMANCE("a send blocked on a peer that stopped reading names why it failed",
                    blocked_send_names_why_scenario)
DISTRPC_CONFORMANCE("shutdown waits for a thread in drive(): no callback runs after it returns",
                    shutdown_waits_for_drive_scenario)

// Leader/follower (transport.hpp InlineScope) and drive().
DISTRPC_CONFORMANCE("a handed-back task runs on the reading thread without blocking reading",
                    distrpc::testing::handed_back_task_scenario)
DISTRPC_CONFORMANCE("a stream whose first task blocks is still read and delivered in order",
                    blocked_stream_scenario)
DISTRPC_CONFORMANCE("drive() reads on the waiting thread, never runs a task there, and hands back",
                    distrpc::testing::driven_reply_scenario)
DISTRPC_CONFORMANCE("a task run by a thread in drive() may wait for a message: it is still read",
                    distrpc::testing::driven_task_waits_scenario)
