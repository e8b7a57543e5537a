// DeviceDirect<T, Channel> (transport/device_direct.hpp) without a GPU: the host-memory stand-in
// channel (support/host_channel.hpp) takes the place of CUDA IPC, so the decorator's own protocol
// runs here: which buffers go through the channel, the loans and their release, staging for an
// unreachable peer or a refused export, a failed import, order per peer, a lost peer, the checks
// of a Transfer's header, and an agent on top. The conformance suite runs the transport contract
// on it too (test_transport_conformance.cpp); CudaIpc<Tcp> with real CUDA tensors is in
// test_rpc_devices.cpp (needs a GPU).
#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <doctest/doctest.h>

#include <distrpc/rpc.hpp>
#include <distrpc/transport/device_direct.hpp>
#include <distrpc/transport/tcp.hpp>

#include "support/fresh_url.hpp"
#include "support/host_channel.hpp"
#include "support/rpc_test_util.hpp"
#include "support/transport_test_util.hpp"

namespace device_direct_test {

at::Tensor twice(at::Tensor t) {
  return t * 2;
}

}  // namespace device_direct_test

namespace {

using namespace distrpc::testing::transport_names;
using distrpc::testing::eventually;
using distrpc::testing::HostChannel;
using distrpc::transport::DeviceDirectStats;
using distrpc::transport::Tcp;
using distrpc::wire::MessageType;
using Direct = distrpc::testing::HostDirect<Tcp>;
using DirectNode = NodeOf<Direct>;
namespace dd = distrpc::transport::detail;

DeviceDirectStats stats(DirectNode& n) {
  return n.ctx->stats();
}

struct Reset {
  Reset() { HostChannel::reset(); }
  ~Reset() { HostChannel::reset(); }
};

}  // namespace

TEST_CASE("DeviceDirect: large buffers go through the channel and every loan comes back") {
  Reset reset;
  DirectNode a(0), b(1);
  introduce(a, 0, b, 1);
  CHECK(a.ctx->reaches(1));
  CHECK(Direct::name == "host_channel(tcp)");
  CHECK(distrpc::transport::carries_device_buffers<Direct>());
  CHECK_FALSE(distrpc::transport::carries_device_buffers<Tcp>());

  // A 1 MiB and a 100-byte buffer through the channel, a 10-byte one inline.
  a.ctx->send(
      1, make_message(MessageType::Request, 7, "p",
                      {pattern_bytes(1 << 20, 1), pattern_bytes(10, 2), pattern_bytes(100, 3)}));
  REQUIRE(b.inbox.wait_messages(1));
  const auto m = b.inbox.take(0);
  CHECK(m.type == MessageType::Request);
  CHECK(m.id == 7);
  CHECK(m.payload == "p");
  REQUIRE(m.buffers.size() == 3);
  CHECK(same_bytes(m.buffers[0], pattern_bytes(1 << 20, 1)));
  CHECK(same_bytes(m.buffers[1], pattern_bytes(10, 2)));
  CHECK(same_bytes(m.buffers[2], pattern_bytes(100, 3)));
  CHECK(stats(a).exported == 2);
  CHECK(stats(b).imported == 2);
  CHECK(eventually([&] { return stats(a).lent == 0 && stats(a).released == 1; }));
  CHECK(HostChannel::lent_now() == 0);
  CHECK(HostChannel::knobs().imports_of_unlent == 0);
  CHECK(HostChannel::knobs().retired == 0);  // released: the channel may reuse it

  // A message without such buffers passes untouched: nothing lent.
  a.ctx->send(1, make_message(MessageType::Response, 8, "small", {pattern_bytes(10, 4)}));
  REQUIRE(b.inbox.wait_messages(2));
  CHECK(b.inbox.take(1).id == 8);
  CHECK(stats(a).exported == 2);
}

