// Faulty<T, Faults> (transports/faulty): the faults it injects. That it changes nothing without
// faults is the conformance suite's (test_transport_conformance.cpp runs Faulty<Tcp>); the RPC
// layer's retries under these faults are test_rref_faulty.cpp's.
#include <ATen/ATen.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <typeinfo>
#include <vector>

#include <doctest/doctest.h>

#include "distrpc/transport/faulty.hpp"
#include "distrpc/transport/tcp.hpp"
#include "support/transport_test_util.hpp"

namespace {

using namespace distrpc::testing::transport_names;
using distrpc::transport::Faulty;
using distrpc::transport::FaultyOptions;
using distrpc::transport::Tcp;
using distrpc::wire::MessageType;

const MessageType kControl0 = distrpc::wire::control_message_type(0);

struct FailRequests3 {
  static FaultyOptions options() {
    return {.fail_sends = {.kinds = {MessageType::Request, kControl0}, .count = 3}};
  }
};
struct DelayRequests {
  static FaultyOptions options() {
    return {.delay = {.kinds = {MessageType::Request}, .by = std::chrono::milliseconds(300)}};
  }
};
struct DelayLong {
  static FaultyOptions options() {
    return {.delay = {.kinds = {MessageType::Request}, .by = std::chrono::seconds(10)}};
  }
};
struct NegativeCount {
  static FaultyOptions options() { return {.fail_sends = {.kinds = {kControl0}, .count = -1}}; }
};
struct NegativeDelay {
  static FaultyOptions options() {
    return {.delay = {.kinds = {kControl0}, .by = std::chrono::milliseconds(-5)}};
  }
};
struct FailHandshake {
  static FaultyOptions options() {
    return {.fail_sends = {.kinds = {MessageType::Handshake}, .count = 1}};
  }
};

// Faults per worker: only worker 0 fails its requests.
struct Worker0FailsRequests {
  static FaultyOptions options(const distrpc::transport::TransportOptions& t) {
    if (t.self_id != 0) return {};
    return {.fail_sends = {.kinds = {MessageType::Request}, .count = 1}};
  }
};

using distrpc::testing::thrown_exactly;

// A Faulty<Tcp, F> worker 0 and a plain Tcp worker 1 (same domain: they talk).
template <class F>
struct Pair {
  NodeOf<Faulty<Tcp, F>> a{0};
  NodeOf<Tcp> b{1};
  Pair() {
    a.ctx->add_peer(1, "w1", b.ctx->address());
    b.ctx->add_peer(0, "w0", a.ctx->address());
  }
};

}  // namespace

TEST_CASE("faulty: name, domain key and options of the decorator") {
  static_assert(distrpc::transport::check_transport<Faulty<Tcp>>());
  static_assert(distrpc::transport::has_drive<Faulty<Tcp>::Context>);
  CHECK(Faulty<Tcp>::name == "faulty(tcp)");
  CHECK(Faulty<Tcp>::domain_key() == Tcp::domain_key());
  CHECK(Faulty<Tcp>::viable());
  NodeOf<Faulty<Tcp, FailRequests3>> a(0);
  CHECK(a.ctx->faults().fail_sends.count == 3);
  CHECK(a.ctx->stats().failed.empty());
}

TEST_CASE("faulty: the first 3 sends of a chosen kind fail, the 4th goes; other kinds pass") {
  Pair<FailRequests3> p;
  for (int i = 1; i <= 3; ++i) {
    CHECK(thrown_exactly<DistNetworkError>([&] {
            p.a.ctx->send(1, make_message(MessageType::Request, static_cast<std::uint64_t>(i),
                                          "lost", {pattern_bytes(64, 1)}));
          }) == "distrpc faulty(tcp): cannot send to worker 1 ('w1'): injected failure " +
                    std::to_string(i) + " of 3 for Request messages (FaultyOptions::fail_sends)");
    // Another kind between the failures is not affected.
    p.a.ctx->send(1, make_message(MessageType::Response, 100 + static_cast<std::uint64_t>(i), "r"));
  }
  p.a.ctx->send(1, make_message(MessageType::Request, 4, "goes", {pattern_bytes(64, 2)}));
  // Control kinds are counted apart from requests: their first 3 fail as well.
  for (int i = 1; i <= 3; ++i) {
    CHECK_THROWS_AS(p.a.ctx->send(1, make_message(kControl0, 0, "c")), DistNetworkError);
  }
  p.a.ctx->send(1, make_message(kControl0, 7, "control goes"));
  REQUIRE(p.b.inbox.wait_messages(5));
  std::this_thread::sleep_for(50ms);  // nothing else arrives
  REQUIRE(p.b.inbox.message_count() == 5);
  {
    std::lock_guard<std::mutex> lk(p.b.inbox.mu);
    std::vector<std::uint64_t> ids;
    for (const auto& [from, m] : p.b.inbox.messages) ids.push_back(m.id);
    CHECK(ids == std::vector<std::uint64_t>{101, 102, 103, 4, 7});
    CHECK(p.b.inbox.messages[3].second.payload == "goes");
    CHECK(same_bytes(p.b.inbox.messages[3].second.buffers.at(0), pattern_bytes(64, 2)));
  }
  const auto s = p.a.ctx->stats();
  CHECK(s.failed.at(MessageType::Request) == 3);
  CHECK(s.failed.at(kControl0) == 3);
  CHECK(s.failed.count(MessageType::Response) == 0);
  CHECK(s.delayed.empty());
  // The count is per kind over every destination: a send to an unknown worker now is T's error.
  CHECK(contains(thrown_exactly<DistNetworkError>(
                     [&] { p.a.ctx->send(9, make_message(MessageType::Request, 5, "x")); }),
                 "distrpc tcp: cannot send to worker 9"));
  CHECK(p.b.inbox.lost_count() == 0);
}

