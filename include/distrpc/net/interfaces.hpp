// Which local address to listen on and to publish: the questions a worker answers before its
// peers on other hosts can reach it.
//
//   interface_address("eth0")          the interface's address (IPv4 first, then IPv6)
//   route_source_address("10.0.0.5")   the local address the kernel would send from to reach that
//                                      host (a UDP "connect": no packet is sent)
//   is_loopback_host("127.0.1.1")      true for 127.0.0.0/8, ::1 and "localhost"
//   choose_endpoint(request)           the whole rule (below), as a pure function
//
// Part of the net layer: OS-level helpers with no libtorch, usable by the store and the agent.
#pragma once

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "distrpc/net/errno_text.hpp"
#include "distrpc/net/fd.hpp"

namespace distrpc::net {

// A configuration that cannot give a reachable address; the text says what to set.
class AddressError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline std::string sockaddr_text(const sockaddr* sa) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (sa->sa_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(sa)->sin_addr, buf, sizeof buf);
  } else if (sa->sa_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr, buf, sizeof buf);
  }
  return buf;
}

struct InterfaceAddress {
  std::string interface;
  std::string address;
  bool ipv6 = false;
};

// Every IPv4 and IPv6 address of every interface that is up. IPv6 link-local addresses are left
// out: they need a scope to be dialled, which a published "host:port" cannot carry.
inline std::vector<InterfaceAddress> interface_addresses() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) {
    throw AddressError("cannot list the network interfaces: " + errno_text(errno));
  }
  std::vector<InterfaceAddress> out;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || !(i->ifa_flags & IFF_UP)) continue;
    const int family = i->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    if (family == AF_INET6 &&
        IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<const sockaddr_in6*>(i->ifa_addr)->sin6_addr)) {
      continue;
    }
    out.push_back({i->ifa_name, sockaddr_text(i->ifa_addr), family == AF_INET6});
  }
  ::freeifaddrs(list);
  return out;
}

// "lo 127.0.0.1, eth0 10.0.0.2": what an error offers instead of a name that does not exist.
inline std::string interfaces_text() {
  std::string text;
  for (const auto& a : interface_addresses()) {
    text += (text.empty() ? "" : ", ") + a.interface + " " + a.address;
  }
  return text.empty() ? std::string("none") : text;
}

// The address of interface `name`: its first IPv4 address, else its first IPv6 one.
inline std::string interface_address(const std::string& name) {
  std::string v6;
  for (const auto& a : interface_addresses()) {
    if (a.interface != name) continue;
    if (!a.ipv6) return a.address;
    if (v6.empty()) v6 = a.address;
  }
  if (!v6.empty()) return v6;
  throw AddressError(
      "network interface '" + name +
      "' does not exist or has no address (interfaces that are up: " + interfaces_text() + ")");
}

// The numeric addresses `host` resolves to (a literal resolves to itself).
inline std::vector<std::string> resolve_host(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res); rc != 0) {
    throw AddressError("cannot resolve host '" + host + "': " + ::gai_strerror(rc));
  }
  std::vector<std::string> out;
  for (addrinfo* r = res; r != nullptr; r = r->ai_next) out.push_back(sockaddr_text(r->ai_addr));
  ::freeaddrinfo(res);
  return out;
}

inline bool is_loopback_address(const std::string& numeric) {
  in_addr v4{};
  if (::inet_pton(AF_INET, numeric.c_str(), &v4) == 1) {
    return (ntohl(v4.s_addr) >> 24) == 127;
  }
  in6_addr v6{};
  if (::inet_pton(AF_INET6, numeric.c_str(), &v6) == 1) {
    if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
    // ::ffff:127.x.y.z
    return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
  }
  return false;
}

inline bool is_wildcard_address(const std::string& host) {
  return host == "0.0.0.0" || host == "::" || host == "[::]";
}

// True when `host` means this machine only: "localhost" or a name or literal that resolves to
// loopback addresses only. A name that does not resolve is not called loopback.
inline bool is_loopback_host(const std::string& host) {
  if (host == "localhost") return true;
  std::vector<std::string> addrs;
  try {
    addrs = resolve_host(host);
  } catch (const AddressError&) {
    return false;
  }
  if (addrs.empty()) return false;
  for (const auto& a : addrs) {
    if (!is_loopback_address(a)) return false;
  }
  return true;
}

