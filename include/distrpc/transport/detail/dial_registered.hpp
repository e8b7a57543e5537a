// The dial a send() makes to a peer it has no connection to yet, shared by the transports: at
// the address add_peer() registered, minding the moves add_peer() may make while it is under way
// (a replacement process registered at a new address).
#pragma once

#include <mutex>
#include <string>
#include <utility>

#include "distrpc/error.hpp"

namespace distrpc::transport::detail {

// True when add_peer() has registered peer `p` (a transport's peer entry: `mu` guards its name and
// address) at another address than `address`: a dial there reaches the incarnation it replaced.
template <class Peer>
bool moved_away(Peer& p, const std::string& address) {
  std::lock_guard<std::mutex> lk(p.mu);
  return p.address != address;
}

// One dial of peer `p` at its registered address, by `dial(name, address)`. The caller holds the
// peer's connect_mu, which guards `last_failure` and `attempts`. Returns the connection and the
// address it was made to; a null connection when add_peer() moved the peer while the dial was
// under way and the dial failed on that account (the caller dials the new address). Any other
// failure is recorded for the threads waiting on connect_mu (it stands for theirs), and rethrown.
template <class Peer, class Dial>
auto dial_registered(Peer& p, Dial&& dial) {
  std::string name, address;
  {
    std::lock_guard<std::mutex> lk(p.mu);
    name = p.name;
    address = p.address;
  }
  using Conn = decltype(dial(name, address));
  try {
    Conn c = dial(name, address);
    p.last_failure.clear();
    return std::pair<Conn, std::string>(std::move(c), std::move(address));
  } catch (const DistNetworkError& e) {
    if (moved_away(p, address)) return std::pair<Conn, std::string>(Conn{}, std::move(address));
    p.last_failure = e.what();
    p.attempts.fetch_add(1);
    throw;
  }
}

}  // namespace distrpc::transport::detail