TEST_CASE("DeviceDirect: a peer's messages keep their order across channel and plain ones") {
  Reset reset;
  DirectNode a(0), b(1);
  introduce(a, 0, b, 1);
  constexpr int kMessages = 300;
  for (int i = 1; i <= kMessages; ++i) {
    std::vector<at::Tensor> buffers;
    if (i % 3 != 0) buffers.push_back(pattern_bytes(i % 2 == 0 ? 4096 : 8, i));
    a.ctx->send(1, make_message(MessageType::Request, i, "m", std::move(buffers)));
  }
  REQUIRE(b.inbox.wait_messages(kMessages));
  std::lock_guard<std::mutex> lk(b.inbox.mu);
  for (int i = 1; i <= kMessages; ++i) {
    const auto& m = b.inbox.messages[i - 1].second;
    CHECK(m.id == static_cast<std::uint64_t>(i));
    if (i % 3 != 0) CHECK(same_bytes(m.buffers.at(0), pattern_bytes(i % 2 == 0 ? 4096 : 8, i)));
  }
}

TEST_CASE("DeviceDirect: an unreachable peer and a refused export get a CPU copy instead") {
  Reset reset;
  SUBCASE("the channel does not reach the peer") {
    HostChannel::knobs().reach = false;
    DirectNode a(0), b(1);
    introduce(a, 0, b, 1);
    CHECK_FALSE(a.ctx->reaches(1));
    a.ctx->send(1, make_message(MessageType::Request, 1, "x", {pattern_bytes(5000, 9)}));
    REQUIRE(b.inbox.wait_messages(1));
    CHECK(same_bytes(b.inbox.take(0).buffers.at(0), pattern_bytes(5000, 9)));
    CHECK(stats(a).exported == 0);
    CHECK(stats(a).staged == 1);
    CHECK(stats(b).imported == 0);
  }
  SUBCASE("the channel refuses one of two exports") {
    DirectNode a(0), b(1);
    introduce(a, 0, b, 1);
    HostChannel::knobs().failing_exports = 1;
    a.ctx->send(1, make_message(MessageType::Request, 1, "x",
                                {pattern_bytes(5000, 1), pattern_bytes(6000, 2)}));
    REQUIRE(b.inbox.wait_messages(1));
    const auto m = b.inbox.take(0);
    CHECK(same_bytes(m.buffers.at(0), pattern_bytes(5000, 1)));
    CHECK(same_bytes(m.buffers.at(1), pattern_bytes(6000, 2)));
    CHECK(stats(a).staged == 1);
    CHECK(stats(a).exported == 1);
    CHECK(stats(b).imported == 1);
    CHECK(eventually([&] { return stats(a).lent == 0; }));
  }
}

TEST_CASE("DeviceDirect: a failed import leaves the buffer empty, logs why, and the loan returns") {
  Reset reset;
  LogLines log;
  DirectNode a(0), b(1);
  introduce(a, 0, b, 1);
  HostChannel::knobs().failing_imports = 1;
  a.ctx->send(1, make_message(MessageType::Request, 3, "x",
                              {pattern_bytes(5000, 1), pattern_bytes(7000, 2)}));
  REQUIRE(b.inbox.wait_messages(1));
  const auto m = b.inbox.take(0);
  CHECK(m.type == MessageType::Request);
  REQUIRE(m.buffers.size() == 2);
  CHECK(m.buffers[0].numel() == 0);  // the decoder then fails the call, naming the buffer
  CHECK(same_bytes(m.buffers[1], pattern_bytes(7000, 2)));
  CHECK(stats(b).failed == 1);
  CHECK(stats(b).imported == 1);
  CHECK(contains(log.wait_for("could not be imported"),
                 "device buffer 0 of 5000 bytes from worker 0 could not be imported through "
                 "host_channel (the message's decoder will refuse it): host_channel: import "
                 "refused (test)"));
  CHECK(eventually([&] { return stats(a).lent == 0 && stats(a).released == 1; }));
  check_still_works(a, b, 99);
}

