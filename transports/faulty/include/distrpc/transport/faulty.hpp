// Faulty<T, Faults>: a decorator policy that injects send failures and delays into transport T,
// for testing how a program (and the library's own protocols) copes with an unreliable network.
// PyTorch runs its RRef and distributed-autograd suites on such a "faulty agent"; this is the
// same, as a policy: `init_rpc<Faulty<Tcp, MyFaults>>(...)`.
//
// Faults (FaultyOptions, from `Faults::options()` or `Faults::options(transport_options)`, read
// once per Context):
//  - fail_sends: the first `count` sends of each listed message kind fail: send() throws the
//    DistNetworkError a wrapped transport throws when it cannot reach a peer, and nothing is
//    written. Counted per Context (per worker), per kind, over all destinations, as PyTorch's
//    faulty agent counts. The (count + 1)-th send of a kind goes through.
//  - delay: sends of the listed kinds are handed to T only `by` later, by a timer thread of this
//    Context; send() returns at once. Messages of a delayed kind keep their order among
//    themselves (per peer); other kinds are not held back, so they may overtake them, which is
//    the point. A delayed message that T then refuses (the peer was lost meanwhile) is dropped
//    with a logged warning, as a message lost with a broken connection is; at shutdown, delayed
//    messages not yet handed over are dropped.
// Receiving is T's, untouched. Everything else (address, peers, drive(), bounded shutdown) is
// forwarded to T, so Faulty<T> with no faults behaves as T does; its name is "faulty(<T's>)" and
// its domain key T's, so it talks to plain T peers.
#pragma once

#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>

#include "distrpc/bounded_thread.hpp"
#include "distrpc/error.hpp"
#include "distrpc/log.hpp"
#include "distrpc/transport/detail/decorated_name.hpp"
#include "distrpc/transport/transport.hpp"
#include "distrpc/wire/message.hpp"

namespace distrpc::transport {

// What to break. Plain data with defaults (no faults), for designated initializers:
//   FaultyOptions{.fail_sends = {.kinds = {wire::MessageType::Request}, .count = 3},
//                 .delay = {.kinds = {wire::MessageType::Response}, .by = 1500ms}}
struct FaultyOptions {
  // Every member has a default, so a designated initializer may leave any out (no
  // -Wmissing-field-initializers).
  struct FailSends {
    std::set<wire::MessageType> kinds{};
    int count = 0;  // the first `count` sends of each kind fail, per Context
  };
  struct Delay {
    std::set<wire::MessageType> kinds{};
    std::chrono::milliseconds by{0};
  };
  FailSends fail_sends{};
  Delay delay{};
};

// The default Faults: none, so Faulty<T> alone behaves as T.
struct NoFaults {
  static FaultyOptions options() { return {}; }
};

// What Faulty's second argument provides: the same faults for every worker, or faults chosen per
// worker from its TransportOptions (self_id, self_name), e.g. only worker 0's requests late.
template <class F>
concept FaultSource =
    requires {
      { F::options() } -> std::convertible_to<FaultyOptions>;
    } || requires(const TransportOptions& t) {
      { F::options(t) } -> std::convertible_to<FaultyOptions>;
    };

// What a Context injected so far, per kind.
struct FaultyStats {
  std::map<wire::MessageType, std::uint64_t> failed;   // sends that threw
  std::map<wire::MessageType, std::uint64_t> delayed;  // sends held back by delay.by
};

namespace detail {

inline constexpr std::string_view kFaultyName = "faulty";

// A kind a Context can be asked to send: Request, Response, Exception or a control kind (the
// Handshake is the transport's own frame, never passed to send()).
inline bool sendable_kind(wire::MessageType k) {
  return wire::is_valid_message_type(static_cast<std::uint8_t>(k)) &&
         k != wire::MessageType::Handshake;
}

// Throws std::invalid_argument naming the first thing wrong in `o` (`who` names the policy).
inline void validate(const FaultyOptions& o, std::string_view who) {
  const auto bad = [&](const std::string& what) {
    return std::invalid_argument(std::string("distrpc ") + std::string(who) +
                                 ": bad FaultyOptions: " + what);
  };
  if (o.fail_sends.count < 0) {
    throw bad("fail_sends.count must be >= 0, got " + std::to_string(o.fail_sends.count));
  }
  if (o.delay.by.count() < 0) {
    throw bad("delay.by must be >= 0 ms, got " + std::to_string(o.delay.by.count()) + " ms");
  }
  const auto check_kinds = [&](const std::set<wire::MessageType>& kinds, const char* field) {
    for (auto k : kinds) {
      if (!sendable_kind(k)) {
        throw bad(std::string(field) + " lists " + wire::to_string(k) + " (value " +
                  std::to_string(static_cast<int>(k)) +
                  "), which is never sent through a transport's send(): use Request, Response, "
                  "Exception or a control kind (wire::control_message_type(n))");
      }
    }
  };
  check_kinds(o.fail_sends.kinds, "fail_sends.kinds");
  check_kinds(o.delay.kinds, "delay.kinds");
}

}  // namespace detail

template <class T, class Faults = NoFaults>
struct Faulty {
  static_assert(check_transport<T>(), "Faulty<T>: T must be a transport policy (see above)");
  static_assert(FaultSource<Faults>,
                "Faulty<T, Faults>: Faults must provide `static FaultyOptions options();` or "
                "`static FaultyOptions options(const TransportOptions&);`");

  static constexpr std::string_view name =
      detail::DecoratedName<detail::kFaultyName, T::name>::value;
  static constexpr bool carries_device_buffers = transport::carries_device_buffers<T>();
  static bool viable() { return T::viable(); }
  static std::string domain_key() { return T::domain_key(); }