TEST_CASE("faulty: delayed kinds arrive after the delay, the sender does not block, others pass") {
  Pair<DelayRequests> p;
  const auto t0 = Clock::now();
  p.a.ctx->send(1, make_message(MessageType::Request, 1, "late 1", {pattern_bytes(1000, 3)}));
  p.a.ctx->send(1, make_message(MessageType::Request, 2, "late 2"));
  const auto send_took = Clock::now() - t0;
  CHECK(send_took < 100ms);  // handed to the timer, not slept on
  p.a.ctx->send(1, make_message(MessageType::Response, 3, "on time"));
  REQUIRE(p.b.inbox.wait_messages(1));
  CHECK(Clock::now() - t0 < 250ms);
  CHECK(p.b.inbox.take(0).id == 3);  // the undelayed kind overtook the delayed ones
  REQUIRE(p.b.inbox.wait_messages(3, 5s));
  const auto arrived = Clock::now() - t0;
  CHECK(arrived >= 300ms);
  CHECK(arrived < 2s);
  const auto m1 = p.b.inbox.take(1);
  CHECK(m1.id == 1);  // delayed ones keep their order
  CHECK(m1.payload == "late 1");
  CHECK(same_bytes(m1.buffers.at(0), pattern_bytes(1000, 3)));
  CHECK(p.b.inbox.take(2).id == 2);
  const auto s = p.a.ctx->stats();
  CHECK(s.delayed.at(MessageType::Request) == 2);
  CHECK(s.failed.empty());
}

TEST_CASE("faulty: shutdown drops delayed messages at once; a delayed send after it throws") {
  Pair<DelayLong> p;
  p.a.ctx->send(1, make_message(MessageType::Request, 1, "never"));
  const auto t0 = Clock::now();
  p.a.ctx->shutdown();
  CHECK(Clock::now() - t0 < 2s);
  p.a.ctx->shutdown();  // idempotent
  CHECK(thrown_exactly<DistNetworkError>(
            [&] { p.a.ctx->send(1, make_message(MessageType::Request, 2, "after")); }) ==
        "distrpc faulty(tcp): cannot send to worker 1 ('w1'): the transport of worker 0 is "
        "shut down");
  CHECK(contains(thrown_exactly<DistNetworkError>(
                     [&] { p.a.ctx->send(1, make_message(MessageType::Response, 3, "after")); }),
                 "shut down"));
  std::this_thread::sleep_for(100ms);
  CHECK(p.b.inbox.message_count() == 0);
}

TEST_CASE("faulty: malformed options are refused at construction, naming the field") {
  CHECK(thrown_exactly<std::invalid_argument>([] {
          Faulty<Tcp, NegativeCount>::Context c(options_for(0), {});
        }) == "distrpc faulty(tcp): bad FaultyOptions: fail_sends.count must be >= 0, got -1");
  CHECK(thrown_exactly<std::invalid_argument>([] {
          Faulty<Tcp, NegativeDelay>::Context c(options_for(0), {});
        }) == "distrpc faulty(tcp): bad FaultyOptions: delay.by must be >= 0 ms, got -5 ms");
  CHECK(thrown_exactly<std::invalid_argument>(
            [] { Faulty<Tcp, FailHandshake>::Context c(options_for(0), {}); }) ==
        "distrpc faulty(tcp): bad FaultyOptions: fail_sends.kinds lists Handshake (value 1), "
        "which is never sent through a transport's send(): use Request, Response, "
        "Exception or a control kind (wire::control_message_type(n))");
}

TEST_CASE("faulty: faults chosen per worker from its TransportOptions") {
  NodeOf<Faulty<Tcp, Worker0FailsRequests>> a(0), b(1);
  introduce(a, 0, b, 1);
  CHECK(a.ctx->faults().fail_sends.count == 1);
  CHECK(b.ctx->faults().fail_sends.kinds.empty());
  CHECK_THROWS_AS(a.ctx->send(1, make_message(MessageType::Request, 1, "x")), DistNetworkError);
  b.ctx->send(0, make_message(MessageType::Request, 2, "from 1"));  // worker 1 has no faults
  a.ctx->send(1, make_message(MessageType::Request, 3, "second"));
  REQUIRE(a.inbox.wait_messages(1));
  REQUIRE(b.inbox.wait_messages(1));
  CHECK(a.inbox.take(0).id == 2);
  CHECK(b.inbox.take(0).id == 3);
}