TEST_CASE("DeviceDirect: a Transfer on the wire, and a lost peer's loans kept until it is back") {
  Reset reset;
  // `b` is a plain Tcp node that says it is reached by the channel: it receives the Transfer as
  // it is and never releases the loan.
  DirectNode a(0);
  auto b = std::make_unique<NodeOf<Tcp>>(1);
  a.ctx->add_peer(
      1, "w1",
      b->ctx->address() + std::string(dd::kAddressMark) + "pid=" + std::to_string(::getpid()));
  b->ctx->add_peer(0, "w0", a.ctx->address().substr(0, a.ctx->address().rfind(dd::kAddressMark)));
  a.ctx->send(1, make_message(MessageType::Response, 5, "r", {pattern_bytes(3000, 4)}));
  REQUIRE(b->inbox.wait_messages(1));
  const auto raw = b->inbox.take(0);
  CHECK(raw.type == dd::kTransfer);
  CHECK(raw.id == 5);
  REQUIRE(raw.buffers.size() == 2);
  CHECK(raw.buffers[0].numel() == 0);
  const auto h = dd::decode_transfer_header(raw.buffers[1], 1, 0);
  CHECK(h.kind == MessageType::Response);
  REQUIRE(h.entries.size() == 1);
  CHECK(h.entries[0].index == 0);
  CHECK(h.entries[0].nbytes == 3000);
  CHECK(stats(a).lent == 1);
  CHECK(HostChannel::lent_now() == 1);

  // The peer goes: the channel forgets it, and its loan is kept (a receiver that read the
  // Transfer before the break may still be copying) until worker 1 is registered again.
  b.reset();
  REQUIRE(a.inbox.wait_lost(1));
  CHECK(a.inbox.lost.at(0).first == 1);
  CHECK(stats(a).lent == 0);
  CHECK(stats(a).orphaned == 1);
  CHECK(stats(a).released == 0);
  CHECK(HostChannel::knobs().forgotten == 1);
  CHECK(HostChannel::lent_now() == 1);
  CHECK(HostChannel::knobs().retired == 0);
  // Either way the loan ends without a Release: the channel is told, so that it never reuses
  // what it lent (the receiver may still be reading it).
  SUBCASE("until the worker is registered again") {
    NodeOf<Tcp> again(1);
    a.ctx->add_peer(1, "w1", again.ctx->address());
    CHECK(HostChannel::lent_now() == 0);
    CHECK(HostChannel::knobs().retired == 1);
  }
  SUBCASE("or until the grace has passed (HostChannel::orphan_grace, 300 ms)") {
    CHECK(eventually([] { return HostChannel::lent_now() == 0; }, 5s));
    CHECK(stats(a).released == 0);
    CHECK(HostChannel::knobs().retired == 1);
  }
}

TEST_CASE("DeviceDirect: a loan that never comes back takes half of shutdown's time, not all") {
  Reset reset;
  // `b` never releases what it receives and stays up, so nothing tells `a` that the loan is
  // gone (as when the peer is shutting down too and dropped the Transfer unread).
  DirectNode a(0);
  NodeOf<Tcp> b(1);
  a.ctx->add_peer(
      1, "w1",
      b.ctx->address() + std::string(dd::kAddressMark) + "pid=" + std::to_string(::getpid()));
  a.ctx->send(1, make_message(MessageType::Response, 5, "r", {pattern_bytes(3000, 4)}));
  REQUIRE(b.inbox.wait_messages(1));
  REQUIRE(stats(a).lent == 1);
  const auto t0 = std::chrono::steady_clock::now();
  a.ctx->shutdown(t0 + 2s);
  const auto took = std::chrono::steady_clock::now() - t0;
  CHECK(took >= 900ms);                 // it waited for the loan a while
  CHECK(took < 1900ms);                 // and left the rest to the transport underneath
  CHECK(HostChannel::lent_now() == 0);  // returned at shutdown
  CHECK(HostChannel::knobs().retired == 1);  // unreleased: the channel must not reuse it
}

