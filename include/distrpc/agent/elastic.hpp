// A dynamic group's joins and leaves (init_rpc without a world size; docs/rpc.md, "Elastic
// membership"). The store orders the joins and holds each member's entry (Membership::
// join_dynamic); this class runs the messages between members.
//
// Join: the joiner reads the members that joined before it from the store, then tells each of
// them (admit): each adds it to its table and its transport before answering, so once init_rpc
// returns, the joiner and every member it read can call each other both ways. A member that joins
// later reads the joiner's entry from the store itself. Every pair learns of each other once, in
// one direction each, with no lock and nobody watching the store (no polling).
//
// Replacement: a joiner with the name of a member that died takes its place. A member told of it
// checks that the old one is gone (known lost, or it does not answer a ping as the incarnation
// it knew); a live member with that name makes the join fail ("is not unique").
//
// Leave (a graceful shutdown): the leaver releases what it holds of others (user RRefs), stops
// admitting joiners (a joiner it refuses leaves it out), marks its entry left in the store (later
// joiners skip it), tells every member (each drops it from its table), waits until none of its own
// calls is outstanding and no request runs here, and stops. There is no group-wide barrier: the
// others go on.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "distrpc/agent.hpp"
#include "distrpc/agent/calls.hpp"
#include "distrpc/agent/membership.hpp"
#include "distrpc/agent/runtime.hpp"
#include "distrpc/error.hpp"
#include "distrpc/future.hpp"
#include "distrpc/options.hpp"
#include "distrpc/registry.hpp"
#include "distrpc/rpc_error.hpp"
#include "distrpc/store/rendezvous.hpp"
#include "distrpc/wire.hpp"
#include "distrpc/worker_info.hpp"

namespace distrpc::detail {

class ElasticProtocol {
 public:
  using milliseconds = std::chrono::milliseconds;
  using Clock = std::chrono::steady_clock;

  // admit()'s answers.
  static constexpr int kAdmitted = 0;
  static constexpr int kLeaving = 1;  // the member is leaving: the joiner leaves it out
  static constexpr int kRefused = 2;  // the join fails with the text given
  // How long an admission waits for the layers to finish with the loss of the member it replaces
  // (at most init_timeout).
  static constexpr milliseconds kLossNoticeLimit{10000};

  explicit ElasticProtocol(std::shared_ptr<RpcAgent> agent) : agent_(std::move(agent)) {}

  // The joiner's side: publishes this worker, reads the members, tells each. On a refusal (a
  // live member already has this name), the members that admitted it drop it again and the join
  // fails with the refusal's text.
  void join() {
    auto& m = agent_->members_;
    const milliseconds limit = agent_->options_.init_timeout;
    const std::string address = agent_->transport_address();
    const auto view = m.join_dynamic(address, limit);
    // Told: every member read, and the entries with this worker's name under another rank, so a
    // live one refuses (a dead one does not answer). One under this worker's own rank cannot be
    // addressed (the transport knows this rank as itself): its death is taken on trust.
    std::vector<Membership::DynamicEntry> told = view.members;
    for (const auto& e : view.replaced) {
      if (e.info.id != agent_->self().id) told.push_back(e);
    }
    for (const auto& e : told) agent_->transport_add_peer(e.info.id, e.info.name, e.address);
    ensure_library_registered<&ElasticProtocol::admit>();
    const WorkerInfo me = agent_->self();
    std::vector<Future<wire::Message>> replies;
    for (const auto& e : told) {
      replies.push_back(send_call<&ElasticProtocol::admit>(agent_, e.info, CallOptions{limit},
                                                           /*internal=*/true, me.id, me.name,
                                                           address, m.own_seq())
                            .reply);
    }
    std::vector<WorkerInfo> admitted;
    std::string refusal;
    for (std::size_t i = 0; i < replies.size(); ++i) {
      const auto& e = told[i];
      try {
        std::pair<int, std::string> answer;
        wire::decode(replies[i].value(), answer);
        if (answer.first == kAdmitted) {
          admitted.push_back(e.info);
        } else if (answer.first == kLeaving) {
          m.remove(e.info);
        } else if (refusal.empty()) {
          refusal = answer.second;
        }
      } catch (const DistNetworkError& ex) {
        // Gone: it left meanwhile (its entry says so), else it died without leaving, and stays a
        // member known lost (calls to it fail naming it) until a replacement takes its name.
        if (m.left_in_store(e.seq)) {
          m.remove(e.info);
        } else {
          m.mark_lost(e.info.id, ex.what());
        }
      } catch (const std::exception& ex) {
        if (refusal.empty()) {
          refusal = "init_rpc: " + me.str() + " could not join the dynamic group: " + e.info.str() +
                    " answered: " + ex.what();
        }
      }
    }
    if (!refusal.empty()) {
      try {
        m.mark_left_in_store();
      } catch (const std::exception&) {
        // The store is gone with its host: no later joiner reads this entry either.
      }
      tell_departure(admitted, limit);
      throw RpcError(refusal);
    }
    agent_->open_for_requests();
  }

