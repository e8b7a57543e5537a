// Choosing the address a worker listens on and publishes (include/distrpc/net/interfaces.hpp) and
// where the rendezvous server listens (store/rendezvous.hpp): the rule as a table, on this
// machine's real interfaces, without processes and without libtorch. The same rule across real
// hosts (network namespaces) is tests/hosts/check.sh. Then the reading threads' epoll set
// (net/ready_set.hpp), with eventfds standing in for connections.
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <doctest/doctest.h>

#include "distrpc/net/interfaces.hpp"
#include "distrpc/net/ready_set.hpp"
#include "distrpc/store/rendezvous.hpp"
#include "distrpc/store/tcp_store.hpp"

namespace {

using distrpc::net::AddressError;
using distrpc::net::choose_endpoint;
using distrpc::net::EndpointRequest;

// A non-loopback IPv4 address of this machine (one a peer on another host could dial), or "".
std::string some_non_loopback_address() {
  for (const auto& a : distrpc::net::interface_addresses()) {
    if (!a.ipv6 && !distrpc::net::is_loopback_address(a.address)) return a.address;
  }
  return {};
}

std::string error_text(const EndpointRequest& r) {
  try {
    (void)choose_endpoint(r);
  } catch (const AddressError& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("net: loopback addresses and hosts are recognised, other addresses are not") {
  using distrpc::net::is_loopback_address;
  using distrpc::net::is_loopback_host;
  CHECK(is_loopback_address("127.0.0.1"));
  CHECK(is_loopback_address("127.0.1.1"));  // what Debian resolves its own host name to
  CHECK(is_loopback_address("::1"));
  CHECK(is_loopback_address("::ffff:127.0.0.1"));
  CHECK_FALSE(is_loopback_address("10.0.0.1"));
  CHECK_FALSE(is_loopback_address("192.0.2.2"));
  CHECK_FALSE(is_loopback_address("::"));
  CHECK_FALSE(is_loopback_address("not-an-address"));
  CHECK(is_loopback_host("localhost"));
  CHECK(is_loopback_host("127.0.0.1"));
  CHECK(is_loopback_host("127.0.1.1"));
  CHECK_FALSE(is_loopback_host("10.1.2.3"));
  CHECK_FALSE(is_loopback_host("no-such-host.invalid"));
  CHECK(distrpc::net::is_wildcard_address("0.0.0.0"));
  CHECK(distrpc::net::is_wildcard_address("::"));
  CHECK_FALSE(distrpc::net::is_wildcard_address("127.0.0.1"));
}

TEST_CASE("net: an interface's address by name; an unknown name lists what exists") {
  CHECK(distrpc::net::interface_address("lo") == "127.0.0.1");
  try {
    (void)distrpc::net::interface_address("nosuch0");
    FAIL("an unknown interface was accepted");
  } catch (const AddressError& e) {
    const std::string text = e.what();
    CHECK(text.rfind("network interface 'nosuch0' does not exist or has no address (interfaces "
                     "that are up: ",
                     0) == 0);
    CHECK(text.find("lo 127.0.0.1") != std::string::npos);
  }
}

TEST_CASE("net: the route toward a host starts from the local address the kernel would use") {
  CHECK(distrpc::net::route_source_address("127.0.0.1", 29500) == "127.0.0.1");
  const std::string mine = some_non_loopback_address();
  if (mine.empty()) {
    MESSAGE("no non-loopback IPv4 address on this machine: the rest of this case is skipped");
    return;
  }
  // An address of this host is reached from itself.
  CHECK(distrpc::net::route_source_address(mine, 29500) == mine);
  CHECK_THROWS_AS(distrpc::net::route_source_address("no-such-host.invalid", 1), AddressError);
}

TEST_CASE("net: a group meeting on loopback or through a file stays on loopback") {
  EndpointRequest r;
  auto e = choose_endpoint(r);  // file:// (no store host)
  CHECK(e.listen_host == "127.0.0.1");
  CHECK(e.advertise_host == "127.0.0.1");
  CHECK(e.why == "loopback (the group meets through a file)");
  r.store_host = "127.0.0.1";
  e = choose_endpoint(r);
  CHECK(e.listen_host == "127.0.0.1");
  CHECK(e.advertise_host == "127.0.0.1");
  CHECK(e.why == "loopback (the rendezvous host 127.0.0.1 is this machine)");
  r.store_host = "localhost";
  CHECK(choose_endpoint(r).advertise_host == "127.0.0.1");
  // Explicit settings are taken as they are on a single host.
  r.listen_host = "127.0.0.2";
  e = choose_endpoint(r);
  CHECK(e.listen_host == "127.0.0.2");
  CHECK(e.advertise_host == "127.0.0.2");
  r.listen_host.clear();
  r.interface = "lo";
  CHECK(choose_endpoint(r).listen_host == "127.0.0.1");
}

TEST_CASE("net: a rendezvous host elsewhere means many hosts: the address that reaches it") {
  const std::string mine = some_non_loopback_address();
  if (mine.empty()) {
    MESSAGE("no non-loopback IPv4 address on this machine: case skipped");
    return;
  }
  // The store's host is a non-loopback address (here one of this machine's own, which the kernel
  // reaches from itself: the rule cannot tell, and does not need to).
  EndpointRequest r;
  r.store_host = mine;
  r.store_port = 29500;
  auto e = choose_endpoint(r);
  CHECK(e.listen_host == mine);
  CHECK(e.advertise_host == mine);
  CHECK(e.why == "the address that reaches the rendezvous host " + mine);

  SUBCASE("every interface publishes the address on the route to the store") {
    r.listen_host = "0.0.0.0";
    e = choose_endpoint(r);
    CHECK(e.listen_host == "0.0.0.0");
    CHECK(e.advertise_host == mine);
  }
  SUBCASE("an advertise address replaces what is published, not what is listened on") {
    r.advertise_host = "203.0.113.7";
    e = choose_endpoint(r);
    CHECK(e.listen_host == mine);
    CHECK(e.advertise_host == "203.0.113.7");
  }
  SUBCASE("publishing loopback to a store on another host is refused, saying what to set") {
    r.listen_host = "127.0.0.1";
    const std::string text = error_text(r);
    CHECK(text.rfind("this worker would publish the loopback address 127.0.0.1 to a group whose "
                     "rendezvous store is on another host (" +
                         mine +
                         "), where no peer can reach it; set RpcBackendOptions::interface (or "
                         "DISTRPC_SOCKET_IFNAME)",
                     0) == 0);
    CHECK(text.find("DISTRPC_LISTEN_ADDR / DISTRPC_ADVERTISE_ADDR") != std::string::npos);
    CHECK(text.find("lo 127.0.0.1") != std::string::npos);
    r.listen_host.clear();
    r.interface = "lo";
    CHECK(error_text(r).rfind("this worker would publish the loopback address 127.0.0.1", 0) == 0);
    r.interface.clear();
    r.advertise_host = "localhost";
    CHECK(error_text(r).rfind("this worker would publish the loopback address localhost", 0) == 0);
  }
  SUBCASE("an interface that does not exist is named") {
    r.interface = "nosuch0";
    CHECK(error_text(r).rfind("network interface 'nosuch0' does not exist", 0) == 0);
  }
}

TEST_CASE("rendezvous: the server stays on loopback for a loopback host, else listens everywhere") {
  using distrpc::store::detail::store_listen_address;
  CHECK(store_listen_address("127.0.0.1") == "");
  CHECK(store_listen_address("localhost") == "");
  CHECK(store_listen_address("127.0.1.1") == "");
  CHECK(store_listen_address("10.0.0.1") == "0.0.0.0");
  CHECK(store_listen_address("fd00::2") == "::");
  CHECK(store_listen_address("no-such-host.invalid") == "0.0.0.0");
}

TEST_CASE("rendezvous: the result says where the store's server is") {
  auto r = distrpc::store::rendezvous("tcp://127.0.0.1:0", 0, 1, std::chrono::seconds(10));
  CHECK(r.store_host == "127.0.0.1");
  CHECK(r.store_port == static_cast<distrpc::store::TCPStore&>(*r.store).port());
  CHECK(r.store_port > 0);
  const std::string mine = some_non_loopback_address();
  if (mine.empty()) return;
  // A non-loopback host: the server listens on every interface, so loopback reaches it too.
  auto wide = distrpc::store::rendezvous("tcp://" + mine + ":0", 0, 1, std::chrono::seconds(10));
  CHECK(wide.store_host == mine);
  distrpc::store::TCPStore via_loopback("127.0.0.1", wide.store_port, 1, false,
                                        std::chrono::seconds(10));
  wide.store->set("k", "v");
  CHECK(via_loopback.get("k") == distrpc::store::Bytes{'v'});
}

// ---- net::ReadySet: sleepers are not woken while a thread polls -----------------------------

namespace {

using namespace std::chrono_literals;
using distrpc::net::ReadySet;

// An eventfd standing in for a connection: readable once written, registered one-shot with `key`.
struct FakeConnection {
  FakeConnection(ReadySet& set, std::uint64_t key) : set(set), key(key) {
    fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    REQUIRE(fd >= 0);
    epoll_event ev{EPOLLIN | EPOLLONESHOT, {.u64 = key}};
    REQUIRE(::epoll_ctl(set.fd(), EPOLL_CTL_ADD, fd, &ev) == 0);
  }
  ~FakeConnection() { ::close(fd); }
  void make_ready() {
    const std::uint64_t one = 1;
    REQUIRE(::write(fd, &one, sizeof one) == sizeof one);
  }
  ReadySet& set;
  std::uint64_t key;
  int fd = -1;
};

// A thread sleeping in wait() until it takes something; what it took, or 0 after stop().
struct Sleeper {
  explicit Sleeper(ReadySet& set) : set(set) {
    thread = std::thread([this, &set] {
      for (;;) {
        epoll_event ev{};
        const int n = set.wait(ev);
        if (n == ReadySet::kNothing) continue;
        took.store(n == 1 ? ev.data.u64 : 0);
        return;
      }
    });
  }
  // A failed check may leave it asleep: stopping the set then ends it instead of hanging here.
  ~Sleeper() {
    if (took.load() == kNone) set.stop();
    thread.join();
  }
  bool took_within(std::chrono::milliseconds d) {
    const auto until = std::chrono::steady_clock::now() + d;
    while (took.load() == kNone && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(1ms);
    }
    return took.load() != kNone;
  }
  static constexpr std::uint64_t kNone = ~std::uint64_t{0};
  ReadySet& set;
  std::atomic<std::uint64_t> took{kNone};
  std::thread thread;
};

}  // namespace

TEST_CASE("net: ReadySet wakes a sleeper for a ready connection, and every sleeper at stop()") {
  ReadySet set("test");
  FakeConnection a(set, 7);
  {
    Sleeper s(set);
    std::this_thread::sleep_for(20ms);  // asleep in wait()
    a.make_ready();
    REQUIRE(s.took_within(5s));
    CHECK(s.took.load() == 7);
  }
  Sleeper s1(set), s2(set);
  std::this_thread::sleep_for(20ms);
  set.stop();
  REQUIRE(s1.took_within(5s));
  REQUIRE(s2.took_within(5s));
  CHECK(s1.took.load() == 0);
  CHECK(s2.took.load() == 0);
}

TEST_CASE("net: ReadySet keeps sleepers asleep while a thread polls") {
  // Pollers count as stale only after 10 s here: a preempted poller thread must not hand over.
  ReadySet set("test", {.every_ms = 50, .stale = 10s});
  std::vector<std::unique_ptr<FakeConnection>> conns;
  for (std::uint64_t key = 1; key <= 20; ++key) {
    conns.push_back(std::make_unique<FakeConnection>(set, key));
  }
  Sleeper s(set);
  std::this_thread::sleep_for(20ms);  // asleep in wait()
  set.begin_polling();
  CHECK(set.pollers() == 1);
  CHECK_FALSE(set.try_begin_polling());  // a reading thread does not poll beside a caller
  std::atomic<bool> polling{true};
  std::atomic<std::uint64_t> taken{0};  // how many the poller took
  std::thread poller([&] {
    while (polling.load()) {
      epoll_event ev{};
      if (set.poll(ev) == 1) taken.fetch_add(1);
    }
  });
  // 20 connections made ready one by one: the poller takes each, the sleeper hears none.
  for (std::uint64_t i = 0; i < 20; ++i) {
    conns[i]->make_ready();
    const auto until = std::chrono::steady_clock::now() + 5s;
    while (taken.load() <= i && s.took.load() == Sleeper::kNone &&
           std::chrono::steady_clock::now() < until) {
      std::this_thread::yield();
    }
  }
  polling.store(false);
  poller.join();
  CHECK(taken.load() == 20);
  CHECK(s.took.load() == Sleeper::kNone);
  set.end_polling();
}

TEST_CASE("net: ReadySet sleepers take over from a poller that stopped polling") {
  ReadySet set("test");  // the defaults: a look every 50 ms, stale after 1 ms
  FakeConnection a(set, 1);
  Sleeper s(set);
  std::this_thread::sleep_for(20ms);
  set.begin_polling();
  epoll_event ev{};
  CHECK(set.poll(ev) == ReadySet::kNothing);
  // The poller is now busy elsewhere, or preempted, and does not say so: within the sleepers'
  // next look at it, they take what comes.
  a.make_ready();
  REQUIRE(s.took_within(5s));
  CHECK(s.took.load() == 1);
  set.end_polling();
}

TEST_CASE("net: ReadySet hands over at once when a nested poll on the same thread ends") {
  // Looks every 10 s only: the hand-over below is the nested poll's, not the watch's.
  ReadySet set("test", {.every_ms = 10000, .stale = 1ms});
  FakeConnection a(set, 1), b(set, 2);
  Sleeper s1(set);
  std::this_thread::sleep_for(20ms);
  set.begin_polling();  // a caller waiting for its reply...
  set.begin_polling();  // ...runs a task for what it read, which waits for another reply
  CHECK(set.pollers() == 2);
  set.end_polling();  // the inner wait ends; the outer caller is busy with its task
  a.make_ready();
  REQUIRE(s1.took_within(5s));
  CHECK(s1.took.load() == 1);
  // The caller polls again: sleepers stop listening.
  epoll_event ev{};
  CHECK(set.poll(ev) == ReadySet::kNothing);
  Sleeper s2(set);
  std::this_thread::sleep_for(20ms);
  b.make_ready();
  CHECK_FALSE(s2.took_within(200ms));
  REQUIRE(set.poll(ev) == 1);
  const std::uint64_t took = ev.data.u64;  // a packed field: copied before CHECK binds it
  CHECK(took == 2);
  set.end_polling();
}

TEST_CASE("net: ReadySet wakes a second sleeper for a second ready connection") {
  ReadySet set("test");
  FakeConnection a(set, 1), b(set, 2);
  Sleeper s1(set), s2(set);
  std::this_thread::sleep_for(20ms);
  // Both become ready while nobody polls: each sleeper takes one (the first re-arms for the other).
  a.make_ready();
  b.make_ready();
  REQUIRE(s1.took_within(5s));
  REQUIRE(s2.took_within(5s));
  CHECK(s1.took.load() + s2.took.load() == 3);
  CHECK(s1.took.load() != s2.took.load());
}

TEST_CASE("net: ReadySet lets a reading thread poll only alone, counting nested pollers") {
  ReadySet set("test");
  REQUIRE(set.try_begin_polling());
  set.begin_polling();  // a caller joins: the reading thread sees two and stops
  CHECK(set.pollers() == 2);
  set.end_polling();
  CHECK(set.pollers() == 1);
  CHECK_FALSE(set.try_begin_polling());
  set.end_polling();
  CHECK(set.pollers() == 0);
  CHECK(set.try_begin_polling());
  set.end_polling();
}
