// Auto<Candidates...>: a composite policy that picks, per peer, the first candidate both sides can
// use with each other: what TensorPipe does at run time, here with the candidate set fixed at
// compile time. `Auto<Shm, Tcp>` uses shared memory with peers on this host and TCP with the rest.
//
// Selection: the address a Context publishes lists, for every candidate viable here, its name, its
// domain key and its own address. For a peer, add_peer() takes the first candidate (in the order
// of the template arguments) that the peer also lists with an equal domain key. Every candidate
// stays open for receiving, so two binaries that order their candidates differently still talk
// (each sends on its own choice); messages to one peer all go through one candidate, so their
// order holds.
//
// Testing the "other host" branch on one machine: DISTRPC_TRANSPORT_DOMAIN_OVERRIDE_<NAME> (NAME is
// the candidate's name in upper case, e.g. ..._SHM) replaces that candidate's domain key; "{id}" in
// the value becomes the worker id, so "host-{id}" makes every worker look like its own host.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "distrpc/bounded_thread.hpp"
#include "distrpc/error.hpp"
#include "distrpc/transport/transport.hpp"

namespace distrpc::transport {

namespace detail {

inline constexpr std::string_view kAddressTag = "auto:v1";

// The environment variable that overrides the domain key of the policy called `name`.
inline std::string override_variable(std::string_view name) {
  std::string v = "DISTRPC_TRANSPORT_DOMAIN_OVERRIDE_";
  for (char c : name) {
    v += std::isalnum(static_cast<unsigned char>(c))
             ? static_cast<char>(std::toupper(static_cast<unsigned char>(c)))
             : '_';
  }
  return v;
}

// The domain key worker `self_id` publishes for policy P: P's own, unless overridden.
template <class P>
std::string effective_domain_key(int self_id) {
  const std::string var = override_variable(P::name);
  const char* v = std::getenv(var.c_str());
  if (!v || !*v) return P::domain_key();
  std::string key = v;
  for (std::size_t at = key.find("{id}"); at != std::string::npos; at = key.find("{id}", at)) {
    key.replace(at, 4, std::to_string(self_id));
  }
  return "override:" + key;
}

// Percent-encoding of the separators, '%' and anything unprintable.
inline std::string escape(const std::string& s) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c < 0x21 || c > 0x7e || c == '%' || c == ';' || c == '=' || c == '@') {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += ch;
    }
  }
  return out;
}

inline std::string unescape(const std::string& s, const std::string& whole) {
  const auto hex = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    throw DistNetworkError("distrpc auto: malformed address '" + whole +
                           "': bad percent-escape in '" + s + "'");
  };
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      out += s[i];
      continue;
    }
    if (i + 2 >= s.size()) {
      throw DistNetworkError("distrpc auto: malformed address '" + whole +
                             "': truncated percent-escape in '" + s + "'");
    }
    out += static_cast<char>(hex(s[i + 1]) * 16 + hex(s[i + 2]));
    i += 2;
  }
  return out;
}

struct Entry {
  std::string name;
  std::string domain;
  std::string address;
};

// "auto:v1;<name>=<domain key>@<address>;..." with keys and addresses percent-encoded.
inline std::string encode_address(const std::vector<Entry>& entries) {
  std::string out(kAddressTag);
  for (const auto& e : entries) {
    out += ';' + escape(e.name) + '=' + escape(e.domain) + '@' + escape(e.address);
  }
  return out;
}

inline std::vector<Entry> decode_address(const std::string& address) {
  const auto bad = [&](const std::string& why) {
    return DistNetworkError("distrpc auto: malformed address '" + address + "': " + why +
                            " (expected " + std::string(kAddressTag) +
                            ";<name>=<domain key>@<address>;..., as an Auto policy publishes)");
  };
  if (address.compare(0, kAddressTag.size(), kAddressTag) != 0) {
    throw bad("it does not start with '" + std::string(kAddressTag) + "'");
  }
  std::vector<Entry> out;
  std::size_t at = kAddressTag.size();
  while (at < address.size()) {
    if (address[at] != ';') throw bad("expected ';' at offset " + std::to_string(at));
    const std::size_t end = std::min(address.find(';', at + 1), address.size());
    const std::string item = address.substr(at + 1, end - at - 1);
    const auto eq = item.find('=');
    const auto amp = item.find('@');
    if (eq == std::string::npos || amp == std::string::npos || amp < eq || eq == 0) {
      throw bad("entry '" + item + "' is not <name>=<domain key>@<address>");
    }
    out.push_back(Entry{unescape(item.substr(0, eq), address),
                        unescape(item.substr(eq + 1, amp - eq - 1), address),
                        unescape(item.substr(amp + 1), address)});
    at = end;
  }
  if (out.empty()) throw bad("it lists no transport");
  return out;
}

}  // namespace detail

template <class... Candidates>
struct Auto {
  static_assert(sizeof...(Candidates) >= 1, "Auto<...> needs at least one candidate policy");
  static_assert((check_transport<Candidates>() && ...), "see the messages above");