  // The leaver's side (shutdown() of a dynamic member). Returns the error to raise once the
  // caller has forgotten the agent, or null. Not graceful: local stop only (the others find the
  // worker lost, as a crash).
  std::exception_ptr leave(bool graceful, milliseconds timeout) {
    std::exception_ptr error;
    std::exception_ptr leak_error;
    if (graceful) {
      try {
        const auto deadline = Clock::now() + timeout;
        milliseconds limit = timeout.count() > 0
                                 ? std::chrono::duration_cast<milliseconds>(deadline - Clock::now())
                                 : agent_->default_timeout();
        if (limit.count() <= 0) limit = std::chrono::seconds(60);
        // What this worker holds of others goes first (user RRefs), while they still know it.
        for (const auto& x : agent_->extensions()) x->before_exit(limit);
        auto& m = agent_->members_;
        const auto others = m.begin_leave();
        try {
          m.mark_left_in_store();
        } catch (const std::exception&) {
          // The store's host left first: no later joiner can read this entry anyway.
        }
        tell_departure(others, limit);
        wait_idle(Clock::now() + limit);
        if (auto leaks = agent_->extension_leaks(); leaks && !leak_error) leak_error = leaks;
      } catch (...) {
        error = std::current_exception();
      }
    }
    try {
      agent_->stop(/*sync_exit=*/false, timeout);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
    return error ? error : leak_error;
  }

  // ---- what members call on each other (internal calls) -----------------------------------
  // A joiner (`id`, `name`, listening at `address`, join number `seq`) asks to be added.
  static std::pair<int, std::string> admit(int id, std::string name, std::string address,
                                           std::int64_t seq) {
    return ElasticProtocol(current_agent()).on_admit(WorkerInfo{id, std::move(name)}, address, seq);
  }
  // Member `id` / `name` leaves (or gave up its join).
  static bool depart(int id, std::string name) {
    current_agent()->members_.remove(WorkerInfo{id, std::move(name)});
    return true;
  }
  // Whether this worker is the incarnation that joined under `seq` (a replacement under the same
  // rank answers false).
  static bool ping(std::int64_t seq) { return current_agent()->members_.own_seq() == seq; }

 private:
  std::pair<int, std::string> on_admit(const WorkerInfo& w, const std::string& address,
                                       std::int64_t seq) {
    auto& m = agent_->members_;
    const WorkerInfo me = agent_->self();
    if (!m.dynamic()) return {kRefused, Membership::kMixedText};
    // A refusal goes back through the transport, which must know the joiner. Not under a live
    // member's rank: routing that rank to the joiner would cut the live member off (the joiner
    // then gets no answer here, and its join fails at init_timeout).
    const auto refuse = [&](const WorkerInfo& live) -> std::pair<int, std::string> {
      if (w.id != live.id && w.id != me.id) agent_->transport_add_peer(w.id, w.name, address);
      return {kRefused, not_unique(w, live)};
    };
    if (w.id == me.id || w.name == me.name) return refuse(me);
    // Each member the joiner would replace is checked, and let go, while the transport still
    // routes its rank to it: the liveness check reaches that process (not the joiner), and
    // what the layers drop for it (RRefs it owned, contexts it made) cannot include anything
    // made with the joiner under that rank.
    const auto conflicts = m.conflicts(w);
    for (const auto& c : conflicts) {
      if (m.is_lost(c.id)) continue;  // the layers were told when it was lost
      if (answers(c)) return refuse(c);
      // Its calls still pending fail now, as a lost worker's do (its connection may never
      // break: the transport is about to know its rank at the replacement's address).
      const std::string reason = "it no longer answers; replaced by " + w.str();
      const auto pending = agent_->calls_.calls_to(c.id);
      m.mark_lost(c.id, reason);
      agent_->fail_calls(pending, c, reason);
      // Nothing released what it held either: the RRefs it owned and the contexts it made go
      // now, as a lost worker's do, before the new one can hold any (this runs on a
      // callback-pool thread, never a reading one: values may be destroyed here).
      for (const auto& x : agent_->extensions_) x->on_peer_lost(c.id);
    }
    agent_->transport_add_peer(w.id, w.name, address);
    // The layers' handling of an old member's loss (queued when its connection broke, which may
    // be after the check above) ends before the joiner is admitted: run later, it would drop what
    // the joiner holds under that rank. The transport reports no loss of the old connections
    // once it routes the rank to the joiner (above). That includes a member that left under the
    // joiner's rank (no conflict any more: its connection closed when it stopped).
    std::vector<int> gone{w.id};
    for (const auto& c : conflicts) {
      if (c.id != w.id) gone.push_back(c.id);
    }
    const auto limit = std::min(kLossNoticeLimit, agent_->options_.init_timeout);
    for (const int id : gone) {
      // The joiner gave up meanwhile (its admission timed out): it is not admitted.
      if (!agent_->wait_loss_notices(id, limit) && m.left_in_store(seq)) {
        return {kLeaving, std::string()};
      }
    }
    if (!m.admit(w, seq)) return {kLeaving, std::string()};
    for (const auto& x : agent_->extensions_) x->on_peer_joined(w.id);
    return {kAdmitted, std::string()};
  }

  static std::string not_unique(const WorkerInfo& joiner, const WorkerInfo& live) {
    return "Worker name '" + joiner.name + "' is not unique: " + joiner.str() +
           " cannot join the dynamic group while " + live.str() +
           " is alive in it (a replacement takes the name of a worker that died)";
  }

  // Whether member `c` still answers as the incarnation this worker knows.
  bool answers(const WorkerInfo& c) {
    ensure_library_registered<&ElasticProtocol::ping>();
    try {
      auto reply =
          send_call<&ElasticProtocol::ping>(agent_, c, CallOptions{milliseconds(2000)},
                                            /*internal=*/true, agent_->members_.seq_of(c.id))
              .reply;
      bool same = false;
      wire::decode(reply.value(), same);
      return same;
    } catch (const std::exception&) {
      return false;  // unreachable or silent for 2 s: taken for dead
    }
  }

  // Tells `members` that this worker leaves; waits for their answers up to `limit` (a member that
  // died meanwhile cannot answer, and needs not be told).
  void tell_departure(const std::vector<WorkerInfo>& members, milliseconds limit) {
    ensure_library_registered<&ElasticProtocol::depart>();
    const WorkerInfo me = agent_->self();
    std::vector<Future<wire::Message>> replies;
    for (const auto& w : members) {
      replies.push_back(send_call<&ElasticProtocol::depart>(agent_, w, CallOptions{limit},
                                                            /*internal=*/true, me.id, me.name)
                            .reply);
    }
    for (auto& r : replies) {
      try {
        r.value();
      } catch (const std::exception&) {
        // Lost or gone: it drops this worker when it learns of the broken connection.
      }
    }
  }

  // Until no call of this worker is outstanding and no request runs or waits here, twice in a row
  // (a request that arrived just before the members dropped this worker still runs). Polls every
  // millisecond, during a leave only.
  void wait_idle(Clock::time_point deadline) {
    int quiet = 0;
    while (quiet < 2) {
      const WorkCounters c = agent_->counters();
      const bool idle = c.client_sent == c.client_done && c.server_active == 0 &&
                        c.protocol_pending == 0 && agent_->request_pool_.queued() == 0;
      quiet = idle ? quiet + 1 : 0;
      if (quiet >= 2) break;
      if (Clock::now() > deadline) {
        throw RpcError("shutdown: " + agent_->self().str() +
                       " left the dynamic group with calls still outstanding (" +
                       std::to_string(c.client_sent - c.client_done) + " sent, " +
                       std::to_string(c.server_active) + " running here)");
      }
      std::this_thread::sleep_for(milliseconds(1));
    }
  }

  const std::shared_ptr<RpcAgent> agent_;
};

// Checks the options, joins the dynamic group of options.init_method as worker `name` of rank
// `rank` and starts an agent on transport policy T (init_rpc without a world size).
template <class T>
std::shared_ptr<RpcAgent> start_dynamic_agent(const std::string& name, int rank,
                                              const RpcBackendOptions& options,
                                              std::shared_ptr<const Registry> registry) {
  check_agent_options(name, options, registry);
  // Device maps are checked across the group when a static group meets; a dynamic group has no
  // moment when everyone's are known.
  if (!options.device_maps.empty() || !options.devices.empty()) {
    throw std::invalid_argument(
        "device maps and devices are not supported in a dynamic group (init_rpc without a world "
        "size): only CPU tensors can be sent there");
  }
  auto rdzv = store::rendezvous_dynamic(options.init_method, rank, options.init_timeout,
                                        options.auth_token, options.tls);
  auto agent = make_agent<T>(name, rdzv, options, std::move(registry));
  try {
    ElasticProtocol(agent).join();
  } catch (...) {
    agent->stop(/*sync_exit=*/false, std::chrono::milliseconds(0));
    throw;
  }
  return agent;
}

}  // namespace distrpc::detail