TEST_CASE(
    "DeviceDirect: a receiver shutting down with Transfers queued releases their loans unread") {
  Reset reset;
  DirectNode a(0);
  auto b = std::make_unique<DirectNode>(1);
  a.ctx->add_peer(1, "w1", b->ctx->address());
  b->ctx->add_peer(0, "w0", a.ctx->address());
  // b's receiving thread holds the first import, so the next Transfers queue behind it.
  HostChannel::knobs().hold_imports = true;
  for (int i = 0; i < 3; ++i) {
    a.ctx->send(1, make_message(MessageType::Request, 10 + i, "q", {pattern_bytes(2000, i)}));
  }
  CHECK(stats(a).lent == 3);
  REQUIRE(eventually([&] { return stats(*b).queued == 3; }, 10s));  // one held, two behind it
  CHECK(b->inbox.message_count() == 0);
  b->ctx->shutdown(std::chrono::steady_clock::now() + 2s);
  // The two queued behind the held import were released unread; the held one was given up
  // (its import returned once b's channel stopped) and is b's to release or a's to orphan.
  CHECK(eventually([&] { return stats(a).released >= 2; }, 2s));
  CHECK(stats(a).released <= 3);
  CHECK(HostChannel::knobs().imports_of_unlent == 0);
  b.reset();
  CHECK(eventually([] { return HostChannel::lent_now() == 0; }, 5s));
  // Each loan ended once: released, or retired when it came back without a Release.
  CHECK(
      eventually([&] { return stats(a).released + HostChannel::knobs().retired.load() == 3; }, 5s));
}

TEST_CASE("DeviceDirect: a Release to a sender not registered yet goes once it is") {
  Reset reset;
  DirectNode a(0), b(1);
  a.ctx->add_peer(1, "w1", b.ctx->address());  // b does not know worker 0 yet
  a.ctx->send(1, make_message(MessageType::Request, 4, "early", {pattern_bytes(2000, 6)}));
  REQUIRE(b.inbox.wait_messages(1));  // delivered: the agent holds it until its table is read
  CHECK(same_bytes(b.inbox.take(0).buffers.at(0), pattern_bytes(2000, 6)));
  std::this_thread::sleep_for(200ms);
  CHECK(stats(a).lent == 1);  // b could not answer yet
  b.ctx->add_peer(0, "w0", a.ctx->address());
  CHECK(eventually([&] { return stats(a).lent == 0 && stats(a).released == 1; }));
  CHECK(HostChannel::lent_now() == 0);
}

TEST_CASE("DeviceDirect: a forged Transfer is dropped with a log, the connection stays") {
  Reset reset;
  LogLines log;
  DirectNode a(0);
  NodeOf<Tcp> b(1);
  a.ctx->add_peer(1, "w1", b.ctx->address());
  b.ctx->add_peer(0, "w0", a.ctx->address().substr(0, a.ctx->address().rfind(dd::kAddressMark)));
  const at::Tensor junk = at::full({12}, 9, at::kByte);  // version 9
  b.ctx->send(0, make_message(dd::kTransfer, 1, "", {at::empty({0}, at::kByte), junk}));
  CHECK(contains(log.wait_for("dropping a message from worker 1"),
                 "dropping a message from worker 1: device transfer header: unknown version"));
  b.ctx->send(0, make_message(MessageType::Request, 2, "after"));
  REQUIRE(a.inbox.wait_messages(1));
  CHECK(a.inbox.take(0).id == 2);
}