  static constexpr std::string_view name = "auto";
  static bool viable() { return (Candidates::viable() || ...); }
  // Two composites can talk when some candidate of theirs can.
  static std::string domain_key() {
    std::string key = "auto(";
    ((key += std::string(Candidates::name) + "=" + Candidates::domain_key() + ";"), ...);
    return key + ")";
  }

  class Context {
    static constexpr std::size_t N = sizeof...(Candidates);
    using Contexts = std::tuple<std::unique_ptr<typename Candidates::Context>...>;
    static constexpr std::array<std::string_view, N> kNames{Candidates::name...};

    struct PeerState {
      int chosen = -1;  // index into the candidates
      bool lost_reported = false;
    };
    // Shared with the candidates' callbacks, which may outlive nothing: shutdown() joins them.
    struct State {
      std::mutex mu;
      std::map<int, PeerState> peers;
      TransportCallbacks callbacks;
    };

   public:
    // Starts a Context of every candidate viable here. Throws DistNetworkError when none is, or
    // when a candidate's Context cannot start.
    Context(const TransportOptions& options, TransportCallbacks callbacks)
        : self_(options.self_id), state_(std::make_shared<State>()) {
      state_->callbacks = std::move(callbacks);
      std::string tried;
      start<0>(options, tried);
      if (entries_.empty()) {
        throw DistNetworkError("distrpc auto: worker " + std::to_string(self_) +
                               ": none of the candidate transports is viable here (" + tried + ")");
      }
      address_ = detail::encode_address(entries_);
    }
    ~Context() { shutdown(); }
    Context(const Context&) = delete;
    Context& operator=(const Context&) = delete;

    std::string address() const { return address_; }

    // Chooses the transport for worker `id` from the address it published and registers the peer
    // with that candidate. Throws DistNetworkError naming the peer when the address is malformed
    // or no candidate is shared (the text lists both sides' transports and domain keys).
    void add_peer(int id, const std::string& name, const std::string& address) {
      std::vector<detail::Entry> theirs;
      try {
        theirs = detail::decode_address(address);
      } catch (const DistNetworkError& e) {
        throw DistNetworkError("distrpc auto: add_peer: worker " + std::to_string(id) + " ('" +
                               name + "'): " + e.what());
      }
      for (const auto& mine : entries_) {
        for (const auto& other : theirs) {
          if (other.name != mine.name || other.domain != mine.domain) continue;
          const int index = index_of(mine.name);
          add_to<0>(index, id, name, other.address);
          std::lock_guard<std::mutex> lk(state_->mu);
          auto& ps = state_->peers[id];
          if (ps.chosen >= 0) --in_use_[static_cast<std::size_t>(ps.chosen)];
          ++in_use_[static_cast<std::size_t>(index)];
          ps.chosen = index;
          ps.lost_reported = false;
          return;
        }
      }
      std::string have, offered;
      for (const auto& e : entries_) have += " " + e.name + " (" + e.domain + ")";
      for (const auto& e : theirs) offered += " " + e.name + " (" + e.domain + ")";
      throw DistNetworkError("distrpc auto: no transport can reach worker " + std::to_string(id) +
                             " ('" + name + "'): this worker has" + have + "; it offers" + offered +
                             " (a transport is shared when both list it with the same domain key)");
    }

    // Sends through the candidate chosen for `peer`. Throws DistNetworkError naming the peer when
    // add_peer() was not called for it, or what the candidate throws.
    void send(int peer, wire::Message&& m) {
      const int index = chosen(peer);
      if (index < 0) {
        throw DistNetworkError("distrpc auto: cannot send to worker " + std::to_string(peer) +
                               ": its address is unknown (add_peer() was not called for it)");
      }
      send_on<0>(index, peer, std::move(m));
    }

    // The name of the transport used for `peer` ("shm", "tcp", ...). Throws DistNetworkError when
    // add_peer() was not called for it.
    std::string_view transport_for(int peer) const {
      const int index = chosen(peer);
      if (index < 0) {
        throw DistNetworkError("distrpc auto: no transport chosen for worker " +
                               std::to_string(peer) + " (add_peer() was not called for it)");
      }
      return kNames[static_cast<std::size_t>(index)];
    }

    // The candidates viable here, in order of preference.
    std::vector<std::string> candidates() const {
      std::vector<std::string> out;
      for (const auto& e : entries_) out.push_back(e.name);
      return out;
    }

    // The Context of candidate P, or null when P is not viable here.
    template <class P>
    typename P::Context* candidate() {
      return std::get<std::unique_ptr<typename P::Context>>(contexts_).get();
    }

    // Shuts every candidate down (each is idempotent and joins its threads), waiting for threads
    // that run a handed-back task no later than `deadline` (one deadline for all candidates, so
    // the bound does not add up); returns how many such threads the candidates abandoned.
    std::size_t shutdown(std::chrono::steady_clock::time_point deadline) {
      return std::apply(
          [&](auto&... c) { return (std::size_t{0} + ... + shutdown_one(c, deadline)); },
          contexts_);
    }
    // As above, with the default bound (kDefaultShutdownGrace).
    void shutdown() { shutdown(std::chrono::steady_clock::now() + kDefaultShutdownGrace); }

