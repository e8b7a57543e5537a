// Choosing the address a worker listens on and publishes (include/distrpc/net/interfaces.hpp) and
// where the rendezvous server listens (store/rendezvous.hpp): the rule as a table, on this
// machine's real interfaces, without processes and without libtorch. The same rule across real
// hosts (network namespaces) is tests/hosts/check.sh.
#include <string>
#include <vector>

#include <doctest/doctest.h>

#include "distrpc/net/interfaces.hpp"
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