TEST_CASE("DeviceDirect: every field of a Transfer's header is checked") {
  const auto header = [](dd::TransferHeader h) { return dd::encode_transfer_header(h); };
  const auto text = [](const at::Tensor& b, std::size_t buffers, std::int64_t max = 0) {
    try {
      (void)dd::decode_transfer_header(b, buffers, max);
    } catch (const distrpc::DistNetworkError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  dd::TransferHeader ok;
  ok.kind = MessageType::Request;
  ok.loan = 42;
  ok.entries = {{0, 100, "abc"}, {2, 50, ""}};
  const auto round = dd::decode_transfer_header(header(ok), 3, 0);
  CHECK(round.loan == 42);
  CHECK(round.entries.at(0).descriptor == "abc");
  CHECK(round.entries.at(1).index == 2);

  const at::Tensor good = header(ok);
  CHECK(text(good.narrow(0, 0, good.numel() - 1), 3) ==
        "device transfer header: truncated at byte 45 of 48");
  dd::TransferHeader one = ok;
  one.entries = {{0, 100, "abc"}};
  const at::Tensor single = header(one);
  CHECK(text(single.narrow(0, 0, single.numel() - 1), 3) ==
        "device transfer header: descriptor of 3 bytes is truncated");
  CHECK(text(good.narrow(0, 0, 10), 3) == "device transfer header: truncated at byte 6 of 10");
  at::Tensor v = good.clone();
  v.data_ptr<std::uint8_t>()[0] = 9;
  CHECK(text(v, 3) == "device transfer header: unknown version 9");
  auto bad = ok;
  bad.kind = MessageType::Handshake;
  CHECK(text(header(bad), 3) ==
        "device transfer header: message kind 1 cannot carry device buffers");
  bad = ok;
  bad.kind = dd::kTransfer;
  CHECK(text(header(bad), 3) ==
        "device transfer header: message kind 128 cannot carry device buffers");
  CHECK(text(good, 1) ==
        "device transfer header: 2 device buffers named in a message of 1 buffers");
  bad = ok;
  bad.entries = {};
  CHECK(text(header(bad), 3) ==
        "device transfer header: 0 device buffers named in a message of 3 buffers");
  bad = ok;
  bad.entries[1].index = 0;
  CHECK(text(header(bad), 3) ==
        "device transfer header: device buffer index 0 is out of range or repeated");
  bad.entries[1].index = 3;
  CHECK(text(header(bad), 3) ==
        "device transfer header: device buffer index 3 is out of range or repeated");
  bad = ok;
  bad.entries[0].nbytes = 0;
  CHECK(text(header(bad), 3) == "device transfer header: device buffer of 0 bytes");
  CHECK(text(good, 3, 99) ==
        "device transfer header: device buffers of more than 99 bytes in one message "
        "(Limits::max_message_bytes)");
  CHECK(text(good, 3, 149) ==  // 100 + 50 bytes: each fits, not both
        "device transfer header: device buffers of more than 149 bytes in one message "
        "(Limits::max_message_bytes)");
  CHECK(dd::decode_transfer_header(good, 3, 150).entries.size() == 2);
  at::Tensor longer = at::cat({good, at::zeros({2}, at::kByte)});
  CHECK(text(longer, 3) == "device transfer header: 2 trailing bytes");
}

TEST_CASE("DeviceDirect: agents call each other over it, tensors through the channel") {
  Reset reset;
  auto registry = std::make_shared<distrpc::Registry>();
  registry->add<&device_direct_test::twice>();
  distrpc::RpcBackendOptions o;
  o.init_method = distrpc::testing::fresh_file_url("direct");
  o.rpc_timeout = 20s;
  o.init_timeout = 20s;
  auto ps = std::async(std::launch::async,
                       [&] { return distrpc::RpcGroup::join<Direct>("ps", 0, 2, o, registry); });
  auto trainer = distrpc::RpcGroup::join<Direct>("trainer", 1, 2, o, registry);
  REQUIRE(ps.wait_for(30s) == std::future_status::ready);
  auto server = ps.get();

  const at::Tensor x = at::arange(1 << 16, at::kFloat);  // 256 KiB: through the channel
  const at::Tensor y = trainer.rpc_sync<&device_direct_test::twice>("ps", x);
  CHECK(at::equal(y, x * 2));
  auto agent = std::dynamic_pointer_cast<distrpc::Agent<Direct>>(trainer.agent());
  REQUIRE(agent);
  CHECK(agent->context().stats().exported >= 1);  // the request's tensor
  CHECK(agent->context().stats().imported >= 1);  // the reply's
  CHECK(HostChannel::knobs().imports_of_unlent == 0);

  auto f = std::async(std::launch::async, [&] { server.shutdown(); });
  trainer.shutdown();
  REQUIRE(f.wait_for(30s) == std::future_status::ready);
  f.get();
  CHECK(HostChannel::lent_now() == 0);
}

namespace {

// HostChannel with the optional hooks of a channel that pairs a peer's imports with its exports
// in order (as NCCL's receives match its sends): ordered_exports, unsent and peer_lost. Each
// descriptor carries the sequence number of its export to that peer; an import checks that they
// arrive in that order.
struct OrderedChannel : HostChannel {
  static constexpr std::string_view name = "ordered_channel";
  static constexpr bool ordered_exports = true;
  struct Counts {
    std::atomic<int> out_of_order{0};
    std::atomic<int> unsent{0};
    std::atomic<int> peer_lost{0};
    std::atomic<int> refused{0};
    std::atomic<int> forgotten_at_loss{-1};  // forget() calls seen when peer_lost() came
  };
  static Counts& counts() {
    static Counts c;
    return c;
  }
  static void reset() {
    HostChannel::reset();
    counts().out_of_order = 0;
    counts().unsent = 0;
    counts().peer_lost = 0;
    counts().refused = 0;
    counts().forgotten_at_loss = -1;
  }

  using HostChannel::HostChannel;

  distrpc::transport::ChannelExport export_buffer(int peer, const at::Tensor& b) {
    auto e = HostChannel::export_buffer(peer, b);
    std::uint64_t seq = 0;
    {
      std::lock_guard<std::mutex> lk(mu_);
      seq = ++exported_[peer];
    }
    // Widens the window between an export and the send of its Transfer, where senders on
    // several threads would interleave without the policy's lock.
    std::this_thread::yield();
    e.descriptor.insert(0, reinterpret_cast<const char*>(&seq), sizeof seq);
    return e;
  }
  at::Tensor import_buffer(int peer, std::string_view d, std::int64_t nbytes) {
    std::uint64_t seq = 0;
    if (d.size() < sizeof seq) throw std::runtime_error("ordered_channel: bad descriptor");
    std::memcpy(&seq, d.data(), sizeof seq);
    if (seq != ++imported_[peer]) {  // imports run on the receiving thread only
      ++counts().out_of_order;
      imported_[peer] = seq;
    }
    return HostChannel::import_buffer(peer, d.substr(sizeof seq), nbytes);
  }
  void unsent(const std::shared_ptr<void>& keep) {
    if (keep) ++counts().unsent;
  }
  void refused(const std::shared_ptr<void>& keep) {
    if (keep) ++counts().refused;
  }
  void peer_lost(int /*peer*/) {
    counts().forgotten_at_loss = knobs().forgotten.load();
    ++counts().peer_lost;
  }

 private:
  std::mutex mu_;
  std::map<int, std::uint64_t> exported_;
  std::map<int, std::uint64_t> imported_;
};

using Ordered = distrpc::transport::DeviceDirect<Tcp, OrderedChannel>;
using OrderedNode = NodeOf<Ordered>;

struct ResetOrdered {
  ResetOrdered() { OrderedChannel::reset(); }
  ~ResetOrdered() { OrderedChannel::reset(); }
};

}  // namespace

TEST_CASE(
    "DeviceDirect: a channel with ordered_exports imports a peer's buffers in the order they were "
    "exported, with 4 threads sending") {
  ResetOrdered reset;
  OrderedNode a(0), b(1);
  introduce(a, 0, b, 1);
  constexpr int kThreads = 4;
  constexpr int kEach = 150;
  std::vector<std::thread> senders;
  for (int t = 0; t < kThreads; ++t) {
    senders.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        const int id = t * kEach + i + 1;
        a.ctx->send(1, make_message(MessageType::Request, static_cast<std::uint64_t>(id), "o",
                                    {pattern_bytes(256 + id % 7, static_cast<std::uint32_t>(id))}));
      }
    });
  }
  for (auto& s : senders) s.join();
  REQUIRE(b.inbox.wait_messages(kThreads * kEach));
  CHECK(OrderedChannel::counts().out_of_order == 0);
  std::lock_guard<std::mutex> lk(b.inbox.mu);
  int intact = 0;
  for (const auto& [peer, m] : b.inbox.messages) {
    const auto id = static_cast<std::uint32_t>(m.id);
    intact += m.buffers.size() == 1 && same_bytes(m.buffers[0], pattern_bytes(256 + id % 7, id));
  }
  CHECK(intact == kThreads * kEach);
}