    // Lets the candidates that some peer uses read on the calling thread (transport.hpp): the
    // only one for the whole wait when all peers use the same, else each in turns of a few
    // microseconds, since the reply may come through any of them. A candidate no peer uses has
    // nothing to read: a turn there would only leave the one in use unread meanwhile, and then
    // a reply arriving in that turn wakes one of its threads (the cost drive() exists to avoid).
    void drive(const std::function<bool()>& done, std::chrono::steady_clock::time_point until) {
      std::size_t used = 0;
      for (const auto& n : in_use_) used += n.load(std::memory_order_relaxed) > 0 ? 1 : 0;
      if (used == 0) return;
      while (!done() && std::chrono::steady_clock::now() < until) {
        drive_each(std::make_index_sequence<N>{}, done, until, used > 1);
      }
    }

    // How many registered peers use each candidate (for tests and diagnostics).
    std::size_t peers_using(std::string_view candidate) const {
      const int index = index_of(std::string(candidate));
      return index < 0 ? 0
                       : static_cast<std::size_t>(in_use_[static_cast<std::size_t>(index)].load());
    }

   private:
    template <std::size_t... I>
    void drive_each(std::index_sequence<I...>, const std::function<bool()>& done,
                    std::chrono::steady_clock::time_point until, bool in_turns) {
      (drive_one<I>(done, until, in_turns), ...);
    }
    template <std::size_t I>
    void drive_one(const std::function<bool()>& done, std::chrono::steady_clock::time_point until,
                   bool in_turns) {
      auto& c = std::get<I>(contexts_);
      if (!c || in_use_[I].load(std::memory_order_relaxed) == 0 || done()) return;
      using C = typename std::tuple_element_t<I, Contexts>::element_type;
      if constexpr (has_drive<C>) {
        c->drive(done, in_turns ? std::min(until, std::chrono::steady_clock::now() + kDriveSlice)
                                : until);
      } else {
        std::this_thread::yield();
      }
    }
    template <class C>
    static std::size_t shutdown_one(std::unique_ptr<C>& c,
                                    std::chrono::steady_clock::time_point deadline) {
      return c ? shutdown_until(*c, deadline) : 0;
    }
    static constexpr auto kDriveSlice = std::chrono::microseconds(20);

    int chosen(int peer) const {
      std::lock_guard<std::mutex> lk(state_->mu);
      auto it = state_->peers.find(peer);
      return it == state_->peers.end() ? -1 : it->second.chosen;
    }

    static int index_of(const std::string& name) {
      for (std::size_t i = 0; i < N; ++i) {
        if (kNames[i] == name) return static_cast<int>(i);
      }
      return -1;
    }

    template <std::size_t I>
    void start(const TransportOptions& options, std::string& tried) {
      if constexpr (I < N) {
        using P = std::tuple_element_t<I, std::tuple<Candidates...>>;
        if (P::viable()) {
          TransportCallbacks cb;
          std::weak_ptr<State> weak = state_;
          cb.on_message = [weak](int peer, wire::Message&& m) {
            if (auto s = weak.lock(); s && s->callbacks.on_message) {
              s->callbacks.on_message(peer, std::move(m));
            }
          };
          // A dead peer breaks its connections on every candidate: its owner hears it once.
          cb.on_peer_lost = [weak](int peer, const std::string& reason) {
            auto s = weak.lock();
            if (!s) return;
            {
              std::lock_guard<std::mutex> lk(s->mu);
              auto& ps = s->peers[peer];
              if (ps.lost_reported) return;
              ps.lost_reported = true;
            }
            if (s->callbacks.on_peer_lost) s->callbacks.on_peer_lost(peer, reason);
          };
          auto& slot = std::get<I>(contexts_);
          slot = std::make_unique<typename P::Context>(options, std::move(cb));
          entries_.push_back(detail::Entry{
              std::string(P::name), detail::effective_domain_key<P>(self_), slot->address()});
          tried += std::string(tried.empty() ? "" : ", ") + std::string(P::name) + ": viable";
        } else {
          tried += std::string(tried.empty() ? "" : ", ") + std::string(P::name) + ": not viable";
        }
        start<I + 1>(options, tried);
      }
    }

    template <std::size_t I>
    void add_to(int index, int id, const std::string& name, const std::string& address) {
      if constexpr (I < N) {
        if (static_cast<int>(I) == index) {
          std::get<I>(contexts_)->add_peer(id, name, address);
          return;
        }
        add_to<I + 1>(index, id, name, address);
      }
    }

    template <std::size_t I>
    void send_on(int index, int peer, wire::Message&& m) {
      if constexpr (I < N) {
        if (static_cast<int>(I) == index) {
          std::get<I>(contexts_)->send(peer, std::move(m));
          return;
        }
        send_on<I + 1>(index, peer, std::move(m));
      }
    }

    int self_;
    std::shared_ptr<State> state_;
    Contexts contexts_;
    std::array<std::atomic<int>, N> in_use_{};  // peers per candidate (under state_->mu to write)
    std::vector<detail::Entry> entries_;
    std::string address_;
  };
};

}  // namespace distrpc::transport