// The local address the kernel picks to reach host:port: a UDP socket "connected" there (no
// packet leaves) and asked its own name. Throws AddressError when there is no route.
inline std::string route_source_address(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port > 0 ? port : 9);
  if (const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &res); rc != 0) {
    throw AddressError("cannot resolve host '" + host + "': " + ::gai_strerror(rc));
  }
  std::string last_error = "no address";
  std::string found;
  for (addrinfo* r = res; r != nullptr && found.empty(); r = r->ai_next) {
    Fd s(::socket(r->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (!s) {
      last_error = errno_text(errno);
      continue;
    }
    if (::connect(s.get(), r->ai_addr, r->ai_addrlen) != 0) {
      last_error = errno_text(errno);
      continue;
    }
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    if (::getsockname(s.get(), reinterpret_cast<sockaddr*>(&local), &len) != 0) {
      last_error = errno_text(errno);
      continue;
    }
    found = sockaddr_text(reinterpret_cast<const sockaddr*>(&local));
  }
  ::freeaddrinfo(res);
  if (found.empty()) {
    throw AddressError("no route from this host to '" + host + "': " + last_error);
  }
  return found;
}

// ---- the rule --------------------------------------------------------------------------------

// What a worker was told, and where its group meets. Empty strings mean "not set".
struct EndpointRequest {
  std::string interface;       // listen on this interface's address
  std::string listen_host;     // listen on this address ("0.0.0.0" / "::": every interface)
  std::string advertise_host;  // publish this address instead of the one listened on
  // The rendezvous store's host (tcp:// or env://); empty when the group meets elsewhere (file://).
  std::string store_host;
  int store_port = 0;
};

struct Endpoint {
  std::string listen_host;     // what the transport binds
  std::string advertise_host;  // what peers are told to dial
  std::string why;             // how it was chosen, for the log
};

// The rule, in order:
//  1. an interface: listen on its address, publish it;
//  2. a listen address: a specific one is published as it is; a wildcard publishes the address
//     that routes to the store's host (or, with no store host, to the default route);
//  3. neither: a store on loopback (or none) keeps everything on loopback, as a single-host group
//     needs; a store elsewhere means many hosts: listen on, and publish, the local address that
//     reaches the store's host;
// then an advertise address replaces what is published. A loopback address published to a group
// whose store is on another host is refused: no peer there could dial it.
inline Endpoint choose_endpoint(const EndpointRequest& r) {
  Endpoint e;
  const bool remote_store = !r.store_host.empty() && !is_loopback_host(r.store_host);
  const auto toward_group = [&] {
    if (!r.store_host.empty()) return route_source_address(r.store_host, r.store_port);
    // No store host to aim at: the address of the default route stands for "this host".
    return route_source_address("192.0.2.1", 9);
  };
  if (!r.interface.empty()) {
    e.listen_host = e.advertise_host = interface_address(r.interface);
    e.why = "the address of interface " + r.interface;
  } else if (!r.listen_host.empty()) {
    e.listen_host = r.listen_host;
    if (is_wildcard_address(r.listen_host)) {
      e.advertise_host = r.advertise_host.empty() ? toward_group() : r.advertise_host;
      e.why = "every interface, publishing the address that reaches " +
              (r.store_host.empty() ? std::string("the default route") : r.store_host);
    } else {
      e.advertise_host = r.listen_host;
      e.why = "the configured listen address";
    }
  } else if (remote_store) {
    e.listen_host = e.advertise_host = toward_group();
    e.why = "the address that reaches the rendezvous host " + r.store_host;
  } else {
    e.listen_host = e.advertise_host = "127.0.0.1";
    e.why = r.store_host.empty()
                ? "loopback (the group meets through a file)"
                : "loopback (the rendezvous host " + r.store_host + " is this machine)";
  }
  if (!r.advertise_host.empty()) {
    e.advertise_host = r.advertise_host;
    e.why += ", publishing " + r.advertise_host + " as configured";
  }
  if (remote_store && is_loopback_host(e.advertise_host)) {
    throw AddressError(
        "this worker would publish the loopback address " + e.advertise_host +
        " to a group whose rendezvous store is on another host (" + r.store_host +
        "), where no peer can reach it; set RpcBackendOptions::interface (or "
        "DISTRPC_SOCKET_IFNAME) to the network interface to use, or listen_host / "
        "advertise_host (DISTRPC_LISTEN_ADDR / DISTRPC_ADVERTISE_ADDR) to an address the other "
        "hosts can reach (interfaces that are up: " +
        interfaces_text() + ")");
  }
  return e;
}

}  // namespace distrpc::net