TEST_CASE(
    "DeviceDirect: the channel hears of a lost peer at once (peer_lost), before forget() and "
    "while an import from that peer is still running") {
  ResetOrdered reset;
  OrderedNode a(0);
  auto b = std::make_unique<OrderedNode>(1);
  introduce(a, 0, *b, 1);
  HostChannel::knobs().hold_imports = true;  // a's receiving thread stays in the import
  b->ctx->send(0, make_message(MessageType::Request, 1, "held", {pattern_bytes(4096, 1)}));
  CHECK(eventually([&] { return a.ctx->stats().queued == 1; }));
  b.reset();
  CHECK(eventually([] { return OrderedChannel::counts().peer_lost.load() == 1; }));
  CHECK(OrderedChannel::counts().forgotten_at_loss == 0);  // forget() is behind the import
  CHECK(a.inbox.lost_count() == 0);                        // and so is the agent's news
  HostChannel::knobs().hold_imports = false;
  REQUIRE(a.inbox.wait_lost(1));
  CHECK(HostChannel::knobs().forgotten == 1);
  CHECK(OrderedChannel::counts().peer_lost == 1);
}

TEST_CASE(
    "DeviceDirect: a buffer exported whose Transfer could not be sent is named to the channel "
    "(unsent), and its loan ends") {
  ResetOrdered reset;
  OrderedNode a(0);
  auto b = std::make_unique<OrderedNode>(1);
  introduce(a, 0, *b, 1);
  a.ctx->send(1, make_message(MessageType::Request, 1, "hello"));  // connected
  REQUIRE(b->inbox.wait_messages(1));
  b.reset();
  REQUIRE(a.inbox.wait_lost(1));
  // Still registered as reached: the export happens, then T refuses the send to a lost peer.
  CHECK_THROWS_AS(a.ctx->send(1, make_message(MessageType::Request, 2, "late",
                                              {pattern_bytes(4096, 2), pattern_bytes(512, 3)})),
                  distrpc::DistNetworkError);
  CHECK(OrderedChannel::counts().unsent == 2);
  CHECK(a.ctx->stats().lent == 0);
  CHECK(HostChannel::lent_now() == 0);
}