  class Context {
   public:
    // Starts T's Context. Throws std::invalid_argument when Faults::options() is malformed
    // (naming the field), and whatever T's Context throws.
    Context(const TransportOptions& options, TransportCallbacks callbacks)
        : self_(options.self_id),
          faults_(checked_options(options)),
          delaying_(!faults_.delay.kinds.empty() && faults_.delay.by.count() > 0) {
      inner_ = std::make_unique<typename T::Context>(options, std::move(callbacks));
      if (delaying_) {
        timer_ = std::thread([this] { run_timer(); });
      }
    }
    ~Context() { shutdown(); }
    Context(const Context&) = delete;
    Context& operator=(const Context&) = delete;

    std::string address() const { return inner_->address(); }

    void add_peer(int id, const std::string& peer_name, const std::string& address) {
      inner_->add_peer(id, peer_name, address);
      std::lock_guard<std::mutex> lk(mu_);
      names_[id] = peer_name;
    }

    // Fails, delays or forwards `m` (see the top of this file). A delayed send returns at once.
    void send(int peer, wire::Message&& m) {
      const wire::MessageType kind = m.type;
      {
        std::unique_lock<std::mutex> lk(mu_);
        if (faults_.fail_sends.kinds.count(kind) != 0) {
          auto& n = stats_.failed[kind];
          if (n < static_cast<std::uint64_t>(faults_.fail_sends.count)) {
            ++n;
            const std::string who = peer_text_locked(peer);
            lk.unlock();
            // The type a wrapped transport throws when the peer cannot be reached, so the caller
            // takes it for a real send failure.
            throw DistNetworkError("distrpc " + std::string(name) + ": cannot send to " + who +
                                   ": injected failure " + std::to_string(n) + " of " +
                                   std::to_string(faults_.fail_sends.count) + " for " +
                                   wire::to_string(kind) + " messages (FaultyOptions::fail_sends)");
          }
        }
        if (delaying_ && faults_.delay.kinds.count(kind) != 0) {
          if (stopping_) {
            throw DistNetworkError("distrpc " + std::string(name) + ": cannot send to " +
                                   peer_text_locked(peer) + ": the transport of worker " +
                                   std::to_string(self_) + " is shut down");
          }
          ++stats_.delayed[kind];
          // Equal due times keep their insertion order (multimap), so a kind's order holds.
          due_.emplace(Clock::now() + faults_.delay.by, Pending{peer, std::move(m)});
          cv_.notify_one();
          return;
        }
      }
      inner_->send(peer, std::move(m));
    }

    // Idempotent. Delayed messages not yet handed to T are dropped.
    std::size_t shutdown(std::chrono::steady_clock::time_point deadline) {
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (shut_down_) return 0;
        shut_down_ = true;
        stopping_ = true;
      }
      cv_.notify_all();
      // T first: a delayed send blocked in T (back-pressure) fails at once and the timer exits.
      const std::size_t abandoned = shutdown_until(*inner_, deadline);
      join_or_detach(timer_);  // detached when called from inside T's send on the timer
      std::multimap<Clock::time_point, Pending> dropped;
      {
        std::lock_guard<std::mutex> lk(mu_);
        dropped.swap(due_);
      }
      return abandoned;
    }
    void shutdown() { shutdown(std::chrono::steady_clock::now() + kDefaultShutdownGrace); }

    // T's drive(), where T has one.
    void drive(const std::function<bool()>& done, std::chrono::steady_clock::time_point until)
      requires has_drive<typename T::Context>
    {
      inner_->drive(done, until);
    }

    // What was injected so far.
    FaultyStats stats() const {
      std::lock_guard<std::mutex> lk(mu_);
      return stats_;
    }
    const FaultyOptions& faults() const { return faults_; }
    // The wrapped policy's Context (its own diagnostics).
    typename T::Context& inner() { return *inner_; }

   private:
    using Clock = std::chrono::steady_clock;
    struct Pending {
      int peer;
      wire::Message message;
    };

    static FaultyOptions checked_options(const TransportOptions& t) {
      FaultyOptions o;
      if constexpr (requires { Faults::options(t); }) {
        o = Faults::options(t);
      } else {
        o = Faults::options();
      }
      detail::validate(o, name);
      return o;
    }

    std::string peer_text_locked(int peer) const {
      auto it = names_.find(peer);
      return "worker " + std::to_string(peer) +
             (it == names_.end() ? std::string() : " ('" + it->second + "')");
    }

    // Hands each delayed message to T when it is due, outside the lock (T's send may block).
    void run_timer() {
      std::unique_lock<std::mutex> lk(mu_);
      while (!stopping_) {
        if (due_.empty()) {
          cv_.wait(lk, [&] { return stopping_ || !due_.empty(); });
          continue;
        }
        const auto at = due_.begin()->first;
        if (Clock::now() < at) {
          cv_.wait_until(lk, at);
          continue;
        }
        Pending p = std::move(due_.begin()->second);
        due_.erase(due_.begin());
        lk.unlock();
        try {
          inner_->send(p.peer, std::move(p.message));
        } catch (const std::exception& e) {
          lk.lock();
          if (!stopping_) {
            distrpc::detail::log_warning(
                "worker " + std::to_string(self_),
                "distrpc " + std::string(name) + ": a delayed message was dropped: " + e.what());
          }
          continue;
        }
        lk.lock();
      }
    }

    const int self_;
    const FaultyOptions faults_;
    const bool delaying_;  // a delay is configured: the timer thread runs
    std::unique_ptr<typename T::Context> inner_;
    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::map<int, std::string> names_;
    FaultyStats stats_;
    std::multimap<Clock::time_point, Pending> due_;
    bool stopping_ = false;
    bool shut_down_ = false;
    std::thread timer_;  // only when a delay is configured
  };
};

}  // namespace distrpc::transport
