// The lost state of one peer in a transport's peer table, with its generation guard.
//
// A peer's connections break together when it dies: the owner hears of it once (on_peer_lost),
// and sends fail fast until add_peer() registers the peer again. That registration is a fresh
// incarnation: events of connections made before it (a late hang-up of the old pair) must not
// mark the new one lost. Every connection records the generation it was made (or adopted) in, and
// its loss counts only while that generation is current. A replacement may also dial before its
// registration reaches this side: its connection is adopted in the old generation, but its Hello
// says where it listens, and it counts as the new incarnation's once add_peer() registers that
// address (current(), ahead_of()), so its loss is not taken for the old incarnation's late one.
//
// Not synchronised: it lives under the peer entry's mutex.
#pragma once

#include <cstdint>
#include <string>

namespace distrpc::transport::detail {

class PeerLiveness {
 public:
  // The generation a connection made now belongs to.
  std::uint64_t generation() const { return generation_; }
  // False for a connection of a registration since replaced: its events are ignored. An
  // incoming connection adopted `ahead` (see ahead_of()) belongs instead to the registration at
  // the address its dialler said it listens at, once the peer has moved there (`registered`, the
  // peer's address now) after the connection was adopted, and as long as that registration
  // lasts: the dialler is that registration's process, which dialled before this side was told
  // of it. Until then its events are nobody's.
  bool current(std::uint64_t connection_generation, const std::string& ahead = {},
               const std::string& registered = {}) const {
    if (ahead.empty()) return connection_generation == generation_;
    return ahead == registered && connection_generation < moved_at_ && generation_ == moved_at_;
  }
  // For an incoming connection whose dialler listens at `claimed` (its Hello), from a peer
  // registered at `registered` (empty: not yet): `claimed` when they differ, so the connection
  // comes from a later incarnation not registered here yet (a process replacing a dead one,
  // whose add_peer() has not arrived); empty otherwise. Kept with the connection for current().
  static std::string ahead_of(const std::string& registered, const std::string& claimed) {
    return !registered.empty() && !claimed.empty() && claimed != registered ? claimed
                                                                            : std::string();
  }
  // Stamps an incoming connection `c` as it is adopted from a dialler that listens at `claimed`,
  // the peer being registered at `registered`: the generation it belongs to and its `ahead`
  // address, which current() later takes (c.generation, c.ahead).
  template <class Connection>
  void stamp_adopted(Connection& c, const std::string& registered,
                     const std::string& claimed) const {
    c.generation = generation_;
    c.ahead = ahead_of(registered, claimed);
  }
  // The first reason a connection of this incarnation broke; empty while none did.
  const std::string& lost_reason() const { return lost_reason_; }
  bool lost() const { return !lost_reason_.empty(); }

  // add_peer(): a fresh registration may be connected (and lost) again. A new generation starts
  // when the old one was lost, or when the peer registers at a new address (`moved`: a process
  // replacing a dead one, whose loss may not have been noticed yet: the old connections' hang-up
  // may still be on its way); connections made before an add_peer() that merely repeats the
  // address stay current. True when a new generation started: the caller lets go of the
  // connections of the old one (they belong to an incarnation that is gone).
  bool renew(bool moved = false) {
    const bool fresh = moved || !lost_reason_.empty() || lost_reported_;
    if (fresh) ++generation_;
    if (moved) moved_at_ = generation_;
    lost_reason_.clear();
    lost_reported_ = false;
    return fresh;
  }

  // A connection of the current generation broke (the caller checked current()): records the
  // first reason; true when the owner must be told now (the first loss of this incarnation).
  bool mark_lost(const std::string& reason) {
    if (lost_reason_.empty()) lost_reason_ = reason;
    if (lost_reported_) return false;
    lost_reported_ = true;
    return true;
  }

 private:
  std::string lost_reason_;
  bool lost_reported_ = false;
  std::uint64_t generation_ = 0;
  std::uint64_t moved_at_ = 0;  // the generation the last move to a new address started
};

}  // namespace distrpc::transport::detail