TEST_CASE(
    "DeviceDirect: a receiver that could not import a buffer says so in its Release, and the "
    "sender's channel hears of every buffer of that loan (refused)") {
  ResetOrdered reset;
  OrderedNode a(0), b(1);
  introduce(a, 0, b, 1);
  HostChannel::knobs().failing_imports = 1;
  a.ctx->send(1, make_message(MessageType::Request, 1, "two",
                              {pattern_bytes(4096, 1), pattern_bytes(512, 2)}));
  REQUIRE(b.inbox.wait_messages(1));
  CHECK(b.inbox.take(0).buffers.at(0).numel() == 0);  // the one that failed is left empty
  CHECK(eventually([&] { return a.ctx->stats().lent == 0; }));
  CHECK(a.ctx->stats().released == 1);
  CHECK(OrderedChannel::counts().refused == 2);
  // A loan whose buffers all came in is not refused.
  a.ctx->send(1, make_message(MessageType::Request, 2, "fine", {pattern_bytes(4096, 3)}));
  REQUIRE(b.inbox.wait_messages(2));
  CHECK(eventually([&] { return a.ctx->stats().released == 2; }));
  CHECK(OrderedChannel::counts().refused == 2);
  CHECK(OrderedChannel::counts().out_of_order == 0);
}
